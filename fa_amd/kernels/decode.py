"""Split-KV decode attention over a KV cache (dense, packed varlen or paged), the in-place cache
append (with fused rotary), the log-sum-exp merge of the splits, then the plain launchers.

Rows of a tile are (query token, head-in-group) pairs of ONE KV head: with one query token the
GROUP query heads of a KV group share a tile, so each K/V block is read once per group (not once
per query head); with seqlen_q > 1 (speculative decoding, chunked prefill) the tokens fold into
the rows too.  The key axis is split over programs (grid axis 0) so that a small batch still
fills the GPU; the splits are combined by their log-sum-exp (`_merge_splits`): by the last split
program of each tile to finish, inside the decode kernel (tables.DECODE_FUSED_MERGE_FAMILIES, one
launch per call), or by `split_merge_kernel` launched after it.

Key addressing modes (constexprs), one loop for all:
  * dense cache (batch_cache, seqlen_cache, hk, d), row b or cache_batch_idx[b];
  * packed varlen keys (total_k, hk, d) from cu_seqlens_k (the paged/seqused varlen route);
  * paged cache (num_pages, page_size, hk, d): key j of sequence b lives in page
    block_table[b, j // page_size] at slot j % page_size; the page size is a runtime int (any
    multiple of 16), so caches of every page size share one compiled kernel.
Keys [k_lo, k_end) of a sequence are attended: k_lo = cache_leftpad (0 without), k_end =
cache_seqlens + seqlen_new (or the varlen length).  Causal / window / ALiBi positions are absolute
key indices, diagonal at k_end - seqlen_q, which equals flash-attn's leftpad-relative convention.

FP8 KV cache (fa_amd/fp8.py checks the arguments): a dtype path of the same kernels, read off the
caches' element type.  The fp32 (q, k, v) descales, one per (sequence, KV head) each, are read where
the caller keeps them (QDescale / KDescale / VDescale and their strides); S is scaled by
q_descale * k_descale (folded into the score scales) and the output by v_descale.  FP8 q (same
type as the caches) dots FP8 K directly and P is rounded to V's FP8 type as in the prefill
forward (score_mods.p_shift); a high-precision q dots K and V widened to q's dtype.  The append
quantises high-precision new k/v into an FP8 cache (x / descale, saturated at the type's max
FP8_MAX, then rounded), as vLLM's cache writes do; FP8 new k/v are stored as they are.

Memory safety never rests on the host: every device-provided index (cache_seqlens, leftpad,
cache_batch_idx, block_table entries, cu_seqlens, rotary positions) is clamped into its tensor
before it addresses memory, and an append whose target slot is outside the cache (or whose page
or cache row is out of range) is dropped instead of written.
"""
import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from ..arch import arch_for, num_sms
from ..tuning import decode_many_rule, decode_masked_stages, decode_merge_step, family_of, get_decode_config, \
    get_decode_split_policy, tables
from .blocks import dot_rows_nt, in_loop, key_ranges
from .launch import CompiledLaunch, cdiv, current_stream, descale_args, head_dim_padded, int_specialization, \
    kept_zeros, launch, new_output, score_args
from .rotary import rotary_forward
from .score_mods import FP8_P_SCALE, LN2, LOG2E, alibi_slope_log2, load_head_descales, p_shift, saturate, score_log2, \
    sink_init


# --------------------------------------------------------------------------- rotary (shared by q and new k)

