"""What fa_amd's ``flash_attn`` stand-in serves beyond the attention functions.

Each section fills one stand-in module (see ``flash_attn_shim._build_modules``):

* ``flash_attn.flash_attn_interface`` private entry points that ring-attention
  and context-parallel libraries import (``_flash_attn_forward`` / ``_backward``,
  dense and varlen, and their ``_wrapped_`` aliases) on fa_amd's kernels;
* ``flash_attn.layers.rotary`` and ``flash_attn.ops.triton.rotary`` on fa_amd's
  fused Triton rotary (``fa_amd.kernels.rotary``);
* the normalization, cross-entropy and activation entry points
  (``flash_attn.ops.triton.layer_norm``, ``flash_attn.ops.layer_norm``,
  ``flash_attn.ops.rms_norm``, ``flash_attn.ops.triton.cross_entropy``,
  ``flash_attn.losses.cross_entropy``, ``flash_attn.ops.activations``) in plain
  PyTorch: the same results (fp32 math, same output and residual dtypes), not
  fused.  Options with no cheap exact equivalent raise ``NotImplementedError``
  naming the option when called.

Modules fa_amd has no stand-in for (``flash_attn.modules.mha``,
``flash_attn.ops.fused_dense``, ...) stay absent, so ``ImportError`` keeps
sending libraries down their own fallbacks instead of into a stub.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------- flash_attn_interface (private)


def _interface():
    from fa_amd import interface

    return interface


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
             window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, varlen):
    api = _interface()
    api._check_qkv(q, k, v, varlen=varlen)
    if varlen:
        max_seqlen_q, max_seqlen_k = api.integer_arg(max_seqlen_q), api.integer_arg(max_seqlen_k)
    dropout_p, scale, left, right, softcap = api._normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap, False,
        return_softmax, seqlen_k=max_seqlen_k if varlen else k.shape[1])
    if return_softmax and dropout_p == 0.0:
        # (flash-attn's C++ forward refuses it too; its public functions ask for S_dmask only with dropout)
        raise ValueError("return_softmax=True needs dropout_p > 0 (as in flash-attn: S_dmask is the dropout "
                         "pattern's probabilities); pass return_softmax=False to get out and softmax_lse")
    if varlen:
        api._check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", q)
        api._check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k", q)
        batch, nheads = cu_seqlens_q.numel() - 1, q.shape[1]
    else:
        batch, nheads = q.shape[0], q.shape[2]
    alibi_slopes = api._check_alibi(alibi_slopes, q, batch, nheads)
    q, k, v = (api._last_dim_contiguous(x) for x in (q, k, v))
    q, k, v = api._fit_int32_offsets(q, k, v, max_seqlen_q, max_seqlen_k, varlen, return_softmax)
    rng_state = api._rng_state(dropout_p, q.device)
    out, lse, probs = torch.ops.fa_amd.attention_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, left, right, softcap,
        alibi_slopes, rng_state, return_softmax, False)
    if rng_state is None:  # flash-attn always hands back a (seed, offset) pair
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    return out, lse, probs, rng_state


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn 2.7+ private forward: (out, softmax_lse (b, h, sq) fp32, S_dmask, rng_state)."""
    return _forward(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, alibi_slopes, return_softmax, varlen=False)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """flash-attn 2.7+ private varlen forward: (out, softmax_lse (h, total_q) fp32, S_dmask, rng_state).

    block_table (paged k / v) and seqused_k run fa_amd's paged varlen path (forward-only, dropout 0, as
    ``flash_attn_varlen_func(block_table=...)``); num_splits then picks its key splits (0: heuristic, 1: none,
    n: n), and is unused otherwise (the dense kernels do not split keys)."""
    if leftpad_k is not None:
        raise NotImplementedError("fa_amd's _flash_attn_varlen_forward does not support leftpad_k "
                                  "(flash_attn_with_kvcache takes cache_leftpad)")
    from fa_amd.kvcache import check_num_splits, flash_attn_varlen_paged

    check_num_splits(num_splits)  # (checked on the dense path too, where it is unused)
    if block_table is not None or seqused_k is not None:

        out, lse, s_dmask = flash_attn_varlen_paged(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            (window_size_left, window_size_right), softcap, alibi_slopes, True, block_table, seqused_k,
            num_splits=num_splits)
        # (no dropout on this path: flash-attn's rng_state is then an unused (seed, offset) pair)
        return out, lse, s_dmask, torch.zeros(2, dtype=torch.int64, device=q.device)
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, varlen=True)


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
              deterministic, rng_state, varlen):
    api = _interface()
    api._check_qkv(q, k, v, varlen=varlen)
    if varlen:
        max_seqlen_q, max_seqlen_k = api.integer_arg(max_seqlen_q), api.integer_arg(max_seqlen_k)
    dropout_p, scale, left, right, softcap = api._normalize_scalars(
        q.shape[-1], dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap,
        deterministic, False, seqlen_k=max_seqlen_k if varlen else k.shape[1])
    if dropout_p > 0.0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs the rng_state the forward returned (the same dropout mask)")
    if varlen:  # (the forward's checks: values too, once per tensor)
        cu_seqlens_q = api._check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", q)
        cu_seqlens_k = api._check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k", q)
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    alibi_slopes = api._check_alibi(alibi_slopes, q, batch, q.shape[-2])
    grads = torch.ops.fa_amd.attention_bwd(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale,
        left, right, softcap, alibi_slopes, rng_state if dropout_p > 0.0 else None, deterministic)
    for buffer, grad in zip((dq, dk, dv), grads[:3]):
        if buffer is not None:
            buffer.copy_(grad)
    # softmax_d: rowsum(dout * out), fp32, laid out like softmax_lse
    softmax_d = (dout.float() * out.float()).sum(-1)
    return softmax_d.transpose(0, 1).contiguous() if varlen else softmax_d.transpose(1, 2).contiguous()


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """flash-attn 2.7+ private backward: writes dq/dk/dv (when given) and returns softmax_d (b, h, sq)."""
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, None, None, q.shape[1], k.shape[1], dropout_p,
                     softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                     deterministic, rng_state, varlen=False)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None, zero_tensors=False):
    """flash-attn 2.7+ private varlen backward: writes dq/dk/dv and returns softmax_d (h, total_q)."""
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                     alibi_slopes, deterministic, rng_state, varlen=True)


