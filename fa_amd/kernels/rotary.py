"""Fused rotary position embedding (RoPE) in Triton.

One file, Liger style: the Triton kernel, then plain ``rotary_forward`` /
``rotary_backward`` launchers, then the ``torch.library`` custom ops
(``fa_amd::rotary_fwd``, ``fa_amd::rotary_bwd``) with fake impls and autograd,
so ``torch.compile(fullgraph=True)`` traces straight through, then the public
``apply_rotary_emb``.

Conventions:

* ``cos``/``sin`` are what Hugging Face rotary modules return: shape
  ``(batch or 1, seq, rotary_dim)`` (or ``(seq, rotary_dim)``) with the two
  halves duplicated, ``cos[..., i] == cos[..., i + rotary_dim // 2]``.  Only the
  first half is read: frequency ``i`` rotates pair ``i``.
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

from ..arch import INTERPRET, check_interpreter_supported, cpu_without_interpreter_message
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
    n_heads,
    half_rotary_dim,
    n_pass,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    # One program owns BLOCK_S tokens x all heads of one batch row.  Rows of the
    # 2D tile are (token, head) pairs so cos/sin are gathered per token.
    pid_s = tl.program_id(0)
    pid_b = tl.program_id(1)

    rows = tl.arange(0, BLOCK_S * BLOCK_H)
    tok = pid_s * BLOCK_S + rows // BLOCK_H
    head = rows % BLOCK_H
    row_ok = (tok < seqlen) & (head < n_heads)

    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < half_rotary_dim
    ok = row_ok[:, None] & half_ok[None, :]

    cos = tl.load(cos_ptr + pid_b * stride_cb + tok[:, None] * stride_cs + half[None, :], mask=ok, other=0.0)
    sin = tl.load(sin_ptr + pid_b * stride_sb + tok[:, None] * stride_ss + half[None, :], mask=ok, other=0.0)
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

    x_row = x_ptr + pid_b * stride_xb + tok[:, None] * stride_xs + head[:, None] * stride_xh
    o_row = out_ptr + pid_b * stride_ob + tok[:, None] * stride_os + head[:, None] * stride_oh

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

_MAX_TILE = 8192  # elements per program (rows x half)


def _fake_like(x: torch.Tensor) -> torch.Tensor:
    # same layout as x when x is dense (e.g. a transposed view), else contiguous
    out = torch.empty_like(x)
    if out.stride(-1) != 1:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


def _cos_sin_3d(t: torch.Tensor, name: str, batch: int, seqlen: int) -> torch.Tensor:
    if t.ndim == 2:
        t = t.unsqueeze(0)
    if t.ndim != 3:
        raise ValueError(f"{name} must be (seq, rotary_dim) or (batch, seq, rotary_dim), got shape {tuple(t.shape)}")
    if t.shape[0] not in (1, batch) or t.shape[1] != seqlen:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} does not broadcast to batch {batch}, seq {seqlen}"
        )
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: (b, s, h, d) with any strides (last dim contiguous) -> rotated copy (x's layout, or into ``out``)."""
    if x.ndim != 4:
        raise ValueError(f"expected a 4D (batch, seq, heads, head_dim) tensor, got shape {tuple(x.shape)}")
    batch, seqlen, n_heads, head_dim = x.shape
    cos = _cos_sin_3d(cos, "cos", batch, seqlen)
    sin = _cos_sin_3d(sin, "sin", batch, seqlen)
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 != 0 or rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim (cos.shape[-1]={rotary_dim}) must be even, > 0 and <= head_dim {head_dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = _fake_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}, last dim contiguous), "
            f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}, strides {out.stride()}"
        )
    if x.numel() == 0:
        return out

    half = rotary_dim // 2
    n_pass = head_dim - rotary_dim
    block_half = next_power_of_2(half)
    block_h = next_power_of_2(n_heads)
    block_pass = next_power_of_2(n_pass) if n_pass > 0 else 0
    width = max(block_half, block_pass)
    block_s = max(1, min(next_power_of_2(seqlen), _MAX_TILE // (block_h * width)))
    grid = (triton.cdiv(seqlen, block_s), batch)
    _rotary_kernel[grid](
        x,
        out,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1),
        sin.stride(0) if sin.shape[0] > 1 else 0,
        sin.stride(1),
        seqlen,
        n_heads,
        half,
        n_pass,
        INTERLEAVED=interleaved,
        BACKWARD=backward,
        BLOCK_S=block_s,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
    )
    return out


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate x (b, s, h, d) by the angles in cos/sin into a new tensor (or ``out``)."""
    return _launch(x, cos, sin, interleaved, backward=False, out=out)


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gradient of rotary_forward: the rotation by -theta of the incoming gradient."""
    return _launch(grad, cos, sin, interleaved, backward=True, out=out)


# ---------------------------------------------------------------------------
# torch.library custom ops (compile-friendly, autograd-aware)
# ---------------------------------------------------------------------------


@torch.library.custom_op("fa_amd::rotary_fwd", mutates_args=())
def _rotary_fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return rotary_forward(x, cos, sin, interleaved)


@_rotary_fwd_op.register_fake
def _(x, cos, sin, interleaved):
    return _fake_like(x)


@torch.library.custom_op("fa_amd::rotary_bwd", mutates_args=())
def _rotary_bwd_op(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return rotary_backward(grad, cos, sin, interleaved)


@_rotary_bwd_op.register_fake
def _(grad, cos, sin, interleaved):
    return _fake_like(grad)


def _setup_context(ctx, inputs, output):
    _, cos, sin, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    return _rotary_bwd_op(grad, cos, sin, ctx.interleaved), None, None, None


_rotary_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _bwd_of_bwd(ctx, grad):
    cos, sin = ctx.saved_tensors
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    return _rotary_fwd_op(grad, cos, sin, ctx.interleaved), None, None, None


_rotary_bwd_op.register_autograd(_bwd_of_bwd, setup_context=_setup_context)


# Eager mode: the same launcher through a plain autograd.Function, without the
# custom ops' Python dispatch (which cost more host time than the launch; see
# fa_amd/ops.py).  `inverse` rotates by -theta; the backward of each direction is
# the other one, so double backward works too.
class _EagerRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inverse):
        _setup_context(ctx, (x, cos, sin, interleaved), None)
        ctx.inverse = inverse
        return _launch(x, cos, sin, interleaved, backward=inverse)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _EagerRotary.apply(grad, cos, sin, ctx.interleaved, not ctx.inverse), None, None, None, None


def _rotate(x, cos, sin, interleaved: bool):
    """Differentiable rotary_forward: the custom op while torch.compile traces, else the Function."""
    if torch.compiler.is_compiling():
        return _rotary_fwd_op(x, cos, sin, interleaved)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return rotary_forward(x, cos, sin, interleaved)  # inference: no autograd node
    return _EagerRotary.apply(x, cos, sin, interleaved, False)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _rotate_one(x: torch.Tensor, cos, sin, interleaved: bool, heads_first: bool, name: str) -> torch.Tensor:
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
    out = _rotate(x_bshd, cos.to(x.dtype), sin.to(x.dtype), interleaved)
    return out.transpose(1, 2) if heads_first else out


def apply_rotary_emb(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    heads_first: bool = True,
):
    """Apply RoPE to q and (optionally) k with one fused Triton kernel per tensor.

    Args:
        q: (batch, heads, seq, head_dim) when ``heads_first`` (the Hugging Face
            layout), else (batch, seq, heads, head_dim) (the flash layout).  Any
            strides; the last dim must be contiguous (copied otherwise).
        k: same layout as q, possibly fewer heads (GQA); or None.
        cos, sin: (batch or 1, seq, rotary_dim) or (seq, rotary_dim), halves
            duplicated as Hugging Face rotary modules produce them.
        interleaved: False for rotate-half (Llama), True for GPT-J pairs.

    Returns:
        (q_rot, k_rot) in the input layout (k_rot is None when k is None).
    """
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise TypeError("cos and sin must be tensors")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "fa_amd rotary does not propagate gradients to cos/sin; compute them under torch.no_grad() "
            "(as Hugging Face rotary modules do) or detach them"
        )
    q_rot = _rotate_one(q, cos, sin, interleaved, heads_first, "q")
    k_rot = None if k is None else _rotate_one(k, cos, sin, interleaved, heads_first, "k")
    return q_rot, k_rot


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Drop-in for ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``.

    ``unsqueeze_dim=1`` means q/k are (b, h, s, d); ``2`` means (b, s, h, d).
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (b, h, s, d) or 2 (b, s, h, d), got {unsqueeze_dim}")
    return apply_rotary_emb(q, k, cos, sin, interleaved=False, heads_first=unsqueeze_dim == 1)