@triton.jit
def _rotate_rows(x, row_ptrs, row_ok, offs_d, pos, Cos, Sin, stride_cos, rot_half, seqlen_ro,
                 INTERLEAVED: tl.constexpr):
    """x [R, D] (loaded from row_ptrs [R, 1] + offs_d) rotated at positions pos [R], in fp32.

    cos/sin are flash-attn's (seqlen_ro, rotary_dim / 2) tables; columns past rotary_dim pass through.
    Column c pairs with its partner column (c ^ 1 interleaved, c +- rotary_dim/2 rotate-half)."""
    in_rot = offs_d < 2 * rot_half
    if INTERLEAVED:
        freq = offs_d // 2
        partner = offs_d ^ 1
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        first = offs_d < rot_half
        freq = tl.where(first, offs_d, offs_d - rot_half)
        partner = tl.where(first, offs_d + rot_half, offs_d - rot_half)
        sign = tl.where(first, -1.0, 1.0)
    ok = row_ok & in_rot[None, :]
    pos = tl.minimum(tl.maximum(pos, 0), seqlen_ro - 1)  # positions come from device values: clamp
    cs_off = pos[:, None].to(tl.int64) * stride_cos + freq[None, :]
    cos = tl.load(Cos + cs_off, mask=ok, other=1.0).to(tl.float32)
    sin = tl.load(Sin + cs_off, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    return tl.where(in_rot[None, :], xf * cos + sign[None, :] * xp * sin, xf)


@triton.jit
def _cache_row(BatchIdx, b, num_cache_rows, HAS_BATCH_IDX: tl.constexpr):
    """Row of the dense cache that sequence b reads: b, or cache_batch_idx[b] clamped into the cache."""
    if HAS_BATCH_IDX:
        row = tl.minimum(tl.maximum(tl.load(BatchIdx + b).to(tl.int32), 0), num_cache_rows - 1)
    else:
        row = b
    return row


# --------------------------------------------------------------------------- append (+ rotary of the new keys)

@triton.jit
def kv_append_kernel(
    KNew, VNew, KCache, VCache, CacheSeqlens, BatchIdx, BlockTable, Cos, Sin,
    seqlen_new, cache_seqlens_int, capacity, num_cache_rows, page_size,
    stride_nb, stride_nt, stride_nh, stride_mb, stride_mt, stride_mh,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_btb, stride_cos, rot_half, seqlen_ro,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SEQLENS_TENSOR: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr,
    ROTARY: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    QDescale=None, KDescale=None, VDescale=None, stride_qdb=None, stride_qdh=None, stride_kdb=None,
    stride_kdh=None, stride_vdb=None, stride_vdh=None, FP8_MAX: tl.constexpr = 0.0,
):
    """k/v[b, t] -> cache slot cache_seqlens[b] + t of sequence b (k rotated there when ROTARY).
    An FP8 cache takes high-precision k/v quantised with their descales (module doc), FP8 k/v as they are."""
    CACHE_FP8: tl.constexpr = KCache.dtype.element_ty.is_fp8()
    NEW_FP8: tl.constexpr = KNew.dtype.element_ty.is_fp8()
    pid_t = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    if SEQLENS_TENSOR:
        base = tl.maximum(tl.load(CacheSeqlens + b).to(tl.int32), 0)
    else:
        base = b * 0 + cache_seqlens_int
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_PAD)
    pos = base + offs_t
    ok = (offs_t < seqlen_new) & (pos < capacity)
    if PAGED:
        page = tl.load(BlockTable + b.to(tl.int64) * stride_btb + pos // page_size, mask=ok, other=-1)
        ok = ok & (page >= 0) & (page < num_cache_rows)
        row64 = tl.maximum(page, 0).to(tl.int64)
        slot = pos % page_size
    else:
        if HAS_BATCH_IDX:  # an out-of-range row drops the write (the attention reads a clamped row)
            row = tl.load(BatchIdx + b).to(tl.int32) + offs_t * 0
            ok = ok & (row >= 0) & (row < num_cache_rows)
            row64 = tl.maximum(row, 0).to(tl.int64)
        else:
            row64 = (b + offs_t * 0).to(tl.int64)
        slot = pos
    d_ok = offs_d[None, :] < HEAD_DIM
    ok2 = ok[:, None] & d_ok
    k_rows = KNew + b.to(tl.int64) * stride_nb + offs_t[:, None] * stride_nt + hk * stride_nh
    v_rows = VNew + b.to(tl.int64) * stride_mb + offs_t[:, None] * stride_mt + hk * stride_mh
    k = tl.load(k_rows + offs_d[None, :], mask=ok2, other=0.0)
    if ROTARY:
        k = _rotate_rows(k, k_rows, ok[:, None], offs_d, pos, Cos, Sin, stride_cos, rot_half, seqlen_ro,
                         ROTARY_INTERLEAVED)
    v = tl.load(v_rows + offs_d[None, :], mask=ok2, other=0.0)
    if CACHE_FP8:
        if not NEW_FP8:  # quantise: x / descale of (sequence, KV head), saturated
            _, k_descale, v_descale = load_head_descales(QDescale, KDescale, VDescale, b, hk, hk, stride_qdb,
                                                         stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
                                                         True, CACHE_FP8)
            k = k.to(tl.float32) / k_descale
            v = saturate(v.to(tl.float32) / v_descale, FP8_MAX)
        if ROTARY or not NEW_FP8:  # (a rotated FP8 key may leave the type's range too)
            k = saturate(k, FP8_MAX)
    k_dst = KCache + row64[:, None] * stride_kb + slot[:, None] * stride_kn + hk * stride_kh + offs_d[None, :]
    v_dst = VCache + row64[:, None] * stride_vb + slot[:, None] * stride_vn + hk * stride_vh + offs_d[None, :]
    tl.store(k_dst, k.to(KCache.dtype.element_ty), mask=ok2)
    tl.store(v_dst, v.to(VCache.dtype.element_ty), mask=ok2)


# --------------------------------------------------------------------------- split-KV attention

@triton.jit
def _decode_block(acc, l_i, m_i, q, q_rows, q_len, Q, K_base, V_base, BT_row, KM_row, start_n, end,
                  offs_n, offs_d, rows_tok, diag, k_lo, k_end, stride_kn, stride_vn, stride_kp, stride_vp,
                  page_size, num_pages,
                  qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK: tl.constexpr, PAGED: tl.constexpr, HAS_KEY_MASK: tl.constexpr, IS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr, Q_FP8: tl.constexpr,
                  HAS_LEFTPAD: tl.constexpr):
    """Key block [start_n, start_n + BLOCK_N) of _decode_inner's loop (which ends at `end`)."""
    # K and V tiles are computed in q's dtype: a no-op cast except for an FP8 cache under a
    # high-precision q (widened); FP8 q dots the FP8 cache as it is (module doc)
    cols = start_n + offs_n
    if PAGED:
        if MASK:
            page = tl.load(BT_row + cols // page_size, mask=cols < k_end, other=0)
        else:
            page = tl.load(BT_row + cols // page_size)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        slot = cols % page_size
        k_off = page * stride_kp + slot * stride_kn
        v_off = page * stride_vp + slot * stride_vn
    else:
        k_off = cols * stride_kn
        v_off = cols * stride_vn
    v_ptrs = V_base + v_off[:, None] + offs_d[None, :]
    if RELOAD_CHUNK:
        # q streamed from memory in head-dim chunks with each key block (register-bound RDNA)
        qk = dot_rows_nt(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), q_rows,
                         rows_tok[:, None] < in_loop(q_len, start_n, end), K_base + k_off[:, None],
                         cols[:, None] < k_end, HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
    else:
        kT_ptrs = K_base + k_off[None, :] + offs_d[:, None]
        if MASK:
            kT = tl.load(kT_ptrs, mask=(cols[None, :] < k_end) & (offs_d[:, None] < HEAD_DIM), other=0.0)
        elif D_PAD != HEAD_DIM:
            kT = tl.load(kT_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
        qk = tl.dot(q, kT.to(Q.dtype.element_ty), input_precision=INPUT_PRECISION)
    s, _ = score_log2(qk, rows_tok[:, None], cols[None, :], diag, k_end, qk_scale_log2, softcap_div,
                      softcap_log2, slope_log2, win_left, win_right,
                      MASK, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT)
    if MASK:
        # keys before cache_leftpad (block starts are aligned below it)
        s = tl.where(cols[None, :] >= k_lo, s, float("-inf"))
        if HAS_KEY_MASK:
            keep = tl.load(KM_row + cols, mask=cols < k_end, other=0)
            s = tl.where(keep[None, :] != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with every key masked so far keeps m=-inf; shift by 0 instead of NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
    p = tl.exp2(s - p_shift(m_shift, Q_FP8)[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if MASK:
        # slots before cache_leftpad are not the sequence's (uninitialised memory, maybe NaN): not read
        in_seq = cols[:, None] < k_end
        if HAS_LEFTPAD:  # (only then: the compare cost CDNA builds a 36 B spill under triton 3.6)
            in_seq = in_seq & (cols[:, None] >= k_lo)
        v = tl.load(v_ptrs, mask=in_seq & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif D_PAD != HEAD_DIM:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        v = tl.load(v_ptrs)
    v = v.to(Q.dtype.element_ty)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _decode_inner(acc, l_i, m_i, q, q_rows, q_len, Q, K_base, V_base, BT_row, KM_row, start, end,
                  offs_n, offs_d, rows_tok, diag, k_lo, k_end, stride_kn, stride_vn, stride_kp, stride_vp,
                  page_size, num_pages,
                  qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK: tl.constexpr, PAGED: tl.constexpr, HAS_KEY_MASK: tl.constexpr, IS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr, Q_FP8: tl.constexpr,
                  HAS_LEFTPAD: tl.constexpr, STAGES: tl.constexpr = 0):
    """Key blocks [start, end) of one program.  STAGES: 0 pipelines the loop as the launch's num_stages says,
    else in this many stages (1: not pipelined -- no prologue / epilogue copies of the loads).  (Two loops, not
    one tl.range with a computed num_stages: the unswitched launches keep the exact code they were fitted with.)"""
    if STAGES == 0:
        for start_n in range(start, end, BLOCK_N):
            acc, l_i, m_i = _decode_block(
                acc, l_i, m_i, q, q_rows, q_len, Q, K_base, V_base, BT_row, KM_row, start_n, end, offs_n, offs_d,
                rows_tok, diag, k_lo, k_end, stride_kn, stride_vn, stride_kp, stride_vp, page_size, num_pages,
                qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right, HEAD_DIM, D_PAD, BLOCK_M,
                BLOCK_N, MASK, PAGED, HAS_KEY_MASK, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, INPUT_PRECISION,
                RELOAD_CHUNK, Q_FP8, HAS_LEFTPAD)
    else:
        for start_n in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            acc, l_i, m_i = _decode_block(
                acc, l_i, m_i, q, q_rows, q_len, Q, K_base, V_base, BT_row, KM_row, start_n, end, offs_n, offs_d,
                rows_tok, diag, k_lo, k_end, stride_kn, stride_vn, stride_kp, stride_vp, page_size, num_pages,
                qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right, HEAD_DIM, D_PAD, BLOCK_M,
                BLOCK_N, MASK, PAGED, HAS_KEY_MASK, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, INPUT_PRECISION,
                RELOAD_CHUNK, Q_FP8, HAS_LEFTPAD)
    return acc, l_i, m_i


@triton.jit
def decode_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart,
    CuSeqlensQ, CacheSeqlens, CuSeqlensK, SeqUsedK, LeftPad, BatchIdx, BlockTable, KeyMask, Cos, Sin, Alibi,
    seqlen_q, cache_seqlens_int, seqlen_new, capacity, num_cache_rows, page_size, n_splits, total_q, n_heads,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    stride_btb, stride_kmb, stride_cos, stride_ab,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, rot_half, seqlen_ro,
    GROUP, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_VARLEN: tl.constexpr, K_LENS: tl.constexpr, K_PACKED: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    ROTARY: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_TOKEN: tl.constexpr, SPLIT: tl.constexpr,
    IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr,
    Sinks=None, HAS_SINKS: tl.constexpr = False, QDescale=None, KDescale=None, VDescale=None, stride_qdb=None,
    stride_qdh=None, stride_kdb=None, stride_kdh=None, stride_vdb=None, stride_vdh=None,
    FP8_MAX: tl.constexpr = 0.0, SplitCounters=None, FUSED_MERGE: tl.constexpr = False,
    MASKED_STAGES: tl.constexpr = 0, MERGE_ROWS: tl.constexpr = 0, MERGE_STEP: tl.constexpr = 2,
    NAN_FROM_EMPTY: tl.constexpr = False,
):
    """One (KV head x row tile, key split, sequence) program.

    K_LENS: where each sequence's key count comes from: 0 the int cache_seqlens_int, 1 the tensor
    CacheSeqlens (both + seqlen_new, the appended keys), 2 cu_seqlens_k (varlen; SeqUsedK overrides).
    K_PACKED: keys are packed varlen rows starting at cu_seqlens_k[b] (else row b of the cache, or
    pages).  With SPLIT each program writes its normalized partial output and log2-sum-exp to
    OutPart / LsePart (split, token, head), merged by split_merge_kernel; else Out / Lse directly.
    FUSED_MERGE (with SPLIT; tables.DECODE_FUSED_MERGE_FAMILIES): no merge launch -- the last split
    program of each tile to finish merges the tile's partials itself (_last_split_merges), its live rows
    MERGE_ROWS at a time (0: BLOCK_M), MERGE_STEP splits per step (tuning.decode_merge_step).
    Learnable sinks (HAS_SINKS) start the online softmax (score_mods.sink_init); with SPLIT the merge
    adds them instead, so each row counts its sink once.
    FP8 caches (and q) with their descales, each (batch, n_kv_heads) at its strides: module doc.
    MASKED_STAGES (tables.DECODE_MASKED_STAGES): the masked key loops' pipeline stages (0: as num_stages); with it
    the masked front loop is emitted only where a left window or leftpad can mask the front.
    """
    n_kv_heads = n_heads // GROUP
    hk = tl.program_id(0) % n_kv_heads
    mt = tl.program_id(0) // n_kv_heads
    split = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    KV_FP8: tl.constexpr = K.dtype.element_ty.is_fp8()
    Q_FP8: tl.constexpr = Q.dtype.element_ty.is_fp8()
    q_descale, k_descale, v_descale = load_head_descales(QDescale, KDescale, VDescale, b, hk, hk, stride_qdb,
                                                         stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
                                                         True, KV_FP8)
    if KV_FP8:  # S = (q . k8) * q_descale * k_descale: folded into the scalar score scales
        qk_scale_log2 = qk_scale_log2 * (q_descale * k_descale)
        softcap_div = softcap_div * (q_descale * k_descale)

    # ---- query rows of this tile: r = token * GROUP + head-in-group
    if Q_VARLEN:
        q_start = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + b), 0), total_q)
        q_len = tl.minimum(tl.load(CuSeqlensQ + b + 1), total_q) - q_start
    else:
        q_start = b * 0
        q_len = b * 0 + seqlen_q
    r0 = mt * BLOCK_M
    if r0 >= q_len * GROUP:
        return
    offs_r = r0 + tl.arange(0, BLOCK_M)
    tok = offs_r // GROUP
    h = hk * GROUP + offs_r % GROUP
    row_ok = tok < q_len
    tok0 = r0 // GROUP

    # ---- this sequence's keys: [k_lo, k_end) of a key space of `cap` slots
    k_start = b * 0  # first packed row (K_PACKED)
    cap = b * 0 + capacity
    if K_LENS == 2:
        c0 = tl.load(CuSeqlensK + b)
        raw = tl.load(CuSeqlensK + b + 1) - c0
        if K_PACKED:
            k_start = tl.minimum(tl.maximum(c0, 0), capacity)
            cap = capacity - k_start
        if HAS_SEQUSED:
            raw = tl.load(SeqUsedK + b)
        rot_base = raw * 0
    elif K_LENS == 1:
        raw = tl.load(CacheSeqlens + b).to(tl.int32)
        rot_base = tl.maximum(raw, 0)
        raw = raw + seqlen_new
    else:
        raw = b * 0 + cache_seqlens_int
        rot_base = raw
        raw = raw + seqlen_new
    k_end = tl.minimum(tl.maximum(raw, 0), cap)
    k_lo = b * 0
    if HAS_LEFTPAD:
        k_lo = tl.minimum(tl.maximum(tl.load(LeftPad + b).to(tl.int32), 0), k_end)
    diag = k_end - q_len

    if PAGED:
        row_base = 0
        BT_row = BlockTable + b64 * stride_btb
    else:
        row = _cache_row(BatchIdx, b, num_cache_rows, HAS_BATCH_IDX)
        row_base = row.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_kn
        BT_row = BlockTable  # unused
    K_base = K + row_base + hk.to(tl.int64) * stride_kh
    if PAGED:
        V_base = V + hk.to(tl.int64) * stride_vh
    else:
        V_base = V + row.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    KM_row = KeyMask + b64 * stride_kmb

    # ---- the key blocks this tile visits, then this split's share of them
    lo, full_lo, full_hi, hi = key_ranges(tok0, q_len, k_end, diag, win_left, win_right,
                                          BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    lo = tl.maximum(lo, k_lo // BLOCK_N * BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, (k_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N), hi)
    full_hi = tl.maximum(full_hi, full_lo)
    if HAS_KEY_MASK:
        full_hi = full_lo  # every block takes the per-key mask
    per_split = (hi - lo + BLOCK_N - 1) // BLOCK_N
    per_split = (per_split + n_splits - 1) // n_splits * BLOCK_N
    s_lo = tl.minimum(lo + split * per_split, hi)
    s_hi = tl.minimum(s_lo + per_split, hi)
    a1 = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    a2 = tl.minimum(tl.maximum(full_hi, a1), s_hi)

    # ---- q tile (rotated in place of the load when rotary is fused)
    if Q_VARLEN:
        q_rows = Q + (q_start + tok).to(tl.int64) * stride_qm + h * stride_qh
    else:
        q_rows = Q + b64 * stride_qb + tok * stride_qm + h * stride_qh
    offs_d = tl.arange(0, D_PAD)
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if RELOAD_CHUNK:
        q = 0.0  # streamed per key block by _decode_inner (rotary is applied by the launcher then)
    else:
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=q_ok, other=0.0)
    if ROTARY:
        if ROTARY_PER_TOKEN:
            pos = rot_base + tok
        else:
            pos = rot_base + tok * 0
        q = _rotate_rows(q, q_rows[:, None], row_ok[:, None], offs_d, pos, Cos, Sin, stride_cos, rot_half,
                         seqlen_ro, ROTARY_INTERLEAVED)
        if Q_FP8:  # a rotated FP8 query may leave the type's range
            q = saturate(q, FP8_MAX)
        q = q.to(Q.dtype.element_ty)

    slope_log2 = alibi_slope_log2(Alibi, stride_ab, b, h[:, None], HAS_ALIBI)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        if not SPLIT:
            m_i, l_i = sink_init(Sinks, h, BLOCK_M)
            if Q_FP8:  # l_i sums P * 2**FP8_P_LOG2 (score_mods.p_shift): the sink's term too
                l_i = l_i * FP8_P_SCALE
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # without a left window or leftpad full_lo = lo: the masked front [s_lo, a1) is empty, and a MASKED_STAGES
    # launch does not emit it (tables.DECODE_MASKED_STAGES; others keep the code they were fitted with: dropping
    # it took sm90's 16x64/s2 DECODE_MANY tile from 148 to 128 registers and 262 to 276 instructions per block)
    if (HAS_LEFT or HAS_LEFTPAD) or MASKED_STAGES == 0:  # (triton 3.2: no chained or)
        acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, q_rows[:, None], q_len, Q, K_base, V_base, BT_row, KM_row,
                                      s_lo, a1, offs_n, offs_d, tok, diag, k_lo, k_end, stride_kn, stride_vn,
                                      stride_kb, stride_vb, page_size, num_cache_rows,
                                      qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                                      HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, PAGED, HAS_KEY_MASK, IS_SOFTCAP,
                                      HAS_ALIBI, HAS_LEFT, HAS_RIGHT, INPUT_PRECISION, RELOAD_CHUNK, Q_FP8, HAS_LEFTPAD,
                                      MASKED_STAGES)
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, q_rows[:, None], q_len, Q, K_base, V_base, BT_row, KM_row,
                                  a1, a2, offs_n, offs_d, tok, diag, k_lo, k_end, stride_kn, stride_vn, stride_kb,
                                  stride_vb, page_size, num_cache_rows,
                                  qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                                  HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, False, PAGED, HAS_KEY_MASK, IS_SOFTCAP,
                                  HAS_ALIBI, HAS_LEFT, HAS_RIGHT, INPUT_PRECISION, RELOAD_CHUNK, Q_FP8, HAS_LEFTPAD)
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, q_rows[:, None], q_len, Q, K_base, V_base, BT_row, KM_row,
                                  a2, s_hi, offs_n, offs_d, tok, diag, k_lo, k_end, stride_kn, stride_vn, stride_kb,
                                  stride_vb, page_size, num_cache_rows,
                                  qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                                  HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, PAGED, HAS_KEY_MASK, IS_SOFTCAP,
                                  HAS_ALIBI, HAS_LEFT, HAS_RIGHT, INPUT_PRECISION, RELOAD_CHUNK, Q_FP8, HAS_LEFTPAD,
                                  MASKED_STAGES)

    empty_row = l_i == 0.0
    out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * v_descale
        m_i = p_shift(m_i, Q_FP8)  # l_i summed P * 2**FP8_P_LOG2
    lse2 = tl.where(empty_row, float("-inf"), m_i + tl.log2(tl.where(empty_row, 1.0, l_i)))
    if SPLIT:
        # (split, token, head) rows of the partial buffers; tokens are numbered over the whole batch
        if Q_VARLEN:
            t0 = q_start
        else:
            t0 = b * seqlen_q
        part_row = (split.to(tl.int64) * total_q + t0 + tok) * n_heads + h
        tl.store(OutPart + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_ok)
        tl.store(LsePart + part_row, lse2, mask=row_ok)
        if FUSED_MERGE:
            _last_split_merges(Out, Lse, OutPart, LsePart, SplitCounters, Sinks, b64, q_start, t0, q_len, r0,
                               hk, GROUP, offs_d, total_q, n_heads, n_splits, stride_ob, stride_om, stride_oh,
                               stride_lb, stride_lh, HEAD_DIM, D_PAD, BLOCK_M, MERGE_ROWS if MERGE_ROWS else BLOCK_M,
                               MERGE_STEP, HAS_SINKS, NAN_FROM_EMPTY)
    else:
        # flash-attn convention: a row that sees no key has output 0 and lse +inf
        lse = tl.where(empty_row, float("inf"), lse2 * LN2)
        _store_rows(Out, Lse, out, lse, b64, q_start, tok, h, offs_d, q_ok, row_ok,
                    stride_ob, stride_om, stride_oh, stride_lb, stride_lh)


@triton.jit
def _store_rows(Out, Lse, out, lse, b64, q_start, tok, h, offs_d, q_ok, row_ok,
                stride_ob, stride_om, stride_oh, stride_lb, stride_lh):
    """A decode tile's final output rows and their (natural-log) lse."""
    o_rows = Out + (q_start + tok).to(tl.int64) * stride_om + b64 * stride_ob + h * stride_oh
    tl.store(o_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=q_ok)
    tl.store(Lse + b64 * stride_lb + h * stride_lh + q_start + tok, lse, mask=row_ok)


@triton.jit
def _last_split_merges(Out, Lse, OutPart, LsePart, SplitCounters, Sinks, b64, q_start, t0, q_len, r0, hk, GROUP,
                       offs_d, total_q, n_heads, n_splits, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, MERGE_ROWS: tl.constexpr,
                       MERGE_STEP: tl.constexpr, HAS_SINKS: tl.constexpr, NAN_FROM_EMPTY: tl.constexpr = False):
    """After this program stored its partial: count it in its tile's counter (one int32 per program of
    grid axis 0 and sequence, zero before the launch); the program that arrives last merges every
    split's partial of the tile's live rows (r0 on, tokens numbered from t0 over the batch), MERGE_ROWS
    rows at a time, writes Out / Lse, and sets the counter back to 0, so the buffer is zero again after
    every launch (no memset per call; graph replays included).

    Ordering: the barrier puts every thread's partial stores before the counter RMW, which one thread
    issues (a scalar atomic) with release semantics at GPU scope; the last program's RMW acquires
    each earlier program's release, and Triton hands the RMW's result to the other threads through
    shared memory behind a barrier, so the merge's loads see every partial."""
    counter = SplitCounters + b64 * tl.num_programs(0) + tl.program_id(0)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        live_end = r0 + tl.minimum(q_len * GROUP - r0, BLOCK_M)  # (rows past the tile or the tokens: none)
        for c0 in range(r0, live_end, MERGE_ROWS):
            offs_r = c0 + tl.arange(0, MERGE_ROWS)
            row_ok = offs_r < live_end
            tok = offs_r // GROUP
            h = hk * GROUP + offs_r % GROUP
            out, lse = _merge_splits(OutPart, LsePart, (t0 + tok).to(tl.int64) * n_heads + h, row_ok, h,
                                     total_q * n_heads, n_splits, offs_d, Sinks, HEAD_DIM, D_PAD, MERGE_ROWS,
                                     HAS_SINKS, MERGE_STEP, NAN_FROM_EMPTY)
            _store_rows(Out, Lse, out, lse, b64, q_start, tok, h, offs_d,
                        row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), row_ok, stride_ob, stride_om, stride_oh,
                        stride_lb, stride_lh)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # every split has arrived: nobody else touches it


# split_merge_kernel's splits per step (the fused merge's: tuning.decode_merge_step)
MERGE_STEP = tl.constexpr(2)


@triton.jit
def _merge_splits(OutPart, LsePart, rows64, ok, heads, n_rows, n_splits, offs_d, Sinks,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr,
                  STEP: tl.constexpr, NAN_FROM_EMPTY: tl.constexpr = False):
    """(out, lse) of rows `rows64` (token * n_heads + head, `ok` the live ones; `heads` their query heads)
    merged over the n_splits partials of OutPart / LsePart (split-major, n_rows rows per split):
    out = sum_s w_s OutPart[s], w_s = 2^(LsePart[s] - max) / sum (an empty split, lse -inf, has w 0;
    a sink adds a term without a value row); a row no split saw gets out 0 and lse +inf (flash-attn).
    Online, in split order: STEP splits per step, whose loads depend on nothing computed in the step, so
    each step is one wave of L2 round trips (at batch 1 the last program's merge is a serial tail)."""
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_SINKS:  # one more softmax term per row, with no value row (score_mods.sink_init)
        m = tl.load(Sinks + heads, mask=ok, other=float("-inf")).to(tl.float32) * LOG2E
        den = tl.where(m == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_R, D_PAD], dtype=tl.float32)
    d_ok = offs_d[None, :] < HEAD_DIM
    for s0 in range(0, n_splits, STEP):
        for j in tl.static_range(STEP):
            split = tl.zeros([BLOCK_R], dtype=tl.int32) + (s0 + j)
            row = split.to(tl.int64) * n_rows + rows64
            valid = ok & (split < n_splits)
            lse_s = tl.load(LsePart + row, mask=valid, other=float("-inf"))
            o = tl.load(OutPart + row[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None] & d_ok, other=0.0)
            live = lse_s != float("-inf")  # an empty split left its partial output unwritten: select, not scale
            m_new = tl.maximum(m, lse_s)
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # (nothing live yet: shift by 0, not NaN)
            alpha = tl.exp2(m - m_shift)
            w = tl.where(live, tl.exp2(lse_s - m_shift), 0.0)
            den = den * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * tl.where(live[:, None], o, 0.0)
            if NAN_FROM_EMPTY:
                # a split that saw none of this row's keys still multiplied V's NaN features by zero probabilities:
                # its NaNs join the row, as in the reference (multi-token masked calls)
                acc = acc + tl.where(live[:, None] | (o == o), 0.0, o)
            m = m_new
    empty = den == 0.0
    out = acc / tl.where(empty, 1.0, den)[:, None]
    lse = tl.where(empty, float("inf"), (tl.where(m == float("-inf"), 0.0, m) + tl.log2(tl.where(empty, 1.0, den)))
                   * LN2)
    return out, lse