PRIVATE_INTERFACE = dict(
    _flash_attn_forward=_flash_attn_forward,
    _flash_attn_varlen_forward=_flash_attn_varlen_forward,
    _flash_attn_backward=_flash_attn_backward,
    _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    # flash-attn >= 2.7 also exposes its torch.library-wrapped versions under these names
    _wrapped_flash_attn_forward=_flash_attn_forward,
    _wrapped_flash_attn_varlen_forward=_flash_attn_varlen_forward,
    _wrapped_flash_attn_backward=_flash_attn_backward,
    _wrapped_flash_attn_varlen_backward=_flash_attn_varlen_backward,
)


# --------------------------------------------------------------------------- bert_padding extras


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """(b, s, ...) + per-row lengths of the samples packed in each row (zeros after them) ->
    (tokens, indices, cu_seqlens int32, max_seqlen int)."""
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    keep = torch.arange(seqlen, device=lengths.device)[None, :] < lengths.sum(-1, keepdim=True)
    seqlens = lengths.flatten()[lengths.flatten() > 0].to(torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0


# --------------------------------------------------------------------------- layers.rotary


def _rotary():
    from fa_amd.kernels import rotary

    return rotary


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None):
    """flash_attn.layers.rotary.apply_rotary_emb on fa_amd's fused rotary (differentiable).

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens;
    cos, sin: (seqlen_rotary, rotary_dim / 2); rotates the first rotary_dim features.
    """
    return _rotary().flash_apply_rotary_emb(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
                                            max_seqlen)


