"""Decode-side public API: `flash_attn_with_kvcache` (flash-attn 2.x signature and semantics) and
the paged / `seqused_k` route of `flash_attn_varlen_func`, with all their argument checking; the
split-KV kernels are fa_amd/kernels/decode.py.  Re-exported by fa_amd.interface and fa_amd.

Forward only, as in flash-attn.  No host synchronisation on the default path (graphs capture it,
torch.compile sees two custom ops): shapes, dtypes and devices are checked on the host, and device
values (cache_seqlens, cache_batch_idx, cache_leftpad, block_table entries) only where that costs
no sync (CPU tensors, i.e. the interpreter) or when FA_AMD_CHECK_KVCACHE=1 (one device->host copy
per tensor version, memoized; skipped under graph capture and torch.compile).  The kernels clamp
every such index, so unchecked bad values never read or write outside the tensors.

FP8 KV caches (k_cache / v_cache in one FP8 type, with k_descale / v_descale, and q FP8 with
q_descale or high-precision): fa_amd.fp8.kvcache_fp8_args states and checks the rules.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor

from .arch import INTERPRET, arch_for, check_interpreter_supported
from .interface import (MAX_HEAD_DIM, SUPPORTED_DTYPES, _check_alibi, _check_cu_seqlens, _check_device, _check_sinks,
                        _check_tensor, _is_fp8_call, _normalize_scalars)
from .kernels.decode import decode_forward, filed_plan, kv_append, run_filed_plan
from .kernels.launch import MAX_GRID_YZ, head_dim_padded, row_offsets_fit
from .memo import memo_per_tensor
from .ops import forward_level_open, refuse_forward_tangents
from .tuning import get_decode_config, tables
from .tuning.tuned_table import getenv

# "1": also check the values of device index tensors (one device->host copy per tensor version)
CHECK_KVCACHE_ENV = "FA_AMD_CHECK_KVCACHE"
PAGE_MULTIPLE = 16
_INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- custom ops (torch.compile)

@torch.library.custom_op("fa_amd::kvcache_append", mutates_args=("k_cache", "v_cache"))
def _append_op(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
               cache_seqlens_int: Optional[int], cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor],
               rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], rotary_interleaved: bool,
               q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
               v_descale: Optional[Tensor] = None) -> None:
    _append(k, v, k_cache, v_cache, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table, rotary_cos,
            rotary_sin, rotary_interleaved, q_descale, k_descale, v_descale)


@_append_op.register_fake
def _(k, v, k_cache, v_cache, *args):
    return None


@torch.library.custom_op("fa_amd::decode_fwd", mutates_args=())
def _decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, softmax_scale: float, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
               max_seqlen_q: Optional[int], cache_seqlens: Optional[Tensor], cache_seqlens_int: Optional[int],
               seqlen_new: int, cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
               cache_leftpad: Optional[Tensor], cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor],
               key_mask: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
               rotary_interleaved: bool, rotary_per_token: bool, num_splits: int,
               sinks: Optional[Tensor], q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
               v_descale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    return decode_forward(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                          cu_seqlens_q, max_seqlen_q, cache_seqlens, cache_seqlens_int, seqlen_new, cu_seqlens_k,
                          seqused_k, cache_leftpad, cache_batch_idx, block_table, key_mask, rotary_cos, rotary_sin,
                          rotary_interleaved, rotary_per_token, num_splits, sinks,
                          _descales(q_descale, k_descale, v_descale), out_dtype,
                          own_counters=True)  # (see decode_forward: the compiled graph may run in cudagraph trees)


@_decode_op.register_fake
def _(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q, *args):
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    out_dtype = args[19] if len(args) > 19 and args[19] is not None else q.dtype  # (decode_attention passes all)
    return q.new_empty(q.shape, dtype=out_dtype), lse


def _descales(q_descale, k_descale, v_descale):
    """The ops' three descale arguments as the kernels' `descale` (None: not an FP8 call)."""
    return None if k_descale is None else (q_descale, k_descale, v_descale)


def _append(k, v, k_cache, v_cache, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table, rotary_cos,
            rotary_sin, rotary_interleaved, q_descale=None, k_descale=None, v_descale=None):
    cfg = get_decode_config(arch_for(k), head_dim_padded(k.shape[-1]), k.dtype == torch.float32)["append"]
    kv_append(k, v, k_cache, v_cache, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table, rotary_cos,
              rotary_sin, rotary_interleaved, cfg, _descales(q_descale, k_descale, v_descale))


def decode_attention(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap, alibi_slopes=None,
                     cu_seqlens_q=None, max_seqlen_q=None, cache_seqlens=None, cache_seqlens_int=None, seqlen_new=0,
                     cu_seqlens_k=None, seqused_k=None, cache_leftpad=None, cache_batch_idx=None, block_table=None,
                     key_mask=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                     rotary_per_token=False, num_splits=0, sinks=None, descale=None, out_dtype=None,
                     plan_key=None, need_lse=True, alias_key=None, grow_key=None):
    """(out, lse) of the decode kernel on already-checked arguments: the custom op while
    torch.compile traces, the launcher directly otherwise (fa_amd.kernels.decode.decode_forward;
    `plan_key`: the key its launch plan is memoized under, for a plain call of flash_attn_with_kvcache;
    `need_lse` False: the caller drops the lse, which the eager path then returns as None; `alias_key`: see
    decode_forward)."""
    if torch.compiler.is_compiling():
        fp8 = (*descale, out_dtype) if descale is not None else ()  # (a non-FP8 call passes what it always did)
        return _decode_op(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                          cu_seqlens_q, max_seqlen_q, cache_seqlens, cache_seqlens_int, seqlen_new, cu_seqlens_k,
                          seqused_k, cache_leftpad, cache_batch_idx, block_table, key_mask, rotary_cos, rotary_sin,
                          rotary_interleaved, rotary_per_token, num_splits, sinks, *fp8)
    return decode_forward(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                          cu_seqlens_q, max_seqlen_q, cache_seqlens, cache_seqlens_int, seqlen_new, cu_seqlens_k,
                          seqused_k, cache_leftpad, cache_batch_idx, block_table, key_mask, rotary_cos, rotary_sin,
                          rotary_interleaved, rotary_per_token, num_splits, sinks, descale, out_dtype, plan_key,
                          need_lse=need_lse, alias_key=alias_key, grow_key=grow_key)


def append_and_attend(q, k_cache, v_cache, k, v, softmax_scale, window_left, window_right, softcap,
                      cache_seqlens=None, block_table=None, sinks=None):
    """flash_attn_with_kvcache's append + attention for a caller that vouches for its arguments and
    whose device values may be out of range on purpose: Transformers' continuous batching pads a batch
    with sequences of cache_seqlens -1 and block-table entries -1, which the kernels clamp (reads) or
    drop (writes).  No host-side value checks, no sync.  Returns out."""
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t is not None and t.shape[0] != q.shape[0]:  # the kernels index them by sequence
            raise ValueError(f"{name} has {t.shape[0]} rows for {q.shape[0]} sequences")
    if k is not None:
        append = _append_op if torch.compiler.is_compiling() else _append
        append(k, v, k_cache, v_cache, cache_seqlens, None, None, block_table, None, None, False)
    out, _ = decode_attention(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap,
                              cache_seqlens=cache_seqlens, seqlen_new=0 if k is None else k.shape[1],
                              block_table=block_table, sinks=sinks, need_lse=False)
    return out


# --------------------------------------------------------------------------- checks

def _check_values_now(t: torch.Tensor) -> bool:
    """Whether a device tensor's values are checked on the host for this call (see the module doc)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    if getenv(CHECK_KVCACHE_ENV) != "1":  # (tuned_table.getenv: a cheaper os.environ read, per call)
        return False
    return not torch.cuda.is_current_stream_capturing()


