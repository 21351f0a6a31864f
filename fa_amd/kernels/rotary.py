"""Fused rotary position embedding (RoPE) in Triton.

One file, Liger style: the Triton kernel, then plain ``rotary_forward`` /
``rotary_backward`` launchers, then the ``torch.library`` custom ops
(``fa_amd::rotary_fwd``, ``fa_amd::rotary_bwd``) with fake impls and autograd,
so ``torch.compile(fullgraph=True)`` traces straight through, then the public
functions: ``apply_rotary_emb`` / ``hf_apply_rotary_pos_emb`` (Hugging Face
layout and tables) and ``apply_rotary`` / ``flash_apply_rotary_emb``
(flash-attn's ``ops.triton.rotary`` / ``layers.rotary`` semantics).

Conventions:

* ``cos``/``sin`` are what Hugging Face rotary modules return: shape
  ``(batch or 1, seq, rotary_dim)`` (or ``(seq, rotary_dim)``) with the two
  halves duplicated, ``cos[..., i] == cos[..., i + rotary_dim // 2]``.  Only the
  first half is read: frequency ``i`` rotates pair ``i``.
* "half tables" (flash-attn, gpt-oss) hold only those ``rotary_dim / 2``
  columns: ``(seqlen_ro, rotary_dim / 2)`` or ``(batch, seqlen_ro, rotary_dim / 2)``.
* positions: token ``t`` of sequence ``b`` reads table row ``t + offset[b]``
  (``seqlen_offsets``, an int or a per-sequence tensor; 0 for the HF layout);
  rows outside ``[0, seqlen_ro)`` are left unrotated (cos 1, sin 0), never read.
* varlen: ``x`` is ``(total_tokens, heads, head_dim)`` and ``cu_seqlens`` marks
  the sequences; positions restart at each sequence start.
* rotate-half (Llama/NeoX, default): pair ``i`` is ``(x[i], x[i + rotary_dim/2])``.
* interleaved (GPT-J): pair ``i`` is ``(x[2i], x[2i + 1])``.
* ``rotary_dim < head_dim`` rotates the leading ``rotary_dim`` features; the
  rest passes through unchanged.

The backward of a rotation by theta is the rotation by -theta, so the same
kernel serves both directions (``sin`` negated).  No gradient flows to
cos/sin (Hugging Face computes them under ``no_grad``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import launch as launch_plumbing
from ..arch import INTERPRET, arch_for, check_interpreter_supported, cpu_without_interpreter_message
from ..tuning import rotary_config
from .launch import next_power_of_2

# ---------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens_ptr,
    offsets_ptr,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    seqlen,
    seqlen_offset,
    seqlen_ro,
    n_heads,
    half_rotary_dim,
    n_pass,
    IS_VARLEN: tl.constexpr,
    OFFSETS_TENSOR: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    # One program owns BLOCK_S tokens x all heads of one sequence.  Rows of the
    # 2D tile are (token, head) pairs so cos/sin are gathered per token.
    pid_s = tl.program_id(0)
    pid_b = tl.program_id(1)

    if IS_VARLEN:
        # the grid covers the longest sequence; this one's tokens start at cu_seqlens[b]
        start = tl.load(cu_seqlens_ptr + pid_b)
        seqlen = tl.load(cu_seqlens_ptr + pid_b + 1) - start
        x_seq = x_ptr + start.to(tl.int64) * stride_xs
        o_seq = out_ptr + start.to(tl.int64) * stride_os
    else:
        x_seq = x_ptr + pid_b.to(tl.int64) * stride_xb
        o_seq = out_ptr + pid_b.to(tl.int64) * stride_ob
    if OFFSETS_TENSOR:
        offset = tl.load(offsets_ptr + pid_b).to(tl.int32)
    else:
        offset = seqlen_offset

    rows = tl.arange(0, BLOCK_S * BLOCK_H)
    tok = pid_s * BLOCK_S + rows // BLOCK_H
    head = rows % BLOCK_H
    row_ok = (tok < seqlen) & (head < n_heads)

    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < half_rotary_dim
    ok = row_ok[:, None] & half_ok[None, :]

    # positions outside the table are not rotated (cos 1, sin 0), and never read
    pos = tok + offset
    table_ok = ok & ((pos >= 0) & (pos < seqlen_ro))[:, None]
    cos = tl.load(cos_ptr + pid_b * stride_cb + pos[:, None] * stride_cs + half[None, :], mask=table_ok, other=1.0)
    sin = tl.load(sin_ptr + pid_b * stride_sb + pos[:, None] * stride_ss + half[None, :], mask=table_ok, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    if BACKWARD:
        sin = -sin

    if INTERLEAVED:
        first = 2 * half
        second = 2 * half + 1
    else:
        first = half
        second = half + half_rotary_dim

    x_row = x_seq + tok[:, None].to(tl.int64) * stride_xs + head[:, None] * stride_xh
    o_row = o_seq + tok[:, None].to(tl.int64) * stride_os + head[:, None] * stride_oh

    x1 = tl.load(x_row + first[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(o_row + first[None, :], y1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o_row + second[None, :], y2.to(out_ptr.dtype.element_ty), mask=ok)

    if BLOCK_PASS > 0:
        # partial rotary: features past rotary_dim are copied unchanged
        rest = 2 * half_rotary_dim + tl.arange(0, BLOCK_PASS)
        rest_ok = row_ok[:, None] & (tl.arange(0, BLOCK_PASS) < n_pass)[None, :]
        xr = tl.load(x_row + rest[None, :], mask=rest_ok, other=0.0)
        tl.store(o_row + rest[None, :], xr, mask=rest_ok)


# ---------------------------------------------------------------------------
# Plain launchers
# ---------------------------------------------------------------------------

def _fake_like(x: torch.Tensor) -> torch.Tensor:
    # same layout as x when x is dense (e.g. a transposed view), else contiguous
    out = torch.empty_like(x)
    if out.stride(-1) != 1:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


def _table_3d(t: torch.Tensor, name: str, batch: int) -> torch.Tensor:
    """cos or sin as (batch or 1, seqlen_ro, columns), last dim contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.ndim == 2:
        t = t.unsqueeze(0)
    if t.ndim != 3:
        raise ValueError(f"{name} must be (seq, columns) or (batch, seq, columns), got shape {tuple(t.shape)}")
    if t.shape[0] not in (1, batch):
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to batch {batch}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool,
            out: Optional[torch.Tensor] = None, half_tables: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
            seqlen_offsets=0, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Rotate x into a new tensor (x's layout) or into ``out`` (which may be x itself: in place).

    x: (b, s, h, d) with any strides (last dim contiguous), or (total, h, d) with ``cu_seqlens``.
    cos/sin: HF tables (duplicated halves, seq == s, no offsets) or, with ``half_tables``, flash-attn's
    (seqlen_ro, rotary_dim / 2) tables read at position + ``seqlen_offsets`` (int or (b,) int tensor).
    """
    varlen = cu_seqlens is not None
    if x.ndim != (3 if varlen else 4):
        layout = "(total_tokens, heads, head_dim) with cu_seqlens" if varlen else "(batch, seq, heads, head_dim)"
        raise ValueError(f"expected a {3 if varlen else 4}D {layout} tensor, got shape {tuple(x.shape)}")
    if varlen:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens must be a 1D int32/int64 tensor of batch + 1 offsets on {x.device}")
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
            raise ValueError(f"max_seqlen must be a Python int >= 0 with cu_seqlens, got {max_seqlen!r}")
        batch, seqlen = cu_seqlens.numel() - 1, max_seqlen
        n_heads, head_dim = x.shape[1], x.shape[2]
    else:
        batch, seqlen, n_heads, head_dim = x.shape
    cos = _table_3d(cos, "cos", batch)
    sin = _table_3d(sin, "sin", batch)
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    seqlen_ro = cos.shape[1]
    rotary_dim = cos.shape[-1] * (2 if half_tables else 1)
    if rotary_dim % 2 != 0 or rotary_dim == 0 or rotary_dim > head_dim:
        columns = "2 * cos.shape[-1]" if half_tables else "cos.shape[-1]"
        raise ValueError(f"rotary_dim ({columns}={rotary_dim}) must be even, > 0 and <= head_dim {head_dim}")
    offsets = None
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64) \
                or seqlen_offsets.device != x.device:
            raise ValueError(f"seqlen_offsets must be an int or a ({batch},) int32/int64 tensor on {x.device}, "
                             f"got {seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
        offsets, seqlen_offsets = seqlen_offsets.contiguous(), 0
    elif isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
        raise TypeError(f"seqlen_offsets must be an int or a tensor, got {type(seqlen_offsets).__name__}")
    if not half_tables and not varlen and offsets is None and seqlen_offsets == 0 and seqlen_ro != seqlen:
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} do not broadcast to batch {batch}, seq {seqlen}")
    if offsets is None and (seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro):
        # a tensor of offsets is checked on the device (positions outside the table stay unrotated)
        raise ValueError(f"positions {seqlen_offsets}..{seqlen_offsets + seqlen - 1} fall outside the "
                         f"{seqlen_ro} rows of cos/sin (seqlen_offsets={seqlen_offsets}, seqlen={seqlen})")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = _fake_like(x)
        if launch_plumbing.POISON_OUTPUTS:  # tests: an element the kernel fails to write shows as NaN
            out.fill_(float("nan"))
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}, last dim contiguous), "
            f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}, strides {out.stride()}"
        )
    if x.numel() == 0 or batch == 0 or seqlen == 0:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return out

    half = rotary_dim // 2
    # in place, the features past rotary_dim are already where they belong
    n_pass = head_dim - rotary_dim if out.data_ptr() != x.data_ptr() else 0
    block_half = next_power_of_2(half)
    block_h = next_power_of_2(n_heads)
    block_pass = next_power_of_2(n_pass) if n_pass > 0 else 0
    width = max(block_half, block_pass)
    max_tile = rotary_config(arch_for(x))["MAX_TILE"]  # elements per program (rows x half): table data
    block_s = max(1, min(next_power_of_2(seqlen), max_tile // (block_h * width)))
    grid = (triton.cdiv(seqlen, block_s), batch)
    token_axis = 0 if varlen else 1
    _rotary_kernel[grid](
        x,
        out,
        cos,
        sin,
        cu_seqlens if varlen else x,  # unused pointers when the constexprs are off
        offsets if offsets is not None else x,
        0 if varlen else x.stride(0),
        x.stride(token_axis),
        x.stride(token_axis + 1),
        0 if varlen else out.stride(0),
        out.stride(token_axis),
        out.stride(token_axis + 1),
        cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1),
        sin.stride(0) if sin.shape[0] > 1 else 0,
        sin.stride(1),
        seqlen,
        seqlen_offsets,
        seqlen_ro,
        n_heads,
        half,
        n_pass,
        IS_VARLEN=varlen,
        OFFSETS_TENSOR=offsets is not None,
        INTERLEAVED=interleaved,
        BACKWARD=backward,
        BLOCK_S=block_s,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
    )
    return out


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                   out: Optional[torch.Tensor] = None, **geometry) -> torch.Tensor:
    """Rotate x (b, s, h, d) by the angles in cos/sin into a new tensor (or ``out``).

    ``geometry``: ``half_tables``, ``cu_seqlens``, ``seqlen_offsets``, ``max_seqlen`` (see ``_launch``).
    """
    return _launch(x, cos, sin, interleaved, backward=False, out=out, **geometry)


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                    out: Optional[torch.Tensor] = None, **geometry) -> torch.Tensor:
    """Gradient of rotary_forward: the rotation by -theta of the incoming gradient."""
    return _launch(grad, cos, sin, interleaved, backward=True, out=out, **geometry)


# ---------------------------------------------------------------------------
# torch.library custom ops (compile-friendly, autograd-aware)
# ---------------------------------------------------------------------------


# The geometry arguments after `interleaved` default to the Hugging Face case (duplicated tables,
# dense, no offsets); flash-attn's functions pass theirs.  A tensor of offsets and an int offset
# are separate arguments because an op's schema has one type per argument.
def _geometry(half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen) -> dict:
    return dict(half_tables=half_tables, cu_seqlens=cu_seqlens,
                seqlen_offsets=seqlen_offsets if seqlen_offsets is not None else seqlen_offset,
                max_seqlen=None if max_seqlen < 0 else max_seqlen)


@torch.library.custom_op("fa_amd::rotary_fwd", mutates_args=())
def _rotary_fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                   half_tables: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                   seqlen_offsets: Optional[torch.Tensor] = None, seqlen_offset: int = 0,
                   max_seqlen: int = -1) -> torch.Tensor:
    return rotary_forward(x, cos, sin, interleaved,
                          **_geometry(half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen))


@_rotary_fwd_op.register_fake
def _(x, cos, sin, interleaved, half_tables=False, cu_seqlens=None, seqlen_offsets=None, seqlen_offset=0,
      max_seqlen=-1):
    return _fake_like(x)


@torch.library.custom_op("fa_amd::rotary_bwd", mutates_args=())
def _rotary_bwd_op(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                   half_tables: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                   seqlen_offsets: Optional[torch.Tensor] = None, seqlen_offset: int = 0,
                   max_seqlen: int = -1) -> torch.Tensor:
    return rotary_backward(grad, cos, sin, interleaved,
                           **_geometry(half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen))


@_rotary_bwd_op.register_fake
def _(grad, cos, sin, interleaved, half_tables=False, cu_seqlens=None, seqlen_offsets=None, seqlen_offset=0,
      max_seqlen=-1):
    return _fake_like(grad)


_N_OP_INPUTS = 9


def _setup_context(ctx, inputs, output):
    _, cos, sin, interleaved, *geometry = inputs
    geometry += [False, None, None, 0, -1][len(geometry):]  # defaults the caller left out
    half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen = geometry
    ctx.save_for_backward(cos, sin, cu_seqlens, seqlen_offsets)
    ctx.interleaved = interleaved
    ctx.scalars = (half_tables, seqlen_offset, max_seqlen)


def _saved(ctx):
    """(cos, sin, interleaved, half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen)."""
    cos, sin, cu_seqlens, seqlen_offsets = ctx.saved_tensors
    half_tables, seqlen_offset, max_seqlen = ctx.scalars
    return cos, sin, ctx.interleaved, half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen


def _backward(ctx, grad):
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    return (_rotary_bwd_op(grad, *_saved(ctx)),) + (None,) * (_N_OP_INPUTS - 1)


_rotary_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _bwd_of_bwd(ctx, grad):
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    return (_rotary_fwd_op(grad, *_saved(ctx)),) + (None,) * (_N_OP_INPUTS - 1)


_rotary_bwd_op.register_autograd(_bwd_of_bwd, setup_context=_setup_context)


# Eager mode: the same launcher through a plain autograd.Function, without the
# custom ops' Python dispatch (which cost more host time than the launch; see
# fa_amd/ops.py).  `inverse` rotates by -theta; the backward of each direction is
# the other one, so double backward works too.
class _EagerRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inverse, cos, sin, interleaved, *geometry):
        _setup_context(ctx, (x, cos, sin, interleaved, *geometry), None)
        ctx.inverse = inverse
        return _launch(x, cos, sin, interleaved, backward=inverse, **_geometry(*geometry))

    @staticmethod
    def backward(ctx, grad):
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        if torch.compiler.is_compiling():
            # compiled autograd traces this backward of an eager forward: the custom op, not the launcher
            op = _rotary_fwd_op if ctx.inverse else _rotary_bwd_op
            return (op(grad, *_saved(ctx)),) + (None,) * _N_OP_INPUTS
        dx = _EagerRotary.apply(grad, not ctx.inverse, *_saved(ctx))
        return (dx,) + (None,) * (1 + _N_OP_INPUTS - 1)


def _rotate(x, cos, sin, interleaved: bool, half_tables: bool = False, cu_seqlens=None, seqlen_offsets=None,
            seqlen_offset: int = 0, max_seqlen: int = -1):
    """Differentiable rotary_forward: the custom op while torch.compile traces, else the Function."""
    args = (cos, sin, interleaved, half_tables, cu_seqlens, seqlen_offsets, seqlen_offset, max_seqlen)
    if torch.compiler.is_compiling():
        return _rotary_fwd_op(x, *args)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return rotary_forward(x, cos, sin, interleaved, **_geometry(*args[3:]))  # inference: no autograd node
    return _EagerRotary.apply(x, False, *args)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _rotate_one(x: torch.Tensor, cos, sin, interleaved: bool, heads_first: bool, name: str,
                half_tables: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        raise ValueError(f"{name} must be a 4D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != cos.device:
        raise ValueError(f"{name} is on {x.device} but cos/sin are on {cos.device}")
    if x.device.type == "cpu":  # Triton's interpreter, set up right, or an error that says what is wrong
        check_interpreter_supported()
        if not INTERPRET:
            raise ValueError(cpu_without_interpreter_message(name))
    x_bshd = x.transpose(1, 2) if heads_first else x
    if x_bshd.stride(-1) != 1:
        x_bshd = x_bshd.contiguous()
    out = _rotate(x_bshd, cos.to(x.dtype), sin.to(x.dtype), interleaved, half_tables)
    return out.transpose(1, 2) if heads_first else out


def _check_tables(cos, sin) -> None:
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise TypeError("cos and sin must be tensors")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "fa_amd rotary does not propagate gradients to cos/sin; compute them under torch.no_grad() "
            "(as Hugging Face rotary modules do) or detach them"
        )


def apply_rotary_emb(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    heads_first: bool = True,
    half_tables: bool = False,
):
    """Apply RoPE to q and (optionally) k with one fused Triton kernel per tensor.

    Args:
        q: (batch, heads, seq, head_dim) when ``heads_first`` (the Hugging Face
            layout), else (batch, seq, heads, head_dim) (the flash layout).  Any
            strides; the last dim must be contiguous (copied otherwise).
        k: same layout as q, possibly fewer heads (GQA); or None.
        cos, sin: (batch or 1, seq, rotary_dim) or (seq, rotary_dim), halves
            duplicated as Hugging Face rotary modules produce them; with
            ``half_tables``, only the rotary_dim / 2 frequencies (gpt-oss).
        interleaved: False for rotate-half (Llama), True for GPT-J pairs.

    Returns:
        (q_rot, k_rot) in the input layout (k_rot is None when k is None).
    """
    _check_tables(cos, sin)
    q_rot = _rotate_one(q, cos, sin, interleaved, heads_first, "q", half_tables)
    k_rot = None if k is None else _rotate_one(k, cos, sin, interleaved, heads_first, "k", half_tables)
    return q_rot, k_rot


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1, half_tables: bool = False):
    """Drop-in for ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``.

    ``unsqueeze_dim=1`` means q/k are (b, h, s, d); ``2`` means (b, s, h, d).
    A ``cos`` narrower than the head dim rotates its leading features only (Phi-3's
    partial rotary); ``half_tables`` reads gpt-oss's tables of rotary_dim / 2 columns.
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (b, h, s, d) or 2 (b, s, h, d), got {unsqueeze_dim}")
    return apply_rotary_emb(q, k, cos, sin, interleaved=False, heads_first=unsqueeze_dim == 1,
                            half_tables=half_tables)


# ---------------------------------------------------------------------------
# flash-attn semantics (flash_attn.ops.triton.rotary / flash_attn.layers.rotary)
# ---------------------------------------------------------------------------


def _flash_geometry(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen):
    """The op arguments after `interleaved` for flash-attn's conventions (validated here, once)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be a float16, bfloat16 or float32 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    _check_tables(cos, sin)
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"x is on {x.device} but cos/sin are on {cos.device}/{sin.device}")
    if cu_seqlens is not None and max_seqlen is None:
        raise ValueError("cu_seqlens needs max_seqlen (the longest sequence, a Python int)")
    tensor_offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
    int_offset = 0 if tensor_offsets is not None else seqlen_offsets
    if tensor_offsets is None and (isinstance(int_offset, bool) or not isinstance(int_offset, int)):
        raise TypeError(f"seqlen_offsets must be an int or an int tensor of shape (batch,), got "
                        f"{type(seqlen_offsets).__name__}")
    return (True, cu_seqlens, tensor_offsets, int_offset, -1 if max_seqlen is None else max_seqlen)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offsets=0,
                 cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                 interleaved: bool = False, inplace: bool = False, conjugate: bool = False) -> torch.Tensor:
    """flash-attn's ``ops.triton.rotary.apply_rotary``: one kernel launch, no autograd.

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with
    ``cu_seqlens`` (batch + 1,) and ``max_seqlen``.  cos/sin: (seqlen_ro, rotary_dim / 2).
    ``seqlen_offsets``: int or (batch,) int tensor, added to every position of that
    sequence (KV-cache decoding).  Rotates the first rotary_dim features, the rest
    pass through.  ``inplace`` writes into x; ``conjugate`` rotates by -theta.
    """
    geometry = _flash_geometry(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    if torch.compiler.is_compiling():  # functional op; copy back for in-place semantics
        op = _rotary_bwd_op if conjugate else _rotary_fwd_op
        out = op(x, cos, sin, interleaved, *geometry)
        return x.copy_(out) if inplace else out
    if inplace and x.stride(-1) != 1:
        raise ValueError("inplace=True needs x with a contiguous last dim")
    return _launch(x, cos, sin, interleaved, backward=conjugate, out=x if inplace else None,
                   **_geometry(*geometry))


def autograd_refuses_inplace(x: torch.Tensor) -> bool:
    """x is a leaf that requires grad, or a view of one: autograd refuses in-place writes to it."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return False
    return x.is_leaf or (x._base is not None and x._base.is_leaf)


class InPlaceRotaryOfLeaf(torch.autograd.Function):
    """flash-attn's in-place rotary of a tensor autograd will not let anything write in place (a leaf that
    requires grad, or a view of one; flash-attn's own tests rotate such leaves): ``rotate(t, conjugate)``
    rotates t's part(s) in place by a kernel inside forward, where autograd does not watch, and the output is
    the input, whose gradient is the same rotation conjugated (the rotation is orthogonal)."""

    @staticmethod
    def forward(ctx, x, rotate):
        rotate(x, False)
        ctx.rotate = rotate
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.rotate(grad, True)
        return grad, None


def flash_apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                           inplace: bool = False, seqlen_offsets=0, cu_seqlens: Optional[torch.Tensor] = None,
                           max_seqlen: Optional[int] = None) -> torch.Tensor:
    """flash-attn's ``layers.rotary.apply_rotary_emb``: :func:`apply_rotary` with autograd.

    The gradient of x is the rotation of the incoming gradient by -theta; none
    flows to cos/sin.  With ``inplace`` the result is written into x (and x is
    returned), also when x needs a gradient.
    """
    geometry = _flash_geometry(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    if inplace and not torch.compiler.is_compiling() and autograd_refuses_inplace(x) and x.stride(-1) == 1:
        return InPlaceRotaryOfLeaf.apply(x, lambda t, conjugate: apply_rotary(
            t, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace=True, conjugate=conjugate))
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
        if x.stride(-1) != 1:
            x_in = x.contiguous()
        else:
            x_in = x
        out = _rotate(x_in, cos, sin, interleaved, *geometry)
        return x.copy_(out) if inplace else out  # autograd sees the copy: the gradient flows through it
    return apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)
