"""FP8 quantisation of q, k, v for the quantising FP8 functions (fa_amd.fp8.quantize_fp8), in two
passes over x: `fp8_amax_kernel` writes partial maxima of |x| per (sequence, head), `fp8_cast_kernel`
reduces them to the head's scale and writes x8 = fp8(clamp(fp32(x) * scale)) in the layout the
forward reads (V token-major per head where tables.FP8_V_TOKEN_MAJOR says so), and the descale.
Why kernels: the same rule as a chain of torch ops (abs, amax, float, multiply, clamp, cast, and a
transposing copy for V) read and wrote each tensor about seven times, which cost more than the FP8
attention itself on the H100; here x is read twice and x8 written once.

Rule (as fa_amd.reference.fp8_quantize_ref for finite x): amax = max |x| over the head's FINITE
tokens and features, scale = fp8_max / amax as torch evaluates it for a tensor amax (fp8_max *
fp32(1 / amax)), descale = amax / fp8_max rounded to nearest (both 1 where amax is 0: an all-zero,
all-non-finite or empty head).  Non-finite x (NaN, +-inf) is cast to the FP8 type's NaN, and takes no
part in the scale: one NaN or inf then poisons only the attention rows that use it (as in the
fp16/fp32 path), where a NaN amax (scale 1: every other value saturated or flushed) or an inf amax
(scale 0: every value 0, the inf NaN) used to wreck its whole head.  A head whose amax is below
AMAX_FLOOR (2^-100) is scaled as if its amax were the floor: fp8_max / amax would overflow fp32 to
inf (0 * inf: NaN) for amax below ~1e-36, and amax / fp8_max underflow to a zero descale.  Varlen:
the tokens past cu_seqlens[-1] (static buffers) belong to no sequence and are cast with scale 1, by
one extra program row.

Work split: grid (splits, heads, sequences); each program walks its sequence's token blocks
split, split + splits, ...  (tables.FP8_QUANTIZE: block size, split count, warps).  The amax pass
writes one partial per program, so it needs no zeroed buffer and no atomics, and the result does
not depend on timing.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..arch import arch_for
from ..tuning import fp8_quantize_config
from .launch import head_scan_grid, new_output, next_power_of_2


# (a power of two: the floor's scale and descale are exact)
AMAX_FLOOR = tl.constexpr(2.0 ** -100)


@triton.jit
def _finite_abs(x):
    """|x| in fp32 where x is finite, 0 where it is NaN or +-inf."""
    a = tl.abs(x.to(tl.float32))
    return tl.where(a < float("inf"), a, 0.0)  # (False for NaN)


@triton.jit
def _segment(cu_seqlens, b, seqlen, total, IS_VARLEN: tl.constexpr, HAS_TAIL: tl.constexpr):
    """(first token, tokens) of program row b: dense rows are whole sequences of seqlen tokens;
    varlen segments are clamped into the total tokens (no cu_seqlens content moves an access
    outside x), and with HAS_TAIL the last row is the tail past cu_seqlens[-1]."""
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + b), 0), total)
        if HAS_TAIL:
            end = tl.load(cu_seqlens + b + 1, mask=b < tl.num_programs(2) - 1, other=total)
        else:
            end = tl.load(cu_seqlens + b + 1)
        end = tl.minimum(tl.maximum(end, start), total)
        length = end - start
    else:
        start = b * 0
        length = b * 0 + seqlen
    return start, length


@triton.jit
def fp8_amax_kernel(X, Partial, cu_seqlens, seqlen, total, stride_xb, stride_xt, stride_xh,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Partial[b, h, split] = max |x| over the finite x of this program's token blocks of sequence b,
    head h (0 if it has none)."""
    split = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    splits = tl.num_programs(0)
    start, length = _segment(cu_seqlens, b, seqlen, total, IS_VARLEN, False)
    base = X + b.to(tl.int64) * stride_xb + start.to(tl.int64) * stride_xt + h.to(tl.int64) * stride_xh
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_PAD)
    amax = tl.zeros([BLOCK_T, D_PAD], dtype=tl.float32)
    for t0 in range(split * BLOCK_T, length, splits * BLOCK_T):
        rows = t0 + offs_t
        x = tl.load(base + rows.to(tl.int64)[:, None] * stride_xt + offs_d[None, :],
                    mask=(rows[:, None] < length) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        amax = tl.maximum(_finite_abs(x), amax)
    amax = tl.max(tl.max(amax, 1), 0)
    tl.store(Partial + (b * tl.num_programs(1) + h) * splits + split, amax)


@triton.jit
def fp8_cast_kernel(X, Out, Partial, Descale, cu_seqlens, seqlen, total, stride_xb, stride_xt, stride_xh,
                    stride_ob, stride_ot, stride_oh, stride_od, n_splits, fp8_max,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    IS_VARLEN: tl.constexpr, SCALED: tl.constexpr, Fp8Ref=None, ROUND_TRIP: tl.constexpr = False):
    """Out[b, t, h, :] = fp8(clamp(fp32(X[b, t, h, :]) * scale)) with the scale of (sequence b, head h)
    from Partial's n_splits maxima (NaN where X is not finite); Descale[b, h] = its descale.  Out's
    strides are free (token-major V: stride_ot == 1).  SCALED=False: a plain (transposing) copy of an
    FP8 X, no scale.  ROUND_TRIP (with SCALED): Out is in X's dtype and gets the value the FP8 tensor
    stands for, fp8(...) * descale, rounded to Out's dtype (Fp8Ref: any tensor of the FP8 type)."""
    split = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    start, length = _segment(cu_seqlens, b, seqlen, total, IS_VARLEN, IS_VARLEN)
    scale = 1.0
    if SCALED:
        n_seqs = tl.num_programs(2)
        if IS_VARLEN:  # the last program row is the tail
            n_seqs -= 1
        offs_s = tl.arange(0, SPLITS_PAD)
        # (no partials for the tail row; a scalar condition in the mask itself trips the interpreter)
        parts = tl.load(Partial + (b * tl.num_programs(1) + h) * n_splits + offs_s,
                        mask=offs_s < tl.where(b < n_seqs, n_splits, 0), other=0.0)
        amax = tl.max(parts, 0)  # finite, >= 0
        nonzero = amax > 0.0
        # (no division by 0, even in a discarded branch; the floor keeps scale finite, descale > 0)
        safe = tl.where(nonzero, tl.maximum(amax, AMAX_FLOOR), 1.0)
        # fp8_max * (1 / amax), each rounded to nearest: torch's `fp8_max / amax` for a tensor amax
        # (reciprocal, then multiply), so x8 matches the reference bit for bit on any device
        scale = tl.where(nonzero, tl.math.div_rn(1.0, safe) * fp8_max, 1.0)
        descale = tl.where(nonzero, tl.math.div_rn(safe, fp8_max), 1.0)
        if (split == 0) & (b < n_seqs):
            tl.store(Descale + b * tl.num_programs(1) + h, descale)
    x_base = X + b.to(tl.int64) * stride_xb + start.to(tl.int64) * stride_xt + h.to(tl.int64) * stride_xh
    o_base = Out + b.to(tl.int64) * stride_ob + start.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_PAD)
    for t0 in range(split * BLOCK_T, length, tl.num_programs(0) * BLOCK_T):
        rows = (t0 + offs_t).to(tl.int64)
        ok = (rows[:, None] < length) & (offs_d[None, :] < HEAD_DIM)
        x = tl.load(x_base + rows[:, None] * stride_xt + offs_d[None, :], mask=ok, other=0.0)
        if SCALED:
            x32 = x.to(tl.float32)
            y = tl.minimum(tl.maximum(x32 * scale, -fp8_max), fp8_max)
            # NaN and +-inf -> the FP8 type's NaN (every FP8 type has one; +-inf would clamp to +-fp8_max)
            y = tl.where(tl.abs(x32) < float("inf"), y, float("nan"))
            if ROUND_TRIP:
                x = (y.to(Fp8Ref.dtype.element_ty).to(tl.float32) * descale).to(Out.dtype.element_ty)
            else:
                x = y.to(Out.dtype.element_ty)
        tl.store(o_base + rows[:, None] * stride_ot + offs_d[None, :] * stride_od, x, mask=ok)