def _api_checks_varlen_values() -> bool:
    """Whether cu_seqlens values are checked on the host (interface._check_cu_seqlens: FA_AMD_CHECK_VARLEN)."""
    from . import interface

    return interface._CHECK_VARLEN


def _check_index(name: str, t, batch: int, q, dtypes=_INDEX_DTYPES, shape=None):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        what = ("an int, an int32 (or int64) torch.Tensor or None" if name == "cache_seqlens"
                else "a torch.Tensor or None")
        raise TypeError(f"{name} must be {what}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        kinds = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be an {kinds} tensor, got {t.dtype}")
    want = shape or (batch,)
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(t.shape)}")
    _check_device(name, t, q)
    return t if t.is_contiguous() else t.contiguous()


def _minmax(t: torch.Tensor):
    return tuple(torch.stack([t.min(), t.max()]).tolist()) if t.numel() else (0, 0)


def _check_grad(what: str, **tensors):
    refuse_forward_tangents(what, **tensors)
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{what} is forward-only (as in flash-attn) but {name} requires grad; call it under "
                f"torch.no_grad() / torch.inference_mode(), or train with flash_attn_func / flash_attn_varlen_func "
                f"on contiguous k/v")


def _check_common(q, k_cache, v_cache, paged: bool, fp8: bool = False):
    """fp8: the dtypes are fa_amd.fp8.kvcache_fp8_args' to check (q may differ from the caches)."""
    _check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)", (q.dtype,) if fp8 else SUPPORTED_DTYPES)
    layout = ("(num_blocks, page_block_size, nheads_k, headdim)" if paged
              else "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _check_tensor("k_cache", k_cache, 4, layout, (k_cache.dtype,) if fp8 else SUPPORTED_DTYPES)
    _check_tensor("v_cache", v_cache, 4, layout, (v_cache.dtype,) if fp8 else SUPPORTED_DTYPES)
    if not fp8 and not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _check_device("k_cache", k_cache, q)
    _check_device("v_cache", v_cache, q)
    _check_runtime(q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension (it is updated in place)")
    d = q.shape[-1]
    if k_cache.shape[-1] != d:
        raise ValueError(f"q and k_cache must share the head dim, got {d} and {k_cache.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    hq, hk = q.shape[2], k_cache.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"nheads of q ({hq}) must be a multiple of nheads of k_cache/v_cache ({hk})")
    if hq > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} query heads are supported, got {hq}")


def _check_runtime(q):
    check_interpreter_supported()
    if q.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            "q is a CPU tensor but fa_amd's kernels need a GPU; on a machine without one, set "
            "TRITON_INTERPRET=1 before importing fa_amd to run them through Triton's interpreter")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on unsupported device type {q.device.type!r} (expected cuda/ROCm or cpu)")


def check_num_splits(num_splits) -> None:
    """The decode kernel's key splits, as flash-attn takes them: 0 = heuristic, 1 = no split, n = n."""
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic, 1 = no split), got {num_splits!r}")


