"""FP8 attention: FA3-style descaled FP8 inputs, and the ROCm backend's four quantising functions.

Both run the same FP8 forward: FP8 is a dtype path of the prefill kernel
(fa_amd/kernels/forward.py, score_mods.load_head_descales), taken when q, k, v are fp8,
with the descale multipliers applied to the scores (q_descale * k_descale) and the
output (v_descale), and P rounded to V's fp8 type for the P.V dot, as FA3 does; as in FA3 the
output is divided by the row sum of the unrounded P (which keeps the lse exact), so it is within
P's rounding (2**-4 relative for e4m3) of a weighted mean of V.  Summing the rounded P as well
costs the FP8 forward 11 % (docs/TUNING_NOTES.md v25).

* `flash_attn_func` / `flash_attn_varlen_func` with FP8 q, k, v (one FP8 type the
  arch has: tables.FP8_DTYPES) and keyword-only `q_descale`, `k_descale`, `v_descale`
  (fp32, (batch, nheads_k), default 1: the real values are x_fp8 * descale, taken as they are -- a NaN
  descale gives NaN rows, a negative v_descale a negated output -- except that the scores' scale
  q_descale * k_descale must be >= 0: a negative product raises where the values are checked without a sync,
  else gives NaN rows, `_score_descale`; so does softmax_scale * q_descale * k_descale past the bounds
  softmax_scale has alone, interface.MAX_SOFTMAX_SCALE), and `out_dtype` (bfloat16 by default; float16 or float32).
  Forward only, like FA3's FP8: FP8 inputs (and descales) that require grad raise.
  Where the arch reads V token-major (tables.FP8_V_TOKEN_MAJOR), a V in the usual layout
  is copied per call (`token_major_copy`); a V that is a transposed contiguous (batch,
  nheads_k, d, seqlen) tensor is used as it is.
* `flash_attn_with_kvcache` with FP8 `k_cache` / `v_cache` (and paged `flash_attn_varlen_func`
  with FP8 pages): the split-KV decode kernel's FP8 path (kernels/decode.py); the rules are
  `kvcache_fp8_args`'s.  Its descales are taken as they are, of either sign: it has no raw-max path.
* `flash_attn_fp8_func`, `flash_attn_varlen_fp8_func`, `flash_attn_qkvpacked_fp8_func`,
  `flash_attn_varlen_qkvpacked_fp8_func`: fp16 / bf16 / fp32 inputs with the signatures
  of their high-precision siblings, quantised inside to the arch's FP8 type with one
  amax scale per (sequence, head) (`quantize_fp8`: two Triton passes, kernels/quantize.py,
  writing V straight into the layout the forward reads), output in the inputs' dtype, and
  differentiable.  NaN and +-inf inputs become the FP8 type's NaN and take no part in the
  scale (kernels/quantize.py), so they poison only the attention rows that use them.

torch.compile: as in fa_amd.ops, eager calls run the launchers (FP8Attention) and traced code one
custom op per step, each with a fake implementation: fa_amd::attention_fwd_fp8_quantized (the
quantising forward; its backward is fa_amd::attention_bwd), fa_amd::attention_fwd_fp8 (the FA3-style
forward), fa_amd::quantize_fp8 and fa_amd::fp8_token_major_copy (quantize_fp8 and token_major_copy
called in traced code).  The tracer cannot run a Triton launch itself.

Backward of the quantising functions: the gradients with respect to the high-precision
inputs are computed by the existing kernels, in the inputs' precision, from the saved
high-precision q, k, v -- each put through the arch's FP8 type and back first
(fp8_round_trip: the same per-(sequence, head) scale, so the values the FP8 forward used, rounded
to the inputs' dtype).  This is the straight-through rule of FP8 training (the rounding's own
derivative taken as the identity): the gradients of the computation the forward did, handed to the
inputs the user holds.  Why not the saved inputs themselves: the backward rebuilds P as
exp(S - lse), and with S of the unquantised q and k the rows of P stop summing to 1, an error that
grows with the scores' spread (dq off by 80 % of its largest entry at logits of std ~4).  Why out
and lse are recomputed (one forward launch on the round-tripped values) rather than the FP8
forward's: x8 * descale rounded to fp16 / bf16 is not exactly the value the FP8 dot used (the
descale is amax / fp8_max, not a power of two), and under sharply peaked attention that rounding,
times a large score, moved S by up to ~1 against the FP8 forward's lse: rows of P summed to 0.4-9.5
and dV was 40x the emulation's error at bf16 logits of std ~100 (tests/kernels/test_fp8.py,
test_fp8_func_backward_peaked_softmax).  With out and lse of the same values the backward is
exactly the bf16 / fp16 backward at the round-tripped inputs, at any logit scale.  Cost: one amax and
one cast pass over each of q, k, v and one forward in the backward (no FP8 copy is kept from the
forward); on an H100 the round trips took 0.30 ms of flash_attn_fp8_func's 2.70 ms forward+backward
at (4, 4096, 16, 128) causal, where flash_attn_func (bf16) takes 2.44 (.ci/fp8_backward_cost.py,
2026-11-25, before the recomputed forward); no FP8 backward kernel (FA3 and the ROCm path have
none).  Tests bound the gradients by 3x the error of a float64 emulation of this rule
(tests/kernels/test_fp8.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import interface as _api  # argument checks (this module sits above the interface)
from .interface import is_fp8_dtype
from . import ops
from .arch import TRITON_VERSION, arch_for
from .kernels.forward import attention_forward
from .kernels import launch as _launch
from .kernels.launch import MAX_ROW_OFFSET, new_output
from .kernels.quantize import quantize_into
from .kvcache import _check_values_now
from .tuning import fp8_dtype_names, fp8_min_triton, fp8_v_token_major

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ONES = {}  # device -> a one-element fp32 ones tensor, expanded for absent descales


def _ones(device: torch.device) -> Tensor:
    """A one-element fp32 1.0 on `device`, made once per device (traced calls make their own)."""
    if torch.compiler.is_compiling():
        return torch.ones(1, dtype=torch.float32, device=device)
    one = _ONES.get(device)
    if one is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
        # (one made inside a CUDA graph capture holds its value only once the graph replays: not kept)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ONES[device] = one
    return one


# --------------------------------------------------------------------------- arch and dtypes


def fp8_dtypes(device, instead: str = "flash_attn_func with bfloat16 or float16 inputs") -> Tuple[torch.dtype, ...]:
    """The FP8 types with a dot product on `device` (a tensor or device), the quantising functions'
    type first.  Raises a ValueError naming the arch where there is none or the installed Triton
    cannot compile it, and what to use `instead`."""
    probe = device if isinstance(device, torch.Tensor) else torch.empty(0, device=device)
    arch = arch_for(probe)
    names = fp8_dtype_names(arch)
    if not names:
        raise ValueError(
            f"fa_amd: FP8 attention needs an FP8 dot product, which {arch.name} does not have (FP8 needs "
            f"MI300 gfx942, MI350 gfx950 or NVIDIA sm89+); use {instead} on this GPU")
    need = fp8_min_triton(arch)
    if TRITON_VERSION < need:
        raise ValueError(f"fa_amd: FP8 attention on {arch.name} needs triton >= {need[0]}.{need[1]} "
                         f"(installed: {'.'.join(map(str, TRITON_VERSION))}); use {instead}, or a newer triton")
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


def _check_fp8_inputs(q, k, v):
    """q, k, v: tensors of one FP8 type that this arch's dot product takes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    fp8 = [name for name, x in (("q", q), ("k", k), ("v", v)) if is_fp8_dtype(x.dtype)]
    if len(fp8) != 3:
        plain = next(name for name in ("q", "k", "v") if name not in fp8)
        ref = fp8[0] if fp8 else None
        x = {"q": q, "k": k, "v": v}
        got = f"{plain} is {x[plain].dtype}" + (f" while {ref} is {x[ref].dtype}" if ref else "")
        raise TypeError(f"FP8 attention takes q, k and v all in one FP8 dtype, but {got}; pass all three in FP8 "
                        f"(with q_descale/k_descale/v_descale), or high-precision inputs to flash_attn_func, "
                        f"or to flash_attn_fp8_func to have them quantised")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one FP8 dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    supported = fp8_dtypes(q)
    if q.dtype not in supported:
        arch = arch_for(q).name
        raise TypeError(f"q, k and v are {q.dtype}, which {arch} has no dot product for; its FP8 types are "
                        f"{', '.join(str(d) for d in supported)}")
    ops.refuse_forward_tangents("FP8 attention", q=q, k=k, v=v)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        needing_grad = [name for name, x in (("q", q), ("k", k), ("v", v)) if x.requires_grad]
        raise ValueError(f"FP8 {' and '.join(needing_grad)} require{'s' if len(needing_grad) == 1 else ''} grad, "
                         f"but FP8 q, k, v have no backward in fa_amd (FP8 inputs are forward-only, as in FA3); "
                         f"for training pass high-precision tensors to flash_attn_fp8_func (quantised inside, "
                         f"differentiable), or detach the FP8 inputs")