@triton.jit
def split_merge_kernel(
    Out, Lse, OutPart, LsePart,
    n_rows, n_heads, rows_per_seq, n_splits,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
    Sinks=None, HAS_SINKS: tl.constexpr = False, NAN_FROM_EMPTY: tl.constexpr = False,
):
    """Out[token, head] = sum_s w_s OutPart[s], w_s = 2^(LsePart[s] - max) / sum (empty splits: w 0).

    Rows are (token, head) pairs; a token t is (sequence t // rows_per_seq, position t % rows_per_seq)
    (rows_per_seq = seqlen_q for dense q, and = total tokens for varlen q, whose Out has no batch axis)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D_PAD)
    ok = offs_r < n_rows
    out, lse = _merge_splits(OutPart, LsePart, offs_r.to(tl.int64), ok, offs_r % n_heads, n_rows, n_splits, offs_d,
                             Sinks, HEAD_DIM, D_PAD, BLOCK_R, HAS_SINKS, MERGE_STEP, NAN_FROM_EMPTY)
    d_ok = offs_d[None, :] < HEAD_DIM
    t = offs_r // n_heads
    h = offs_r % n_heads
    seq = (t // rows_per_seq).to(tl.int64)
    pos = t % rows_per_seq
    tl.store(Out + seq[:, None] * stride_ob + pos[:, None].to(tl.int64) * stride_om + h[:, None] * stride_oh
             + offs_d[None, :], out.to(Out.dtype.element_ty), mask=ok[:, None] & d_ok)
    tl.store(Lse + seq * stride_lb + h * stride_lh + pos, lse, mask=ok)


# --------------------------------------------------------------------------- launchers

# Triton grid axes 1 and 2 (key splits, sequences) hold at most this many programs.
_MAX_GRID_YZ = 65535


def decode_num_splits(programs: int, key_blocks: int, sms: int, policy, requested: int = 0) -> int:
    """Key splits per (KV head, row tile, sequence): `requested` when > 0 (at most one per key block),
    else flash-attn 2's wave-efficiency rule with the family's tables.DECODE_SPLITS parameters."""
    return _num_splits(programs, key_blocks, sms, tuple(policy.items()), requested)


@functools.lru_cache(maxsize=1024)
def _num_splits(programs: int, key_blocks: int, sms: int, policy_items: tuple, requested: int) -> int:
    # memoized: the rule loops over every split count, and decode launches are host-bound
    policy = dict(policy_items)
    key_blocks = max(1, key_blocks)
    if requested > 0:
        return max(1, min(requested, key_blocks, _MAX_GRID_YZ))
    slots = max(1, sms * policy["programs_per_sm"])
    if programs >= policy["full_fraction"] * slots:
        return 1
    most = min(policy["max_splits"], max(1, key_blocks // policy["min_blocks_per_split"]), _MAX_GRID_YZ)
    if most <= 1:
        return 1

    def efficiency(splits):
        waves = programs * splits / slots
        return waves / -(-waves // 1)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= policy["efficiency"] * best)


def _takes_many_tile(rule, programs: int, splits: int, capacity: int, sms: int) -> bool:
    """Whether an unsplit launch of `programs` programs over `capacity` keys takes the DECODE_MANY tile (`rule`:
    tuning.decode_many_rule's (min programs per SM, max keys), or None)."""
    return rule is not None and splits == 1 and programs >= rule[0] * sms and capacity <= rule[1]


# the decode and append kernels' descale tensor parameters (each call's own tensors: a plan's replay slots)
_DESCALE_PARAMS = ("QDescale", "KDescale", "VDescale")


def _descale_tensors(descale) -> dict:
    """The descale tensor arguments of an FP8 call (parameter name -> tensor; none without FP8)."""
    return {} if descale is None else dict(zip(_DESCALE_PARAMS, descale))


def _descale_layout(descale):
    """The descales' strides (the kernels take them as ints), for a plan's key; None without FP8."""
    return None if descale is None else tuple(t.stride() for t in descale)


def _fp8_kwargs(cache, descale):
    """The FP8 kernels' extra launch arguments for an FP8 cache with its descales (none otherwise:
    launches without them compile to the same code as before FP8 existed): the three tensors, read in
    place (score_mods.load_head_descales), and their (batch, KV head) strides."""
    if descale is None:
        return {}
    return dict(descale_args(*descale), FP8_MAX=float(torch.finfo(cache.dtype).max))


def kv_append(k, v, k_cache, v_cache, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table,
              rotary_cos, rotary_sin, rotary_interleaved, cfg, descale=None):
    """Writes k/v (batch, seqlen_new, hk, d) into the caches at cache_seqlens (tensor, else the int),
    through cache_batch_idx or the block table, rotating k when rotary_cos/sin are given.  No sync.
    FP8 caches come with `descale`, the fp32 (q, k, v) descales, each (batch, hk) at any strides:
    high-precision k/v are quantised with the k and v ones (module doc)."""
    batch, seqlen_new, hk, d = k.shape
    if batch == 0 or seqlen_new == 0 or hk == 0:
        return
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    rotary = rotary_cos is not None
    kv_append_kernel[(cdiv(seqlen_new, cfg["BLOCK_M"]), hk, batch)](
        k, v, k_cache, v_cache,
        cache_seqlens if cache_seqlens is not None else k,
        cache_batch_idx if cache_batch_idx is not None else k,
        block_table if paged else k,
        rotary_cos if rotary else k, rotary_sin if rotary else k,
        seqlen_new, cache_seqlens_int or 0, capacity, k_cache.shape[0], page_size,
        *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if paged else 0,
        rotary_cos.stride(0) if rotary else 0, rotary_cos.shape[1] if rotary else 0,
        rotary_cos.shape[0] if rotary else 1,
        HEAD_DIM=d, D_PAD=head_dim_padded(d), BLOCK_T=cfg["BLOCK_M"],
        SEQLENS_TENSOR=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None, PAGED=paged,
        ROTARY=rotary, ROTARY_INTERLEAVED=bool(rotary_interleaved), **_fp8_kwargs(k_cache, descale),
        **{k_: v_ for k_, v_ in cfg.items() if k_ != "BLOCK_M"})


_SMS = {}


def _sms(q) -> int:
    """arch.num_sms, remembered per device (decode launches are host-bound)."""
    key = q.device
    if key not in _SMS:
        _SMS[key] = num_sms(q)
    return _SMS[key]


# (device, stream) -> the zeroed int32 split counters of the fused merge (decode_kernel FUSED_MERGE),
# and every buffer a grown one replaced (kept: a captured CUDA/HIP graph may still use it)
_SPLIT_COUNTERS = {}
_RETIRED_COUNTERS = []


def _counters_for(q, n: int, stream, own: bool, capturing=None) -> torch.Tensor:
    """The zeroed split counters of a fused-merge launch: the stream's cached buffer, or (own) a fresh one."""
    return torch.zeros(n, dtype=torch.int32, device=q.device) if own else _split_counters(q, n, stream, capturing)


def _current_stream(q):
    """The raw handle of the stream a launch goes to (the current device's current stream, as Triton's
    launcher looks it up), once per decode call: the counters' key and the replayed launches share it."""
    return current_stream() if q.is_cuda else None


def _split_counters(q, n: int, stream=None, capturing=None) -> torch.Tensor:
    """At least n int32 counters, all zero, for a fused-merge decode launch on q's device and stream.

    The kernel leaves them zero (its last split program of each tile resets its counter), so one
    buffer serves every later launch, and a launch captured into a graph stays right at each replay,
    with no memset per call.  One buffer per stream, as launches on two streams may run at once and
    must not share counters.  A graph uses the buffer of the stream it was captured on: graphs
    captured on one stream must not be replayed at the same time as each other, or as decode calls
    on that stream (replays one after another on any stream are fine).  Grown (outside capture) to
    the next power of two, the old buffer kept alive (a graph may hold it); a capture that needs a
    bigger buffer than its stream has gets a fresh zeroed one (the memset is captured with the graph,
    so it is right at every replay) that nothing else uses.  `capturing`: whether the stream is
    capturing, where the caller has asked already."""
    if stream is None:
        stream = _current_stream(q)
    if capturing is None:
        capturing = stream is not None and torch.cuda.is_current_stream_capturing()
    return kept_zeros(_SPLIT_COUNTERS, _RETIRED_COUNTERS, (q.device, stream), n, q.device, capturing=capturing)


def _rotated_q(q, cos, sin, interleaved, per_token, cache_seqlens, cache_seqlens_int):
    """q (b, sq, h, d) rotated at cache_seqlens (+ i per token), on the device, by the fused rotary kernel."""
    batch, seqlen_q = q.shape[:2]
    if cache_seqlens is not None:
        base = cache_seqlens.to(torch.int64).clamp_min(0)[:, None]
    else:
        base = torch.full((batch, 1), cache_seqlens_int or 0, dtype=torch.int64, device=q.device)
    pos = base + (torch.arange(seqlen_q, device=q.device)[None, :] if per_token else 0)
    pos = pos.expand(batch, seqlen_q).clamp(0, cos.shape[0] - 1)
    # rotary.py reads the first half of HF-style (b, s, rotary_dim) tables
    cos_full, sin_full = (torch.cat([t[pos], t[pos]], dim=-1) for t in (cos, sin))
    return rotary_forward(q, cos_full, sin_full, interleaved)


class _DecodePlan(NamedTuple):
    """Everything a decode launch computes from shapes, strides, dtypes and scalars (not from tensor
    data): memoized per call structure (_PLANS), so a steady decode loop only allocates and launches."""
    out_shape: tuple
    out_dtype: torch.dtype
    lse_shape: tuple
    part_shapes: Optional[tuple]  # (out_part, lse_part) shapes when the keys are split
    grid: tuple
    ints: tuple  # the decode kernel's arguments after its tensors
    kwargs: dict  # its constexprs, tiles and launch options (the fitted config)
    merge_grid: tuple
    merge_ints: tuple
    merge_kwargs: dict
    counters: int  # split counters the fused merge needs (_split_counters); 0: a merge launch, or no split
    replays: dict  # "decode" / "merge" -> the CompiledLaunch that replays that launch (_launch_replayed)


# call structure -> _DecodePlan (see decode_forward); one entry per (shapes, dtypes, options) in use
_PLANS = {}
_MAX_PLANS = 256


def filed_plan(key) -> Optional[_DecodePlan]:
    """The decode plan filed under `key` (a caller's plan_key, or an alias_key of decode_forward), or None."""
    return _PLANS.get(key)


def run_filed_plan(plan: _DecodePlan, q, k_cache, v_cache, cache_seqlens=None, block_table=None, need_lse=False):
    """(out, lse) of a call whose plan is `plan` (filed_plan): what decode_forward does on a plan hit, for a
    plain call (no leftpad, batch index, key mask, sinks or descales; lse None unless need_lse).  The launch
    reads the tensors only through their storage (data pointer, dtype, device; the plan holds shapes and
    strides), so any views of the planned tensors' storage will do."""
    return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, None, None, block_table, None, None, None,
                     need_lse=need_lse)


