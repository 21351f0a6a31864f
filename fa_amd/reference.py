"""Plain PyTorch attention with every fa_amd feature: the oracle for all tests.

Computes in float64 by default (`upcast=True`); with upcast=False it computes in
the inputs' own dtype, which gives the "same-precision PyTorch" error that test
tolerances are scaled by.  Dropout is applied from an explicit keep-mask.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def attention_ref(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  softmax_scale=None, dropout_p=0.0, dropout_mask: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None, upcast=True):
    """Dense attention.  q: (b, sq, hq, d), k/v: (b, sk, hk, d).  Returns (out, lse).

    dropout_mask: bool (b, hq, sq, sk), True = kept.  lse is (b, hq, sq) float,
    +inf on rows that see no key (flash-attn convention; their output is 0).
    sinks: (hq,) learnable sink logits, one more column of each row's softmax whose value
    is zero (gpt-oss): lse includes it, a row that sees no key gets lse = sink and output 0;
    dropout acts on the keys' probabilities after the softmax.
    """
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=2)
        v = v.repeat_interleave(hq // hk, dim=2)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(sq, device=q.device)[:, None]
    cols = torch.arange(sk, device=q.device)[None, :]
    rel = cols - rows - (sk - sq)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype)
        slopes = slopes.view(1, hq, 1, 1) if slopes.dim() == 1 else slopes.view(b, hq, 1, 1)
        scores = scores - slopes * rel.abs().to(dtype)
    left, right = window_size
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        # the sink column: in the softmax, then dropped (it has no value)
        scores = torch.cat([scores, sinks.to(dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[..., None], 0.0)[..., :sk]
    lse = lse.masked_fill(empty, float("inf"))
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None,
                         dropout_mask: Optional[Sequence[torch.Tensor]] = None, **kwargs):
    """Varlen attention as a loop of dense calls.  q: (total_q, hq, d).  Returns (out, lse (hq, total_q)).

    dropout_mask: one bool (hq, sq_i, sk_i) tensor per sequence.
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dtype = torch.float64 if kwargs.get("upcast", True) else q.dtype
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=dtype, device=q.device)
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qe == qs:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i:i + 1]
        mask = None if dropout_mask is None else dropout_mask[i][None]
        o, l = attention_ref(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], alibi_slopes=slopes,
                             dropout_mask=mask, **kwargs)
        out[qs:qe] = o[0]
        lse[:, qs:qe] = l[0]
    return out, lse