def _check_block_table(block_table, batch: int, k_cache, q, cache_name: str = "k_cache"):
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch={batch}, max_num_blocks_per_seq), got "
                         f"{tuple(block_table.shape)}")
    if block_table.dtype not in _INDEX_DTYPES:
        raise TypeError(f"block_table must be an int32 (or int64) tensor, got {block_table.dtype}")
    _check_device("block_table", block_table, q)
    page_size = k_cache.shape[1]
    if page_size == 0 or page_size % PAGE_MULTIPLE != 0:
        raise ValueError(f"the page size ({cache_name}.shape[1] with a block_table) must be a positive multiple of "
                         f"{PAGE_MULTIPLE}, got {page_size}")
    if k_cache.shape[0] == 0:
        raise ValueError(f"{cache_name} has no pages (num_blocks = 0) but a block_table was given")
    return block_table if block_table.stride(-1) == 1 else block_table.contiguous()


def _check_block_entries(block_table, ends, num_pages: int, page_size: int, cache_name: str = "k_cache"):
    """block_table entries a sequence reads or writes (its first ceil(end / page_size) pages) in range."""
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < (
        (ends.to(torch.int64)[:, None] + page_size - 1) // page_size)
    entries = block_table[used]
    lo, hi = _minmax(entries)
    if lo < 0 or hi >= num_pages:
        raise ValueError(f"block_table entries must be in [0, {num_pages}) (the pages of {cache_name}), got values in "
                         f"[{lo}, {hi}]")


def _check_rotary(rotary_cos, rotary_sin, k, d: int, capacity: int, q):
    if rotary_cos is None and rotary_sin is None:
        return None, None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need the new k and v to append (flash-attn rotates only new keys)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(t.shape)}")
        _check_device(name, t, q)
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin {tuple(rotary_sin.shape)} must "
                         f"have the same shape")
    seqlen_ro, half = rotary_cos.shape
    if half == 0 or 2 * half > d:
        raise ValueError(f"rotary dim (2 x rotary_cos.shape[1] = {2 * half}) must be in [2, head dim {d}]")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos/rotary_sin cover {seqlen_ro} positions but the KV cache holds {capacity}; "
                         f"they must cover every cache position")
    return (rotary_cos if rotary_cos.stride(-1) == 1 else rotary_cos.contiguous(),
            rotary_sin if rotary_sin.stride(-1) == 1 else rotary_sin.contiguous())