def _check_descale(name: str, x, batch: int, nheads_k: int, q: Tensor) -> Tensor:
    """A (batch, nheads_k) fp32 descale on q's device; ones when None (an expanded view: no launch)."""
    if x is None:
        return _ones(q.device).expand(batch, nheads_k)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if tuple(x.shape) != (batch, nheads_k):
        raise ValueError(f"{name} must have shape (batch, nheads_k) = ({batch}, {nheads_k}), got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share one device")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but FP8 attention is forward-only (no gradient flows to the "
                         f"descales, as in FA3); detach {name}, or train through flash_attn_fp8_func (quantised "
                         f"inside, differentiable in q, k, v)")
    return x


def _check_out_dtype(out_dtype) -> torch.dtype:
    if out_dtype is None:
        return torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float16, torch.bfloat16 or torch.float32 (or None: bfloat16), "
                        f"got {out_dtype!r}")
    return out_dtype


def _score_descale(q_descale: Tensor, k_descale: Tensor, scale: float = 1.0, softcap: float = 0.0) -> Tensor:
    """q_descale, checked against a negative q_descale * k_descale (the scores' scale): the forward's
    unmasked tiles take the row max of the raw scores (tables.FWD_RAW_MAX_FAMILIES), right for a positive
    scale only, and a branch on the sign in the kernel cost the FP8 forward 4-10 % (H200, 2026-11-28).
    A ValueError where the values cost no sync (kvcache._check_values_now: CPU tensors, or
    FA_AMD_CHECK_KVCACHE=1); otherwise the forward kernel takes a negative product as NaN, so those
    (sequence, head)s' rows come out NaN instead of a wrong softmax."""
    if _check_values_now(q_descale):
        product = q_descale * k_descale
        if bool((product < 0).any()):
            raise ValueError("q_descale * k_descale must be >= 0 (descales are reciprocal scales: the real values "
                             "are x_fp8 * descale), got a negative product for (batch, head_k) "
                             f"{tuple((product < 0).nonzero()[0].tolist())}")
        # the scores' float32 scale is softmax_scale * q_descale * k_descale: the bounds softmax_scale has alone
        # (a product past them, e.g. descales of 1e20, made every row NaN)
        largest = float(product.abs().max()) if product.numel() else 0.0
        try:
            _api._check_float32_range(scale * largest, softcap)
        except ValueError as exc:
            raise ValueError(f"softmax_scale * q_descale * k_descale = {scale} * {largest:.3g} is out of the kernels' "
                             f"float32 range: {exc}") from None
    # else the forward kernel itself turns a negative product into NaN (attn_fwd_kernel): no launch per call here;
    # nor is the product's size checked (a product past those bounds gives NaN rows)
    return q_descale