def _remember(memo: dict, key, value):
    """memo[key] = value in one of the plan memos (_PLANS, _RESIZABLE, _GROWABLE), which hold at most _MAX_PLANS
    entries (a full one starts over); returns value."""
    if len(memo) >= _MAX_PLANS:
        memo.clear()
    memo[key] = value
    return value


def _decode_tensors(q, k_cache, v_cache, out, lse, out_part, lse_part, cu_seqlens_q, cache_seqlens, cu_seqlens_k,
                    seqused_k, cache_leftpad, cache_batch_idx, block_table, key_mask, rotary_cos, rotary_sin,
                    alibi_slopes):
    """The decode kernel's tensor arguments in order (q stands in for the absent ones)."""
    # (conditional expressions, not a helper: a call per argument was a tenth of a replayed call's host time)
    return (q, k_cache, v_cache, out, lse, out_part, lse_part, q if cu_seqlens_q is None else cu_seqlens_q,
            q if cache_seqlens is None else cache_seqlens, q if cu_seqlens_k is None else cu_seqlens_k,
            q if seqused_k is None else seqused_k, q if cache_leftpad is None else cache_leftpad,
            q if cache_batch_idx is None else cache_batch_idx, q if block_table is None else block_table,
            q if key_mask is None else key_mask, q if rotary_cos is None else rotary_cos,
            q if rotary_sin is None else rotary_sin, q if alibi_slopes is None else alibi_slopes)