def _check_new_kv(k, v, q, k_cache, capacity: int, fp8: bool = False):
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise ValueError("k and v (the new keys/values to append) must be given together")
    batch, _, _, d = q.shape
    hk = k_cache.shape[2]
    for name, t in (("k", k), ("v", v)):
        # (an FP8 cache also takes high-precision k/v, quantised: fa_amd.fp8.kvcache_fp8_args checked them)
        _check_tensor(name, t, 4, "(batch, seqlen_new, nheads_k, headdim)",
                      (t.dtype,) if fp8 and isinstance(t, torch.Tensor) else SUPPORTED_DTYPES)
        if t.dtype != k_cache.dtype and not fp8:
            raise TypeError(f"{name} must have the cache's dtype {k_cache.dtype}, got {t.dtype}")
        _check_device(name, t, q)
    if k.shape != v.shape or k.shape[0] != batch or k.shape[2] != hk or k.shape[3] != d:
        raise ValueError(f"k and v must both have shape (batch={batch}, seqlen_new, nheads_k={hk}, headdim={d}), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    seqlen_new = k.shape[1]
    if seqlen_new > capacity:
        raise ValueError(f"the KV cache is too small for the append: {seqlen_new} new tokens (k.shape[1]) but the "
                         f"cache holds {capacity} per sequence")
    return seqlen_new


def _check_writable_caches(k_cache, v_cache):
    """The append writes k_cache and v_cache in place: refuse caches whose elements share memory (an expanded
    tensor, or one tensor given as both), whose writes would overwrite each other, as torch's in-place ops do.
    (Not while torch.compile traces: neither test traces; the eager call checks the same caches.)"""
    if torch.compiler.is_compiling():
        return
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if torch._debug_has_internal_overlap(t) == 1:  # (1: some elements share memory; 2: too hard to tell)
            raise ValueError(f"{name} has elements that share memory (an expanded tensor?); the append writes "
                             f"it in place: pass a tensor of its own (e.g. .clone())")
    # (two empty caches, e.g. of a batch of 0, both report address 0: nothing is written to either)
    if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr() and k_cache.dtype == v_cache.dtype:
        raise ValueError("k_cache and v_cache are the same memory; the append writes both in place: pass two caches")
    if _caches_share_elements(k_cache, v_cache):
        raise ValueError("k_cache and v_cache share memory (overlapping views of one buffer); the append writes both "
                         "in place: pass caches whose elements are apart (e.g. the two halves of a packed KV buffer)")


def _byte_span(t):
    """[first, last) bytes a tensor with non-negative strides can touch."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _caches_share_elements(a, b) -> bool:
    """Whether two caches, each free of internal overlap, hold a common element.  Views of one buffer that are
    translates of each other (one shape, strides and dtype: a packed KV buffer's halves, caches side by side) are
    decided exactly; others whose byte spans meet count as sharing (their layouts are not worth solving for)."""
    if not (a.numel() and b.numel()) or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if min(a.stride() + b.stride()) < 0:
        return True
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    size = a.element_size()
    if (a.shape, a.stride(), a.dtype) != (b.shape, b.stride(), b.dtype) or (b0 - a0) % size:
        return True
    # offset = sum(i_d * stride_d), |i_d| < shape_d: greedy over strides taken largest first is exact when each
    # stride exceeds the span of the smaller ones (nested strides); other layouts count as sharing
    dims = sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1), reverse=True)
    if any(st <= sum((m - 1) * sm for sm, m in dims[i + 1:]) for i, (st, _) in enumerate(dims)):
        return True
    rest = abs(b0 - a0) // size
    for st, n in dims:
        rest -= min(rest // st, n - 1) * st
    return rest == 0


def _contiguous_last(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------- flash_attn_with_kvcache

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            sinks=None, s_aux=None, *, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Attention of q over a KV cache, appending k/v first (flash-attn 2.x semantics), forward only.

    q: (batch, seqlen_q, nheads, headdim).  k_cache / v_cache: (batch_size_cache, seqlen_cache,
    nheads_k, headdim), or with block_table (num_blocks, page_block_size, nheads_k, headdim) pages,
    page_block_size any multiple of 16.  k / v: (batch, seqlen_new, nheads_k, headdim), written in
    place at cache_seqlens (through cache_batch_idx / block_table) before attending; cache_seqlens
    (int or int32 (batch,)) is never modified.  rotary_cos / rotary_sin: (seqlen_ro, rotary_dim / 2);
    new k is rotated at cache_seqlens + i, q at cache_seqlens + i when causal or local, else at
    cache_seqlens.  cache_leftpad (batch,): each row's keys start there.  block_table: (batch,
    max_num_blocks_per_seq) int32.  Causal is bottom-right aligned.  num_splits: 0 = heuristic from
    the GPU's SM/CU count, 1 = no split.  Returns out, and (out, softmax_lse (batch, nheads,
    seqlen_q) fp32) with return_softmax_lse.  sinks (alias s_aux): (nheads,) learnable sink logits, as
    in flash_attn_func (fa_amd's extension).  No host synchronisation: CUDA/HIP graphs capture it.

    FP8 KV cache (MI300 / MI350 / NVIDIA sm89+): k_cache and v_cache in the arch's FP8 type with
    k_descale / v_descale fp32 (batch, nheads_k) (real values = x8 * descale, default 1); q either FP8
    of the same type with q_descale (both products in FP8, as FA3) or fp16 / bf16 / fp32 (K and V are
    widened to q's dtype in the kernel).  New k / v in the cache's FP8 type are stored as given (already
    scaled); high-precision new k / v are quantised with k_descale / v_descale (fp8(clamp(x /
    descale)), saturating, as vLLM writes its FP8 caches), after rotary.  Output: out_dtype, default
    bfloat16 for FP8 q and q's dtype otherwise.  Descale row b belongs to q's sequence b (whatever
    cache row / pages it reads).  Rules and errors: fa_amd.fp8.kvcache_fp8_args.
    """
    plain_key = None
    if (k is None and v is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
            and cache_leftpad is None and alibi_slopes is None and sinks is None and s_aux is None
            and q_descale is None and k_descale is None and v_descale is None and out_dtype is None
            and type(window_size) is tuple and not torch.compiler.is_compiling()
            and not forward_level_open()  # (a dual level open: the checks below refuse tangents)
            and not any(isinstance(x, torch.Tensor) for x in (softmax_scale, causal, softcap, *window_size))):
        # (0-d tensor scalars hash by identity and can change in place: the checks below read their values)
        plain_key = _plain_call_key(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                                    window_size, softcap, rotary_interleaved, num_splits, return_softmax_lse)
        try:
            checked = _CHECKED_PLAIN_CALLS.get(plain_key)
        except TypeError:  # an unhashable argument (a list, an array): the checks below name it
            plain_key = checked = None
        if checked is not None:  # this call's structure passed every check below before
            return _plain_call(plain_key, q, k_cache, v_cache, cache_seqlens, block_table, causal, num_splits,
                               return_softmax_lse, *checked)
    paged = block_table is not None
    descale = out_dtype_fp8 = None
    fp8 = _is_fp8_call((q, k_cache, v_cache, k, v), (q_descale, k_descale, v_descale, out_dtype))
    # ranks and shapes first (FP8 dtypes are kvcache_fp8_args' to check): the FP8 checks size the descales by them
    _check_common(q, k_cache, v_cache, paged, fp8)
    if fp8:
        from .fp8 import kvcache_fp8_args  # fp8 sits above this module

        descale, out_dtype_fp8 = kvcache_fp8_args(q, k_cache, v_cache, k, v, q_descale, k_descale, v_descale,
                                                  out_dtype, q.shape[0])
    batch, seqlen_q, hq, d = q.shape
    if batch > MAX_GRID_YZ:
        raise ValueError(f"batch size must be at most {MAX_GRID_YZ}, got {batch}")
    if paged:
        # (before the block table's shape: FA3 takes a row per cache entry picked by cache_batch_idx, and its
        # users should read why the pair is refused, not a shape mismatch)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (paged KV): the block table "
                             "already says which pages each sequence uses (index its rows instead: "
                             "block_table[cache_batch_idx])")
        block_table = _check_block_table(block_table, batch, k_cache, q)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    seqlen_new = _check_new_kv(k, v, q, k_cache, capacity, fp8)
    if seqlen_new:
        _check_writable_caches(k_cache, v_cache)
    _check_grad("flash_attn_with_kvcache", q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, rotary_cos=rotary_cos,
                rotary_sin=rotary_sin, alibi_slopes=alibi_slopes, sinks=sinks, s_aux=s_aux, q_descale=q_descale,
                k_descale=k_descale, v_descale=v_descale)
    _, scale, left, right, softcap = _normalize_scalars(d, 0.0, softmax_scale, causal, window_size, softcap, False,
                                                         False, seqlen_k=capacity)
    for name, flag in (("rotary_interleaved", rotary_interleaved), ("return_softmax_lse", return_softmax_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    check_num_splits(num_splits)
    alibi_slopes = _check_alibi(alibi_slopes, q, batch, hq)
    sinks = _check_sinks(sinks, s_aux, q, hq)

    # cache_seqlens: an int (checked here) or an int32 (batch,) tensor (clamped in the kernels)
    cache_seqlens_int = None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = int(cache_seqlens)  # numpy ints too
    if cache_seqlens is None:
        if seqlen_new:
            raise ValueError("cache_seqlens is required when k/v are appended (where should they go?)")
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens = {cache_seqlens} (+ {seqlen_new} new tokens) does not fit the KV cache "
                             f"of {capacity} slots per sequence")
        cache_seqlens_int, cache_seqlens = cache_seqlens, None
    else:
        cache_seqlens = _check_index("cache_seqlens", cache_seqlens, batch, q)
    cache_batch_idx = _check_index("cache_batch_idx", cache_batch_idx, batch, q)
    cache_leftpad = _check_index("cache_leftpad", cache_leftpad, batch, q)
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass cache_batch_idx "
                         f"to pick rows")
    rotary_cos, rotary_sin = _check_rotary(rotary_cos, rotary_sin, k, d, capacity, q)
    if not paged and not row_offsets_fit(capacity, k_cache.stride(1), d):
        raise ValueError(f"k_cache rows of {capacity} slots x token stride {k_cache.stride(1)} exceed the 2**31 "
                         f"elements fa_amd addresses within one cache row; use a paged cache (block_table)")
    _check_index_values(cache_seqlens, cache_seqlens_int, seqlen_new, capacity, cache_batch_idx, cache_leftpad,
                        block_table, k_cache, batch)
    rotary_per_token = _rotary_per_token(causal, left, right, capacity)
    if rotary_cos is not None and rotary_per_token:
        _check_rotary_q_positions(rotary_cos.shape[0], seqlen_q, cache_seqlens, cache_seqlens_int)

    if plain_key is not None and not fp8:
        if len(_CHECKED_PLAIN_CALLS) >= _MAX_CHECKED:
            _CHECKED_PLAIN_CALLS.clear()
        _CHECKED_PLAIN_CALLS[plain_key] = (capacity, scale, left, right, softcap)
    q = _contiguous_last(q)
    k, v = _contiguous_last(k), _contiguous_last(v)
    if seqlen_new:
        append = _append_op if torch.compiler.is_compiling() else _append
        append(k, v, k_cache, v_cache, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table, rotary_cos,
               rotary_sin, rotary_interleaved, *(descale if fp8 else ()))
    out, lse = decode_attention(
        q, k_cache, v_cache, scale, left, right, softcap, alibi_slopes,
        cache_seqlens=cache_seqlens, cache_seqlens_int=cache_seqlens_int, seqlen_new=seqlen_new,
        cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        rotary_per_token=rotary_per_token, num_splits=num_splits, sinks=sinks, descale=descale,
        out_dtype=out_dtype_fp8, plan_key=_decode_plan_key(plain_key) if plain_key is not None and not fp8 else None,
        need_lse=return_softmax_lse)
    return (out, lse) if return_softmax_lse else out


# flash_attn_with_kvcache: the structure of plain calls (no append, rotary, index tensors, ALiBi, sinks
# or FP8) that passed every host check -> what the checks derived.  A decode loop repeats one call
# structure, and the checks cost more host time than the launches (decode is host-bound).
_CHECKED_PLAIN_CALLS = {}
_MAX_CHECKED = 256


def _tensor_key(t):
    if not isinstance(t, torch.Tensor):
        return (type(t), t)  # ints (cache_seqlens), None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _plain_call_key(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
                    rotary_interleaved, num_splits, return_softmax_lse):
    """Everything the host checks of a plain call depend on; types too (True == 1 as a dict key)."""
    scalars = (softmax_scale, causal, softcap, rotary_interleaved, num_splits, return_softmax_lse, *window_size)
    # (absent tensors as None, no call: this runs on every decode step)
    return (_tensor_key(q), _tensor_key(k_cache), _tensor_key(v_cache),
            None if cache_seqlens is None else _tensor_key(cache_seqlens),
            None if block_table is None else _tensor_key(block_table), scalars, tuple(map(type, scalars)),
            torch.is_grad_enabled(), INTERPRET)


