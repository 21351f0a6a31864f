"""flash_attn 2.x compatible public functions.

Same names, argument names, defaults and return values as flash-attn, so
`from fa_amd import flash_attn_func` (or fa_amd.integrations' flash_attn shim)
is a drop-in switch.  ALL argument checking lives here, once; the ops and
kernels below trust what they are given.
"""
from __future__ import annotations

import numbers
import operator
import os
from typing import Optional, Sequence

import torch

import triton

from . import arch, ops  # the attention op (and registers torch.ops.fa_amd.*)
from .arch import INTERPRET, check_interpreter_supported, cpu_without_interpreter_message
from .kernels.launch import MAX_GRID_YZ, row_offsets_fit, with_int32_row_offsets
from .memo import memo_per_tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# the kernels compute scores in float32 log2 units (softmax_scale * log2(e), softcap * log2(e))
_FLOAT32_MAX = 3.4028234663852886e38
_LOG2E = 1.4426950408889634
# cu_seqlens values are checked on the host (one small device->host copy per
# call) unless this is "0" or the call is being traced by torch.compile.
_CHECK_VARLEN = os.environ.get("FA_AMD_CHECK_VARLEN", "1") != "0"


# --------------------------------------------------------------------------- checks

def is_fp8_dtype(dtype) -> bool:
    """One-byte floating types (float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, ...)."""
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1


def _check_tensor(name: str, x, rank: int, layout: str, dtypes=SUPPORTED_DTYPES):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        hint = ""
        if is_fp8_dtype(x.dtype):  # an FP8 tensor where this entry takes none
            hint = ("; FP8 tensors go to flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache with "
                    "q_descale / k_descale / v_descale (the *_fp8_func functions quantise high-precision inputs "
                    "themselves)")
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}{hint}")


def _check_device(name: str, x: torch.Tensor, ref: torch.Tensor):
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but q is on {ref.device}; all inputs must share one device")