# the decode kernel's optional tensor parameters, for which _decode_tensors passes q when they are absent
_OPTIONAL_TENSORS = frozenset(decode_kernel.arg_names[decode_kernel.arg_names.index("CuSeqlensQ"):
                                                      decode_kernel.arg_names.index("Alibi") + 1])

# the decode and merge kernels' buffers that _run_plan allocates (or owns) in the plan's sizes: their
# specialisation never changes, so a replay does not check them (CompiledLaunch `fixed`)
_OWN_BUFFERS = frozenset({"Out", "Lse", "OutPart", "LsePart", "SplitCounters"})


def _launch_replayed(plan: _DecodePlan, name: str, kernel, grid, tensors, ints, kwargs, extra, stream=None):
    """kernel[grid](*tensors, *ints, **kwargs, **extra) through the plan's replayed CompiledLaunch of
    it when Triton would specialise these tensors as it did the first time, else through the JIT
    (whose CompiledKernel then becomes the plan's replay).  tensors[0] (q) stands in for the absent
    tensor arguments, which the plan's structure fixes."""
    call = tensors + tuple(extra.values())
    replay = plan.replays.get(name)
    if replay is not None and replay.run(call, stream):
        return
    compiled = kernel[grid](*tensors, *ints, **kwargs, **extra)
    if isinstance(compiled, CompiledKernel):  # (not the interpreter's or an AOT recorder's launch)
        names = tuple(kernel.arg_names[:len(tensors)]) + tuple(extra)
        # q in an optional tensor's slot stands in for it (_decode_tensors; the plan's structure says which are
        # absent).  Only there: a call whose k_cache is q names the same object in a slot that later calls fill
        # with other tensors, and no plan key tells the two apart.
        standins = {n for n, t in zip(names, call) if t is tensors[0] and n in _OPTIONAL_TENSORS}
        fixed = standins | (_OWN_BUFFERS & set(names))
        plan.replays[name] = CompiledLaunch(kernel, compiled, grid, tensors + ints, dict(kwargs, **extra), names,
                                            arch_for(tensors[0]).is_hip, fixed,
                                            same_as=[0 if n in standins else i for i, n in enumerate(names)])