def _decode_plan_key(plain_key):
    """The key of a plain call's launch plan (kernels/decode.py): its checked structure determines the
    launch, with the merge's table in force (tests and A/B scripts switch it)."""
    return plain_key, tables.DECODE_FUSED_MERGE_FAMILIES


def _rotary_per_token(causal, left, right, capacity):
    """Whether q token i is rotated at cache_seqlens + i (else every q token at cache_seqlens): causal or
    local calls, where, as flash-attn decides it, a window entry >= the cache's capacity bounds nothing
    (left / right: the checked window, _normalize_scalars')."""
    return bool(causal or 0 <= left < capacity or 0 <= right < capacity)


def _plain_call(plain_key, q, k_cache, v_cache, cache_seqlens, block_table, causal, num_splits, return_softmax_lse,
                capacity, scale, left, right, softcap):
    """flash_attn_with_kvcache's plain call whose structure was checked before (see _CHECKED_PLAIN_CALLS):
    only the device values are checked (where that costs no sync), then the kernels run -- from the
    launch plan stored under the call's checked key once there is one."""
    cache_seqlens_int = None
    if isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = cache_seqlens if cache_seqlens.is_contiguous() else cache_seqlens.contiguous()
    elif cache_seqlens is not None:
        cache_seqlens_int, cache_seqlens = int(cache_seqlens), None
    if block_table is not None:
        block_table = _contiguous_last(block_table)
    if cache_seqlens is not None or block_table is not None:  # (device values; an int is in the checked key)
        _check_index_values(cache_seqlens, cache_seqlens_int, 0, capacity, None, None, block_table, k_cache,
                            q.shape[0])
    plan_key = _decode_plan_key(plain_key)
    q = _contiguous_last(q)
    plan = filed_plan(plan_key)  # (an int cache_seqlens is in the key, and in the plan's ints)
    if plan is not None:  # straight to its launch: decode is host-bound
        out, lse = run_filed_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, return_softmax_lse)
    else:
        out, lse = decode_attention(
            q, k_cache, v_cache, scale, left, right, softcap, None, cache_seqlens=cache_seqlens,
            cache_seqlens_int=cache_seqlens_int, block_table=block_table,
            rotary_per_token=_rotary_per_token(causal, left, right, capacity), num_splits=num_splits,
            plan_key=plan_key, need_lse=return_softmax_lse)
    return (out, lse) if return_softmax_lse else out