def apply_rotary(x, cos, sin, seqlen_offsets: Union[int, torch.Tensor] = 0, cu_seqlens=None, max_seqlen=None,
                 interleaved=False, inplace=False, conjugate=False):
    """flash_attn.ops.triton.rotary.apply_rotary: one fused kernel launch, no autograd."""
    return _rotary().apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace,
                                  conjugate)


def rotate_half(x, interleaved=False):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """Plain-PyTorch rotary (flash-attn's reference). cos/sin: (seqlen, rotary_dim / 2) or (b, seqlen, rd / 2)."""
    rotary_dim = cos.shape[-1] * 2
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds head dim {x.shape[-1]}")
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = x[..., :rotary_dim]
    return torch.cat([rot * cos + rotate_half(rot, interleaved) * sin, x[..., rotary_dim:]], dim=-1)


class ApplyRotaryEmb:
    """``ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)``."""

    @staticmethod
    def apply(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
        return apply_rotary_emb(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def _qk_views(qkv, num_heads_q):
    """q and k views of a fused qkv: (b, s, 3, h, d) or (b, s, hq + 2 * hk, d) with num_heads_q."""
    if qkv.ndim == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.ndim != 4 or num_heads_q is None:
        raise ValueError("a 4D qkv (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) needs num_heads_q")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q + 2 * num_heads_k != qkv.shape[2] or num_heads_k < 1:
        raise ValueError(f"qkv has {qkv.shape[2]} heads, not num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def _rotate_views_inplace(views_and_tables, interleaved, seqlen_offsets, owner, views_of=None):
    """Rotate q/k views of ``owner`` in place (under autograd: an out-of-place rotation copied back; an owner
    autograd lets nothing write in place, a leaf that requires grad: the rotation inside one autograd Function,
    as flash-attn does -- ``views_of(t)`` gives the same views of another tensor, for its gradient)."""
    if views_of is not None and not torch.compiler.is_compiling() and _rotary().autograd_refuses_inplace(owner):
        tables = [(cos, sin) for _, cos, sin in views_and_tables]

        def rotate(t, conjugate):
            for view, (cos, sin) in zip(views_of(t), tables):
                apply_rotary(view, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True,
                             conjugate=conjugate)

        return _rotary().InPlaceRotaryOfLeaf.apply(owner, rotate)
    for view, cos, sin in views_and_tables:
        apply_rotary_emb(view, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return owner


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets: Union[int, torch.Tensor] = 0, num_heads_q: Optional[int] = None):
    """Rotate q and k of a fused qkv in place (flash_attn.layers.rotary.apply_rotary_emb_qkv_); returns qkv."""
    q, k = _qk_views(qkv, num_heads_q)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    return _rotate_views_inplace(((q, cos, sin), (k, cos_k, sin_k)), interleaved, seqlen_offsets, qkv,
                                 lambda t: _qk_views(t, num_heads_q))


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets: Union[int, torch.Tensor] = 0):
    """Rotate k of a fused kv (batch, seqlen, 2, nheads, headdim) in place; returns kv."""
    if kv.ndim != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}")
    return _rotate_views_inplace(((kv[:, :, 0], cos, sin),), interleaved, seqlen_offsets, kv, lambda t: (t[:, :, 0],))


class RotaryEmbedding(torch.nn.Module):
    """flash_attn.layers.rotary.RotaryEmbedding: cached cos/sin tables + in-place fused rotary of qkv / q, kv.

    ``scale_base`` turns on XPos (queries scaled by ``scale``, keys by ``1 / scale``).
    The cache attributes (``_cos_cached``, ``_sin_cached``, ``_cos_k_cached``,
    ``_sin_k_cached``, ``_seq_len_cached``, ``_update_cos_sin_cache``) are the ones
    subclasses such as ModernBERT's unpadded rotary use.
    """

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None, *,
                 pos_idx_in_fp32=True):  # flash-attn 2.8's order; older releases took pos_idx_in_fp32 (by keyword)
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("scale", self._compute_scale(device) if scale_base is not None else None,
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _compute_scale(self, device=None):
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        stale = (seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.device != device
                 or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference()))
        if not stale:
            return
        self._seq_len_cached = seqlen
        # positions and frequencies in fp32: a bf16 model's inv_freq would lose the angles' precision
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        if self.scale is None:
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)
        else:
            # in fp32 too (a module cast to bf16 holds a bf16 scale: 1.1 % off at 1000 tokens, as flash-attn avoids)
            base = self.scale if self.scale.dtype == torch.float32 else self._compute_scale(self.scale.device)
            power = (torch.arange(seqlen, dtype=torch.float32, device=base.device) - seqlen // 2) / self.scale_base
            scale = base ** power[:, None]
            scale = scale.to(freqs.device)
            self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
            self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
            self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
            self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None):
        """qkv: (b, s, 3, h, d) or (b, s, hq + 2 * hk, d) with num_heads_q; or q (b, s, h, d) with kv
        (b, s, 2, h, d).  Rotates in place; returns qkv, or (q, kv).  A tensor seqlen_offset needs
        max_seqlen to size the cache."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        else:
            raise ValueError("a tensor seqlen_offset needs max_seqlen (the cos/sin cache length)")
        cos, sin = self._cos_cached, self._sin_cached
        cos_k = self._cos_k_cached if self.scale is not None else cos
        sin_k = self._sin_k_cached if self.scale is not None else sin
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, cos, sin, interleaved=self.interleaved, inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv


ROTARY_LAYERS = dict(
    apply_rotary_emb=apply_rotary_emb,
    apply_rotary_emb_func=apply_rotary_emb,  # the older name
    apply_rotary_emb_torch=apply_rotary_emb_torch,
    apply_rotary_emb_qkv_=apply_rotary_emb_qkv_,
    apply_rotary_emb_kv_=apply_rotary_emb_kv_,
    rotate_half=rotate_half,
    ApplyRotaryEmb=ApplyRotaryEmb,
    RotaryEmbedding=RotaryEmbedding,
)
TRITON_ROTARY = dict(apply_rotary=apply_rotary)


# --------------------------------------------------------------------------- layer norm / RMS norm


def _unsupported(op: str, what: str):
    raise NotImplementedError(
        f"fa_amd's flash_attn stand-in does not implement {op}({what}); install flash-attn for it, or call "
        f"{op} without it")


def _norm(x, weight, bias, eps, is_rms_norm, zero_centered_weight):
    weight = weight.float() + 1.0 if zero_centered_weight else weight.float()
    if is_rms_norm:
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight
    else:
        y = F.layer_norm(x, x.shape[-1:], eps=eps) * weight
    return y + bias.float() if bias is not None else y


def _dropout(x, p):
    """x with dropout p applied (fp32), and the keep mask (bool) or None."""
    if p <= 0.0:
        return x, None
    keep = torch.rand_like(x) >= p
    return torch.where(keep, x / (1.0 - p), 0.0), keep


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                  is_rms_norm=False, return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    """flash_attn.ops.triton.layer_norm.layer_norm_fn in PyTorch (fp32 math, autograd by PyTorch).

    Computes ``norm(dropout(x * rowscale) [+ dropout(x1)] + residual)``; the sum is the
    new residual (dtype: residual's, else fp32 with residual_in_fp32, else x's).
    Returns y, then y1 (with weight1), then the residual (with prenorm), then the
    dropout masks (with return_dropout_mask), as flash-attn does.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if x1 is not None and rowscale is not None:
        raise ValueError("rowscale is not supported with parallel LayerNorm (x1)")
    for name, other in (("residual", residual), ("x1", x1)):
        if other is not None and other.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(other.shape)}")
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h = x.float()
    if rowscale is not None:
        h = h * rowscale.reshape(x.shape[:-1]).float()[..., None]
    h, mask = _dropout(h, dropout_p)
    mask1 = None
    if x1 is not None:
        h1, mask1 = _dropout(x1.float(), dropout_p)
        h = h + h1
    if residual is not None:
        h = h + residual.float()
    y = _norm(h, weight, bias, eps, is_rms_norm, zero_centered_weight).to(out_dtype)
    y1 = None if weight1 is None else _norm(h, weight1, bias1, eps, is_rms_norm, zero_centered_weight).to(out_dtype)
    new_residual = h.to(residual_dtype)
    if out is not None:
        y = out.copy_(y.view_as(out)).view_as(y)
    if residual_out is not None:
        new_residual = residual_out.copy_(new_residual.view_as(residual_out)).view_as(new_residual)
    outputs = (y,) if y1 is None else (y, y1)
    if prenorm:
        outputs += (new_residual,)
    if return_dropout_mask:
        outputs += (mask, mask1)
    return outputs[0] if len(outputs) == 1 else outputs


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    """flash_attn.ops.triton.layer_norm.rms_norm_fn: :func:`layer_norm_fn` with is_rms_norm=True."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
                         residual_out)


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                   upcast=False):
    if dropout_mask is not None or dropout_mask1 is not None:
        _unsupported("layer_norm_ref", "dropout_mask=")
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         zero_centered_weight=zero_centered_weight)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                 upcast=False):
    if dropout_mask is not None or dropout_mask1 is not None:
        _unsupported("rms_norm_ref", "dropout_mask=")
    return rms_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                       zero_centered_weight=zero_centered_weight)


def layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-6,
                         prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    """Norm then linear (flash_attn.ops.triton.layer_norm.layer_norm_linear_fn)."""
    normed = layer_norm_fn(x, norm_weight, norm_bias, residual=residual, eps=eps, prenorm=True,
                           residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)
    y, new_residual = normed
    dtype = torch.get_autocast_dtype(y.device.type) if torch.is_autocast_enabled(y.device.type) else y.dtype
    out = F.linear(y.to(dtype), linear_weight.to(dtype), None if linear_bias is None else linear_bias.to(dtype))
    return (out, new_residual) if prenorm else out


class RMSNorm(torch.nn.Module):
    """flash_attn.ops.triton.layer_norm.RMSNorm (forward(x, residual=None, prenorm=False, residual_in_fp32=False))."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.zeros_(self.weight) if self.zero_centered_weight else torch.nn.init.ones_(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                           zero_centered_weight=self.zero_centered_weight)