# the names of the decode kernel's arguments after its tensors, in order: _DecodePlan.ints
_DECODE_INT_NAMES = tuple(decode_kernel.arg_names[decode_kernel.arg_names.index("seqlen_q"):])
_DECODE_INT_INDEX = {name: i for i, name in enumerate(_DECODE_INT_NAMES)}


class _Resizable(NamedTuple):
    """A dense-cache plan and what its split count came from: a call that differs from it only in the
    cache's capacity (and the strides and per-key mask width that follow it) replays it with those ints
    changed, as long as the split rule gives the same count (_resized_plan)."""
    plan: _DecodePlan
    policy: dict  # the split rule's parameters (get_decode_split_policy)
    programs: int  # programs per split the rule counted
    block_n: int  # the table tile's key block the rule counted key blocks in
    many_rule: Optional[tuple]  # the DECODE_MANY rule in force (decode_many_rule), and whether the plan took its tile
    many: bool


# capacity-free structure (+ the sized ints' specialisation, the window flag) -> _Resizable.  Transformers'
# dynamic cache hands over one more key every step: without this, the first layer of each step built a
# plan through the JIT (launch + binding, ~100-200 us of host time) and the second replayed it through the
# JIT once more to make its CompiledLaunch.
_RESIZABLE = {}

# a caller's capacity-free key (decode_forward's grow_key) -> _Growable: what a later call of that key, which differs
# only in the dense cache's capacity, needs to find its plan through _resized_plan without the glue above
# decode_forward (Transformers' dynamic cache grows by a key each step: its first layer's call missed the step's
# filed plan and took the full path, ~7x a filed step's host time)
_GROWABLE = {}


class _Growable(NamedTuple):
    structure: tuple  # decode_forward's capacity-free key of the call that filed it
    window_left: int
    num_splits: int
    fused_merge_families: tuple  # tables.DECODE_FUSED_MERGE_FAMILIES then (in `structure` too)


def forget_plans():
    """Drop every memoized decode plan and kept scratch set (tests and A/B scripts: the next call takes the
    full path)."""
    _PLANS.clear()
    _RESIZABLE.clear()
    _GROWABLE.clear()
    _SCRATCH.clear()


def grown_plan(grow_key, q, k_cache, v_cache, alias_key):
    """The plan of a dense, whole-cache call (no cache_seqlens) that differs from the one decode_forward filed
    under `grow_key` only in the cache's capacity and the strides that follow it, filed under `alias_key` too; or
    None (the caller then takes the full path).  q, k_cache, v_cache: the call's flash-layout tensors."""
    entry = _GROWABLE.get(grow_key)
    if entry is None or entry.fused_merge_families != tables.DECODE_FUSED_MERGE_FAMILIES:
        return None
    sized = _sized_ints(k_cache, v_cache, None, whole_cache=True)
    return _resized_plan(entry.structure, sized, q, entry.window_left, entry.num_splits, alias_key)


def _sized_ints(k_cache, v_cache, key_mask, whole_cache: bool):
    """The decode kernel's int arguments that follow a dense cache's capacity, by parameter name
    (whole_cache: no cache_seqlens tensor or int, every key of the cache is attended)."""
    capacity = k_cache.shape[1]
    sized = dict(capacity=capacity, stride_kb=k_cache.stride(0), stride_kn=k_cache.stride(1),
                 stride_kh=k_cache.stride(2), stride_vb=v_cache.stride(0), stride_vn=v_cache.stride(1),
                 stride_vh=v_cache.stride(2))
    if whole_cache:  # (decode_forward passes the capacity as cache_seqlens_int)
        sized["cache_seqlens_int"] = capacity
    if key_mask is not None:
        sized["stride_kmb"] = key_mask.stride(0)
    return sized


def _resizable_key(structure, sized, window_left):
    # the same Triton specialisation of every sized int, and the same left-window flag (score_args:
    # a window narrower than the cache switches HAS_LEFT on), guarantee the same compiled kernel
    return structure, tuple(int_specialization(v) for v in sized.values()), 0 <= window_left < sized["capacity"] - 1


def _resized_plan(structure, sized, q, window_left, num_splits, plan_key):
    """The plan of a dense-cache call whose capacity differs from a planned one's (its _sized_ints `sized`),
    or None (_Resizable)."""
    entry = _RESIZABLE.get(_resizable_key(structure, sized, window_left))
    if entry is None:
        return None
    plan = entry.plan
    splits = decode_num_splits(entry.programs, cdiv(sized["capacity"], entry.block_n), _sms(q), entry.policy,
                               num_splits)
    if splits != plan.grid[1] or _takes_many_tile(entry.many_rule, entry.programs, splits, sized["capacity"],
                                                  _sms(q)) != entry.many:
        return None
    ints = list(plan.ints)
    for name, value in sized.items():
        ints[_DECODE_INT_INDEX[name]] = value
    ints = tuple(ints)
    replays = dict(plan.replays)
    if "decode" in replays:
        replays["decode"] = replays["decode"].patched(sized)
    return _remember(_PLANS, plan_key, plan._replace(ints=ints, replays=replays))


# (device index, stream, lse shape, partial shapes) -> the scratch buffers that planned decode launches of those
# shapes share on that stream (_plan_buffers): at most _MAX_SCRATCH_SETS sets of at most _MAX_KEPT_SCRATCH
# bytes each (a long-query or wide split call's partials can reach 100s of MB: those are not kept)
_SCRATCH = {}
_MAX_SCRATCH_SETS = 16
_MAX_KEPT_SCRATCH = 4 << 20


def _new_buffers(plan: _DecodePlan, q):
    """(lse, out_part, lse_part) of a plan's launch, freshly allocated; without split the partial
    buffers are the lse (stand-ins the kernel does not touch)."""
    lse = new_output(q, plan.lse_shape, torch.float32)
    if plan.part_shapes is None:
        return lse, lse, lse
    return (lse, torch.empty(plan.part_shapes[0], dtype=torch.float32, device=q.device),
            torch.empty(plan.part_shapes[1], dtype=torch.float32, device=q.device))


