"""FlashAttention-2 backward in Triton, then the plain launcher `attention_backward`.

One dK/dV program per key block (and KV head, or slice of its query-head group).
dQ comes from dQ programs that recompute S and dP -- in the same launch as the
dK/dV programs (FUSED_DQ, where the tables fuse) or in a second kernel -- with no
atomics anywhere (bitwise reproducible), or, where the arch's table prefers it for
deterministic=False, is accumulated with fp32 atomics in the dK/dV programs
(backward_dq_mode).  When a whole-group dK/dV program would leave a long tail
(causal GQA), each program takes one query head and the slices are summed
afterwards: fp32 partials in a fixed order (deterministic), or fp32 atomics where
deterministic=False allows them.  Query blocks are visited in the three ranges of
fa_amd/kernels/blocks.py.

delta = rowsum(dO * O) comes from a preprocess launch, or -- where dQ has a launch of its own and
tables.BWD_DELTA_IN_DQ_FAMILIES lists the arch -- from the dQ programs (DELTA_FROM_O), whose launch then
runs before the dK/dV one.  D_HI: the head-dim chunks of forward.py.

RELOAD_CHUNK (see forward.py): N > 0 reloads every d-wide operand (dK/dV: k, v;
dQ: q, dO) next to the dot that needs it and reduces S and dP N head-dim columns at
a time; 0 keeps them in registers.  With RELOAD_CHUNK=0 every op is built in the
same order as before the switch existed, so the code generated for the other
targets is unchanged (compared asm for sm90 and gfx942).
"""
import torch
import triton
import triton.language as tl

from ..arch import arch_for, num_sms
from ..tuning import bwd_fusable, bwd_preprocess_config, family_of, get_bwd_config, gqa_split_sum, grouped_order, \
    head_dim_chunks, is_short, memo_get, memo_put, nondeterministic_dq, program_group, table_rows
from ..tuning import tables
from .blocks import dot_rows_nt, grouped_program_ids, in_loop, key_ranges, load_cols_t, load_row_tile, query_ranges, \
    store_cols_t, whole_blocks, zero_rows
from .launch import (
    LaunchPlan, alias_pattern, cdiv, even_qk, grid_blocks, head_dim_padded, jit_launch, kernel_args, launch,
    lse_strides, new_output, recording, row_strides, score_args, shape_info)
from .score_mods import LOG2E, alibi_slope_log2, dropout_keep, dropout_seed, score_log2, seq_bounds, \
    sink_grad_rows, tail_start