# --------------------------------------------------------------------------- FP8 KV cache (fa_amd.kvcache)

def kvcache_fp8_args(q, k_cache, v_cache, k, v, q_descale, k_descale, v_descale, out_dtype, batch: int,
                     q_name: str = "q", cache_names=("k_cache", "v_cache"), new_names=("k", "v")):
    """The FP8 arguments of flash_attn_with_kvcache (and of paged flash_attn_varlen_func) checked:
    (descale, out_dtype), descale the fp32 (q_descale, k_descale, v_descale), each (batch, nheads_k), which
    the decode kernels read in place (an absent one a ones view); (None, None) for a call with no FP8 tensor
    and no FP8 option.

    Rules: k_cache and v_cache share one FP8 type the arch has a dot product for (tables.FP8_DTYPES);
    q is FP8 of that type (q_descale applies) or fp16 / bf16 / fp32 (K and V are widened to its dtype
    in the kernel; q_descale must be left out); new k and v are both FP8 of the caches' type (stored as
    they are: already scaled by k_descale / v_descale) or both high-precision (quantised on append:
    fp8(clamp(x / descale)), saturating at the type's max, as vLLM writes its FP8 caches).  Descales:
    fp32 (batch, nheads_k), default 1, taken as they are: unlike the prefill forward (`_score_descale`), the
    decode kernel computes a negative q_descale * k_descale exactly (it takes no raw-score max).  Output:
    out_dtype, default bfloat16 for an FP8 q (as FA3) and q's dtype for a high-precision q."""
    kc_name, vc_name = cache_names
    named = ((q_name, q), (kc_name, k_cache), (vc_name, v_cache), (new_names[0], k), (new_names[1], v))
    for name, x in named[:3]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    fp8 = {name for name, x in named if isinstance(x, torch.Tensor) and is_fp8_dtype(x.dtype)}
    options = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale), ("out_dtype", out_dtype))
    if not fp8:
        given = next((name for name, x in options if x is not None), None)
        if given is not None:
            raise ValueError(f"{given} applies to an FP8 KV cache only, but {kc_name} is {k_cache.dtype}; leave it "
                             f"out, or pass FP8 {kc_name}/{vc_name}")
        return None, None
    if kc_name not in fp8 or vc_name not in fp8:
        plain = kc_name if kc_name not in fp8 else (vc_name if vc_name not in fp8 else None)
        if plain is not None:
            other = next(name for name in (q_name, kc_name, vc_name, *new_names) if name in fp8)
            x = dict(named)
            raise TypeError(f"{other} is {x[other].dtype} but {plain} is {x[plain].dtype}: FP8 attention over a KV "
                            f"cache needs {kc_name} and {vc_name} in one FP8 dtype (then {q_name} may be FP8 of that "
                            f"type or fp16/bf16/fp32)")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{kc_name} and {vc_name} must share one FP8 dtype, got {k_cache.dtype} and {v_cache.dtype}")
    supported = fp8_dtypes(q, instead=f"flash_attn_with_kvcache with a bfloat16 or float16 {kc_name} / {vc_name}")
    if k_cache.dtype not in supported:
        raise TypeError(f"{kc_name} and {vc_name} are {k_cache.dtype}, which {arch_for(q).name} has no dot product "
                        f"for; its FP8 types are {', '.join(str(d) for d in supported)}")
    q_fp8 = q_name in fp8
    if q_fp8 and q.dtype != k_cache.dtype:
        raise TypeError(f"{q_name} is {q.dtype} but {kc_name} is {k_cache.dtype}: an FP8 {q_name} must have the "
                        f"cache's FP8 dtype (or pass it as fp16/bf16/fp32)")
    if not q_fp8 and q.dtype not in OUT_DTYPES:
        raise TypeError(f"{q_name} must be FP8 ({k_cache.dtype}) or float16, bfloat16 or float32, got {q.dtype}")
    if not q_fp8 and q_descale is not None:
        raise ValueError(f"q_descale applies to an FP8 {q_name}, but {q_name} is {q.dtype}; leave it out (a "
                         f"high-precision {q_name} needs no descale)")
    if k is not None and v is not None:
        for name, x in ((new_names[0], k), (new_names[1], v)):
            if isinstance(x, torch.Tensor) and is_fp8_dtype(x.dtype) and x.dtype != k_cache.dtype:
                raise TypeError(f"{name} is {x.dtype} but {kc_name} is {k_cache.dtype}: new FP8 keys/values must "
                                f"have the cache's dtype (or be fp16/bf16/fp32, quantised with k_descale/v_descale)")
        if (new_names[0] in fp8) != (new_names[1] in fp8):
            raise TypeError(f"{new_names[0]} is {getattr(k, 'dtype', type(k).__name__)} but {new_names[1]} is "
                            f"{getattr(v, 'dtype', type(v).__name__)}: append both in the "
                            f"cache's FP8 dtype, or both in fp16/bf16/fp32 (quantised with k_descale/v_descale)")
        for name, x in ((new_names[0], k), (new_names[1], v)):
            if isinstance(x, torch.Tensor) and not is_fp8_dtype(x.dtype) and x.dtype not in OUT_DTYPES:
                raise TypeError(f"{name} must be {k_cache.dtype} or float16, bfloat16 or float32, got {x.dtype}")
    nheads_k = k_cache.shape[-2] if k_cache.dim() >= 2 else 0
    descales = [_check_descale(name, x, batch, nheads_k, q)
                for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
    if k is not None and new_names[0] not in fp8:
        # high-precision k / v are quantised as x / descale: a descale <= 0 or NaN would write saturated or NaN
        # values into the cache; checked where the values cost no sync, as the cache's index tensors are
        for name, given, x in (("k_descale", k_descale, descales[1]), ("v_descale", v_descale, descales[2])):
            if given is not None and _check_values_now(x) and not bool((x > 0).all() & torch.isfinite(x).all()):
                raise ValueError(f"{name} must be finite and > 0 to quantise the appended {new_names[0]}/"
                                 f"{new_names[1]} (x8 = fp8(x / descale)), got values in "
                                 f"[{x.min().item()}, {x.max().item()}]")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if q_fp8 else q.dtype
    return tuple(descales), _check_out_dtype(out_dtype)


# --------------------------------------------------------------------------- quantisation

def quantize_fp8(x: Tensor, fp8_dtype: torch.dtype, cu_seqlens: Optional[Tensor] = None,
                 token_major: bool = False, max_seqlen: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """(x8, descale): x (batch, seqlen, nheads, d), or (total, nheads, d) with cu_seqlens, scaled per
    (sequence, head) so its largest finite magnitude maps to the fp8 type's max: x8 = fp8(clamp(x *
    scale)), scale = fp8_max / amax, descale = amax / fp8_max (1 for all-zero, all-non-finite or empty
    heads); NaN and +-inf in x become the fp8 type's NaN (kernels/quantize.py has the whole rule);
    descale is fp32 (batch, nheads).  token_major (dense only): x8 is laid out token-major per head
    (token_major_empty), as the forward reads V on tables.FP8_V_TOKEN_MAJOR families.  Two Triton
    passes over x (kernels/quantize.py); max_seqlen (varlen, optional) only sizes their grid.  Under
    torch.compile the passes run as one custom op (fa_amd::quantize_fp8, with a fake implementation)."""
    if not is_fp8_dtype(fp8_dtype):
        raise TypeError(f"fp8_dtype must be a torch FP8 dtype, got {fp8_dtype}")
    # the interpreter converts to every FP8 type; a GPU's compiler only to its own (sm90 cannot build
    # a cast to gfx942's fnuz type)
    if x.device.type != "cpu" and fp8_dtype not in fp8_dtypes(x):
        raise TypeError(f"fp8_dtype {fp8_dtype} is not an FP8 type of {arch_for(x).name}; its FP8 types are "
                        f"{', '.join(str(d) for d in fp8_dtypes(x))}")
    token_major = token_major and cu_seqlens is None
    if torch.compiler.is_compiling():  # one opaque node for the tracer (it cannot run Triton launches)
        x8, descale = torch.ops.fa_amd.quantize_fp8(x.detach(), fp8_dtype, cu_seqlens, max_seqlen, token_major)
        return (_token_major_view(x8, x.shape[1]) if token_major else x8), descale
    return _quantize(x, fp8_dtype, cu_seqlens, max_seqlen, token_major)


def _quantize(x: Tensor, fp8_dtype: torch.dtype, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
              token_major: bool, storage: bool = False) -> Tuple[Tensor, Tensor]:
    """quantize_fp8's launches (arguments checked; token_major only for dense x); storage: a token-major
    x8 as its padded storage (_token_major_storage)."""
    if token_major:
        base = _token_major_storage(x.shape, fp8_dtype, x.device)
        x8 = _token_major_view(base, x.shape[1])
    else:
        base = x8 = new_output(x, x.shape, fp8_dtype)
    descale = quantize_into(x, x8, torch.finfo(fp8_dtype).max, cu_seqlens, max_seqlen)
    return (base if storage else x8), descale


@torch.library.custom_op("fa_amd::quantize_fp8", mutates_args=())
def quantize_fp8_op(x: Tensor, fp8_dtype: torch.dtype, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                    token_major: bool) -> Tuple[Tensor, Tensor]:
    """quantize_fp8 for traced code: (x8, descale), x8 with token_major the padded storage
    (_token_major_storage; quantize_fp8 takes the view: an op's output may not be a view)."""
    return _quantize(x, fp8_dtype, cu_seqlens, max_seqlen, token_major, storage=True)


@quantize_fp8_op.register_fake
def _quantize_fp8_fake(x, fp8_dtype, cu_seqlens, max_seqlen, token_major):
    batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else x.shape[0]
    descale = x.new_empty((batch, x.shape[-2]), dtype=torch.float32)
    if token_major:
        return _token_major_storage(x.shape, fp8_dtype, x.device, fake=True), descale
    return x.new_empty(x.shape, dtype=fp8_dtype), descale


@torch.library.custom_op("fa_amd::fp8_token_major_copy", mutates_args=())
def token_major_copy_op(v: Tensor) -> Tensor:
    """token_major_copy for traced code: the padded storage (quantize_fp8_op)."""
    return _token_major_copy(v, storage=True)


@token_major_copy_op.register_fake
def _token_major_copy_fake(v):
    return _token_major_storage(v.shape, v.dtype, v.device, fake=True)


_TOKEN_MAJOR_ALIGN = 16  # elements: the token stride of a token-major copy's rows (16 B for fp8 loads)


def _padded_tokens(n_tokens: int) -> int:
    return -(-n_tokens // _TOKEN_MAJOR_ALIGN) * _TOKEN_MAJOR_ALIGN


def _token_major_storage(shape, dtype: torch.dtype, device, fake: bool = False) -> Tensor:
    """token_major_empty's storage: (batch, nheads, d, seqlen padded to a multiple of 16), its padding zero
    (fake: only the tensor, for the custom ops' fake implementations)."""
    batch, seqlen, nheads, d = shape
    storage = torch.empty(batch, nheads, d, _padded_tokens(seqlen), dtype=dtype, device=device)
    if not fake:
        if _launch.POISON_OUTPUTS:  # (tests: unwritten values show as NaN)
            storage.fill_(float("nan"))
        storage[..., seqlen:].zero_()
    return storage


def _token_major_view(storage: Tensor, seqlen) -> Tensor:
    """The (batch, seqlen, nheads, d) view of a token-major storage."""
    return storage[..., :seqlen].permute(0, 3, 1, 2)


def token_major_empty(shape, dtype: torch.dtype, device) -> Tensor:
    """A tensor of the dense V shape (batch, seqlen, nheads, d) stored token-major per head: storage
    (batch, nheads, d, seqlen padded to a multiple of 16), its values unset and its padding zero.  The
    forward's masked V tiles read whole padded rows (kernels/forward.py, v_len): the padding must be
    finite, as P is 0 there."""
    return _token_major_view(_token_major_storage(shape, dtype, device), shape[1])


def token_major_copy(v: Tensor) -> Tensor:
    """An FP8 V (batch, seqlen, nheads, d) copied token-major (token_major_empty) by the quantiser's
    cast kernel run unscaled (one read, one write; its tiles transpose in shared memory); under
    torch.compile one custom op (fa_amd::fp8_token_major_copy)."""
    if torch.compiler.is_compiling():
        return _token_major_view(torch.ops.fa_amd.fp8_token_major_copy(v), v.shape[1])
    return _token_major_copy(v)


def _token_major_copy(v: Tensor, storage: bool = False) -> Tensor:
    base = _token_major_storage(v.shape, v.dtype, v.device)
    out = _token_major_view(base, v.shape[1])
    if v.numel():
        quantize_into(v, out, 0.0, scaled=False)
    return base if storage else out


def _token_major(arch, varlen: bool, seqlen_k: int, head_dim: int) -> bool:
    """Whether the forward reads this call's FP8 V token-major: dense calls on tables.FP8_V_TOKEN_MAJOR
    families whose padded rows keep the kernels' in-sequence offsets ((d - 1) * row stride + row
    stride - 1) within int32.  (Varlen V stays head-dim-major: its sequences start at arbitrary tokens,
    so its token-major tiles would not be aligned.)"""
    return (not varlen and fp8_v_token_major(arch)
            and head_dim * _padded_tokens(seqlen_k) - 1 <= MAX_ROW_OFFSET)


def _v_layout(v: Tensor, varlen: bool, arch) -> Tensor:
    """FP8 V as the forward reads it: where _token_major says so, V itself if it is token-major with
    rows exactly seqlen_k long (e.g. a transposed contiguous (batch, nheads, d, seqlen) tensor: the
    masked tiles then read nothing past a row), else a zero-padded token-major copy
    (token_major_empty); elsewhere V with a contiguous head dim."""
    if _token_major(arch, varlen, v.shape[1] if not varlen else 0, v.shape[-1]):
        if v.stride(1) == 1 and v.stride(-1) == v.shape[1] and v.shape[1] > 1:
            return v
        return token_major_copy(v)
    return v if v.stride(-1) == 1 else v.contiguous()


# --------------------------------------------------------------------------- the FP8 forward op

@torch.library.custom_op("fa_amd::attention_fwd_fp8", mutates_args=())
def attention_fwd_fp8(
    q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[Tensor], rng_state: Optional[Tensor], return_probs: bool, out_dtype: torch.dtype,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                             return_probs, sinks, descales=(q_descale, k_descale, v_descale), out_dtype=out_dtype)


@attention_fwd_fp8.register_fake
def _attention_fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                            rng_state, return_probs, out_dtype, sinks=None):
    if cu_seqlens_q is not None:
        batch, hq = cu_seqlens_q.shape[0] - 1, q.shape[1]
        lse = q.new_empty((hq, q.shape[0]), dtype=torch.float32)
    else:
        batch, hq = q.shape[0], q.shape[2]
        lse = q.new_empty((batch, hq, q.shape[1]), dtype=torch.float32)
    probs = q.new_empty((batch, hq, max_seqlen_q, max_seqlen_k) if return_probs else (0,), dtype=out_dtype)
    return q.new_empty(q.shape, dtype=out_dtype), lse, probs


def _fp8_forward(q, k, v, descales, *args, sinks=None):
    """attention_fwd_fp8's (out, lse, probs) for descales (q_descale, k_descale, v_descale) and the op's other
    arguments: the op while torch.compile traces, the launcher otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.fa_amd.attention_fwd_fp8(q, k, v, *descales, *args, sinks)
    return attention_forward(q, k, v, *args[:-1], sinks, descales=tuple(descales), out_dtype=args[-1])


# --------------------------------------------------------------------------- FA3-style FP8 inputs

def descaled_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                       q_descale=None, k_descale=None, v_descale=None, out_dtype=None, sinks=None, s_aux=None,
                       block_table=None, seqused_k=None):
    """flash_attn_func / flash_attn_varlen_func (cu_seqlens_q given) with FP8 q, k, v (forward only)."""
    varlen = cu_seqlens_q is not None
    if not any(isinstance(x, torch.Tensor) and is_fp8_dtype(x.dtype) for x in (q, k, v)):
        given = next(name for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                                          ("v_descale", v_descale), ("out_dtype", out_dtype)) if x is not None)
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"{given} applies to FP8 q, k, v only, but q is {got}; leave it out for high-precision "
                         f"inputs, or call flash_attn_fp8_func to run them in FP8 (quantised inside)")
    if block_table is not None or seqused_k is not None:  # paged / seqused varlen: the decode kernel
        # (its rules are the FP8 KV cache's, kvcache_fp8_args: q may also be fp16 / bf16 / fp32 over FP8 k / v)
        return _api.flash_attn_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                            return_attn_probs, block_table, seqused_k, sinks=sinks, s_aux=s_aux,
                                            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                            out_dtype=out_dtype, deterministic=deterministic)
    _check_fp8_inputs(q, k, v)
    _api._check_qkv(q, k, v, varlen=varlen, dtypes=(q.dtype,))
    dropout_p, scale, left, right, softcap = _api._normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        seqlen_k=max_seqlen_k if varlen else k.shape[1])
    if varlen:
        batch, cu_seqlens_q, cu_seqlens_k = _api._check_varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                    max_seqlen_k)
        max_q, max_k = max_seqlen_q, max_seqlen_k
    else:
        batch, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]
    nheads_q, nheads_k = q.shape[-2], k.shape[-2]
    descales = [_check_descale(name, x, batch, nheads_k, q)
                for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
    if q_descale is not None or k_descale is not None:
        descales[0] = _score_descale(*descales[:2], scale, softcap)
    out_dtype = _check_out_dtype(out_dtype)
    alibi_slopes = _api._check_alibi(alibi_slopes, q, batch, nheads_q)
    sinks = _api._check_sinks(sinks, s_aux, q, nheads_q)
    if sinks is not None and torch.is_grad_enabled() and sinks.requires_grad:
        raise ValueError("FP8 attention is forward-only: sinks that require grad have no backward here; detach "
                         "them, or use flash_attn_func with high-precision inputs to train sinks")
    # V straight to the layout the forward reads: a token-major V made head-dim contiguous first was copied
    # twice per call (a strided torch copy, then the token-major copy back; 0.26 ms of a 1.6 ms b2 s8k call)
    q, k = (_api._last_dim_contiguous(x) for x in (q, k))
    v = _v_layout(v, varlen, arch_for(q))
    with_probs = _api.probs_wanted(return_attn_probs, dropout_p)
    q, k, v = _api._fit_int32_offsets(q, k, v, max_q, max_k, varlen, with_probs)
    # (the kernels read the three descales in place: no launch here to pack them)
    out, lse, probs = _fp8_forward(
        q, k, v, descales, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, scale, left, right, softcap,
        alibi_slopes, _api._rng_state(dropout_p, q.device), with_probs, out_dtype, sinks=sinks)
    return _api._finish(out, lse, probs, return_attn_probs)


# --------------------------------------------------------------------------- quantising functions

def _quantized_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       window_left, window_right, softcap, alibi_slopes, rng_state, return_probs):
    """Quantise q, k, v per (sequence, head) to the arch's FP8 type and run the FP8 forward;
    (out in q's dtype, lse, probs).  Eager code only (FP8Attention, or attention_fwd_fp8_quantized's
    implementation)."""
    fp8_dtype = fp8_dtypes(q)[0]
    varlen = cu_seqlens_q is not None
    token_major = _token_major(arch_for(q), varlen, 0 if varlen else v.shape[1], v.shape[-1])
    # (_quantize: quantize_fp8's launches without its checks; this runs eagerly or inside the op)
    q8, q_descale = _quantize(q, fp8_dtype, cu_seqlens_q, max_seqlen_q, False)
    k8, k_descale = _quantize(k, fp8_dtype, cu_seqlens_k, max_seqlen_k, False)
    v8, v_descale = _quantize(v, fp8_dtype, cu_seqlens_k, max_seqlen_k, token_major)
    return _fp8_forward(q8, k8, v8, (q_descale, k_descale, v_descale), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                        rng_state, return_probs, q.dtype)


def fp8_round_trip(x: Tensor, fp8_dtype: torch.dtype, cu_seqlens: Optional[Tensor] = None,
                   max_seqlen: Optional[int] = None) -> Tensor:
    """x quantised as quantize_fp8 does it and dequantised, in x's dtype: the values the FP8 forward of
    the quantising functions used (one amax pass and one fused cast pass, kernels/quantize.py)."""
    out = new_output(x, x.shape, x.dtype)
    quantize_into(x, out, torch.finfo(fp8_dtype).max, cu_seqlens, max_seqlen, round_trip=fp8_dtype)
    return out


@torch.library.custom_op("fa_amd::fp8_round_trip", mutates_args=())
def fp8_round_trip_op(x: Tensor, fp8_dtype: torch.dtype, cu_seqlens: Optional[Tensor],
                      max_seqlen: Optional[int]) -> Tensor:
    """fp8_round_trip for traced code (the compiled backward of attention_fwd_fp8_quantized)."""
    return fp8_round_trip(x, fp8_dtype, cu_seqlens, max_seqlen)


@fp8_round_trip_op.register_fake
def _fp8_round_trip_fake(x, fp8_dtype, cu_seqlens, max_seqlen):
    return x.new_empty(x.shape)


def _forward_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, trip=fp8_round_trip):
    """(q, k, v) as the quantising forward used them: each through the arch's FP8 type and back (`trip`: the
    eager function, or its custom op where the backward is traced)."""
    fp8_dtype = fp8_dtypes(q)[0]
    return (trip(q, fp8_dtype, cu_seqlens_q, max_seqlen_q), trip(k, fp8_dtype, cu_seqlens_k, max_seqlen_k),
            trip(v, fp8_dtype, cu_seqlens_k, max_seqlen_k))


def _traced_forward_values(*args):
    """_forward_values through fa_amd::fp8_round_trip: AOT autograd traces a compiled backward with fake
    tensors, and there torch.compiler.is_compiling() need not be true."""
    return _forward_values(*args, trip=torch.ops.fa_amd.fp8_round_trip)


def _backward(ctx, dout):
    """Gradients of the high-precision inputs by the existing kernels, at the values the FP8 forward used (the
    saved q, k, v through FP8 and back), with out and lse recomputed from those values (module docstring);
    once-differentiable as fa_amd.ops' backward (create_graph=True: a second backward raises)."""
    if torch.compiler.is_compiling():
        return _compiled_backward(ctx, dout, None, None)
    bwd = ops._OnceDifferentiableGrads.apply if torch.is_grad_enabled() else ops._gradients
    return ops._backward_with(bwd, ctx, dout, round_trip=_forward_values, forward=torch.ops.fa_amd.attention_fwd)


def _compiled_backward(ctx, dout, _dlse, _dprobs):
    """attention_fwd_fp8_quantized's backward (torch.compile): _backward's rule through custom ops."""
    return ops._backward_with(torch.ops.fa_amd.attention_bwd, ctx, dout, round_trip=_traced_forward_values,
                              forward=torch.ops.fa_amd.attention_fwd)


class FP8Attention(torch.autograd.Function):
    """Quantising FP8 forward with the high-precision backward; takes attention_fwd's arguments."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _quantized_forward(*inputs[:-1])  # the last input, `deterministic`, is for the backward
        ops._setup_context(ctx, inputs, output)  # saves the high-precision q, k, v with out and lse
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse, _dprobs):
        if dout is None:  # only lse / probs were used
            return (None,) * 16
        return _backward(ctx, dout)


@torch.library.custom_op("fa_amd::attention_fwd_fp8_quantized", mutates_args=())
def attention_fwd_fp8_quantized(
    q: Tensor, k: Tensor, v: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[Tensor], rng_state: Optional[Tensor], return_probs: bool, deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The quantising forward (_quantized_forward) as one op for torch.compile: attention_fwd's
    arguments and outputs, differentiable through fa_amd::attention_bwd as attention_fwd is (the
    backward rule of the module docstring: the same saved tensors as FP8Attention)."""
    return _quantized_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                              return_probs)