def _strides(x: torch.Tensor, varlen: bool):
    """(batch, token, head) strides; varlen tensors have no batch axis."""
    s = x.stride()
    return (0, s[0], s[1]) if varlen else s[:3]


def quantize_into(x: torch.Tensor, out: torch.Tensor, fp8_max: float, cu_seqlens=None, max_seqlen=None,
                  scaled: bool = True, round_trip: Optional[torch.dtype] = None) -> torch.Tensor:
    """Writes x (batch, seqlen, nheads, d) -- or (total, nheads, d) with cu_seqlens -- quantised per
    (sequence, head) into `out` (same shape, an FP8 type, any strides, e.g. token-major); returns the
    descale, fp32 (batch, nheads).  (x is copied first if its last dim is not contiguous.)  scaled=False: `out` = x (an FP8
    tensor of out's type) relaid, no descale (returns None).  round_trip (an FP8 type): `out` is in
    x's dtype and gets x quantised to that type and dequantised (the values an FP8 forward used).
    max_seqlen (varlen) only sizes the grid; every token of a segment is quantised whatever it says."""
    if x.stride(-1) != 1:
        x = x.detach().contiguous()
    varlen = cu_seqlens is not None
    nheads, d = x.shape[-2], x.shape[-1]
    batch = cu_seqlens.numel() - 1 if varlen else x.shape[0]
    total = x.shape[0]
    seqlen = 0 if varlen else x.shape[1]
    longest = (max_seqlen if max_seqlen is not None else total) if varlen else seqlen
    descale = new_output(x, (batch, nheads), torch.float32) if scaled else None
    if x.numel() == 0 and not varlen:
        return descale.fill_(1.0) if scaled else None
    cfg = fp8_quantize_config(arch_for(x))
    d_pad = next_power_of_2(d)
    block_t, splits = head_scan_grid(cfg, d_pad, longest)
    cu = cu_seqlens if varlen else x
    options = dict(num_warps=cfg["num_warps"])
    if scaled:
        if batch > 0 and nheads > 0:
            partial = x.new_empty((batch, nheads, splits), dtype=torch.float32)
            fp8_amax_kernel[(splits, nheads, batch)](
                x, partial, cu, seqlen, total, *_strides(x, varlen),
                HEAD_DIM=d, D_PAD=d_pad, BLOCK_T=block_t, IS_VARLEN=varlen, **options)
        else:
            partial = descale
    else:
        partial = x  # unused
    rows = batch + varlen  # varlen: one more program row casts the tail past cu_seqlens[-1]
    if rows > 0 and nheads > 0:
        fp8_cast_kernel[(splits, nheads, rows)](
            x, out, partial, descale if scaled else x, cu, seqlen, total, *_strides(x, varlen),
            *_strides(out, varlen), out.stride(-1), splits, float(fp8_max),
            HEAD_DIM=d, D_PAD=d_pad, BLOCK_T=block_t, SPLITS_PAD=next_power_of_2(splits), IS_VARLEN=varlen,
            SCALED=scaled, **(dict(Fp8Ref=x.new_empty((1,), dtype=round_trip), ROUND_TRIP=True)
                               if round_trip is not None else {}), **options)
    return descale