@triton.jit
def bwd_preprocess_kernel(
    Out, DO, Delta, cu_seqlens_q, seqlen_q,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh, total_q,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    Lse=None, Sinks=None, DSinksPart=None, HAS_SINKS: tl.constexpr = False,
):
    """delta_i = rowsum(dO_i * O_i), the softmax-gradient correction term; with sinks also
    this block's share of d sink_h, one fp32 per program (summed by the launcher in a fixed
    order: deterministic, no atomics)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, _, _ = seq_bounds(cu_seqlens_q, cu_seqlens_q, b, seqlen_q, seqlen_q, total_q, total_q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + b64 * stride_ob + q_start.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m, delta, mask=offs_m < q_len)
    if HAS_SINKS:
        lse = tl.load(Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m, mask=offs_m < q_len,
                      other=float("inf"))
        tl.store(DSinksPart + (b64 * tl.num_programs(1) + h) * tl.num_programs(0) + pid_m,
                 sink_grad_rows(Sinks, h, lse, delta, offs_m < q_len))


@triton.jit
def _bwd_dkdv_inner(dk, dv, dk_hi, dv_hi, k, v, k_hi, v_hi, k_rows, v_rows,
                    Q_head, DO_head, Lse_head, Delta_head, DQ_head, stride_qm, stride_dom, stride_dqm,
                    start, end, cols, offs_m, offs_d, offs_dh, diag, q_len, k_len,
                    qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right, sm_scale,
                    seed, seed_offset, bh, keep_threshold, keep_scale,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASK: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    ATOMIC_DQ: tl.constexpr, RELOAD_CHUNK: tl.constexpr,
                    WANT_DK: tl.constexpr, WANT_DV: tl.constexpr, D_HI: tl.constexpr, COL_BOUNDS: tl.constexpr,
                    skip_at=0, skip=0, SKIPS: tl.constexpr = False, EVEN: tl.constexpr = False):
    # SKIPS: the loop runs the query blocks [start, skip_at) and then [skip_at + skip, end + skip) -- two masked
    # ranges in one loop (DKDV_ONE_MASKED_LOOP), its iteration `it` counting as if they were adjacent.
    # EVEN (EVEN_QK): every query block is whole, so a masked block's loads need no row bounds; only its scores
    # are masked
    ROWS_MASKED: tl.constexpr = MASK and not EVEN
    for it in range(start, end, BLOCK_M):
        start_m = it
        if SKIPS:
            start_m = it + skip * (it >= skip_at).to(tl.int32)
        rows = start_m + offs_m
        if RELOAD_CHUNK:
            # every d-wide operand comes from memory next to the dot that needs it
            Q_rows = Q_head + rows[:, None] * stride_qm
            DO_rows = DO_head + rows[:, None] * stride_dom
            kv_live = cols[:, None] < in_loop(k_len, it, end)
            if ROWS_MASKED:
                q_row_ok = rows[:, None] < q_len
                lse = tl.load(Lse_head + rows, mask=rows < q_len, other=float("inf"))
                delta = tl.load(Delta_head + rows, mask=rows < q_len, other=0.0)
            else:
                q_row_ok = rows[:, None] >= 0  # every row is in range
                lse = tl.load(Lse_head + rows)
                delta = tl.load(Delta_head + rows)
            sT = dot_rows_nt(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), k_rows, kv_live, Q_rows, q_row_ok,
                              HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
        else:
            qT_ptrs = Q_head + rows[None, :] * stride_qm + offs_d[:, None]
            do_ptrs = DO_head + rows[:, None] * stride_dom + offs_d[None, :]
            if COL_BOUNDS and (ROWS_MASKED or D_PAD == HEAD_DIM):
                # DKDV_COL_BOUNDS: addresses from the block's scalar start plus loop-invariant offsets, and past
                # the last row lse = 0 (zero-filled; the score mask below drops those rows): no row vector or
                # lse mask is carried across the software pipeline's stages (sm90: spills at 64x128/w8/s3)
                qT_offs = offs_m[None, :] * stride_qm + offs_d[:, None]
                do_offs = offs_m[:, None] * stride_dom + offs_d[None, :]
                if ROWS_MASKED:
                    rows_left = q_len - start_m
                    qT = tl.load(Q_head + start_m * stride_qm + qT_offs,
                                 mask=(offs_m[None, :] < rows_left) & (offs_d[:, None] < HEAD_DIM), other=0.0)
                    do = tl.load(DO_head + start_m * stride_dom + do_offs,
                                 mask=(offs_m[:, None] < rows_left) & (offs_d[None, :] < HEAD_DIM), other=0.0)
                    lse = tl.load(Lse_head + start_m + offs_m, mask=offs_m < rows_left, other=0.0)
                    delta = tl.load(Delta_head + start_m + offs_m, mask=offs_m < rows_left, other=0.0)
                else:
                    qT = tl.load(Q_head + start_m * stride_qm + qT_offs)
                    do = tl.load(DO_head + start_m * stride_dom + do_offs)
                    lse = tl.load(Lse_head + start_m + offs_m)
                    delta = tl.load(Delta_head + start_m + offs_m)
            elif ROWS_MASKED:
                qT = tl.load(qT_ptrs, mask=(rows[None, :] < q_len) & (offs_d[:, None] < HEAD_DIM), other=0.0)
                do = tl.load(do_ptrs, mask=(rows[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
                # rows past the end get lse=+inf, hence p=0: they add nothing
                lse = tl.load(Lse_head + rows, mask=rows < q_len, other=float("inf"))
                delta = tl.load(Delta_head + rows, mask=rows < q_len, other=0.0)
            else:
                if D_PAD > HEAD_DIM:
                    qT = tl.load(qT_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
                    do = tl.load(do_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
                else:
                    qT = tl.load(qT_ptrs)
                    do = tl.load(do_ptrs)
                lse = tl.load(Lse_head + rows)
                delta = tl.load(Delta_head + rows)
            sT = tl.dot(k, qT, input_precision=INPUT_PRECISION)
            if D_HI:  # the head dim's second chunk (columns D_PAD..)
                qT_hi = load_cols_t(Q_head + rows[None, :] * stride_qm, rows[None, :] < q_len, offs_dh[:, None],
                                    HEAD_DIM, D_PAD + D_HI, ROWS_MASKED)
                do_hi = load_cols_t(DO_head + rows[:, None] * stride_dom, rows[:, None] < q_len, offs_dh[None, :],
                                    HEAD_DIM, D_PAD + D_HI, ROWS_MASKED)
                sT = tl.dot(k_hi, qT_hi, sT, input_precision=INPUT_PRECISION)
        if (MASK and COL_BOUNDS) and not RELOAD_CHUNK:  # (triton 3.2: no chained and)
            sT, tT = score_log2(sT, start_m + offs_m[None, :], cols[:, None], diag, k_len, qk_scale_log2,
                                softcap_div, softcap_log2, slope_log2, win_left, win_right,
                                False, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT)
            # score_log2's masks as [row_lo, row_hi) per key column, in rows from start_m: past the last
            # row (lse 0 there), past the last key, outside the window
            row_hi = q_len - start_m
            if HAS_LEFT:
                row_hi = tl.minimum(row_hi, cols - diag + win_left + 1 - start_m)
            row_hi = tl.where(cols < k_len, row_hi, 0)
            keep = offs_m[None, :] < row_hi[:, None]
            if HAS_RIGHT:
                keep = keep & (offs_m[None, :] >= (cols - diag - win_right - start_m)[:, None])
            sT = tl.where(keep, sT, float("-inf"))
        else:
            sT, tT = score_log2(sT, rows[None, :], cols[:, None], diag, k_len, qk_scale_log2, softcap_div,
                                softcap_log2, slope_log2, win_left, win_right,
                                MASK, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, not EVEN)
        pT = tl.exp2(sT - (lse * LOG2E)[None, :])
        # (WANT_DK / WANT_DV: which accumulators this program holds; both but in DKDV_SPLIT programs)
        if RELOAD_CHUNK:
            if WANT_DK:
                dpT = dot_rows_nt(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), v_rows, kv_live, DO_rows,
                                  q_row_ok, HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
            do = load_row_tile(DO_rows + offs_d[None, :], rows, q_len, offs_d, HEAD_DIM, D_PAD, ROWS_MASKED)
        elif WANT_DK:
            dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            if D_HI:
                dpT = tl.dot(v_hi, tl.trans(do_hi), dpT, input_precision=INPUT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, seed_offset, bh, rows[None, :], cols[:, None], keep_threshold)
            if WANT_DV:
                p_kept = tl.where(keep, pT * keep_scale, 0.0).to(do.dtype)
                dv = tl.dot(p_kept, do, dv, input_precision=INPUT_PRECISION)
                if D_HI:
                    dv_hi = tl.dot(p_kept, do_hi, dv_hi, input_precision=INPUT_PRECISION)
            if WANT_DK:
                dpT = tl.where(keep, dpT * keep_scale, 0.0)
        elif WANT_DV:
            p_op = pT.to(do.dtype)
            dv = tl.dot(p_op, do, dv, input_precision=INPUT_PRECISION)
            if D_HI:
                dv_hi = tl.dot(p_op, do_hi, dv_hi, input_precision=INPUT_PRECISION)
        if WANT_DK:
            dsT = pT * (dpT - delta[None, :])
            if IS_SOFTCAP:
                dsT = dsT * (1.0 - tT * tT)
            if RELOAD_CHUNK:
                q = load_row_tile(Q_rows + offs_d[None, :], rows, q_len, offs_d, HEAD_DIM, D_PAD, ROWS_MASKED)
                dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
            else:
                ds_op = dsT.to(qT.dtype)
                dk = tl.dot(ds_op, tl.trans(qT), dk, input_precision=INPUT_PRECISION)
                if D_HI:
                    dk_hi = tl.dot(ds_op, tl.trans(qT_hi), dk_hi, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ and WANT_DK:
            # non-deterministic fast path: dQ from the same dS tile, summed with
            # fp32 atomics instead of a second pass that recomputes S and dP
            if RELOAD_CHUNK:
                k_op = tl.load(k_rows + offs_d[None, :], mask=kv_live & (offs_d[None, :] < HEAD_DIM), other=0.0)
            else:
                k_op = k
            dq = tl.dot(tl.trans(dsT.to(k_op.dtype)), k_op, input_precision=INPUT_PRECISION) * sm_scale
            dq_ptrs = DQ_head + rows[:, None] * stride_dqm + offs_d[None, :]
            if ROWS_MASKED:
                tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")
            if D_HI:
                dq_hi = tl.dot(tl.trans(dsT.to(k_hi.dtype)), k_hi, input_precision=INPUT_PRECISION) * sm_scale
                tl.atomic_add(DQ_head + rows[:, None] * stride_dqm + offs_dh[None, :], dq_hi,
                              mask=(rows[:, None] < q_len) & (offs_dh[None, :] < HEAD_DIM), sem="relaxed")
    return dk, dv, dk_hi, dv_hi


@triton.jit
def _dkdv_program(
    Q, K, V, DO, Lse, Delta, DK, DV, DQ,
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale,
    total_q, total_k,
    GROUP, heads_per_prog, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, RELOAD_CHUNK: tl.constexpr,
    ATOMIC_DKDV: tl.constexpr, pid_n, pid_h, b, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr, D_HI: tl.constexpr,
    SPLIT_EARLY_RETURN: tl.constexpr, COL_BOUNDS: tl.constexpr, ONE_MASKED_LOOP: tl.constexpr = 0,
    EVEN: tl.constexpr = False,
):
    """The dK/dV program of key block pid_n, axis-1 slot pid_h and sequence b (WANT_DK / WANT_DV: which of the
    two it computes; D_HI: the width of the head dim's second chunk, columns [D_PAD, D_PAD + D_HI), 0 for none;
    SPLIT_EARLY_RETURN: a DKDV_SPLIT program past its sequence returns early too,
    tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES; COL_BOUNDS, ONE_MASKED_LOOP: the kernel switches DKDV_COL_BOUNDS,
    DKDV_ONE_MASKED_LOOP; EVEN: EVEN_QK, whole query and key blocks)."""
    # program axis 1 = KV heads x group slices: this program sums query heads
    # [pid_h * heads_per_prog, +heads_per_prog) and writes dK/dV head pid_h
    # (DK/DV have hk * GROUP / heads_per_prog heads; == hk when unsplit)
    hk = pid_h * heads_per_prog // GROUP
    q_start, q_len, k_start, k_len = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, total_q, total_k,
                                                IS_VARLEN)
    q_len, k_len = whole_blocks(q_len, k_len, BLOCK_M, BLOCK_N, EVEN)
    n0 = pid_n * BLOCK_N
    if (WANT_DK and WANT_DV) or SPLIT_EARLY_RETURN:
        if n0 >= k_len:  # a key block past this sequence (varlen)
            return
    diag = k_len - q_len
    b64 = b.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    if RELOAD_CHUNK:
        k = 0.0  # streamed from memory per query block by _bwd_dkdv_inner
        v = 0.0
        k_rows = (K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
                  + cols[:, None] * stride_kn)
        v_rows = (V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
                  + cols[:, None] * stride_vn)
    else:
        k = load_cols_t(K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
                        + cols[:, None] * stride_kn, cols[:, None] < k_len, offs_d[None, :], HEAD_DIM, D_PAD, not EVEN)
        v = load_cols_t(V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
                        + cols[:, None] * stride_vn, cols[:, None] < k_len, offs_d[None, :], HEAD_DIM, D_PAD, not EVEN)
        k_rows = K  # unused
        v_rows = V  # unused
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    k_hi = 0.0  # D_HI: the second chunk's operands and accumulators
    v_hi = 0.0
    dk_hi = 0.0
    dv_hi = 0.0
    offs_dh = 0
    if D_HI:
        offs_dh = D_PAD + tl.arange(0, D_HI)
        k_hi = load_cols_t(K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
                           + cols[:, None] * stride_kn, cols[:, None] < k_len, offs_dh[None, :], HEAD_DIM,
                           D_PAD + D_HI, True)
        v_hi = load_cols_t(V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
                           + cols[:, None] * stride_vn, cols[:, None] < k_len, offs_dh[None, :], HEAD_DIM,
                           D_PAD + D_HI, True)
        dk_hi = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)
        dv_hi = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)

    seed, seed_offset = dropout_seed(SeedState, HAS_DROPOUT)
    lo, full_lo, full_hi, hi = query_ranges(n0, q_len, k_len, diag, win_left, win_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if not SPLIT_EARLY_RETURN:
        if n0 >= k_len:
            # DKDV_SPLIT (dK or dV only), a key block past this sequence: no query block, every load and store
            # masked off.  Not an early return as above: with one, triton 3.4 / 3.5 kept the split kernel's two
            # calls of this function as real calls on AMD, whose register saves spilled 376-1032 B of scratch
            # (docs/TUNING_NOTES.md v15)
            lo = hi
            full_lo = hi
            full_hi = hi
    num_heads = tl.num_programs(1) * heads_per_prog
    # GQA: this KV head's gradient is the sum over its query heads, done here
    # in registers (no atomics -> deterministic).
    for g in range(heads_per_prog):
        h = pid_h * heads_per_prog + g
        slope_log2 = alibi_slope_log2(Alibi, stride_ab, b, h, HAS_ALIBI)
        bh = b * num_heads + h
        Q_head = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
        DO_head = DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
        Lse_head = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
        Delta_head = Delta + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
        DQ_head = DQ + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh
        if ONE_MASKED_LOOP or HAS_RIGHT:
            # the diagonal's masked query blocks [lo, full_lo); ONE_MASKED_LOOP: the tail's [full_hi, hi) too, in the
            # same loop -- one software pipeline fewer to fill and drain per program (TUNING_NOTES v34)
            masked_end = full_lo
            if ONE_MASKED_LOOP:
                masked_end = full_lo + (hi - full_hi)
            dk, dv, dk_hi, dv_hi = _bwd_dkdv_inner(
                dk, dv, dk_hi, dv_hi, k, v, k_hi, v_hi, k_rows, v_rows, Q_head, DO_head, Lse_head, Delta_head,
                DQ_head, stride_qm, stride_dom, stride_dqm,
                lo, masked_end, cols, offs_m, offs_d, offs_dh, diag, q_len, k_len,
                qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                sm_scale, seed, seed_offset, bh, keep_threshold, keep_scale,
                HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT,
                HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, ATOMIC_DQ, RELOAD_CHUNK, WANT_DK, WANT_DV, D_HI,
                COL_BOUNDS, full_lo, full_hi - full_lo, ONE_MASKED_LOOP, EVEN)
        dk, dv, dk_hi, dv_hi = _bwd_dkdv_inner(
            dk, dv, dk_hi, dv_hi, k, v, k_hi, v_hi, k_rows, v_rows, Q_head, DO_head, Lse_head, Delta_head,
            DQ_head, stride_qm, stride_dom, stride_dqm,
            full_lo, full_hi, cols, offs_m, offs_d, offs_dh, diag, q_len, k_len,
            qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
            sm_scale, seed, seed_offset, bh, keep_threshold, keep_scale,
            HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, False, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT,
            HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, ATOMIC_DQ, RELOAD_CHUNK, WANT_DK, WANT_DV, D_HI,
            COL_BOUNDS, EVEN=EVEN)
        if not ONE_MASKED_LOOP:
            dk, dv, dk_hi, dv_hi = _bwd_dkdv_inner(
                dk, dv, dk_hi, dv_hi, k, v, k_hi, v_hi, k_rows, v_rows, Q_head, DO_head, Lse_head, Delta_head,
                DQ_head, stride_qm, stride_dom, stride_dqm,
                full_hi, hi, cols, offs_m, offs_d, offs_dh, diag, q_len, k_len,
                qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                sm_scale, seed, seed_offset, bh, keep_threshold, keep_scale,
                HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT,
                HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, ATOMIC_DQ, RELOAD_CHUNK, WANT_DK, WANT_DV, D_HI,
                COL_BOUNDS, EVEN=EVEN)
    dk = dk * sm_scale
    # ATOMIC_DKDV: slices of one GQA group add into the group's fp32 dK/dV (KV head hk)
    out_head = pid_h
    if ATOMIC_DKDV:
        out_head = hk
    key_ok = cols[:, None] < k_len
    if WANT_DK:
        dk_rows = (DK + b64 * stride_dkb + k_start.to(tl.int64) * stride_dkn + out_head.to(tl.int64) * stride_dkh
                   + cols[:, None] * stride_dkn)
        store_cols_t(dk_rows, key_ok, offs_d[None, :], dk, HEAD_DIM, D_PAD, not EVEN, ATOMIC_DKDV)
        if D_HI:  # (the second chunk's columns, key-bounded as before EVEN_QK)
            store_cols_t(dk_rows, key_ok, offs_dh[None, :], dk_hi * sm_scale, HEAD_DIM, D_PAD + D_HI, True,
                         ATOMIC_DKDV)
    if WANT_DV:
        dv_rows = (DV + b64 * stride_dvb + k_start.to(tl.int64) * stride_dvn + out_head.to(tl.int64) * stride_dvh
                   + cols[:, None] * stride_dvn)
        store_cols_t(dv_rows, key_ok, offs_d[None, :], dv, HEAD_DIM, D_PAD, not EVEN, ATOMIC_DKDV)
        if D_HI:
            store_cols_t(dv_rows, key_ok, offs_dh[None, :], dv_hi, HEAD_DIM, D_PAD + D_HI, True, ATOMIC_DKDV)


# pairs_per_group: a runtime int (it follows the launch's program count: tuning.program_group), compiled once
@triton.jit(do_not_specialize=["pairs_per_group"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQ,
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale,
    total_q, total_k,
    GROUP, heads_per_prog, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, RELOAD_CHUNK: tl.constexpr,
    ATOMIC_DKDV: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    DKDV_SPLIT: tl.constexpr, D_HI: tl.constexpr = 0, SPLIT_EARLY_RETURN: tl.constexpr = False,
    pairs_per_group=1, GROUPED_ORDER: tl.constexpr = False, DKDV_COL_BOUNDS: tl.constexpr = 0,
    DKDV_ONE_MASKED_LOOP: tl.constexpr = 0, EVEN_QK: tl.constexpr = False,
):
    # EVEN_QK: every sequence's query and key counts are whole multiples of both program kinds' tiles (dense
    # launches whose lengths divide, decided on the host: launch.even_qk); masked blocks then load without bounds
    # D_HI > 0: the head dim in two chunks, columns [0, D_PAD) and [D_PAD, D_PAD + D_HI) (launch.head_dim_chunks);
    # zeroed rows span D_ROW columns
    tl.static_assert(D_HI == 0 or RELOAD_CHUNK == 0)
    D_ROW: tl.constexpr = D_PAD + D_PAD * (D_HI > 0)
    # axis 0 runs the heavy causal programs first (early key blocks, then the late query blocks' dQ), in groups
    # of pairs_per_group (batch, head slot) pairs: tail balance under causal masks
    pid_n, pid_h, b = grouped_program_ids(pairs_per_group, GROUPED_ORDER)
    n_kv_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    if FUSED_DQ:
        # programs past the n_kv_programs dK/dV ones compute dQ (DQ_BLOCK_M query rows of one of
        # this slot's query heads) in the same launch: no second kernel, no atomics, and they fill
        # the GPU beside the longer dK/dV programs (which sum a whole GQA group)
        n_kv_programs = n_kv_blocks * (2 if DKDV_SPLIT else 1)
        if pid_n >= n_kv_programs:
            n_q_blocks = tl.cdiv(seqlen_q, DQ_BLOCK_M)
            j = pid_n - n_kv_programs
            g = j * 0  # (one head per slot: no runtime division)
            if heads_per_prog > 1:
                g = j // n_q_blocks
            _dq_program(Q, K, V, DO, Lse, Delta, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                        stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                        stride_dqb, stride_dqm, stride_dqh, stride_lb, stride_lh,
                        Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
                        qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale, total_q, total_k,
                        GROUP, n_q_blocks - 1 - (j - g * n_q_blocks), pid_h * heads_per_prog + g, b,
                        tl.num_programs(1) * heads_per_prog, HEAD_DIM, D_PAD, DQ_BLOCK_M, DQ_BLOCK_N,
                        IS_VARLEN, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION,
                        RELOAD_CHUNK, D_HI, Q, 0, 0, 0, False, EVEN_QK)
            return
    if IS_VARLEN:
        if b == tl.num_programs(2) - 1:
            # the extra program row: keys past cu_seqlens_k[-1] (static buffers) get dK = dV = 0
            # (ATOMIC_DKDV adds into fp32 buffers that start at zero)
            if not ATOMIC_DKDV:
                n_kv_programs = n_kv_blocks * (2 if DKDV_SPLIT else 1)  # the fused dQ ones returned above
                tail = tail_start(cu_seqlens_k, b, total_k)
                zero_rows(DK + tail.to(tl.int64) * stride_dkn + pid_h.to(tl.int64) * stride_dkh, stride_dkn,
                          total_k - tail, pid_n, n_kv_programs, HEAD_DIM, D_ROW, BLOCK_N)
                zero_rows(DV + tail.to(tl.int64) * stride_dvn + pid_h.to(tl.int64) * stride_dvh, stride_dvn,
                          total_k - tail, pid_n, n_kv_programs, HEAD_DIM, D_ROW, BLOCK_N)
            return
    if DKDV_SPLIT:
        # dK and dV from separate programs (dK: key blocks [0, n_kv_blocks), dV: the next n_kv_blocks),
        # each holding one [BLOCK_N, D_PAD] fp32 accumulator instead of two: half the registers, for
        # S = K Q^T computed twice (5 matmuls per tile pair instead of 4).  At d256 that lets 8 warps
        # take 128-key tiles (a 64-key S tile under 8 warps is computed twice on sm90 anyway).
        if pid_n < n_kv_blocks:
            _dkdv_program(Q, K, V, DO, Lse, Delta, DK, DV, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                          stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                          stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                          stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                          stride_dqb, stride_dqm, stride_dqh, stride_lb, stride_lh,
                          Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
                          qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale, total_q, total_k,
                          GROUP, heads_per_prog, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                          IS_VARLEN, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, HAS_DROPOUT,
                          INPUT_PRECISION, ATOMIC_DQ, RELOAD_CHUNK, ATOMIC_DKDV, pid_n, pid_h, b, True, False, D_HI,
                          SPLIT_EARLY_RETURN, DKDV_COL_BOUNDS, DKDV_ONE_MASKED_LOOP, EVEN_QK)
        else:
            _dkdv_program(Q, K, V, DO, Lse, Delta, DK, DV, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                          stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                          stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                          stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                          stride_dqb, stride_dqm, stride_dqh, stride_lb, stride_lh,
                          Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
                          qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale, total_q, total_k,
                          GROUP, heads_per_prog, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                          IS_VARLEN, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, HAS_DROPOUT,
                          INPUT_PRECISION, ATOMIC_DQ, RELOAD_CHUNK, ATOMIC_DKDV, pid_n - n_kv_blocks, pid_h, b,
                          False, True, D_HI,
                          SPLIT_EARLY_RETURN, DKDV_COL_BOUNDS, DKDV_ONE_MASKED_LOOP, EVEN_QK)
    else:
        _dkdv_program(Q, K, V, DO, Lse, Delta, DK, DV, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                      stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                      stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                      stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                      stride_dqb, stride_dqm, stride_dqh, stride_lb, stride_lh,
                      Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
                      qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale, total_q, total_k,
                      GROUP, heads_per_prog, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                      IS_VARLEN, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, HAS_DROPOUT,
                      INPUT_PRECISION, ATOMIC_DQ, RELOAD_CHUNK, ATOMIC_DKDV, pid_n, pid_h, b, True, True, D_HI,
                      SPLIT_EARLY_RETURN, DKDV_COL_BOUNDS, DKDV_ONE_MASKED_LOOP, EVEN_QK)


@triton.jit
def _bwd_dq_inner(dq, dq_hi, q, do, q_hi, do_hi, q_rows, do_rows, q_len, lse_log2, delta, K_head, V_head, stride_kn,
                  stride_vn, start, end,
                  offs_m, offs_n, offs_d, offs_dh, diag, k_len,
                  qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
                  seed, seed_offset, bh, keep_threshold, keep_scale,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
                  HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  RELOAD_CHUNK: tl.constexpr, D_HI: tl.constexpr, EVEN: tl.constexpr = False):
    COLS_MASKED: tl.constexpr = MASK and not EVEN  # (EVEN: whole key blocks; the window edges are still masked)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if RELOAD_CHUNK:
            # every d-wide operand comes from memory next to the dot that needs it
            q_live = offs_m[:, None] < in_loop(q_len, start_n, end)
            K_rows = K_head + cols[:, None] * stride_kn
            k_row_ok = cols[:, None] < k_len
            s = dot_rows_nt(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), q_rows, q_live, K_rows, k_row_ok,
                             HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
        else:
            k_ptrs = K_head + cols[:, None] * stride_kn + offs_d[None, :]
            vT_ptrs = V_head + cols[None, :] * stride_vn + offs_d[:, None]
            if COLS_MASKED:
                k = tl.load(k_ptrs, mask=(cols[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
                vT = tl.load(vT_ptrs, mask=(cols[None, :] < k_len) & (offs_d[:, None] < HEAD_DIM), other=0.0)
            elif D_PAD > HEAD_DIM:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
                vT = tl.load(vT_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
            else:
                k = tl.load(k_ptrs)
                vT = tl.load(vT_ptrs)
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
            if D_HI:  # the head dim's second chunk (columns D_PAD..)
                k_hi = load_cols_t(K_head + cols[:, None] * stride_kn, cols[:, None] < k_len, offs_dh[None, :],
                                   HEAD_DIM, D_PAD + D_HI, COLS_MASKED)
                vT_hi = load_cols_t(V_head + cols[None, :] * stride_vn, cols[None, :] < k_len, offs_dh[:, None],
                                    HEAD_DIM, D_PAD + D_HI, COLS_MASKED)
                s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision=INPUT_PRECISION)
        s, t = score_log2(s, offs_m[:, None], cols[None, :], diag, k_len, qk_scale_log2, softcap_div,
                          softcap_log2, slope_log2, win_left, win_right,
                          MASK, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, not EVEN)
        p = tl.exp2(s - lse_log2[:, None])
        if RELOAD_CHUNK:
            dp = dot_rows_nt(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), do_rows, q_live,
                              V_head + cols[:, None] * stride_vn, k_row_ok,
                              HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
        else:
            dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
            if D_HI:
                dp = tl.dot(do_hi, vT_hi, dp, input_precision=INPUT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, seed_offset, bh, offs_m[:, None], cols[None, :], keep_threshold)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if IS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if RELOAD_CHUNK:
            k = tl.load(K_rows + offs_d[None, :], mask=k_row_ok & (offs_d[None, :] < HEAD_DIM), other=0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
        if D_HI:
            dq_hi = tl.dot(ds.to(k.dtype), k_hi, dq_hi, input_precision=INPUT_PRECISION)
    return dq, dq_hi


@triton.jit
def _dq_program(
    Q, K, V, DO, Lse, Delta, DQ,
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale, total_q, total_k,
    GROUP, pid_m, h, b, num_heads, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr, D_HI: tl.constexpr,
    Out, stride_ob, stride_om, stride_oh, DELTA_FROM_O: tl.constexpr, EVEN: tl.constexpr = False,
):
    """dQ of query block pid_m of query head h (batch b): loops over the key blocks it sees (D_HI: the
    width of the head dim's second chunk, columns [D_PAD, D_PAD + D_HI), 0 for none).  DELTA_FROM_O: the
    program computes its rows' delta = rowsum(dO * O) itself and stores it for the dK/dV launch that
    follows (no preprocess launch); else it reads the preprocess kernel's.  EVEN: EVEN_QK, whole query and key
    blocks (no row or key bounds on loads and stores)."""
    if IS_VARLEN:
        if b == tl.num_programs(2) - 1:
            # the extra program row: query tokens past cu_seqlens_q[-1] get dQ = 0
            tail = tail_start(cu_seqlens_q, b, total_q)
            zero_rows(DQ + tail.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh, stride_dqm, total_q - tail,
                      pid_m, tl.cdiv(seqlen_q, BLOCK_M), HEAD_DIM, D_PAD + D_PAD * (D_HI > 0), BLOCK_M)
            return
    q_start, q_len, k_start, k_len = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, total_q, total_k,
                                                IS_VARLEN)
    q_len, k_len = whole_blocks(q_len, k_len, BLOCK_M, BLOCK_N, EVEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    diag = k_len - q_len
    hk = h // GROUP
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_mask = offs_m < q_len
    qd_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    if RELOAD_CHUNK:
        q = 0.0  # streamed from memory per key block by _bwd_dq_inner
        do = 0.0
        q_rows = (Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
                  + offs_m[:, None] * stride_qm)
        do_rows = (DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
                   + offs_m[:, None] * stride_dom)
    else:
        q = load_cols_t(Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
                        + offs_m[:, None] * stride_qm, row_mask[:, None], offs_d[None, :], HEAD_DIM, D_PAD, not EVEN)
        do = load_cols_t(DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
                         + offs_m[:, None] * stride_dom, row_mask[:, None], offs_d[None, :], HEAD_DIM, D_PAD, not EVEN)
        q_rows = Q  # unused
        do_rows = DO  # unused
    q_hi = 0.0  # D_HI: the second chunk's operands and accumulator
    do_hi = 0.0
    dq_hi = 0.0
    offs_dh = 0
    if D_HI:
        offs_dh = D_PAD + tl.arange(0, D_HI)
        q_hi = load_cols_t(Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
                           + offs_m[:, None] * stride_qm, row_mask[:, None], offs_dh[None, :], HEAD_DIM, D_PAD + D_HI,
                           not EVEN)
        do_hi = load_cols_t(DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
                            + offs_m[:, None] * stride_dom, row_mask[:, None], offs_dh[None, :], HEAD_DIM,
                            D_PAD + D_HI, not EVEN)
        dq_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
    lse_off = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    if EVEN:
        lse_log2 = tl.load(Lse + lse_off) * LOG2E
    else:
        lse_log2 = tl.load(Lse + lse_off, mask=row_mask, other=float("inf")) * LOG2E
    if DELTA_FROM_O:
        o_rows = (Out + b64 * stride_ob + q_start.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
                  + offs_m[:, None] * stride_om)
        o = tl.load(o_rows + offs_d[None, :], mask=qd_mask, other=0.0)
        if RELOAD_CHUNK:
            do_tile = tl.load(do_rows + offs_d[None, :], mask=qd_mask, other=0.0)
        else:
            do_tile = do
        delta = tl.sum(o.to(tl.float32) * do_tile.to(tl.float32), 1)
        if D_HI:
            o_hi = load_cols_t(o_rows, row_mask[:, None], offs_dh[None, :], HEAD_DIM, D_PAD + D_HI, True)
            delta += tl.sum(o_hi.to(tl.float32) * do_hi.to(tl.float32), 1)
        tl.store(Delta + lse_off, delta, mask=row_mask)
    elif EVEN:
        delta = tl.load(Delta + lse_off)
    else:
        delta = tl.load(Delta + lse_off, mask=row_mask, other=0.0)
    K_head = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    V_head = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh

    slope_log2 = alibi_slope_log2(Alibi, stride_ab, b, h, HAS_ALIBI)
    seed, seed_offset = dropout_seed(SeedState, HAS_DROPOUT)
    bh = b * num_heads + h

    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_ranges(m0, q_len, k_len, diag, win_left, win_right,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:
        dq, dq_hi = _bwd_dq_inner(
            dq, dq_hi, q, do, q_hi, do_hi, q_rows, do_rows, q_len, lse_log2, delta, K_head, V_head,
            stride_kn, stride_vn, lo, full_lo,
            offs_m, offs_n, offs_d, offs_dh, diag, k_len,
            qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
            seed, seed_offset, bh, keep_threshold, keep_scale,
            HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
            HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, D_HI, EVEN)
    dq, dq_hi = _bwd_dq_inner(
        dq, dq_hi, q, do, q_hi, do_hi, q_rows, do_rows, q_len, lse_log2, delta, K_head, V_head,
        stride_kn, stride_vn, full_lo, full_hi,
        offs_m, offs_n, offs_d, offs_dh, diag, k_len,
        qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
        seed, seed_offset, bh, keep_threshold, keep_scale,
        HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, False, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
        HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, D_HI, EVEN)
    dq, dq_hi = _bwd_dq_inner(
        dq, dq_hi, q, do, q_hi, do_hi, q_rows, do_rows, q_len, lse_log2, delta, K_head, V_head,
        stride_kn, stride_vn, full_hi, hi,
        offs_m, offs_n, offs_d, offs_dh, diag, k_len,
        qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
        seed, seed_offset, bh, keep_threshold, keep_scale,
        HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
        HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, D_HI, EVEN)
    dq = dq * sm_scale
    dq_rows = (DQ + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh
               + offs_m[:, None] * stride_dqm)
    store_cols_t(dq_rows, row_mask[:, None], offs_d[None, :], dq, HEAD_DIM, D_PAD, not EVEN, False)
    if D_HI:  # (the second chunk's columns, row-bounded as before EVEN_QK)
        store_cols_t(dq_rows, row_mask[:, None], offs_dh[None, :], dq_hi * sm_scale, HEAD_DIM, D_PAD + D_HI, True,
                     False)



@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale,
    total_q, total_k,
    GROUP, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr, D_HI: tl.constexpr = 0,
    Out=None, stride_ob=0, stride_om=0, stride_oh=0, DELTA_FROM_O: tl.constexpr = False,
    EVEN_QK: tl.constexpr = False,
):
    tl.static_assert(D_HI == 0 or RELOAD_CHUNK == 0)
    # heavier (later) query blocks first: better tail balance under causal masks
    _dq_program(Q, K, V, DO, Lse, Delta, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh, stride_lb, stride_lh,
                Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
                qk_scale_log2, softcap_div, softcap_log2, win_left, win_right, sm_scale, total_q, total_k,
                GROUP, tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2),
                tl.num_programs(1), HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IS_VARLEN, IS_SOFTCAP, HAS_ALIBI,
                HAS_LEFT, HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, D_HI,
                Out, stride_ob, stride_om, stride_oh, DELTA_FROM_O, EVEN_QK)


# --------------------------------------------------------------------------- launcher

# None: split GQA groups in the dK/dV kernel when the GPU would be under-filled
# (dkdv_heads_per_program); tests set an int to force a split.
DKDV_HEADS_PER_PROGRAM = None
# None: the backward's dQ strategy follows the tables (backward_dq_mode); tests set
# "atomic" | "fused" | "separate" to run one path on any arch.
BWD_DQ_MODE = None


def dkdv_heads_per_program(group: int, kv_heads: int, batch: int, seqlen_q: int, seqlen_k: int, causal: bool,
                           block_m: int, block_n: int, sms: int, fused_dq: bool) -> int:
    """Query heads one dK/dV program sums over: the whole GQA group (no extra memory) unless that
    program would hold more than tables.DKDV_MAX_PROGRAM_SHARE of one SM's share of the launch's
    work (a tail the rest of the GPU waits for); then one head per program (H100: splitting in
    two was slower than either, docs/TUNING_NOTES.md v7).  Work is counted in (BLOCK_M x BLOCK_N)
    tile pairs; dQ programs of a fused launch add 3/4 of the dK/dV work (3 matmuls per tile pair
    instead of 4).  Split programs' dK/dV are summed afterwards (tables.GQA_SPLIT_SUM)."""
    if group == 1:  # MHA: nothing to split (also under a test's forced split)
        return 1
    if DKDV_HEADS_PER_PROGRAM is not None:
        return DKDV_HEADS_PER_PROGRAM
    rows = cdiv(seqlen_q, block_m)  # query blocks the longest program visits, per head
    pairs_per_head = rows * cdiv(seqlen_k, block_n) * (0.5 if causal else 1.0)
    work = pairs_per_head * group * kv_heads * batch * (1.75 if fused_dq else 1.0)
    return group if group * rows <= tables.DKDV_MAX_PROGRAM_SHARE * work / sms else 1


def backward_dq_mode(family: str, deterministic: bool, dkdv_cfg, dq_cfg) -> str:
    """How the backward computes dQ: "atomic" (fp32 atomics from the dK/dV programs; only when
    deterministic=False and the arch's table says so, tables.NONDETERMINISTIC_DQ), else by dQ
    programs that recompute S and dP: "fused" into the dK/dV launch when both kernels' launch
    options (warps, stages, HIP options, kernel switches) agree, "separate" (a second launch) when not."""
    if BWD_DQ_MODE is not None:
        return "separate" if deterministic and BWD_DQ_MODE == "atomic" else BWD_DQ_MODE
    if not deterministic and nondeterministic_dq(family) == "atomic":
        return "atomic"
    return "fused" if bwd_fusable(family, dkdv_cfg, dq_cfg) else "separate"


def attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                       deterministic=True, sinks=None):
    """Returns (dq, dk, dv) with the shapes of q, k, v; with `sinks` (fp32 (nheads_q,), the forward's
    learnable sink logits; lse includes them) returns (dq, dk, dv, dsinks), dsinks fp32 (nheads_q,).
    The dK/dV and dQ kernels need nothing for sinks (dS = P * (dP - delta) given that lse);
    d sink_h = -sum exp(sink_h - lse) * delta comes from the preprocess kernel, deterministic.

    deterministic=True: no atomics anywhere (bitwise reproducible); dQ from dQ programs, fused into
    the dK/dV launch or in a second kernel (backward_dq_mode).
    deterministic=False: the tables may choose fp32 atomics for dQ (tables.NONDETERMINISTIC_DQ) and for
    the sums of split GQA groups (tables.GQA_SPLIT_SUM).
    """
    plan_key = rows = arch = None
    if sinks is None and q.device.type != "cpu":
        # replay the launches of an earlier call of this structure (kernels/launch.LaunchPlan): this
        # runs on autograd's own thread, where the launcher's Python costs the most (TUNING_NOTES v11)
        arch = arch_for(q)
        family = family_of(arch)
        plan_key = ("plan", "bwd", dout.stride(), q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
                    out.stride(), lse.shape, lse.stride(), q.dtype, k.dtype, v.dtype, dout.dtype, out.dtype, q.device,
                    cu_seqlens_q is None, cu_seqlens_k is None, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    window_left, window_right, softcap, rng_state is None, deterministic,
                    None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride()),
                    BWD_DQ_MODE, DKDV_HEADS_PER_PROGRAM, tables.NONDETERMINISTIC_DQ.get(family),
                    tables.GQA_SPLIT_SUM.get(family), family in tables.FUSED_DQ_FAMILIES,
                    tables.DKDV_MAX_PROGRAM_SHARE, tables.HEAD_DIM_SPLIT_FAMILIES, tables.BWD_DELTA_IN_DQ_FAMILIES,
                    tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES, tables.EVEN_QK_FAMILIES, tables.EVEN_QK_OTHER_BWD_FAMILIES,
                    get_bwd_config, launch,
                    alias_pattern(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state))
        rows = table_rows(arch, head_dim_padded(q.shape[-1]))
        plan = memo_get(plan_key, rows, False)  # False: not seen yet; None: no plan for this structure
        if plan:
            launches, atomic_dq = plan
            dq, dk, dv = new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape)
            delta = new_output(lse, lse.shape)
            dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic_dq else None
            if launches.run(dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                                 alibi=alibi_slopes, rng=rng_state, dq=dq, dk=dk, dv=dv, delta=delta,
                                 dq_accum=dq_accum)):
                if atomic_dq:
                    dq.copy_(dq_accum)
                return dq, dk, dv
        if plan is None:
            plan_key = None
    with recording() as recorded:
        grads, scratch = _attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap,
                                             alibi_slopes, rng_state, deterministic, sinks)
    if plan_key is not None:
        # (scratch None: a path with host-side copies or fills, _attention_backward; no plan)
        launches = LaunchPlan.build(recorded, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_q=cu_seqlens_q,
                                                   cu_k=cu_seqlens_k, alibi=alibi_slopes, rng=rng_state, dq=grads[0],
                                                   dk=grads[1], dv=grads[2], **scratch),
                                    arch.is_hip) if scratch is not None and recorded else None
        memo_put(plan_key, rows, None if launches is None else (launches, scratch["dq_accum"] is not None))
    return grads