TRITON_LAYER_NORM = dict(layer_norm_fn=layer_norm_fn, rms_norm_fn=rms_norm_fn, layer_norm_ref=layer_norm_ref,
                         rms_norm_ref=rms_norm_ref, layer_norm_linear_fn=layer_norm_linear_fn, RMSNorm=RMSNorm)


# flash_attn.ops.layer_norm / ops.rms_norm: the older CUDA-extension API, same math (layerscale is a
# per-feature scale of x0 before dropout)
def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False, _rms=False):
    if layerscale is not None:
        x0 = x0 * layerscale
    result = layer_norm_fn(x0, weight, bias, residual=residual, eps=epsilon, dropout_p=dropout_p, rowscale=rowscale,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32, is_rms_norm=_rms,
                           return_dropout_mask=return_dropout_mask)
    if not return_dropout_mask:
        return result
    *values, mask, _mask1 = result
    if mask is None:  # the older API hands back an all-kept uint8 mask without dropout
        mask = torch.ones(x0.shape, dtype=torch.uint8, device=x0.device)
    return (*values, mask)


def dropout_add_rms_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                         prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    return dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                                  residual_in_fp32, return_dropout_mask, _rms=True)


def layer_norm(x, weight, bias, epsilon):
    return dropout_add_layer_norm(x, None, weight, bias, 0.0, epsilon)


