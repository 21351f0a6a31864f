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


# --------------------------------------------------------------------------- decode / KV cache

def rotary_ref(x, cos, sin, positions, interleaved: bool):
    """x (b, s, h, d) rotated at integer positions (b, s), with flash-attn's (seqlen_ro, rotary_dim / 2)
    cos/sin tables, computed in float64 and rounded once to x's dtype (as a fused kernel does)."""
    half = cos.shape[1]
    pos = positions.long().clamp(0, cos.shape[0] - 1)
    c = cos.double()[pos][:, :, None, :]  # (b, s, 1, half)
    s = sin.double()[pos][:, :, None, :]
    xd = x.double()
    rot = xd[..., : 2 * half]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([y, xd[..., 2 * half:]], dim=-1).to(x.dtype)


def _cache_rows(cache, b, cache_batch_idx, block_table):
    """All key slots of sequence b: its dense cache row, or its pages concatenated."""
    if block_table is not None:
        return cache[block_table[b].long()].flatten(0, 1)
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return cache[row]


def attention_kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                          cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                          softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                          rotary_interleaved=True, alibi_slopes=None, sinks=None, upcast=True):
    """flash_attn_with_kvcache semantics, plainly: returns (out, lse, k_cache_after, v_cache_after).

    The caches are not modified (copies are returned with the append done: k rotated at positions
    cache_seqlens + i and rounded to the cache dtype, v copied).  Sequence b then attends keys
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of its cache row (cache_batch_idx) or pages
    (block_table), causal bottom-right aligned over those keys; q is rotated at cache_seqlens + i
    when causal or local (a window entry below the capacity), else at cache_seqlens."""
    batch, seqlen_q = q.shape[:2]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        seqlens = [capacity if k is None else 0] * batch
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = [int(x) for x in cache_seqlens.tolist()]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    seqlen_new = 0 if k is None else k.shape[1]
    # flash-attn: a window entry >= the cache's capacity bounds nothing, so it does not make the call local
    local = any(0 <= w < capacity for w in window_size)
    positions = torch.tensor(seqlens, device=q.device)[:, None] + torch.arange(seqlen_q, device=q.device)[None, :]
    if rotary_cos is not None:
        if not (causal or local):
            positions = positions[:, :1].expand(batch, seqlen_q)
        q = rotary_ref(q, rotary_cos, rotary_sin, positions, rotary_interleaved)
        k_pos = torch.tensor(seqlens, device=q.device)[:, None] + torch.arange(seqlen_new, device=q.device)[None, :]
        k = rotary_ref(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)
    if k is not None:
        for b in range(batch):
            dst_k = _cache_rows(k_cache, b, cache_batch_idx, block_table)
            dst_v = _cache_rows(v_cache, b, cache_batch_idx, block_table)
            dst_k[seqlens[b]:seqlens[b] + seqlen_new] = k[b].to(k_cache.dtype)
            dst_v[seqlens[b]:seqlens[b] + seqlen_new] = v[b].to(v_cache.dtype)
            if block_table is not None:  # write the pages back (indexing with a tensor copied them)
                pages = block_table[b].long()
                k_cache[pages] = dst_k.view(k_cache[pages].shape)
                v_cache[pages] = dst_v.view(v_cache[pages].shape)
    dtype = torch.float64 if upcast else q.dtype
    hq = q.shape[2]
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((batch, hq, seqlen_q), float("inf"), dtype=dtype, device=q.device)
    for b in range(batch):
        end = seqlens[b] + seqlen_new
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        keys = _cache_rows(k_cache, b, cache_batch_idx, block_table)[start:end]
        values = _cache_rows(v_cache, b, cache_batch_idx, block_table)[start:end]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        o, l = attention_ref(q[b:b + 1], keys[None], values[None], causal=causal, window_size=window_size,
                             softcap=softcap, alibi_slopes=slopes, softmax_scale=softmax_scale, sinks=sinks,
                             upcast=upcast)
        out[b], lse[b] = o[0], l[0]
    return out, lse, k_cache, v_cache


def attention_paged_varlen_ref(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, block_table, *, seqused_k=None,
                               alibi_slopes=None, **kwargs):
    """flash_attn_varlen_func with a block_table: sequence b's keys are the first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] (or seqused_k[b]) slots of its pages.  Returns (out, lse)."""
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist() if seqused_k is None else seqused_k.tolist()
    keys = [k_pages[block_table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)]
    values = [v_pages[block_table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)]
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    return attention_varlen_ref(q, torch.cat(keys), torch.cat(values), cu_seqlens_q, cu_k,
                                alibi_slopes=alibi_slopes, **kwargs)