def _check_qkv(q, k, v, varlen: bool, dtypes=SUPPORTED_DTYPES):
    rank, layout = (3, "(total_tokens, nheads, headdim)") if varlen else (4, "(batch, seqlen, nheads, headdim)")
    _check_tensor("q", q, rank, layout, dtypes)
    _check_tensor("k", k, rank, layout, dtypes)
    _check_tensor("v", v, rank, layout, dtypes)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    _check_device("k", k, q)
    _check_device("v", v, q)
    check_interpreter_supported()
    if q.device.type == "cpu" and not INTERPRET:
        raise ValueError(cpu_without_interpreter_message("q"))
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and not arch.INTERPRETER_BF16_DOT:
        raise TypeError(f"q is bfloat16, which triton {triton.__version__}'s interpreter computes wrongly; "
                        "use float16 or float32 on the CPU")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on unsupported device type {q.device.type!r} (expected cuda/ROCm or cpu)")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"q, k and v must share the head dim, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    nheads_q, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k == 0 or nheads_q % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads_q}) must be a multiple of nheads of k/v ({nheads_k})")
    if nheads_q > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} query heads are supported, got {nheads_q}")
    if not varlen:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
        if q.shape[0] > MAX_GRID_YZ:
            raise ValueError(f"batch size must be at most {MAX_GRID_YZ}, got {q.shape[0]}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # kernels take any strides except on the head dim; copy only in that case
    return x if x.stride(-1) == 1 else x.contiguous()


def _fit_int32_offsets(q, k, v, max_seqlen_q, max_seqlen_k, varlen, return_attn_probs):
    """q, k, v with token strides the kernels' 32-bit in-sequence offsets can address (copied where
    needed), or a ValueError for shapes no layout fits."""
    nheads_q, head_dim = q.shape[-2], q.shape[-1]
    # out, dQ and the dK/dV work buffers hold nheads_q * head_dim elements per token
    if not row_offsets_fit(max(max_seqlen_q, max_seqlen_k), nheads_q * head_dim, head_dim):
        # (varlen: the lengths are the caller's max_seqlen_q / max_seqlen_k, which may overstate the segments)
        what = (f"max(max_seqlen_q, max_seqlen_k) = {max(max_seqlen_q, max_seqlen_k)}" if varlen else
                f"sequence length {max(max_seqlen_q, max_seqlen_k)}")
        raise ValueError(
            f"{what} x nheads {nheads_q} x head dim {head_dim} exceeds the 2**31 elements fa_amd's kernels address "
            f"within one sequence; split the heads over several calls" + (
                " (or pass the longest segment's length)" if varlen else ""))
    if return_attn_probs and not row_offsets_fit(max_seqlen_q, max_seqlen_k, max_seqlen_k):
        raise ValueError(f"return_attn_probs=True needs a {max_seqlen_q} x {max_seqlen_k} probability matrix per "
                         f"head, over the 2**31 elements fa_amd addresses; use it on shorter sequences")
    return (with_int32_row_offsets("q", q, max_seqlen_q, varlen), with_int32_row_offsets("k", k, max_seqlen_k, varlen),
            with_int32_row_offsets("v", v, max_seqlen_k, varlen))


_MAX_WINDOW = 2 ** 31 - 1


def _is_finite(x) -> bool:
    """math.isfinite for Python numbers and the symbolic floats torch.compile(dynamic=True) passes (inf - inf
    and nan - nan are nan; math.isfinite does not trace)."""
    return x - x == 0


def _float_arg(name: str, x):
    """A Python int or float argument as a float (an int too large for one: a ValueError naming it; symbolic
    floats of torch.compile(dynamic=True) pass through)."""
    if isinstance(x, int):
        try:
            return float(x)
        except OverflowError:
            raise ValueError(f"{name} is an int too large for a float (about 10**{len(str(abs(x))) - 1})") from None
    return x


def _type_name(x) -> str:
    """x's type for an error message, with its module where that is not Python's own (numpy.bool, not bool)."""
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _py_number(x):
    """A numpy (or other non-Python) real scalar, or a one-element real tensor, as the Python int / float it
    holds, as flash-attn's C++ binding takes them (np.float32(0.125) as softmax_scale; flash-attn's own tests
    pass window_size as torch.randint(0, seqlen_k, (2,))); anything else, bools included, unchanged."""
    if isinstance(x, torch.Tensor):
        real = x.dtype != torch.bool and not x.is_complex()
        return x.item() if x.numel() == 1 and real else x
    if type(x) in (int, float) or x is None or isinstance(x, bool) or not isinstance(x, numbers.Real):
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ == "bool":  # (not an Integral; kept for the TypeError)
        return x
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def _normalize_scalars(head_dim, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                       return_attn_probs, seqlen_k=None):
    """(dropout_p, softmax_scale, window_left, window_right, softcap) checked and normalised; causal folded into
    window_right = 0.  seqlen_k: the key length flash-attn's C++ API compares the window with (k's length,
    max_seqlen_k, a KV cache's capacity): an entry >= it bounds nothing there (-1), before causal folds in -- so a
    right window >= seqlen_k no longer masks the top rows of a call with more queries than keys."""
    dropout_p, softmax_scale, softcap = _py_number(dropout_p), _py_number(softmax_scale), _py_number(softcap)
    if isinstance(window_size, torch.Tensor) and window_size.shape == (2,):
        window_size = tuple(window_size.unbind())
    if isinstance(window_size, Sequence) and len(window_size) == 2:
        window_size = tuple(_py_number(w) for w in window_size)
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    dropout_p = _float_arg("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    softmax_scale = _float_arg("softmax_scale", softmax_scale)
    if not _is_finite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    for name, flag in (("causal", causal), ("deterministic", deterministic),
                       ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {_type_name(flag)}")
    if (not isinstance(window_size, Sequence) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    # a window past any sequence fa_amd takes (its offsets are int32) is no window: -1, so no kernel argument
    # outgrows the int64 that Triton specialises ints into
    left, right = (-1 if w > _MAX_WINDOW else w for w in (left, right))
    if type(seqlen_k) is int:  # (not yet checked where the caller passes max_seqlen_k: its own check names it)
        left, right = (-1 if w >= seqlen_k else w for w in (left, right))
    if causal:
        right = 0
    if softcap is None:
        softcap = 0.0
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    softcap = _float_arg("softcap", softcap)
    if not (_is_finite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap}")
    _check_float32_range(float(softmax_scale), float(softcap))
    return float(dropout_p), float(softmax_scale), int(left), int(right), float(softcap)


def _check_float32_range(softmax_scale: float, softcap: float):
    """The factors the kernels multiply raw q.k scores by must be float32 numbers: without softcap,
    softmax_scale * log2(e); with it, softmax_scale / softcap and softcap * log2(e).  (Past that the
    score of every nonzero q.k overflows; a softcapped score is bounded by softcap, so a huge scale
    is fine there.)"""
    if softcap > 0.0:
        if softcap * _LOG2E >= _FLOAT32_MAX:
            raise ValueError(f"softcap = {softcap} overflows the kernels' float32 scores; it must be below "
                             f"{_FLOAT32_MAX / _LOG2E:.3g}")
        if abs(softmax_scale) / softcap >= _FLOAT32_MAX:
            raise ValueError(f"softmax_scale / softcap = {softmax_scale} / {softcap} overflows float32 (the kernels "
                             f"compute softcap * tanh(q.k * softmax_scale / softcap) in float32)")
    elif abs(softmax_scale) > MAX_SOFTMAX_SCALE:
        raise ValueError(f"softmax_scale = {softmax_scale} overflows the kernels' float32 scores: q.k * softmax_scale "
                         f"is float32 there, and past |softmax_scale| = {MAX_SOFTMAX_SCALE:.0e} ordinary scores "
                         f"(|q.k| above {_FLOAT32_MAX / MAX_SOFTMAX_SCALE:.1e}) become inf and the softmax NaN; "
                         f"use |softmax_scale| <= {MAX_SOFTMAX_SCALE:.0e} (or a softcap, which bounds the score)")


# Without softcap, the largest |softmax_scale| taken: scores up to |q.k| = 3.4e6 stay finite (a larger
# scale is hard attention already; 1e38 turned ordinary scores into inf - inf = NaN)
MAX_SOFTMAX_SCALE = 1e32


def _check_alibi(alibi_slopes, q, batch: int, nheads: int):
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if not alibi_slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be a floating tensor (float32 preferred), got {alibi_slopes.dtype}")
    _check_device("alibi_slopes", alibi_slopes, q)
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        # (flash-attn returns no gradient for them either, silently; fa_amd says so)
        raise ValueError("alibi_slopes requires grad, but the kernels compute no gradient for the slopes; pass "
                         "alibi_slopes.detach() (fixed slopes, as ALiBi models use)")
    return alibi_slopes.to(torch.float32).contiguous()


def integer_arg(value):
    """An integer argument as flash-attn takes it (max_seqlen_q / max_seqlen_k: any integer, a numpy int or a
    0-d integer tensor too -- Transformers passes `cu_seq_lens.diff().max()`) as a Python int; anything else
    unchanged, for the checks to name it.  A tensor costs a device->host copy, as flash-attn's conversion does."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.device.type != "meta" and not (
                value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
            return int(value)
        return value  # (the caller's check names it)
    if isinstance(value, (int, bool)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def check_cu_seqlens_form(name, cu):
    """The type, dtype and shape flash-attn demands of cu_seqlens_q / cu_seqlens_k (1-D int32, batch+1 entries)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch+1 entries, got shape {tuple(cu.shape)}")


def check_max_seqlen(name, max_seqlen):
    """max_seqlen_q / max_seqlen_k after integer_arg: a Python int >= 0."""
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool):
        raise TypeError(f"{name} must be an integer (a Python or numpy int, or a 0-d integer tensor), got "
                        f"{type(max_seqlen).__name__}" + (f" {max_seqlen.dtype} of shape {tuple(max_seqlen.shape)}"
                                                          if isinstance(max_seqlen, torch.Tensor) else ""))
    if max_seqlen < 0:
        raise ValueError(f"{name} must be >= 0, got {max_seqlen}")


def _check_cu_seqlens(name, cu, total, max_seqlen, max_name, q):
    """cu (made contiguous: the kernels read it as such) after checking it as the `name` argument.

    Its values (starts at 0, non-decreasing, within the `total` tokens, no segment longer than
    max_seqlen) are checked on the host, once per tensor and version (fa_amd.memo: every layer
    passes the same tensor), unless FA_AMD_CHECK_VARLEN=0 or torch.compile is tracing.  The memo
    also compares a CPU tensor's contents (numpy views write them without bumping the version);
    a write to a GPU tensor that bypasses its version counter (DLPack, `.data`) is not seen.
    Memory safety never rests on this check: the kernels clamp every segment into the packed
    tensors (kernels/score_mods.seq_bounds), so bad values give wrong numbers, never a crash."""
    check_cu_seqlens_form(name, cu)
    _check_device(name, cu, q)
    check_max_seqlen(max_name, max_seqlen)
    if not _CHECK_VARLEN or torch.compiler.is_compiling():
        return cu.contiguous()
    if cu.is_cuda and torch.cuda.is_current_stream_capturing():
        return cu.contiguous()  # a graph being captured (e.g. Transformers' continuous batching) cannot sync
    # a model calls varlen attention once per layer with the same cu_seqlens: one sync per tensor
    first, last, min_len, max_len = memo_per_tensor(cu, "cu_seqlens_stats", _cu_seqlens_stats)
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if min_len < 0:
        raise ValueError(f"{name} must be non-decreasing")
    if last > total:
        raise ValueError(f"{name}[-1] = {last} exceeds the {total} tokens of the packed tensor")
    if max_len > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest segment in {name} ({max_len})")
    return cu.contiguous()


# for the Transformers glue, which checks packed boundaries under its users' argument names
check_cu_seqlens = _check_cu_seqlens


def _check_sinks(sinks, s_aux, q, nheads: int):
    """Learnable attention sinks (`sinks`, as vLLM names them; `s_aux`, as gpt-oss and the FA3 fork
    of vLLM do): one logit per query head that joins each row's softmax denominator.  Returns them as
    fp32 (nheads,) (a differentiable cast: gradients flow back to the caller's tensor) or None."""
    if s_aux is not None:
        if sinks is not None:
            raise ValueError("pass attention sinks as `sinks` or as `s_aux`, not both")
        sinks, name = s_aux, "s_aux"
    else:
        name = "sinks"
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (one logit per query head), got {sinks.dtype}")
    _check_device(name, sinks, q)
    if tuple(sinks.shape) != (nheads,):
        raise ValueError(f"{name} must have shape ({nheads},) (one logit per query head), got {tuple(sinks.shape)}")
    return sinks.to(torch.float32).contiguous()


def _cu_seqlens_stats(cu):
    """(first, last, shortest, longest segment) in one device->host copy."""
    if cu.numel() == 1:  # a batch of 0 sequences: its one entry must still be 0
        return (int(cu[0]), int(cu[0]), 0, 0)
    lengths = cu[1:] - cu[:-1]
    return tuple(torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()]).tolist())


def _check_varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Checks cu_seqlens_q/k and max_seqlen_q/k against q and k; returns (batch, cu_seqlens_q,
    cu_seqlens_k), the cu_seqlens made contiguous (_check_cu_seqlens)."""
    cu_seqlens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", q)
    cu_seqlens_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k", q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch+1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    batch = cu_seqlens_q.numel() - 1
    if batch + 1 > MAX_GRID_YZ:  # one more program row writes the tokens past cu_seqlens_q[-1]
        raise ValueError(f"at most {MAX_GRID_YZ - 1} sequences per varlen call are supported, got {batch}")
    return batch, cu_seqlens_q, cu_seqlens_k


def _is_fp8_call(tensors, options) -> bool:
    """FP8 q/k/v (one-byte floats) or an FP8-only option given: the call belongs to fa_amd.fp8."""
    return any(o is not None for o in options) or any(
        isinstance(x, torch.Tensor) and is_fp8_dtype(x.dtype) for x in tensors)


def _rng_state(dropout_p: float, device) -> Optional[torch.Tensor]:
    """Philox (seed, offset) for this call, drawn from torch's generator on the
    device: different every call, reproducible under torch.manual_seed, and a
    device tensor (not a host int), so CUDA-graph capture replays fresh draws."""
    if dropout_p == 0.0:
        return None
    return torch.randint(0, 2 ** 62, (2,), device=device, dtype=torch.int64)


def probs_wanted(return_attn_probs: bool, dropout_p: float) -> bool:
    """Whether a call materialises S_dmask: as flash-attn (its Python layer asks its kernels for the matrix only
    when `return_attn_probs and dropout_p > 0`), only with dropout; without it S_dmask is an empty tensor, so a
    caller after softmax_lse alone (return_attn_probs=True, as ring / merged attention does) never pays for a
    (batch, nheads, seqlen_q, seqlen_k) matrix."""
    return return_attn_probs and dropout_p > 0.0


def _finish(out, lse, probs, return_attn_probs):
    return (out, lse, probs) if return_attn_probs else out


# --------------------------------------------------------------------------- dense

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None, s_aux=None, *,
                    q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.

    causal is aligned to the bottom-right corner when seqlen_q != seqlen_k.
    Returns out (batch, seqlen_q, nheads, headdim); with return_attn_probs also
    softmax_lse (batch, nheads, seqlen_q) fp32 and S_dmask: with dropout_p > 0 the (batch, nheads, seqlen_q,
    seqlen_k) probabilities, negated where dropout dropped them (testing only); without dropout an empty
    tensor, as flash-attn returns it (probs_wanted).
    deterministic=True computes every gradient without atomics (bitwise reproducible); the default False
    lets the arch's tables choose atomics where they are faster (fp32 atomic dQ on AMD, atomic sums of
    split GQA groups on sm90; last-bit run-to-run differences there).
    sinks (alias s_aux): optional learnable attention sinks, (nheads,) logits that join each row's
    softmax denominator only (gpt-oss; FA3/vLLM's `s_aux`), differentiable; softmax_lse then includes
    them.  With dropout, the probabilities (sink's share included in their denominator) are dropped.
    FP8 q, k, v (FA3 style, forward only): q_descale, k_descale, v_descale fp32 (batch, nheads_k),
    default 1; out is bfloat16 or out_dtype (fa_amd.fp8).
    """
    if _is_fp8_call((q, k, v), (q_descale, k_descale, v_descale, out_dtype)):
        from . import fp8  # fp8 sits above this module (it reuses the checks here)
        return fp8.descaled_attention(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size,
                                      softcap, alibi_slopes, deterministic, return_attn_probs,
                                      q_descale, k_descale, v_descale, out_dtype, sinks=sinks, s_aux=s_aux)
    return dense_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks, s_aux)