def _plan_buffers(plan: _DecodePlan, q, stream, need_lse: bool, fresh: bool):
    """(lse, out_part, lse_part) of a plan's launch.  The split partials -- and the lse, when the caller
    does not read it (Transformers' route, flash_attn_with_kvcache without return_softmax_lse) -- are
    scratch that the launch writes before it reads them, so a plan keeps one set per stream and reuses
    it call after call: a CUDA allocation costs ~7 us of host time on the H100's host, as much as a
    tenth of a decode call (.ci/decode_pieces.py).  Launches on one stream run in order, so plans of
    the same buffer shapes share one set per stream (_SCRATCH; a CPU call's "stream" is None) -- but only
    where one launch both writes and reads them: with a merge launch after the decode launch, another
    thread's call on the same stream could land between the two and overwrite the partials.  `fresh`
    (the custom op under torch.compile, or graph capture: the graph owns its buffers): new buffers."""
    two_launches = plan.part_shapes is not None and not plan.counters
    if fresh or two_launches:
        return _new_buffers(plan, q)
    key = (q.get_device(), stream, plan.lse_shape, plan.part_shapes)
    kept = _SCRATCH.get(key)
    if kept is None:
        kept = _new_buffers(plan, q)
        if 4 * sum(t.numel() for t in {id(t): t for t in kept}.values()) <= _MAX_KEPT_SCRATCH:
            if len(_SCRATCH) >= _MAX_SCRATCH_SETS:
                _SCRATCH.clear()  # (launches still in flight keep theirs: the allocator reuses per stream)
            _SCRATCH[key] = kept
    if not need_lse:
        return kept
    lse = new_output(q, plan.lse_shape, torch.float32)
    return (lse, lse, lse) if plan.part_shapes is None else (lse, kept[1], kept[2])


def _dtype_of(t):
    """A tensor argument's dtype for a plan key, None for an absent one: the compiled kernel reads int32 and
    int64 index tensors (and uint8 / bool masks) differently, so a plan made for one must not launch with
    another."""
    return None if t is None else t.dtype


def _run_plan(plan: _DecodePlan, q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
              key_mask, sinks, descale, own_counters=False, need_lse=True):
    stream = _current_stream(q)
    capturing = stream is not None and torch.cuda.is_current_stream_capturing()  # (asked once per call)
    out = new_output(q, plan.out_shape, plan.out_dtype)
    lse, out_part, lse_part = _plan_buffers(plan, q, stream, need_lse, own_counters or capturing)
    tensors = _decode_tensors(q, k_cache, v_cache, out, lse, out_part, lse_part, None, cache_seqlens, None, None,
                              cache_leftpad, cache_batch_idx, block_table, key_mask, None, None, None)
    extra = {}
    if sinks is not None:
        extra["Sinks"] = sinks
    extra.update(_descale_tensors(descale))
    if plan.counters:
        extra["SplitCounters"] = _counters_for(q, plan.counters, stream, own_counters, capturing)
    _launch_replayed(plan, "decode", decode_kernel, plan.grid, tensors, plan.ints, plan.kwargs, extra, stream)
    if plan.part_shapes is not None and not plan.counters:
        _launch_replayed(plan, "merge", split_merge_kernel, plan.merge_grid, (out, lse, out_part, lse_part),
                         plan.merge_ints, plan.merge_kwargs, {"Sinks": sinks} if sinks is not None else {}, stream)
    return out, (lse if need_lse else None)