def rms_norm(x, weight, epsilon):
    return dropout_add_rms_norm(x, None, weight, None, 0.0, epsilon)


def _subset_unsupported(name):
    def fn(*args, **kwargs):
        _unsupported(name, "...")
    fn.__name__ = name
    return fn


class _DropoutAddNorm(torch.nn.Module):
    _rms = False

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None,
                 dtype=None):
        super().__init__()
        self.prenorm, self.p, self.eps, self.residual_in_fp32 = prenorm, p, eps, residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        if self._rms:
            self.register_parameter("bias", None)
        else:
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x0, residual=None):
        return dropout_add_layer_norm(x0, residual, self.weight, self.bias, self.p if self.training else 0.0,
                                      self.eps, prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32,
                                      _rms=self._rms)


class DropoutAddLayerNorm(_DropoutAddNorm):
    """flash_attn.ops.layer_norm.DropoutAddLayerNorm."""


class DropoutAddRMSNorm(_DropoutAddNorm):
    """flash_attn.ops.rms_norm.DropoutAddRMSNorm."""
    _rms = True


class LegacyRMSNorm(torch.nn.Module):
    """flash_attn.ops.rms_norm.RMSNorm (forward(x))."""

    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


LEGACY_LAYER_NORM = dict(
    layer_norm=layer_norm, dropout_add_layer_norm=dropout_add_layer_norm, DropoutAddLayerNorm=DropoutAddLayerNorm,
    dropout_add_layer_norm_subset=_subset_unsupported("dropout_add_layer_norm_subset"),
    dropout_add_layer_norm_parallel_residual=_subset_unsupported("dropout_add_layer_norm_parallel_residual"))