def _attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                        deterministic, sinks):
    """attention_backward's launches: returns (its gradients, scratch), scratch = the buffers a plan of
    this call re-creates (delta; dq_accum, zeroed, or None), or None where the call also copied, summed
    or filled on the host (empty sides, split GQA groups, sinks) and gets no plan."""
    varlen, batch, hq, hk, d, seqlen_q, seqlen_k = shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dq = new_output(q, q.shape)
    dk = new_output(k, k.shape)
    dv = new_output(v, v.shape)
    dsinks = None if sinks is None else torch.zeros(hq, device=q.device, dtype=torch.float32)
    if batch == 0 or hq == 0 or (max_seqlen_q == 0 and max_seqlen_k == 0):
        return _with_dsinks((dq.zero_(), dk.zero_(), dv.zero_()), dsinks), None
    if max_seqlen_q == 0:
        dq.zero_()
    d_pad = head_dim_padded(d)
    scalars, flags, keep_scale = score_args(q, alibi_slopes, rng_state, dropout_p, softmax_scale,
                                             window_left, window_right, softcap, max_seqlen_q, max_seqlen_k)
    arch = arch_for(q)
    family = family_of(arch)
    # a head dim that is not a power of two may run as two chunks (tables.HEAD_DIM_SPLIT_FAMILIES)
    d_lo, d_hi = head_dim_chunks(arch, d, d_pad)
    short = is_short(max_seqlen_k)
    cfgs = get_bwd_config(arch, d_lo + d_hi, q.dtype == torch.float32, flags["HAS_RIGHT"], short)
    if d_hi and any(cfg["RELOAD_CHUNK"] for cfg in cfgs.values()):  # (the reloading kernels take one chunk)
        d_lo, d_hi = d_pad, 0
        cfgs = get_bwd_config(arch, d_pad, q.dtype == torch.float32, flags["HAS_RIGHT"], short)
    cu_q = cu_seqlens_q if varlen else q
    cu_k = cu_seqlens_k if varlen else q
    delta = new_output(lse, lse.shape)
    common = kernel_args(hq, hk, d, d_pad, varlen, flags, total_q=q.shape[0], total_k=k.shape[0])
    chunked = dict(common, D_PAD=d_lo, **({"D_HI": d_hi} if d_hi else {}))
    strides_in = (*row_strides(q, varlen), *row_strides(k, varlen), *row_strides(v, varlen),
                  *row_strides(dout, varlen))
    mode = backward_dq_mode(family, deterministic, cfgs["dkdv"], cfgs["dq"])
    if max_seqlen_q == 0 or max_seqlen_k == 0:
        mode = "separate"  # one side is empty: nothing to fuse, no dQ to add up
    # a dQ launch of its own may run first and compute delta itself (tables.BWD_DELTA_IN_DQ_FAMILIES)
    delta_in_dq = (mode == "separate" and sinks is None and max_seqlen_q > 0 and max_seqlen_k > 0
                   and family in tables.BWD_DELTA_IN_DQ_FAMILIES)

    masked = flags["HAS_LEFT"] or flags["HAS_RIGHT"]
    even_families = tables.EVEN_QK_FAMILIES if short and masked else tables.EVEN_QK_OTHER_BWD_FAMILIES

    def even(*tiles):  # EVEN_QK of a launch with these tiles (launch.even_qk)
        return dict(EVEN_QK=family in even_families and even_qk(varlen, seqlen_q, seqlen_k, *tiles))

    def launch_dq(**extra):
        launch(attn_bwd_dq_kernel, cfgs["dq"], grid_blocks(max_seqlen_q, "BLOCK_M"), (hq, batch + varlen), (
            q, k, v, dout, lse, delta, dq, cu_q, cu_k, seqlen_q, seqlen_k,
            *strides_in, *row_strides(dq, varlen), *lse_strides(lse, varlen)),
            dict(keep_scale=keep_scale, sm_scale=softmax_scale, **scalars, **chunked, **extra),
            per_cfg=lambda cfg: even((cfg["BLOCK_M"], cfg["BLOCK_N"])))

    if delta_in_dq:
        ob, om, oh = row_strides(out, varlen)
        launch_dq(Out=out, stride_ob=ob, stride_om=om, stride_oh=oh, DELTA_FROM_O=True)
    elif max_seqlen_q > 0:
        pre = bwd_preprocess_config(arch, d_pad)
        pre_block = pre["BLOCK_M"]
        sink_args = {}
        if sinks is not None:  # one slot per program for its rows' share of d sink (early exits leave 0)
            dsinks_part = torch.zeros((batch, hq, cdiv(max_seqlen_q, pre_block)), device=q.device, dtype=torch.float32)
            sink_args = dict(Lse=lse, Sinks=sinks, DSinksPart=dsinks_part, HAS_SINKS=True)
        jit_launch(bwd_preprocess_kernel, (cdiv(max_seqlen_q, pre_block), hq, batch), (
            out, dout, delta, cu_q, seqlen_q,
            *row_strides(out, varlen), *row_strides(dout, varlen), *lse_strides(delta, varlen)),
            dict(total_q=common["total_q"], HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=pre_block, IS_VARLEN=varlen,
                 num_warps=pre["num_warps"], **sink_args))
        if sinks is not None:
            dsinks = dsinks_part.sum(dim=(0, 2))  # a fixed order: deterministic
    atomic_dq = mode == "atomic"
    fused = mode == "fused"
    dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic_dq else dq
    if max_seqlen_k > 0:
        dkdv_cfg = cfgs["dkdv_atomic" if atomic_dq else "dkdv"]
        group = hq // hk
        dq_blocks = cdiv(max_seqlen_q, cfgs["dq"]["BLOCK_M"]) if fused else 0
        per_program = dkdv_heads_per_program(
            group, hk, batch, max_seqlen_q, max_seqlen_k, flags["HAS_RIGHT"], dkdv_cfg["BLOCK_M"],
            dkdv_cfg["BLOCK_N"], num_sms(q), fused)
        split = per_program < group
        split_sum = gqa_split_sum(family)  # validated on every call, split or not
        atomic_dkdv = split and not deterministic and split_sum == "atomic"
        if atomic_dkdv:
            # every slice of a group adds into its KV head: (.., hk, d) in fp32, from zero
            dk_out = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
            dv_out = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        elif split:
            # partial sums per slice of the group, (.., hk * slices, d) in fp32
            part_shape = (*k.shape[:-2], hq // per_program, d)
            dk_out, dv_out = new_output(k, part_shape, torch.float32), new_output(v, part_shape, torch.float32)
        else:
            dk_out, dv_out = dk, dv
        # fused: each axis-1 slot also runs dQ programs for its per_program query heads
        dq_tiles = dict(DQ_BLOCK_M=cfgs["dq"]["BLOCK_M"], DQ_BLOCK_N=cfgs["dq"]["BLOCK_N"]) if fused else \
            dict(DQ_BLOCK_M=16, DQ_BLOCK_N=16)  # unused
        # (a switch of the split kernel only: other launches keep their argument lists)
        split_exit = dict(SPLIT_EARLY_RETURN=True) if dkdv_cfg.get("DKDV_SPLIT") and \
            family in tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES else {}

        dq_pairs = [(dq_tiles["DQ_BLOCK_M"], dq_tiles["DQ_BLOCK_N"])] if fused else []  # (EVEN_QK: whole for both)

        def grid0(cfg):  # dK/dV programs (twice as many under DKDV_SPLIT), then the fused dQ ones
            return cdiv(max_seqlen_k, cfg["BLOCK_N"]) * (2 if cfg.get("DKDV_SPLIT") else 1) + per_program * dq_blocks

        group_size = program_group(arch, "bwd", d_lo + d_hi, grid0(dkdv_cfg), flags["HAS_RIGHT"])
        order = dict(pairs_per_group=group_size, GROUPED_ORDER=True) if grouped_order(arch, "bwd") else {}

        # varlen: one more program row (batch index `batch`) zeroes the rows past cu_seqlens[-1]
        launch(attn_bwd_dkdv_kernel, dkdv_cfg, grid0, (hq // per_program, batch + varlen), (
            q, k, v, dout, lse, delta, dk_out, dv_out, dq_accum, cu_q, cu_k, seqlen_q, seqlen_k,
            *strides_in, *row_strides(dk_out, varlen), *row_strides(dv_out, varlen),
            *row_strides(dq_accum, varlen), *lse_strides(lse, varlen)),
            dict(keep_scale=keep_scale, sm_scale=softmax_scale, heads_per_prog=per_program, **scalars, **chunked,
                 ATOMIC_DQ=atomic_dq, ATOMIC_DKDV=atomic_dkdv, FUSED_DQ=fused, **dq_tiles, **split_exit, **order),
            per_cfg=lambda cfg: even((cfg["BLOCK_M"], cfg["BLOCK_N"]), *dq_pairs))
        if atomic_dkdv:
            dk.copy_(dk_out)
            dv.copy_(dv_out)
        elif split:
            # query head h belongs to KV head h // group: slices of one KV head are adjacent
            slices = group // per_program
            dk.copy_(dk_out.unflatten(-2, (hk, slices)).sum(-2))
            dv.copy_(dv_out.unflatten(-2, (hk, slices)).sum(-2))
    else:  # no key is in a sequence: every key token (e.g. past cu_seqlens_k[-1]) gets dK = dV = 0
        dk.zero_()
        dv.zero_()
    if atomic_dq:
        dq.copy_(dq_accum)
    elif max_seqlen_q > 0 and not fused and not delta_in_dq:
        launch_dq()
    plannable = sinks is None and max_seqlen_q > 0 and max_seqlen_k > 0 and not split
    scratch = dict(delta=delta, dq_accum=dq_accum if atomic_dq else None) if plannable else None
    return _with_dsinks((dq, dk, dv), dsinks), scratch


def _with_dsinks(grads, dsinks):
    """(dq, dk, dv), plus d sinks when the forward had sinks."""
    return grads if dsinks is None else (*grads, dsinks)