def _check_index_values(cache_seqlens, cache_seqlens_int, seqlen_new, capacity, cache_batch_idx, cache_leftpad,
                        block_table, k_cache, batch):
    """Range checks of device index values where they cost no sync (see the module doc)."""
    if cache_seqlens is not None and _check_values_now(cache_seqlens):
        lo, hi = memo_per_tensor(cache_seqlens, "kvcache_minmax", _minmax)
        if lo < 0 or hi + seqlen_new > capacity:
            # (a negative length is its own mistake, not a cache too small)
            what = "the KV cache is too small for the append: " if seqlen_new and lo >= 0 else ""
            raise ValueError(f"{what}cache_seqlens values must be in [0, {capacity - seqlen_new}] (the cache holds "
                             f"{capacity} slots per sequence, {seqlen_new} new tokens), got values in [{lo}, {hi}]")
    if cache_batch_idx is not None and _check_values_now(cache_batch_idx):
        lo, hi = memo_per_tensor(cache_batch_idx, "kvcache_minmax", _minmax)
        if lo < 0 or hi >= k_cache.shape[0]:
            raise ValueError(f"cache_batch_idx entries must be in [0, {k_cache.shape[0]}) (the rows of k_cache), got "
                             f"values in [{lo}, {hi}]")
    if cache_leftpad is not None and _check_values_now(cache_leftpad):
        ends = _ends(cache_seqlens, cache_seqlens_int, capacity, batch, cache_leftpad.device)
        if bool(((cache_leftpad < 0) | (cache_leftpad > ends)).any()):
            raise ValueError("cache_leftpad entries must be in [0, cache_seqlens] (where each row's keys start)")
    if block_table is not None and _check_values_now(block_table):
        ends = _ends(cache_seqlens, cache_seqlens_int, capacity, batch, block_table.device) + seqlen_new
        _check_block_entries(block_table, ends.clamp(0, capacity), k_cache.shape[0], k_cache.shape[1])