LEGACY_RMS_NORM = dict(
    rms_norm=rms_norm, dropout_add_rms_norm=dropout_add_rms_norm, DropoutAddRMSNorm=DropoutAddRMSNorm,
    RMSNorm=LegacyRMSNorm,
    dropout_add_rms_norm_subset=_subset_unsupported("dropout_add_rms_norm_subset"),
    dropout_add_rms_norm_parallel_residual=_subset_unsupported("dropout_add_rms_norm_parallel_residual"))


# --------------------------------------------------------------------------- cross entropy


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, precomputed_lse: Optional[torch.Tensor] = None,
                       label_smoothing: float = 0.0, logit_scale: float = 1.0, lse_square_scale: float = 0.0,
                       ignore_index=-100, inplace_backward: bool = False,
                       process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn.ops.triton.cross_entropy.cross_entropy_loss in PyTorch: per-row (losses, z_losses), fp32.

    loss = lse(s * logits) - s * logits[label] (label smoothing mixes in the mean over classes),
    plus the z-loss lse_square_scale * lse^2, which z_losses also reports; rows whose label is
    ignore_index give 0.  ``inplace_backward`` only saves memory in flash-attn and is ignored.
    """
    if process_group is not None:
        _unsupported("cross_entropy_loss", "process_group=... (tensor-parallel vocab)")
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (batch, vocab) and labels (batch,), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    scaled = logits.float() * logit_scale
    lse = torch.logsumexp(scaled, dim=-1) if precomputed_lse is None else precomputed_lse.float()
    keep = labels != ignore_index
    target = scaled.gather(1, torch.where(keep, labels, 0).long()[:, None]).squeeze(1)
    loss = lse - target
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - scaled.mean(-1))
    z_loss = lse_square_scale * lse.square()
    loss = loss + z_loss
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return torch.where(keep, loss, zero), torch.where(keep, z_loss, zero).detach()


class TritonCrossEntropyLoss:
    """flash_attn.ops.triton.cross_entropy.CrossEntropyLoss (an autograd Function there): ``.apply(...)``."""

    @staticmethod
    def apply(logits, labels, precomputed_lse=None, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
              ignore_index=-100, inplace_backward=False, process_group=None):
        return cross_entropy_loss(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale,
                                  ignore_index, inplace_backward, process_group)


class CrossEntropyLoss(torch.nn.Module):
    """flash_attn.losses.cross_entropy.CrossEntropyLoss (reduction mean / sum / none, z-loss, smoothing)."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                 lse_square_scale=0.0, inplace_backward=False, process_group=None, return_z_loss=False):
        super().__init__()
        if reduction not in ("mean", "none", "sum"):
            raise NotImplementedError("Only support reduction = 'mean' or 'none' or 'sum'")
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.logit_scale, self.lse_square_scale = logit_scale, lse_square_scale
        self.inplace_backward, self.process_group, self.return_z_loss = inplace_backward, process_group, return_z_loss

    def forward(self, input, target, precomputed_lse=None):
        loss, z_loss = cross_entropy_loss(input, target, precomputed_lse, self.label_smoothing, self.logit_scale,
                                          self.lse_square_scale, self.ignore_index, self.inplace_backward,
                                          self.process_group)
        count = (target != self.ignore_index).sum()

        def reduce(values):
            if self.reduction == "mean":
                return values.sum() / count
            return values.sum() if self.reduction == "sum" else values

        return (reduce(loss), reduce(z_loss)) if self.return_z_loss else reduce(loss)