@attention_fwd_fp8_quantized.register_fake
def _attention_fwd_fp8_quantized_fake(*inputs):
    return ops._attention_fwd_fake(*inputs)  # outputs in q's dtype, as attention_fwd's


attention_fwd_fp8_quantized.register_autograd(_compiled_backward, setup_context=ops._setup_context)


def _attention_fp8(*inputs):
    q, k, v = inputs[:3]
    # under torch.compile one opaque node per direction (dynamo refuses to trace FP8Attention.apply given
    # one tensor twice, as varlen calls pass cu_seqlens_q and cu_seqlens_k)
    if torch.compiler.is_compiling():
        return torch.ops.fa_amd.attention_fwd_fp8_quantized(*inputs)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return _quantized_forward(*inputs[:-1])
    return FP8Attention.apply(*inputs)


def flash_attn_fp8_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func for fp16 / bf16 / fp32 q, k, v with the forward in FP8: q, k, v are quantised
    per (batch, head) to the arch's FP8 type (quantize_fp8); returns out in q's dtype (and with
    return_attn_probs (out, softmax_lse, S_dmask)); differentiable (module docstring)."""
    _api._check_qkv(q, k, v, varlen=False)
    fp8_dtypes(q)
    dropout_p, scale, left, right, softcap = _api._normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        seqlen_k=k.shape[1])
    alibi_slopes = _api._check_alibi(alibi_slopes, q, q.shape[0], q.shape[2])
    q, k, v = (_api._last_dim_contiguous(x) for x in (q, k, v))
    with_probs = _api.probs_wanted(return_attn_probs, dropout_p)
    q, k, v = _api._fit_int32_offsets(q, k, v, q.shape[1], k.shape[1], False, with_probs)
    out, lse, probs = _attention_fp8(
        q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, scale, left, right, softcap, alibi_slopes,
        _api._rng_state(dropout_p, q.device), with_probs, deterministic)
    return _api._finish(out, lse, probs, return_attn_probs)


def flash_attn_varlen_fp8_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn_varlen_func with the forward in FP8, quantised per (sequence, head)
    (see flash_attn_fp8_func)."""
    if block_table is not None:
        raise ValueError("flash_attn_varlen_fp8_func does not take block_table (paged KV is forward-only); pass "
                         "contiguous k/v, or FP8 pages with descales to flash_attn_with_kvcache")
    _api._check_qkv(q, k, v, varlen=True)
    fp8_dtypes(q)
    max_seqlen_q, max_seqlen_k = _api.integer_arg(max_seqlen_q), _api.integer_arg(max_seqlen_k)
    dropout_p, scale, left, right, softcap = _api._normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        seqlen_k=max_seqlen_k)
    batch, cu_seqlens_q, cu_seqlens_k = _api._check_varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                max_seqlen_k)
    max_q, max_k = max_seqlen_q, max_seqlen_k
    alibi_slopes = _api._check_alibi(alibi_slopes, q, batch, q.shape[1])
    q, k, v = (_api._last_dim_contiguous(x) for x in (q, k, v))
    with_probs = _api.probs_wanted(return_attn_probs, dropout_p)
    q, k, v = _api._fit_int32_offsets(q, k, v, max_q, max_k, True, with_probs)
    out, lse, probs = _attention_fp8(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, scale, left, right, softcap, alibi_slopes,
        _api._rng_state(dropout_p, q.device), with_probs, deterministic)
    return _api._finish(out, lse, probs, return_attn_probs)


def flash_attn_qkvpacked_fp8_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim), fp16 / bf16 / fp32; see flash_attn_fp8_func."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be a tensor of shape (batch, seqlen, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    _api._check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")  # (its dtype under its own name)
    q, k, v = qkv.unbind(2)
    return flash_attn_fp8_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_fp8_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim), fp16 / bf16 / fp32; see flash_attn_varlen_fp8_func."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a tensor of shape (total, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    _api._check_tensor("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_fp8_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs)