def _check_rotary_q_positions(seqlen_ro: int, seqlen_q: int, cache_seqlens, cache_seqlens_int):
    """A causal / local call rotates q token i at cache_seqlens + i: with more query tokens than new keys the last
    ones sit past the cache's filled slots, and may sit past the rotary tables (flash-attn reads outside them
    there; the kernels clamp to the last row).  A ValueError where the values are known on the host (an int, or a
    tensor checked now: _check_values_now)."""
    if cache_seqlens_int is not None:
        hi = cache_seqlens_int
    elif cache_seqlens is not None and _check_values_now(cache_seqlens):
        hi = memo_per_tensor(cache_seqlens, "kvcache_minmax", _minmax)[1]
    else:
        return
    if hi + seqlen_q > seqlen_ro:
        raise ValueError(f"rotary_cos/rotary_sin cover {seqlen_ro} positions, but this causal / local call rotates "
                         f"query token i at cache_seqlens + i: up to position {hi + seqlen_q - 1} (cache_seqlens up "
                         f"to {hi}, seqlen_q {seqlen_q}); pass tables of at least {hi + seqlen_q} positions")


def _ends(cache_seqlens, cache_seqlens_int, capacity, batch, device):
    if cache_seqlens is not None:
        return cache_seqlens.to(torch.int64)
    value = capacity if cache_seqlens_int is None else cache_seqlens_int
    return torch.full((batch,), value, dtype=torch.int64, device=device)


# --------------------------------------------------------------------------- varlen with block_table / seqused_k

class _NoBackward(torch.autograd.Function):
    """A forward-only result tied to the inputs that require grad: the forward runs (as flash-attn's does under
    autograd) and a backward through it raises, naming the call, instead of leaving those inputs without a
    gradient."""

    @staticmethod
    def forward(ctx, what, out, *needing_grad):
        ctx.what = what
        return out

    @staticmethod
    def backward(ctx, grad_out):
        raise RuntimeError(f"{ctx.what} is forward-only (flash-attn has no backward for it either): its output "
                           f"has no gradient. Train with flash_attn_varlen_func on packed, contiguous k/v.")