TRITON_CROSS_ENTROPY = dict(cross_entropy_loss=cross_entropy_loss, CrossEntropyLoss=TritonCrossEntropyLoss)
LOSSES_CROSS_ENTROPY = dict(CrossEntropyLoss=CrossEntropyLoss)


# --------------------------------------------------------------------------- activations

_GELU_C = math.sqrt(2.0 / math.pi)  # 0.79788456...


def gelu_fwd(x):
    """tanh-approximated GeLU (flash_attn.ops.activations.gelu_fwd)."""
    return F.gelu(x.float(), approximate="tanh").to(x.dtype)


def gelu_bwd(g, x):
    xf = x.float()
    tanh_out = torch.tanh(_GELU_C * xf * (1 + 0.044715 * xf * xf))
    ff = 0.5 * xf * ((1 - tanh_out * tanh_out) * (_GELU_C + 3 * 0.044715 * _GELU_C * xf * xf)) + 0.5 * (1 + tanh_out)
    return (ff * g.float()).to(x.dtype)


def bias_gelu(y, bias):
    return gelu_fwd(y + bias).to(y.dtype)


def bias_gelu_back(g, y, bias):
    grad_y = gelu_bwd(g, y + bias).to(y.dtype)
    return grad_y, grad_y.reshape(-1, grad_y.shape[-1]).sum(0, dtype=bias.dtype)


def bias_gelu_impl(y, bias):
    return F.gelu(y + bias, approximate="tanh")


def fast_gelu_impl(x):
    return F.gelu(x, approximate="tanh")


def relu_bwd(g, x):
    return torch.where(x >= 0, g, 0.0).to(x.dtype)


def sqrelu_fwd(x):
    return F.relu(x).square().to(x.dtype)


def sqrelu_bwd(g, x):
    return (2.0 * g * F.relu(x)).to(x.dtype)


def swiglu(x, y):
    """silu(x) * y (flash_attn.ops.activations.swiglu), differentiable."""
    return (F.silu(x.float()) * y.float()).to(x.dtype)


ACTIVATIONS = dict(gelu_fwd=gelu_fwd, gelu_bwd=gelu_bwd, bias_gelu=bias_gelu, bias_gelu_back=bias_gelu_back,
                   bias_gelu_impl=bias_gelu_impl, fast_gelu_impl=fast_gelu_impl, relu_bwd=relu_bwd,
                   sqrelu_fwd=sqrelu_fwd, sqrelu_bwd=sqrelu_bwd, swiglu=swiglu)