def decode_forward(q, k_cache, v_cache, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                   cu_seqlens_q=None, max_seqlen_q=None, cache_seqlens=None, cache_seqlens_int=None, seqlen_new=0,
                   cu_seqlens_k=None, seqused_k=None, cache_leftpad=None, cache_batch_idx=None, block_table=None,
                   key_mask=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                   rotary_per_token=False, num_splits=0, sinks=None, descale=None, out_dtype=None, plan_key=None,
                   own_counters=False, need_lse=True, alias_key=None, grow_key=None):
    """Split-KV attention of q over a KV cache; returns (out, softmax_lse).  Arguments are trusted
    (fa_amd.kvcache checks them); device values are clamped in the kernels.

    q: (batch, seqlen_q, hq, d), or (total_q, hq, d) with cu_seqlens_q / max_seqlen_q.
    k_cache / v_cache: (batch_cache, capacity, hk, d) rows; with block_table (batch, pages per
    sequence) (num_pages, page_size, hk, d) pages; with cu_seqlens_k and no block table, packed
    (total_k, hk, d) keys.  Keys of sequence b: cache_seqlens[b] (or cache_seqlens_int, or the whole
    capacity) + seqlen_new already-appended ones, or cu_seqlens_k / seqused_k lengths; from
    cache_leftpad[b] on; key_mask (batch, >= keys) uint8 drops single keys; sinks: fp32 (hq,)
    learnable sink logits.  lse: (batch, hq, seqlen_q) fp32, (hq, total_q) for varlen q.
    FP8 caches (q FP8 of their type, or high precision) come with `descale`, the fp32 (q, k, v) descales per
    sequence and KV head, each (batch, hk) at any strides (read in place), and out_dtype (fa_amd.fp8 checks
    them).

    Decode is host-bound at small batches: the common call (dense or paged cache, with or without a
    per-key mask -- Transformers' decode route; no rotary, ALiBi or varlen) reuses a memoized
    _DecodePlan and only allocates and launches.  `plan_key`: the caller's key of such a call, which
    must determine everything this function's own key holds (fa_amd.kvcache's plain calls).
    `own_counters`: a split call with the fused merge takes freshly zeroed counters of its own instead
    of the stream's cached buffer (the custom op under torch.compile: a buffer first made inside
    cudagraph trees' warm-up would live in their memory pool, which they refuse); it also takes fresh scratch
    buffers (_plan_buffers).  `need_lse` False: the caller does not read the lse, which may then be scratch;
    None is returned for it.  `alias_key`: a second key to file this call's plan under, for later calls to pass
    as their `plan_key` (it must determine everything this function's own key holds: Transformers' decode
    step, integrations/hf_attention._decode_step_key).  `grow_key`: a capacity-free key under which a dense,
    whole-cache call remembers its structure, so that a later call differing only in the cache's capacity can take
    grown_plan(grow_key, ...) (Transformers' dynamic cache: integrations/hf_attention._decode_grow_key).
    """
    structure = sized = None  # this function's own key's capacity-free part, for a dense cache (_RESIZABLE)
    whole_cache = cache_seqlens is None and cache_seqlens_int is None
    if plan_key is None and (rotary_cos is None and alibi_slopes is None and cu_seqlens_q is None
                             and cu_seqlens_k is None and seqused_k is None):
        structure = (q.shape, q.stride(), q.dtype, q.device, arch_for(q), k_cache.shape[0], k_cache.shape[2:],
                     k_cache.dtype, None if block_table is None else (block_table.shape, block_table.stride()),
                     _dtype_of(key_mask), _dtype_of(cache_seqlens), cache_seqlens_int,
                     seqlen_new, _dtype_of(cache_leftpad), _dtype_of(cache_batch_idx),
                     _dtype_of(block_table), sinks is None, _descale_layout(descale),
                     out_dtype, softmax_scale, window_left, window_right, softcap, num_splits,
                     tables.DECODE_FUSED_MERGE_FAMILIES)
        plan_key = (structure, k_cache.shape[1], k_cache.stride(), v_cache.stride(),
                    None if key_mask is None else (key_mask.shape, key_mask.stride()))
        if block_table is not None:
            structure = None  # a paged call's capacity is its block table's (in the key)
        elif grow_key is not None and whole_cache and (key_mask is None and sinks is None and descale is None
                                                       and cache_leftpad is None and cache_batch_idx is None):
            # (what run_filed_plan runs: no per-call tensors but q and the caches)
            _remember(_GROWABLE, grow_key, _Growable(structure, window_left, num_splits,
                                                     tables.DECODE_FUSED_MERGE_FAMILIES))
    if plan_key is not None:
        plan = _PLANS.get(plan_key)
        if plan is None and structure is not None:
            sized = _sized_ints(k_cache, v_cache, key_mask, whole_cache)
            plan = _resized_plan(structure, sized, q, window_left, num_splits, plan_key)
        if plan is not None:
            if alias_key is not None:
                _remember(_PLANS, alias_key, plan)
            return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                             key_mask, sinks, descale, own_counters, need_lse)
    q_varlen = cu_seqlens_q is not None
    if q_varlen:
        total_q, hq, d = q.shape
        batch = cu_seqlens_q.numel() - 1
        seqlen_q = max_seqlen_q
    else:
        batch, seqlen_q, hq, d = q.shape
        total_q = batch * seqlen_q
    paged = block_table is not None
    packed = cu_seqlens_k is not None and not paged
    hk = k_cache.shape[-2]
    group = hq // hk
    out = new_output(q, q.shape, out_dtype)
    lse = new_output(q, (hq, total_q) if q_varlen else (batch, hq, seqlen_q), torch.float32)
    if batch == 0 or seqlen_q == 0 or total_q == 0:
        if q_varlen:  # no program runs: every token gets what the tail below gets (rows that see no key)
            out.zero_()
            lse.fill_(float("inf"))
        return out, (lse if need_lse else None)
    if paged:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
        kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    elif packed:
        page_size, capacity = 1, k_cache.shape[0]
        kv_strides = (0, k_cache.stride(0), k_cache.stride(1), 0, v_cache.stride(0), v_cache.stride(1))
    else:
        page_size, capacity = 1, k_cache.shape[1]
        kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    if cu_seqlens_k is not None:
        k_lens = 2
    elif cache_seqlens is not None:
        k_lens = 1
    else:
        k_lens = 0
        if cache_seqlens_int is None:  # the whole cache
            cache_seqlens_int, seqlen_new = capacity, 0
    d_pad = head_dim_padded(d, fp8=descale is not None)
    arch = arch_for(q)
    fp8 = descale is not None  # an FP8 KV cache: the tables' FP8 overrides (tables.DECODE_FP8)
    cfg = get_decode_config(arch, d_pad, q.dtype == torch.float32, fp8=fp8)["decode"]
    wide = seqlen_q * group > cfg["BLOCK_M"]
    if wide:
        cfg = get_decode_config(arch, d_pad, q.dtype == torch.float32, wide=True, fp8=fp8)["decode"]
    programs = batch * hk * cdiv(seqlen_q * group, cfg["BLOCK_M"])  # (per split)
    table_tile = not (wide or fp8 or q.dtype == torch.float32)
    policy = get_decode_split_policy(arch, d_pad, table_tile=table_tile)
    block_n = cfg["BLOCK_N"]  # (what the split rule counts key blocks in, whichever tile runs)
    sms = _sms(q)
    splits = decode_num_splits(programs, cdiv(capacity, block_n), sms, policy, num_splits)
    many_rule = decode_many_rule(arch, d_pad) if table_tile else None
    many = _takes_many_tile(many_rule, programs, splits, capacity, sms)
    if many:
        cfg = get_decode_config(arch, d_pad, many=True)["decode"]
    scalars, flags, _ = score_args(q, alibi_slopes, None, 0.0, softmax_scale, window_left, window_right, softcap,
                                   seqlen_q, capacity)
    flags.pop("HAS_DROPOUT")
    rotary = rotary_cos is not None
    if rotary and cfg["RELOAD_CHUNK"]:
        # the reloading kernel streams q from memory: give it q already rotated (kernels/rotary.py)
        q = _rotated_q(q, rotary_cos, rotary_sin, rotary_interleaved, rotary_per_token, cache_seqlens,
                       cache_seqlens_int)
        rotary = False
    split = splits > 1
    if split:
        out_part = torch.empty((splits, total_q, hq, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits, total_q, hq), dtype=torch.float32, device=q.device)
    else:
        out_part = lse_part = lse
    o_strides = (0, out.stride(0), out.stride(1)) if q_varlen else out.stride()[:3]
    l_strides = (0, lse.stride(0)) if q_varlen else (lse.stride(0), lse.stride(1))
    q_strides = (0, q.stride(0), q.stride(1)) if q_varlen else q.stride()[:3]
    tensors = _decode_tensors(q, k_cache, v_cache, out, lse, out_part, lse_part, cu_seqlens_q if q_varlen else None,
                              cache_seqlens, cu_seqlens_k, seqused_k, cache_leftpad, cache_batch_idx,
                              block_table if paged else None, key_mask, rotary_cos if rotary else None,
                              rotary_sin if rotary else None, alibi_slopes)
    ints = (
        seqlen_q, cache_seqlens_int or 0, seqlen_new, capacity, k_cache.shape[0], page_size, splits, total_q, hq,
        *q_strides, *kv_strides, *o_strides, *l_strides,
        block_table.stride(0) if paged else 0, key_mask.stride(0) if key_mask is not None else 0,
        rotary_cos.stride(0) if rotary else 0, scalars["stride_ab"],
        scalars["qk_scale_log2"], scalars["softcap_div"], scalars["softcap_log2"], scalars["win_left"],
        scalars["win_right"], rotary_cos.shape[1] if rotary else 0, rotary_cos.shape[0] if rotary else 1,
    )
    kwargs = dict(GROUP=group, HEAD_DIM=d, D_PAD=d_pad, Q_VARLEN=q_varlen, K_LENS=k_lens, K_PACKED=packed,
                  HAS_SEQUSED=seqused_k is not None, HAS_LEFTPAD=cache_leftpad is not None,
                  HAS_BATCH_IDX=cache_batch_idx is not None, PAGED=paged, HAS_KEY_MASK=key_mask is not None,
                  ROTARY=rotary, ROTARY_INTERLEAVED=bool(rotary_interleaved) and rotary,
                  ROTARY_PER_TOKEN=bool(rotary_per_token) and rotary, SPLIT=split, **flags)
    # sinks only when given: a launch without them compiles to the same code as before they existed
    sink_kwargs = dict(Sinks=sinks, HAS_SINKS=True) if sinks is not None else {}
    kwargs.update(sink_kwargs, **_fp8_kwargs(k_cache, descale))
    if (flags["HAS_LEFT"] or flags["HAS_RIGHT"]) and seqlen_q > 1:
        # several query tokens under a mask: a key split whose keys a row does not see would drop, in the merge,
        # the NaNs its zero probabilities took from V (decode steps of one token compile without it)
        kwargs["NAN_FROM_EMPTY"] = True
    masked_stages = decode_masked_stages(arch, d_pad) if table_tile and not many else 0
    if masked_stages:  # (only when set: launches without it compile to the same code as before it existed)
        kwargs["MASKED_STAGES"] = masked_stages
    # the last split of each tile merges the splits (no merge launch) where the tables say so
    counters = 0
    if split and family_of(arch) in tables.DECODE_FUSED_MERGE_FAMILIES:
        # one counter per (sequence, program of grid axis 0); row tiles are at least 16 rows (launch._shrink)
        counters = batch * hk * cdiv(seqlen_q * group, 16)
        merge_rows, merge_step = decode_merge_step(arch, seqlen_q * group, cfg["BLOCK_M"])
        kwargs.update(SplitCounters=_counters_for(q, counters, None, own_counters), FUSED_MERGE=True,
                      MERGE_ROWS=merge_rows, MERGE_STEP=merge_step)
    # grid axis 0 (KV heads x row tiles) follows the tile actually launched, should `launch` shrink it
    grid0 = lambda c: hk * cdiv(seqlen_q * group, c["BLOCK_M"])  # noqa: E731
    fitted = launch(decode_kernel, cfg, grid0, (splits, batch), tensors + ints, kwargs)
    merge_grid, merge_ints, merge_kwargs = (), (), {}
    if split and not counters:
        merge = get_decode_config(arch, d_pad, q.dtype == torch.float32)["merge"]
        n_rows = total_q * hq
        merge_grid = (cdiv(n_rows, merge["BLOCK_M"]),)
        merge_ints = (n_rows, hq, total_q if q_varlen else seqlen_q, splits, *o_strides, *l_strides)
        merge_kwargs = dict(HEAD_DIM=d, D_PAD=d_pad, BLOCK_R=merge["BLOCK_M"],
                            **{k_: v_ for k_, v_ in merge.items() if k_ != "BLOCK_M"},
                            **({"HAS_SINKS": True} if sinks is not None else {}),
                            **({"NAN_FROM_EMPTY": True} if kwargs.get("NAN_FROM_EMPTY") else {}))
        split_merge_kernel[merge_grid](out, lse, out_part, lse_part, *merge_ints, **merge_kwargs,
                                       **({"Sinks": sinks} if sinks is not None else {}))
    if q_varlen:
        # tokens past cu_seqlens_q[-1] (static buffers) belong to no sequence: output 0, lse +inf, as the
        # prefill kernels give them (rows that see no key); no kernel row writes them, so they are set here (on
        # the device, no sync)
        tail = torch.arange(total_q, device=q.device) >= cu_seqlens_q[-1]
        out.masked_fill_(tail[:, None, None], 0.0)
        lse.masked_fill_(tail[None, :], float("inf"))
    if plan_key is not None and fitted is not None:  # (an AOT recorder's launch returns no config)
        launch_kwargs = {k_: v_ for k_, v_ in kwargs.items()
                         if k_ not in ("Sinks", "SplitCounters") + _DESCALE_PARAMS}
        launch_kwargs.update(BLOCK_M=fitted["BLOCK_M"], BLOCK_N=fitted["BLOCK_N"],
                             **{k_: v_ for k_, v_ in fitted.items() if k_ not in ("BLOCK_M", "BLOCK_N")})
        plan = _remember(_PLANS, plan_key, _DecodePlan(
            tuple(out.shape), out.dtype, tuple(lse.shape),
            (tuple(out_part.shape), tuple(lse_part.shape)) if split else None,
            (grid0(fitted), splits, batch), ints, launch_kwargs, merge_grid, merge_ints, merge_kwargs, counters, {}))
        if structure is not None:  # (sized: computed for the _resized_plan that missed)
            _remember(_RESIZABLE, _resizable_key(structure, sized, window_left),
                      _Resizable(plan, policy, programs, block_n, many_rule, many))
        if alias_key is not None:
            _remember(_PLANS, alias_key, plan)
    return out, (lse if need_lse else None)