def flash_attn_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                            softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                            block_table, seqused_k, sinks=None, s_aux=None, q_descale=None, k_descale=None,
                            v_descale=None, out_dtype=None, deterministic=False, num_splits=0):
    """flash_attn_varlen_func with block_table (paged k/v: (num_blocks, page_block_size, nheads_k,
    headdim); sequence b's keys are the first cu_seqlens_k[b+1] - cu_seqlens_k[b] slots of its pages)
    and/or seqused_k (int32 (batch,): only the first seqused_k[b] keys of sequence b are used).
    Forward only (flash-attn has no backward for these either); runs the split-KV decode kernel.
    return_attn_probs: (out, softmax_lse (nheads, total_q), an empty S_dmask), as flash-attn returns
    without dropout.  num_splits: key splits of the decode kernel, as flash_attn_with_kvcache's (the flash_attn
    stand-in's private _flash_attn_varlen_forward passes its own; the public function has none).
    FP8 k/v pages (fa_amd.fp8.descaled_attention routes FP8 calls here) with their descales
    (batch, nheads_k): as flash_attn_with_kvcache's FP8 cache (fa_amd.fp8.kvcache_fp8_args)."""
    paged = block_table is not None
    descale = None
    if _is_fp8_call((q, k, v), (q_descale, k_descale, v_descale, out_dtype)):
        from .fp8 import kvcache_fp8_args  # fp8 sits above this module

        batch_q = cu_seqlens_q.numel() - 1 if isinstance(cu_seqlens_q, torch.Tensor) else 0
        # (k / v are the caches here; the absent new keys get names of their own, or they would shadow them)
        descale, out_dtype = kvcache_fp8_args(q, k, v, None, None, q_descale, k_descale, v_descale, out_dtype,
                                              batch_q, cache_names=("k", "v"), new_names=("new k", "new v"))
    fp8 = descale is not None
    _check_tensor("q", q, 3, "(total_q, nheads, headdim)", (q.dtype,) if fp8 else SUPPORTED_DTYPES)
    layout = ("(num_blocks, page_block_size, nheads_k, headdim) when block_table is given" if paged
              else "(total_k, nheads_k, headdim)")
    _check_tensor("k", k, 4 if paged else 3, layout, (k.dtype,) if fp8 else SUPPORTED_DTYPES)
    _check_tensor("v", v, 4 if paged else 3, layout, (v.dtype,) if fp8 else SUPPORTED_DTYPES)
    if not fp8 and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    _check_device("k", k, q)
    _check_device("v", v, q)
    _check_runtime(q)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q, k and v must share the head dim, got {d} and {k.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"nheads of q ({hq}) must be a multiple of nheads of k/v ({hk})")
    if hq > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} query heads are supported, got {hq}")
    check_num_splits(num_splits)
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 with block_table/seqused_k (that path is forward-only "
                         f"inference), got {dropout_p!r}")
    # (deterministic: a forward-only path has nothing to make deterministic, but the flag is checked as elsewhere)
    _, scale, left, right, softcap = _normalize_scalars(d, 0.0, softmax_scale, causal, window_size, softcap,
                                                         deterministic, return_attn_probs, seqlen_k=max_seqlen_k)
    # no segment is longer than q: a larger max_seqlen_q would only size the grid (2**31 of them hung the
    # interpreter and would pass the GPU's grid limit)
    max_seqlen_q = min(max_seqlen_q, q.shape[0])
    what = "flash_attn_varlen_func with block_table/seqused_k"
    _check_grad(what, alibi_slopes=alibi_slopes, sinks=sinks, s_aux=s_aux, q_descale=q_descale, k_descale=k_descale,
                v_descale=v_descale)
    # q / k / v that require grad (a model's activations under grad mode): flash-attn runs this forward under
    # autograd (its own paged tests call it on such a q); a backward through it raises (_NoBackward)
    refuse_forward_tangents(what, q=q, k=k, v=v)
    needing_grad = [t for t in (q, k, v) if t.requires_grad] if torch.is_grad_enabled() else []
    # (read only here: a head dim with a stride is copied, as flash-attn's wrapper and the dense varlen path do)
    k, v = _contiguous_last(k), _contiguous_last(v)
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q must be a torch.Tensor, got {type(cu_seqlens_q).__name__}")
    batch = cu_seqlens_q.numel() - 1
    if batch > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} sequences per varlen call are supported, got {batch}")
    if paged:
        block_table = _check_block_table(block_table, batch, k, q, cache_name="k")
        capacity = block_table.shape[1] * k.shape[1]
        if max_seqlen_k > capacity:
            raise ValueError(f"max_seqlen_k = {max_seqlen_k} exceeds the {block_table.shape[1]} pages x {k.shape[1]} "
                             f"slots a block_table row addresses")
        total_k = batch * capacity
    else:
        capacity = total_k = k.shape[0]
        if not row_offsets_fit(max_seqlen_k, k.stride(0), d):
            raise ValueError(f"max_seqlen_k = {max_seqlen_k} x token stride {k.stride(0)} exceeds the 2**31 "
                             f"elements fa_amd addresses within one sequence")
    cu_seqlens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", q)
    cu_seqlens_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k", q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch+1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    seqused_k = _check_index("seqused_k", seqused_k, batch, q, dtypes=(torch.int32,))
    alibi_slopes = _check_alibi(alibi_slopes, q, batch, hq)
    sinks = _check_sinks(sinks, s_aux, q, hq)
    if seqused_k is not None and _check_values_now(seqused_k):
        lo, hi = memo_per_tensor(seqused_k, "kvcache_minmax", _minmax)
        if lo < 0 or hi > max_seqlen_k:
            raise ValueError(f"seqused_k entries must be in [0, max_seqlen_k = {max_seqlen_k}], got values in "
                             f"[{lo}, {hi}]")
        if not paged and seqused_k.numel() and _api_checks_varlen_values():
            # (packed keys: a sequence uses at most its own segment, as far as cu_seqlens_k's values are checked at
            # all -- FA_AMD_CHECK_VARLEN; the kernel clamps reads into k regardless)
            over = (seqused_k.long() - (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()).amax().item()
            if over > 0:
                raise ValueError(f"seqused_k entries must not exceed their sequences' lengths in cu_seqlens_k "
                                 f"(one is {over} keys longer)")
    if paged and _check_values_now(block_table):
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1] if seqused_k is None else seqused_k
        _check_block_entries(block_table, lens.clamp(0, capacity), k.shape[0], k.shape[1], cache_name="k")
    out, lse = decode_attention(_contiguous_last(q), k, v, scale, left, right, softcap, alibi_slopes,
                                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, cu_seqlens_k=cu_seqlens_k,
                                seqused_k=seqused_k, block_table=block_table, num_splits=num_splits, sinks=sinks,
                                descale=descale, out_dtype=out_dtype, need_lse=bool(return_attn_probs))
    if needing_grad:
        out = _NoBackward.apply(what, out, *needing_grad)
    if return_attn_probs:
        # (out, softmax_lse (nheads, total_q), S_dmask) as flash-attn >= 2.6 returns with dropout_p == 0: its
        # S_dmask is then empty (the probabilities are not materialised on this inference path)
        return out, lse, q.new_empty((0,), dtype=out.dtype)
    return out