# --------------------------------------------------------------------------- FP8 emulation

def fp8_quantize_ref(x, fp8_dtype, cu_seqlens=None):
    """(x rounded to fp8 as fa_amd.fp8 does it, descale): one amax scale per (sequence, head) --
    amax = max |x| over the head's finite values, raised to AMAX_FLOOR (2^-100) if below it,
    scale = fp8_max / amax, x8 = fp8(clamp(fp32(x) * scale)), NaN where x is NaN or +-inf,
    descale = amax / fp8_max (1 where a head has no nonzero finite value) -- written as plain loops.
    Returns x8 (fp8, x's shape) and descale float32 (batch, nheads)."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax_floor = 2.0 ** -100  # kernels/quantize.AMAX_FLOOR
    x = x.detach().float()
    if cu_seqlens is None:
        segments = [x[i] for i in range(x.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        segments = [x[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    x8 = torch.zeros(x.shape, dtype=fp8_dtype, device=x.device)
    descale = torch.ones(len(segments), x.shape[-2], dtype=torch.float32, device=x.device)
    start = 0
    for i, seg in enumerate(segments):
        for h in range(x.shape[-2]):
            values = seg[:, h]
            finite = torch.isfinite(values)
            amax = torch.where(finite, values.abs(), 0.0).max() if values.numel() else x.new_zeros(())
            if amax > 0:
                amax = amax.clamp_min(amax_floor)
                scale = fp8_max / amax
                descale[i, h] = amax / fp8_max
            else:
                scale = x.new_ones(())
            rounded = (values * scale).clamp(-fp8_max, fp8_max)
            rounded = torch.where(finite, rounded, float("nan")).to(fp8_dtype)
            if cu_seqlens is None:
                x8[i, :, h] = rounded
            else:
                x8[start:start + seg.shape[0], h] = rounded
        start += seg.shape[0]
    return x8, descale


def fp8_scale_ref(x, descale, fp8_dtype):
    """x (batch, seqlen, nheads, d) quantised with a GIVEN descale (batch, nheads), as an FP8 KV cache
    takes high-precision keys/values (fa_amd.kvcache): fp8(clamp(fp32(x) / descale, +-fp8 max)),
    round to nearest even."""
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = x.detach().float() / descale.float()[:, None, :, None]
    return scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype)


def fp8_dequantize_ref(x8, descale, cu_seqlens=None):
    """float64 values of x8 * descale (descale (batch, nheads) or (batch, nheads_k) matching x8)."""
    x = x8.double()
    if cu_seqlens is None:
        return x * descale.double()[:, None, :, None]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    per_token = torch.repeat_interleave(descale.double(), torch.tensor(lengths, device=x.device), dim=0)
    out = x.clone()
    out[:per_token.shape[0]] *= per_token[:, :, None]
    return out


def attention_grads_from_stats(q, k, v, out, lse, dout, *, causal=False, window_size=(-1, -1), softmax_scale=None,
                               dropout_p=0.0, dropout_mask=None):
    """(dq, dk, dv) of dense attention at q, k, v (b, s, h, d), with the softmax rebuilt from the
    given row statistics as flash backward kernels do: P = exp(S - lse), dS = P * (dO V^T -
    rowsum(dO * out)).  With q, k, v quantised and dequantised (fp8_quantize_ref, fp8_dequantize_ref) and
    the out and lse of an FP8 forward this is the backward rule of fa_amd.fp8's quantising functions;
    computed in float64.  (Masks: causal and window; dropout with
    dropout_mask (b, h, sq, sk) bool, kept entries scaled by 1 / (1 - dropout_p).)"""
    q, k, v, out, dout = (x.double() for x in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    ke, ve = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    rel = torch.arange(sk, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None] - (sk - sq)
    left, right = window_size
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    lse = lse.double()  # +inf on rows that see no key: P = 0 there
    p = torch.exp(scores - lse[..., None]).masked_fill(~keep, 0.0)
    drop = 1.0 if dropout_mask is None else dropout_mask.double() / (1.0 - dropout_p)
    dv = torch.einsum("bhqk,bqhd->bkhd", p * drop, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve) * drop
    delta = (dout * out).sum(-1).transpose(1, 2)  # (b, h, sq)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dk = dk.view(b, sk, hk, group, d).sum(3)
    dv = dv.view(b, sk, hk, group, d).sum(3)
    return dq, dk, dv