def dense_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                    return_attn_probs, sinks, s_aux, flash_window_rule=True):
    """flash_attn_func for high-precision q, k, v.  flash_window_rule=False takes the window literally instead of
    flash-attn's rule (an entry >= seqlen_k bounds nothing, _normalize_scalars): fa_amd.sdpa's route expresses
    SDPA's top-left causal mask with more queries than keys as window (-1, seqlen_q - seqlen_k), which may pass
    seqlen_k."""
    _check_qkv(q, k, v, varlen=False)
    dropout_p, scale, left, right, softcap = _normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        seqlen_k=k.shape[1] if flash_window_rule else None)
    alibi_slopes = _check_alibi(alibi_slopes, q, q.shape[0], q.shape[2])
    sinks = _check_sinks(sinks, s_aux, q, q.shape[2])
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    with_probs = probs_wanted(return_attn_probs, dropout_p)
    q, k, v = _fit_int32_offsets(q, k, v, q.shape[1], k.shape[1], False, with_probs)
    out, lse, probs = ops.attention(
        q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, scale, left, right, softcap, alibi_slopes,
        _rng_state(dropout_p, q.device), with_probs, deterministic, sinks)
    return _finish(out, lse, probs, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              sinks=None, s_aux=None):
    """qkv: (batch, seqlen, 3, nheads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be a tensor of shape (batch, seqlen, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    _check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")  # (its dtype under its own name)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, s_aux=s_aux)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             sinks=None, s_aux=None):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be a tensor of shape (batch, seqlen_k, 2, nheads_k, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    _check_tensor("kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, s_aux=s_aux)


# --------------------------------------------------------------------------- varlen

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, sinks=None, s_aux=None,
                           seqused_k=None, *, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_*: int32 (batch+1,).

    Segments may be empty and seqlen_q != seqlen_k per segment. softmax_lse is
    (nheads, total_q).  Paged KV (flash-attn >= 2.6): with block_table (batch, max_num_blocks_per_seq)
    int32, k and v are (num_blocks, page_block_size, nheads_k, headdim) pages (page_block_size any
    multiple of 16) and sequence b's keys are the first cu_seqlens_k[b+1] - cu_seqlens_k[b] slots of
    its pages.  seqused_k (batch,) int32: only the first seqused_k[b] keys of sequence b are used.
    Both are forward-only (as in flash-attn) and run the split-KV decode kernel (fa_amd.kvcache).
    Tokens past cu_seqlens_q[-1] / cu_seqlens_k[-1] (a static buffer longer than the batch, e.g.
    for CUDA graphs) belong to no sequence: their output and gradients are 0 and their lse +inf.
    sinks (alias s_aux): (nheads,) learnable sink logits, as in flash_attn_func (one per head, every sequence).
    FP8 q, k, v as in flash_attn_func (descales (batch, nheads_k), batch = len(cu_seqlens_q) - 1).
    """
    max_seqlen_q, max_seqlen_k = integer_arg(max_seqlen_q), integer_arg(max_seqlen_k)
    fp8 = _is_fp8_call((q, k, v), (q_descale, k_descale, v_descale, out_dtype))
    if fp8 or block_table is not None or seqused_k is not None:
        # first there: those routes size other checks by them (the dense route's _check_varlen_args checks them)
        check_cu_seqlens_form("cu_seqlens_q", cu_seqlens_q)
        check_cu_seqlens_form("cu_seqlens_k", cu_seqlens_k)
        check_max_seqlen("max_seqlen_q", max_seqlen_q)
        check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if fp8:
        from . import fp8  # fp8 sits above this module (it reuses the checks here)
        return fp8.descaled_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs, q_descale, k_descale, v_descale, out_dtype, sinks=sinks,
                                      s_aux=s_aux, block_table=block_table, seqused_k=seqused_k)
    if block_table is not None or seqused_k is not None:
        return flash_attn_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                       softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                                       block_table, seqused_k, sinks=sinks, s_aux=s_aux, deterministic=deterministic)
    _check_qkv(q, k, v, varlen=True)
    dropout_p, scale, left, right, softcap = _normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        seqlen_k=max_seqlen_k)
    batch, cu_seqlens_q, cu_seqlens_k = _check_varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                           max_seqlen_k)
    alibi_slopes = _check_alibi(alibi_slopes, q, batch, q.shape[1])
    sinks = _check_sinks(sinks, s_aux, q, q.shape[1])
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    with_probs = probs_wanted(return_attn_probs, dropout_p)
    q, k, v = _fit_int32_offsets(q, k, v, max_seqlen_q, max_seqlen_k, True, with_probs)
    out, lse, probs = ops.attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, left, right, softcap,
        alibi_slopes, _rng_state(dropout_p, q.device), with_probs, deterministic, sinks)
    return _finish(out, lse, probs, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, sinks=None, s_aux=None):
    """qkv: (total, 3, nheads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a tensor of shape (total, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    _check_tensor("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, s_aux=s_aux)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None,
                                    s_aux=None):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must be a tensor of shape (total_k, 2, nheads_k, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    _check_tensor("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, s_aux=s_aux)


# Decode side (flash_attn_with_kvcache, paged varlen): fa_amd/kvcache.py, which reuses the checks above,
# so it is imported last (its import of this module finds every name already defined).
from .kvcache import flash_attn_varlen_paged, flash_attn_with_kvcache  # noqa: E402
