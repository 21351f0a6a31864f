"""FlashAttention-2 forward in Triton (and the probability dump of return_attn_probs),
then the plain launcher `attention_forward` (the torch.library ops in fa_amd/ops.py wrap it).

One kernel serves dense and varlen (IS_VARLEN), MQA/GQA (query head h reads KV
head h // GROUP; GROUP is a runtime int so GQA ratios share one compiled kernel),
causal / sliding window / ALiBi / softcap / dropout.  Key blocks are visited in
the three ranges of fa_amd/kernels/blocks.py.

RELOAD_CHUNK (a constexpr, table data, fa_amd/tuning/tables.py): 0, the default on
every target but RDNA, keeps q in registers across the key loop.  N > 0 reloads it
from memory next to the dot that needs it (it stays hot in L1/L2) and computes
S = QK^T N head-dim columns at a time (blocks.dot_rows_nt).  Why: RDNA3 WMMA
replicates each dot operand across the two lane halves, so a 16-row slice of a
d-wide operand costs d/2 of the 256 VGPRs of a wave32 lane, and the resident
kernels spill at every tile size for d128 and d256 there (docs/AOT.md).

D_HI (a constexpr, tuning.head_dim_chunks): a head dim that is not a power of two may run as two
power-of-two chunks, columns [0, D_PAD) and [D_PAD, D_PAD + D_HI) (192 = 128 + 64): each d-wide tile
has a second tile beside it, and S sums two dots.  0 (one chunk, padded to D_PAD) compiles as before.

FP8 (fa_amd/fp8.py) is a dtype path of the same kernels: FP8 is a constexpr read off Q's
element type; the caller's descales (read in place) scale S and the output, P is rounded to V's fp8 type
for the P.V dot (score_mods.load_head_descales / p_shift), and dense V may be token-major per
head (stride_vn == 1, rows stride_vd apart: tables.FP8_V_TOKEN_MAJOR).  Other dtypes
compile exactly as before (stride_vd == 1, descales unused).
"""
import threading

import torch
import triton
import triton.language as tl

from ..arch import arch_for
from ..tuning import family_of, get_fwd_config, head_dim_chunks, is_short, memo_get, memo_put, nan_flags_config, \
    grouped_order, program_group, table_rows
from ..tuning import tables
from .blocks import div_small, dot_rows_nt, grouped_program_ids, in_loop, key_ranges, load_cols_t, store_cols_t, \
    whole_blocks, zero_rows
from .launch import (
    LaunchPlan, alias_pattern, current_stream, descale_args, even_qk, grid_blocks, head_dim_padded, head_scan_grid,
    jit_launch, kept_zeros, kernel_args, launch, lse_strides, new_output, recording, row_strides, score_args, shape_info)
from .score_mods import FP8_P_SCALE, LN2, LOG2E, alibi_slope_log2, dropout_keep, dropout_seed, fp8_v_ptrs, \
    is_nan, load_head_descales, mask_keys, p_shift, score_log2, seq_bounds, sink_init, tail_start


# At most this many programs per (sequence, KV head) in v_nan_flags_kernel (tables.V_NAN_FLAGS says how
# many a call takes): each writes its own row of flags, so the buffer needs no zeroing or atomics (one
# launch), and the forward's epilogue reads a call's rows, NAN_ROWS_PER_LOAD at a time
NAN_SPLITS_MAX = tl.constexpr(32)
NAN_ROWS_PER_LOAD = tl.constexpr(8)
FP32_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _masked_block(x, start_n, edge_lo, edge_hi, offs_m, offs_n, diag, k_len, win_left, win_right,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr, MASK: tl.constexpr,
                  MASK_EDGES: tl.constexpr):
    """The key block at start_n of x masked (score_mods.mask_keys): with MASK always, with MASK_EDGES only when the
    block lies outside [edge_lo, edge_hi), under a branch.  The tile's own column offsets are compared against
    limits shifted by start_n: no column index per element."""
    if MASK_EDGES:
        if (start_n < edge_lo) | (start_n >= edge_hi):
            x = mask_keys(x, offs_m[:, None], offs_n[None, :], diag - start_n, k_len - start_n, win_left, win_right,
                          HAS_LEFT, HAS_RIGHT, KEY_BOUND)
    elif MASK:
        x = mask_keys(x, offs_m[:, None], offs_n[None, :], diag - start_n, k_len - start_n, win_left, win_right,
                      HAS_LEFT, HAS_RIGHT, KEY_BOUND)
    return x


@triton.jit
def _fwd_inner(acc, acc_hi, l_i, m_i, q, q_hi, q_rows, q_len, K_head, V_head, stride_kn, stride_vn, stride_vd,
               start, end, offs_m, offs_n, offs_d, offs_dh, diag, k_len, v_len,
               qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
               seed, seed_offset, bh, keep_threshold,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr,
               IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
               RELOAD_CHUNK: tl.constexpr, POSITIVE_SCALE: tl.constexpr, FP8: tl.constexpr, D_HI: tl.constexpr,
               EVEN: tl.constexpr = False, edge_lo=0, edge_hi=0, MASK_EDGES: tl.constexpr = False):
    # MASK_EDGES (whole blocks only, MASK False): the loop runs every key block, the masked edges too, and masks the
    # window in the blocks outside [edge_lo, edge_hi) under a branch, so no second software pipeline fills for them
    COLS_MASKED: tl.constexpr = MASK and not EVEN  # (EVEN: whole key blocks; the window edges are still masked)
    tl.static_assert(not MASK_EDGES or (EVEN and not MASK))
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if FP8:
            # every non-empty range of blocks.key_ranges starts on a multiple of BLOCK_N; said here so
            # token-major V tiles (contiguous along cols) load as aligned vectors
            cols = tl.max_contiguous(tl.multiple_of(start_n + offs_n, BLOCK_N), BLOCK_N)
        if RELOAD_CHUNK:
            # q streamed in head-dim chunks with each key block
            qk = dot_rows_nt(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                              q_rows, offs_m[:, None] < in_loop(q_len, start_n, end),
                              K_head + cols[:, None] * stride_kn, cols[:, None] < k_len,
                              HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
            v_ptrs = fp8_v_ptrs(V_head, cols, offs_d, stride_vn, stride_vd, FP8)
        else:
            kT_ptrs = K_head + cols[None, :] * stride_kn + offs_d[:, None]
            v_ptrs = fp8_v_ptrs(V_head, cols, offs_d, stride_vn, stride_vd, FP8)
            if COLS_MASKED:
                kT = tl.load(kT_ptrs, mask=(cols[None, :] < k_len) & (offs_d[:, None] < HEAD_DIM), other=0.0)
            elif D_PAD > HEAD_DIM:
                kT = tl.load(kT_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
            else:
                kT = tl.load(kT_ptrs)
            qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
            if D_HI:  # the head dim's second chunk (columns D_PAD..): S sums both
                kT_hi = load_cols_t(K_head + cols[None, :] * stride_kn, cols[None, :] < k_len, offs_dh[:, None],
                                    HEAD_DIM, D_PAD + D_HI, COLS_MASKED)
                qk = tl.dot(q_hi, kT_hi, qk, input_precision=INPUT_PRECISION)
        # pairs in parentheses: triton < 3.4 rejects a chain of more than two boolean operands
        if POSITIVE_SCALE and (not IS_SOFTCAP and not HAS_ALIBI):
            # plain scores: the row max of the raw tile scaled once per row, and the exp2
            # argument as one FMA per element (scale > 0 keeps the max where it was, and -inf at -inf)
            qk = _masked_block(qk, start_n, edge_lo, edge_hi, offs_m, offs_n, diag, k_len, win_left, win_right,
                               HAS_LEFT, HAS_RIGHT, not EVEN, MASK, MASK_EDGES)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
            if MASK or MASK_EDGES:
                # a row with every key masked so far keeps m=-inf; shift by 0 instead of NaN
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_shift = m_new
            p = tl.exp2(qk * qk_scale_log2 - p_shift(m_shift, FP8)[:, None])
        else:
            s, _ = score_log2(qk, offs_m[:, None], cols[None, :], diag, k_len, qk_scale_log2, softcap_div,
                              softcap_log2, slope_log2, win_left, win_right,
                              MASK, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, not EVEN)
            # (score_log2 masked the MASK blocks already)
            s = _masked_block(s, start_n, edge_lo, edge_hi, offs_m, offs_n, diag, k_len, win_left, win_right,
                              HAS_LEFT, HAS_RIGHT, False, False, MASK_EDGES)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if MASK or MASK_EDGES:
                # a row with every key masked so far keeps m=-inf; shift by 0 instead of NaN
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_shift = m_new
            p = tl.exp2(s - p_shift(m_shift, FP8)[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if D_HI:
            acc_hi = acc_hi * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, seed_offset, bh, offs_m[:, None], cols[None, :], keep_threshold)
            p = tl.where(keep, p, 0.0)
        if COLS_MASKED:
            v = tl.load(v_ptrs, mask=(cols[:, None] < v_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif D_PAD > HEAD_DIM:
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        if D_HI:
            v_hi = load_cols_t(V_head + cols[:, None] * stride_vn, cols[:, None] < v_len, offs_dh[None, :],
                               HEAD_DIM, D_PAD + D_HI, COLS_MASKED)
            acc_hi = tl.dot(p.to(v_hi.dtype), v_hi, acc_hi, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, acc_hi, l_i, m_i


# pairs_per_group: a runtime int (it follows the launch's query-block count: tuning.program_group), compiled once
@triton.jit(do_not_specialize=["pairs_per_group"])
def attn_fwd_kernel(
    Q, K, V, Out, Lse,
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    Alibi, stride_ab, SeedState, keep_threshold, keep_scale,
    total_q, total_k, NanFlags, nan_splits,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right,
    QDescale, KDescale, VDescale, stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    GROUP, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr,
    Sinks=None, HAS_SINKS: tl.constexpr = False, D_HI: tl.constexpr = 0, NAN_FIXUP: tl.constexpr = False,
    pairs_per_group=1, GROUPED_ORDER: tl.constexpr = False, Q_DESCALE_PER_KV_HEAD: tl.constexpr = False,
    EVEN_QK: tl.constexpr = False, FWD_MERGED_EDGES: tl.constexpr = 0, NAN_FROM_OUT: tl.constexpr = False,
):
    # EVEN_QK: every sequence's query and key counts are whole multiples of the tiles (launch.even_qk): the
    # diagonal's key blocks load without bounds, q, out and lse without row bounds
    # heavier (later) query blocks first, in groups of pairs_per_group (batch, head) pairs: tail balance
    # under causal masks
    pid_0, h, b = grouped_program_ids(pairs_per_group, GROUPED_ORDER)
    pid_m = tl.num_programs(0) - 1 - pid_0
    # fp8 operands + descales (score_mods.load_head_descales): a compile-time fact of Q's dtype
    FP8: tl.constexpr = Q.dtype.element_ty.is_fp8()
    # D_HI > 0: the head dim in two chunks, columns [0, D_PAD) and [D_PAD, D_PAD + D_HI) (launch.head_dim_chunks);
    # whole rows (zeroed rows, the V NaN rule) span D_ROW columns
    tl.static_assert(D_HI == 0 or (RELOAD_CHUNK == 0 and not FP8))
    D_ROW: tl.constexpr = D_PAD + D_PAD * (D_HI > 0)
    if IS_VARLEN:
        if b == tl.num_programs(2) - 1:
            # the extra program row: tokens past cu_seqlens_q[-1] (legal: static buffers) belong to
            # no sequence; they get output 0 and lse +inf, as rows that see no key
            tail = tail_start(cu_seqlens_q, b, total_q)
            zero_rows(Out + tail.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh, stride_om, total_q - tail,
                      pid_m, tl.num_programs(0), HEAD_DIM, D_ROW, BLOCK_M)
            offs_t = tl.arange(0, BLOCK_M)
            for r0 in range(tail + pid_m * BLOCK_M, total_q, tl.num_programs(0) * BLOCK_M):
                tl.store(Lse + h.to(tl.int64) * stride_lh + r0 + offs_t, tl.full([BLOCK_M], float("inf"), tl.float32),
                         mask=r0 + offs_t < total_q)
            return
    q_start, q_len, k_start, k_len = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, total_q, total_k,
                                                IS_VARLEN)
    q_len, k_len = whole_blocks(q_len, k_len, BLOCK_M, BLOCK_N, EVEN_QK)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    diag = k_len - q_len
    hk = div_small(h, GROUP)  # (heads < 2**16: MAX_GRID_YZ)
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    q_descale, k_descale, v_descale = load_head_descales(
        QDescale, KDescale, VDescale, b, h, hk, stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb,
        stride_vdh, Q_DESCALE_PER_KV_HEAD, FP8)
    v_len = k_len  # the keys' V rows the masked loads read
    if FP8:
        # S = (q8 . k8) * q_descale * k_descale, folded into the scalar score scales.  A negative product
        # (nonsense for descales; a ValueError where fa_amd.fp8 reads the values without a sync) is NaN: its
        # rows come out NaN, never a softmax taken off the raw scores' max under a negative scale
        score_descale = q_descale * k_descale
        score_descale = tl.where(score_descale < 0, float("nan"), score_descale)
        qk_scale_log2 = qk_scale_log2 * score_descale
        softcap_div = softcap_div * score_descale
        if not IS_VARLEN:
            # token-major V (stride_vn == 1; fa_amd.fp8 pads its rows to a multiple of 16 tokens with
            # zeros): masked tiles read whole rows up to the row stride, so their loads stay 16-byte
            # vectors and the tile goes to shared memory by cp.async like the unmasked ones (its
            # P columns past k_len are 0).  Head-dim-major V has stride_vd == 1: v_len is k_len.
            # (a select, not k_len rounded up to a multiple of stride_vd: no runtime division in the prologue)
            v_len = tl.where(stride_vd >= k_len, tl.where(k_len > 0, stride_vd, 0), k_len)

    if POSITIVE_SCALE:
        # the plain scores' path masks the raw tile (-inf) before scaling it: a scale that is 0 in fp32 (a zero
        # descale, a softmax_scale below fp32's range) would make those -inf * 0 = NaN.  At the smallest normal
        # scale instead every score is ~0 -- the uniform softmax the reference computes -- and -inf stays -inf.
        qk_scale_log2 = tl.maximum(qk_scale_log2, FP32_MIN_NORMAL, propagate_nan=tl.PropagateNan.ALL)
    q_head = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    K_head = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    V_head = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    # NAN_FROM_OUT (no left window): v_nan_fixup_kernel reads V's NaN features off the last query block's output
    # (_v_nan_features_from_out), and no program marks (tables.FWD_NAN_FROM_OUT_FAMILIES)
    tl.static_assert(not (NAN_FROM_OUT and HAS_LEFT))
    if (NAN_FIXUP and (HAS_LEFT or HAS_RIGHT)) and not NAN_FROM_OUT:
        # mark V's NaN features (relaxed, only lanes that see one); v_nan_fixup_kernel,
        # launched after this kernel, writes the NaNs: no reduction, barrier or acq_rel RMW per program.
        # Without a left window every program reads the key blocks that the first one does (those below its hi),
        # and a NaN in a block that a program reads reaches all its rows through the P.V dot (a masked
        # probability is 0, and 0 * NaN is NaN): only the blocks past them need marks (queries after a cached
        # prefix: the prefix's blocks need none)
        marked_lo = 0
        if not HAS_LEFT:
            _, _, _, first_hi = key_ranges(0, q_len, k_len, diag, win_left, win_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                           HAS_RIGHT)
            marked_lo = (first_hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        _v_nan_mark(NanFlags + (b * div_small(tl.num_programs(1), GROUP) + hk).to(tl.int64) * D_ROW, V_head,
                    marked_lo, pid_m * GROUP + (h - hk * GROUP), tl.cdiv(q_len, BLOCK_M) * GROUP, k_len, stride_vn,
                    stride_vd, offs_n, tl.arange(0, D_ROW), HEAD_DIM, D_ROW, BLOCK_N, FP8)
    if RELOAD_CHUNK:
        q = 0.0  # streamed from memory per key block by _fwd_inner
        q_rows = q_head + offs_m[:, None] * stride_qm
    else:
        q = load_cols_t(q_head + offs_m[:, None] * stride_qm, offs_m[:, None] < q_len, offs_d[None, :], HEAD_DIM,
                        D_PAD, not EVEN_QK)
        q_rows = q_head  # unused
    q_hi = 0.0  # D_HI: the second chunk's q, accumulator and columns
    acc_hi = 0.0
    offs_dh = 0
    if D_HI:
        offs_dh = D_PAD + tl.arange(0, D_HI)
        q_hi = load_cols_t(q_head + offs_m[:, None] * stride_qm, offs_m[:, None] < q_len, offs_dh[None, :], HEAD_DIM,
                           D_PAD + D_HI, not EVEN_QK)
        acc_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)

    slope_log2 = alibi_slope_log2(Alibi, stride_ab, b, h, HAS_ALIBI)
    seed, seed_offset = dropout_seed(SeedState, HAS_DROPOUT)
    bh = b * tl.num_programs(1) + h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        m_i, l_i = sink_init(Sinks, h, BLOCK_M)
        if FP8:  # l_i sums P * 2**FP8_P_LOG2 (score_mods.p_shift): the sink's term too
            l_i = l_i * FP8_P_SCALE
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_ranges(m0, q_len, k_len, diag, win_left, win_right,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # FWD_MERGED_EDGES on whole blocks (tables.KERNEL_SWITCHES): the masked edges' blocks join the unmasked loop,
    # masked under a branch there; otherwise a masked loop on each side of it
    MERGED: tl.constexpr = (FWD_MERGED_EDGES and EVEN_QK) and (HAS_LEFT or HAS_RIGHT)
    if HAS_LEFT and not MERGED:
        acc, acc_hi, l_i, m_i = _fwd_inner(
            acc, acc_hi, l_i, m_i, q, q_hi, q_rows, q_len, K_head, V_head, stride_kn, stride_vn, stride_vd,
            lo, full_lo, offs_m, offs_n, offs_d, offs_dh, diag, k_len, v_len,
            qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
            seed, seed_offset, bh, keep_threshold,
            HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT,
            HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, POSITIVE_SCALE, FP8, D_HI, EVEN_QK)
    acc, acc_hi, l_i, m_i = _fwd_inner(
        acc, acc_hi, l_i, m_i, q, q_hi, q_rows, q_len, K_head, V_head, stride_kn, stride_vn, stride_vd,
        lo if MERGED else full_lo, hi if MERGED else full_hi, offs_m, offs_n, offs_d, offs_dh, diag, k_len, v_len,
        qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
        seed, seed_offset, bh, keep_threshold,
        HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, False, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT,
        HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, POSITIVE_SCALE, FP8, D_HI, EVEN_QK,
        full_lo, full_hi, MERGED)
    if not MERGED:
        acc, acc_hi, l_i, m_i = _fwd_inner(
            acc, acc_hi, l_i, m_i, q, q_hi, q_rows, q_len, K_head, V_head, stride_kn, stride_vn, stride_vd,
            full_hi, hi, offs_m, offs_n, offs_d, offs_dh, diag, k_len, v_len,
            qk_scale_log2, softcap_div, softcap_log2, slope_log2, win_left, win_right,
            seed, seed_offset, bh, keep_threshold,
            HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT,
            HAS_RIGHT, HAS_DROPOUT, INPUT_PRECISION, RELOAD_CHUNK, POSITIVE_SCALE, FP8, D_HI, EVEN_QK)

    empty_row = l_i == 0.0
    row_sum = tl.where(empty_row, 1.0, l_i)
    # one reciprocal per row, with dropout's and V's scales folded in: a division per element is ~4 FMUL / FSEL
    # (div.full's range handling) on sm90.  l_i of a row that sees a key is >= 1 (its max term is exp2(0)), so
    # 1 / l_i is a normal float
    row_scale = 1.0 / row_sum
    if HAS_DROPOUT:
        row_scale = row_scale * keep_scale
    if FP8:
        row_scale = row_scale * v_descale
        m_i = p_shift(m_i, FP8)  # l_i summed P * 2**FP8_P_LOG2
    out = acc * row_scale[:, None]
    out_hi = 0.0
    if D_HI:
        out_hi = acc_hi * row_scale[:, None]
    if (HAS_LEFT or HAS_RIGHT) and not NAN_FIXUP:
        # the reference (like SDPA) multiplies masked-out probabilities (0) by V too, so a NaN in
        # feature d of any value of this sequence makes feature d of every row NaN, also of rows
        # whose masks skip its block (NanFlags: one pass over V; only masked launches pay for it;
        # NAN_FIXUP marks them in this kernel and v_nan_fixup_kernel writes them after it instead)
        flag_head = NanFlags + (b * div_small(tl.num_programs(1), GROUP) + hk).to(tl.int64) * nan_splits * D_ROW
        out = tl.where(_v_nan_flagged(flag_head, nan_splits, offs_d, D_ROW, D_PAD)[None, :] != 0, float("nan"), out)
        if D_HI:
            out_hi = tl.where(_v_nan_flagged(flag_head, nan_splits, offs_dh, D_ROW, D_HI)[None, :] != 0, float("nan"),
                              out_hi)
    # flash-attn convention: a row that sees no key has output 0 and lse +inf
    lse = tl.where(empty_row, float("inf"), (m_i + tl.log2(row_sum)) * LN2)
    o_head = Out + b64 * stride_ob + q_start.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    store_cols_t(o_head + offs_m[:, None] * stride_om, offs_m[:, None] < q_len, offs_d[None, :], out, HEAD_DIM, D_PAD,
                 not EVEN_QK, False)
    if D_HI:
        store_cols_t(o_head + offs_m[:, None] * stride_om, offs_m[:, None] < q_len, offs_dh[None, :], out_hi, HEAD_DIM,
                     D_PAD + D_HI, not EVEN_QK, False)
    lse_head = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
    if EVEN_QK:
        tl.store(lse_head + offs_m, lse)
    else:
        tl.store(lse_head + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def _v_nan_flagged(flag_head, nan_splits, cols, D_ROW: tl.constexpr, WIDTH: tl.constexpr):
    """int32 [WIDTH]: nonzero where any of the nan_splits rows of v_nan_flags_kernel's flags (D_ROW
    features each, from flag_head) is set for feature `cols` (NAN_ROWS_PER_LOAD rows per load: a whole
    [NAN_SPLITS_MAX, D_PAD] tile spilled on RDNA3 at d256)."""
    offs_s = tl.arange(0, NAN_ROWS_PER_LOAD)
    v_nan = tl.zeros([WIDTH], dtype=tl.int32)
    for s0 in range(0, nan_splits, NAN_ROWS_PER_LOAD):
        rows = s0 + offs_s
        flags = tl.load(flag_head + rows[:, None] * D_ROW + cols[None, :], mask=rows[:, None] < nan_splits, other=0)
        v_nan = tl.maximum(v_nan, tl.max(flags.to(tl.int32), 0))
    return v_nan


@triton.jit
def _v_nan_tile(V_head, rows, k_len, stride_vn, stride_vd, offs_d, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """bool [rows, offs_d]: where V's rows (of k_len keys) hold a NaN; the one read of V behind both
    forms of the V NaN rule (_v_nan_mark in the forward, _v_nan_columns in the pass before it)."""
    v = tl.load(fp8_v_ptrs(V_head, rows, offs_d, stride_vn, stride_vd, FP8),
                mask=(rows[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return is_nan(v)


@triton.jit
def _v_nan_mark(flags, V_head, first, share, shares, k_len, stride_vn, stride_vd, offs_n, offs_d,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """flags[d] |= 1 for every feature d in which V's key blocks share, share + shares, ... (counted from key
    `first`, a multiple of BLOCK_N) hold a NaN: a relaxed atomic per element, issued only by the lanes that
    hold a NaN (none in the common case).
    (Not _v_nan_columns, which walks the blocks alike: its column reduction costs barriers in every program.)"""
    for n0 in range(first + share * BLOCK_N, k_len, shares * BLOCK_N):
        rows = n0 + offs_n
        tl.atomic_or(flags + offs_d[None, :] + 0 * rows[:, None], 1,
                     mask=_v_nan_tile(V_head, rows, k_len, stride_vn, stride_vd, offs_d, HEAD_DIM, FP8),
                     sem="relaxed")


@triton.jit
def v_nan_fixup_kernel(Out, NanFlags, cu_seqlens_q, seqlen_q, total_q, stride_ob, stride_om, stride_oh, GROUP,
                       HEAD_DIM: tl.constexpr, D_ROW: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
                       FROM_OUT: tl.constexpr = False, FWD_BLOCK_M: tl.constexpr = 1, OUT_ROWS: tl.constexpr = 1,
                       V=None, cu_seqlens_k=None, seqlen_k=0, total_k=0, stride_vb=0, stride_vn=0, stride_vh=0,
                       stride_vd=1, BLOCK_N: tl.constexpr = 16):
    """After a NAN_FIXUP forward: NaN into feature d of every row of every query head of (sequence, KV head)
    where V holds a NaN in feature d -- marked by the forward's programs (NanFlags[b, hk, d], zero before the
    forward; the marks it read set back to zero), or with FROM_OUT (a forward without a left window whose
    programs mark nothing) read off the output of the forward's last query block (FWD_BLOCK_M rows:
    _v_nan_features_from_out)."""
    hk = tl.program_id(0)
    b = tl.program_id(1)
    offs_d = tl.arange(0, D_ROW)
    offs_r = tl.arange(0, BLOCK_M)
    q_start, q_len, _, _ = seq_bounds(cu_seqlens_q, cu_seqlens_q, b, seqlen_q, seqlen_q, total_q, total_q,
                                      IS_VARLEN)
    o_seq = Out + b.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_om
    if FROM_OUT:
        _, _, k_start, k_len = seq_bounds(cu_seqlens_k, cu_seqlens_k, b, seqlen_k, seqlen_k, total_k, total_k,
                                          IS_VARLEN)
        V_head = V + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
        nan_cols = _v_nan_features_from_out(o_seq, hk, GROUP, q_len, stride_om, stride_oh, V_head, k_len, stride_vn,
                                            stride_vd, offs_d, HEAD_DIM, D_ROW, FWD_BLOCK_M, OUT_ROWS, BLOCK_N)
    else:
        flag_row = NanFlags + (b * tl.num_programs(0) + hk).to(tl.int64) * D_ROW + offs_d
        nan_cols = tl.load(flag_row)
    if tl.max(nan_cols, 0) != 0:
        if not FROM_OUT:
            tl.store(flag_row, tl.zeros([D_ROW], dtype=tl.int32))  # (all zero again for the next forward: kept_nan_flags)
        nan_tile = tl.full([BLOCK_M, D_ROW], float("nan"), tl.float32).to(Out.dtype.element_ty)
        for g in range(0, GROUP):
            o_head = o_seq + (hk * GROUP + g).to(tl.int64) * stride_oh
            for r0 in range(0, q_len, BLOCK_M):
                rows = r0 + offs_r
                tl.store(o_head + rows[:, None] * stride_om + offs_d[None, :], nan_tile,
                         mask=(rows[:, None] < q_len) & (nan_cols[None, :] != 0) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _v_nan_features_from_out(o_seq, hk, GROUP, q_len, stride_om, stride_oh, V_head, k_len, stride_vn, stride_vd,
                             offs_d, HEAD_DIM: tl.constexpr, D_ROW: tl.constexpr, FWD_BLOCK_M: tl.constexpr,
                             OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [D_ROW]: nonzero for every feature in which V (k_len keys) holds a NaN, read off the output rows of the
    forward's last query block (FWD_BLOCK_M rows, OUT_ROWS per load) of a query head of KV head hk.  Without a left
    window that program took every key block into every one of its rows, each value times its probability (0
    where masked), so a NaN in feature d of any value made feature d NaN in all its rows; a NaN in q or k makes
    whole rows NaN, every feature.  So in a head whose block has a number anywhere (the first one, unless NaNs in
    q or k fill it), the features NaN in every row are V's.  When every head's block is NaN throughout, V is read
    for its NaNs."""
    last0 = tl.maximum(q_len - 1, 0) // FWD_BLOCK_M * FWD_BLOCK_M
    offs_r = tl.arange(0, OUT_ROWS)
    nan_cols = tl.zeros([D_ROW], dtype=tl.int32)
    read = 0  # whether a head's block had a number
    for g in range(0, GROUP):
        if read == 0:
            o_head = o_seq + (hk * GROUP + g).to(tl.int64) * stride_oh
            all_rows = tl.full([D_ROW], 1, tl.int32)
            for r0 in range(last0, q_len, OUT_ROWS):
                rows = r0 + offs_r
                o = tl.load(o_head + rows[:, None] * stride_om + offs_d[None, :],
                            mask=(rows[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM), other=float("nan"))
                all_rows = tl.minimum(all_rows, tl.min((o != o).to(tl.int32), 0))
            if tl.min(all_rows, 0) == 0:  # (padding features and rows count as NaN here)
                nan_cols = all_rows
                read = 1
    if (read == 0) & (q_len > 0):
        nan_cols = _v_nan_columns(V_head, 0, 1, k_len, stride_vn, stride_vd, tl.arange(0, BLOCK_N), offs_d, HEAD_DIM,
                                  D_ROW, BLOCK_N, V_head.dtype.element_ty.is_fp8()).to(tl.int32)
    return tl.where(offs_d < HEAD_DIM, nan_cols, 0)


@triton.jit
def v_nan_flags_kernel(V, NanFlags, cu_seqlens_k, seqlen_k, total_k, stride_vb, stride_vn, stride_vh,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_VARLEN: tl.constexpr, stride_vd=1):
    """NanFlags[b, hk, split, d] = 1 if V of sequence b, KV head hk holds a NaN in feature d of key
    blocks split, split + splits, ... (splits = programs on grid axis 0); else 0 (every entry is
    written; int8).  FP8 V (a dtype path, as in attn_fwd_kernel) is compared in fp32 and may be
    token-major (stride_vd)."""
    FP8: tl.constexpr = V.dtype.element_ty.is_fp8()
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    _, _, k_start, k_len = seq_bounds(cu_seqlens_k, cu_seqlens_k, b, seqlen_k, seqlen_k, total_k, total_k, IS_VARLEN)
    V_head = V + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    offs_d = tl.arange(0, D_PAD)
    tl.store(NanFlags + ((b * tl.num_programs(1) + hk) * splits + split) * D_PAD + offs_d,
             _v_nan_columns(V_head, split, splits, k_len, stride_vn, stride_vd, tl.arange(0, BLOCK_N), offs_d,
                            HEAD_DIM, D_PAD, BLOCK_N, FP8))


@triton.jit
def _v_nan_columns(V_head, first, step, k_len, stride_vn, stride_vd, offs_n, offs_d,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """int8 [D_PAD]: 1 where V's key blocks first, first + step, ... (of k_len keys) hold a NaN in that
    feature.  FP8 V may be token-major (stride_vd)."""
    found = tl.zeros([BLOCK_N, D_PAD], dtype=tl.int8)  # (int8: a quarter of an int32 tile's registers)
    for n0 in range(first * BLOCK_N, k_len, step * BLOCK_N):
        found = tl.maximum(found, _v_nan_tile(V_head, n0 + offs_n, k_len, stride_vn, stride_vd, offs_d, HEAD_DIM,
                                              FP8).to(tl.int8))
    return tl.max(found, 0)


def v_nan_flags(v, cu_seqlens_k, varlen, batch, hk, d, d_pad, seqlen_k, max_seqlen_k):
    """int8 (batch, hk, splits, d_pad): nonzero where V of (sequence, KV head) holds a NaN in a feature,
    split over at most NAN_SPLITS_MAX programs per (sequence, KV head) (tables.V_NAN_FLAGS)."""
    arch = arch_for(v)
    if arch.backend == "interpreter":  # one torch pass, not splits * hk * batch interpreted programs
        return _v_nan_flags_torch(v, cu_seqlens_k, varlen, batch, hk, d, d_pad)
    cfg = nan_flags_config(arch)
    block_n, splits = head_scan_grid(cfg, d_pad, max_seqlen_k, NAN_SPLITS_MAX.value, heads=batch * hk)
    flags = torch.empty((batch, hk, splits, d_pad), device=v.device, dtype=torch.int8)
    jit_launch(v_nan_flags_kernel, (splits, hk, batch), (
        v, flags, cu_seqlens_k, seqlen_k, v.shape[0], *row_strides(v, varlen)),
        dict(HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n, IS_VARLEN=varlen, num_warps=cfg["num_warps"],
             **({"stride_vd": v.stride(-1)} if v.stride(-1) != 1 else {})))
    return flags


def _v_nan_flags_torch(v, cu_seqlens_k, varlen, batch, hk, d, d_pad):
    """v_nan_flags on CPU tensors: one split, every NaN flag in it."""
    nan = torch.isnan(v.float() if v.dtype.itemsize == 1 else v).to(torch.int32)  # FP8: compare in fp32
    flags = torch.zeros((batch, hk, 1, d_pad), dtype=torch.int8)
    if varlen:  # NaN count per segment: differences of a running count at the (clamped) boundaries
        running = torch.cat([nan.new_zeros(1, hk, d), nan.cumsum(0)])
        cu = cu_seqlens_k[:batch + 1].long().clamp(0, v.shape[0])
        flags[:, :, 0, :d] = (running[cu[1:]] - running[cu[:-1]] > 0).to(torch.int8)
    else:
        flags[:, :, 0, :d] = (nan.sum(1) > 0).to(torch.int8)
    return flags


# --------------------------------------------------------------------------- probabilities (testing aid)

@triton.jit
def attn_probs_kernel(
    Q, K, Lse, Probs,
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_lb, stride_lh,
    stride_pb, stride_ph, stride_pm,
    Alibi, stride_ab, SeedState, keep_threshold,
    total_q, total_k,
    qk_scale_log2, softcap_div, softcap_log2, win_left, win_right,
    QDescale, KDescale, VDescale, stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    GROUP, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, RELOAD_CHUNK: tl.constexpr, Q_DESCALE_PER_KV_HEAD: tl.constexpr = False,
):
    """S_dmask for return_attn_probs: softmax probabilities, negated where dropout dropped them."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, total_q, total_k,
                                                IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    diag = k_len - q_len
    hk = div_small(h, GROUP)  # (heads < 2**16: MAX_GRID_YZ)
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_mask = offs_m < q_len
    FP8: tl.constexpr = Q.dtype.element_ty.is_fp8()
    q_descale, k_descale, v_descale = load_head_descales(  # v: unused
        QDescale, KDescale, VDescale, b, h, hk, stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb,
        stride_vdh, Q_DESCALE_PER_KV_HEAD, FP8)
    if FP8:  # as in attn_fwd_kernel
        qk_scale_log2 = qk_scale_log2 * (q_descale * k_descale)
        softcap_div = softcap_div * (q_descale * k_descale)
    if RELOAD_CHUNK:
        q_rows = (Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
                  + offs_m[:, None] * stride_qm)
    else:
        q = tl.load(Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
                    + offs_m[:, None] * stride_qm + offs_d[None, :],
                    mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    lse_log2 = tl.load(Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m,
                       mask=row_mask, other=float("inf")) * LOG2E
    K_head = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    slope_log2 = alibi_slope_log2(Alibi, stride_ab, b, h, HAS_ALIBI)
    seed, seed_offset = dropout_seed(SeedState, HAS_DROPOUT)
    bh = b * tl.num_programs(1) + h
    P_head = Probs + b64 * stride_pb + h.to(tl.int64) * stride_ph
    for start_n in range(0, k_len, BLOCK_N):
        cols = start_n + offs_n
        if RELOAD_CHUNK:
            # q streamed in head-dim chunks with each key block, as in _fwd_inner
            s = dot_rows_nt(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), q_rows,
                             offs_m[:, None] < in_loop(q_len, start_n, k_len), K_head + cols[:, None] * stride_kn,
                             cols[:, None] < k_len, HEAD_DIM, D_PAD, RELOAD_CHUNK, INPUT_PRECISION)
        else:
            kT = tl.load(K_head + cols[None, :] * stride_kn + offs_d[:, None],
                         mask=(cols[None, :] < k_len) & (offs_d[:, None] < HEAD_DIM), other=0.0)
            s = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        s, _ = score_log2(s, offs_m[:, None], cols[None, :], diag, k_len, qk_scale_log2, softcap_div,
                          softcap_log2, slope_log2, win_left, win_right,
                          True, IS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT)
        p = tl.exp2(s - lse_log2[:, None])
        if HAS_DROPOUT:
            keep = dropout_keep(seed, seed_offset, bh, offs_m[:, None], cols[None, :], keep_threshold)
            p = tl.where(keep, p, -p)
        tl.store(P_head + offs_m[:, None] * stride_pm + cols[None, :], p.to(Probs.dtype.element_ty),
                 mask=row_mask[:, None] & (cols[None, :] < k_len))


# --------------------------------------------------------------------------- launcher

# (device, stream, thread) -> the int32 NaN flags of NAN_FIXUP forwards, all zero between calls: the forward
# marks V's NaN features, v_nan_fixup_kernel reads the marks and zeroes them (no zero-fill launch per call)
_NAN_FLAGS = {}
_RETIRED_NAN_FLAGS = []


def _nan_flags_key(q):
    # per thread too: another thread's forward on the same stream could land between a forward and its fix-up
    return q.device, current_stream() if q.is_cuda else None, threading.get_ident()


def kept_nan_flags(q, shape) -> torch.Tensor:
    """Zeroed int32 NaN flags of `shape` (batch, hk, d_pad) for a NAN_FIXUP forward on q's device: a view of
    the buffer kept for this stream and thread, which the fix-up leaves zero (a torch.zeros per call cost a
    launch and ~10 us of host time); under graph capture a fresh one, captured with its memset, so a replay
    shares nothing with eager calls or other graphs."""
    n = shape[0] * shape[1] * shape[2]
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros(shape, dtype=torch.int32, device=q.device)
    buf = kept_zeros(_NAN_FLAGS, _RETIRED_NAN_FLAGS, _nan_flags_key(q), n, q.device)
    return buf[:n].view(shape)


def forget_nan_flags(q):
    """Drop this stream and thread's kept NaN flags (a forward whose fix-up did not run may have left marks); the
    next masked forward gets a new zeroed buffer.  (The dropped one stays allocated: a launch still queued may use
    it.)"""
    dropped = _NAN_FLAGS.pop(_nan_flags_key(q), None)
    if dropped is not None:
        _RETIRED_NAN_FLAGS.append(dropped)


def _descale_slots(descales) -> dict:
    """A launch plan's names for the FP8 descale tensors (None without FP8)."""
    qd, kd, vd = descales or (None, None, None)
    return dict(q_descale=qd, k_descale=kd, v_descale=vd)


def _descale_args(descales, q, nheads_q: int) -> dict:
    """The forward kernels' descale arguments: the caller's three tensors and their (batch, head) strides
    (score_mods.load_head_descales); without FP8, stand-ins the kernels never read."""
    if descales is None:
        return dict(QDescale=q, KDescale=q, VDescale=q, stride_qdb=0, stride_qdh=0, stride_kdb=0, stride_kdh=0,
                    stride_vdb=0, stride_vdh=0)
    args = descale_args(*descales)
    if descales[0].shape[1] != nheads_q:  # FA3's q_descale: one per (batch, KV head)
        args["Q_DESCALE_PER_KV_HEAD"] = True
    return args


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      window_left, window_right, softcap, alibi_slopes, rng_state, return_probs, sinks=None,
                      descales=None, out_dtype=None):
    """Returns (out, softmax_lse, probs); probs is empty unless return_probs.

    sinks: None, or fp32 (nheads_q,) learnable sink logits that join each row's softmax
    denominator (softmax_lse then includes them; probs exclude the sink's share).
    FP8 q, k, v (one fp8 dtype; the kernels take the FP8 path from it) come with `descales`, the fp32
    tensors (q_descale, k_descale, v_descale), read in place (score_mods.load_head_descales): k and v
    (batch, nheads_k), q (batch, nheads_q) or (batch, nheads_k), any strides (an absent one a ones view
    with strides 0); and `out_dtype` (fa_amd.fp8 checks both).  V may then also be token-major per head
    (v.stride(-3) == 1)."""
    plan_key = rows = arch = None
    if not return_probs and sinks is None and q.device.type != "cpu":
        # the common call (no probs or sinks; FP8 too, its descales a tensor of the replay): replay the
        # launches of an earlier call of this structure (kernels/launch.LaunchPlan; cut the host time of
        # small calls, TUNING_NOTES v11)
        plan_key = ("plan", "fwd", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
                    v.dtype, q.device, cu_seqlens_q is None, cu_seqlens_k is None, max_seqlen_q, max_seqlen_k,
                    dropout_p, softmax_scale, window_left, window_right, softcap, rng_state is None, out_dtype,
                    None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride()),
                    None if descales is None else tuple((x.shape, x.stride()) for x in descales),
                    tables.SHORT_SEQLEN_K, tables.FWD_NAN_FIXUP_FAMILIES, tables.FWD_NAN_FROM_OUT_FAMILIES,
                    tables.HEAD_DIM_SPLIT_FAMILIES, tables.EVEN_QK_FAMILIES, tables.EVEN_QK_FP8_FAMILIES,
                    get_fwd_config,
                    launch,
                    alias_pattern(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state,
                                  *(descales or (None,) * 3)))
        arch = arch_for(q)
        rows = table_rows(arch, head_dim_padded(q.shape[-1]))
        plan = memo_get(plan_key, rows, False)  # False: not seen yet; None: no plan for this structure
        if plan:
            launches, lse_shape, flags_spec = plan
            out = new_output(q, q.shape, out_dtype)
            lse = new_output(q, lse_shape, torch.float32)
            flags = None
            if flags_spec is not None:  # (shape, dtype, zeroed: the fix-up's marks start at 0)
                flags = kept_nan_flags(q, flags_spec[0]) if flags_spec[2] else \
                    torch.empty(flags_spec[0], device=q.device, dtype=flags_spec[1])
            try:
                ran = launches.run(dict(q=q, k=k, v=v, out=out, lse=lse, flags=flags, cu_q=cu_seqlens_q,
                                        cu_k=cu_seqlens_k, alibi=alibi_slopes, rng=rng_state,
                                        **_descale_slots(descales)))
            except BaseException:
                if flags is not None:
                    forget_nan_flags(q)  # (kept flags: the forward may have left marks that no fix-up cleared)
                raise
            if ran:
                return out, lse, q.new_empty((0,), dtype=out.dtype)
        if plan is None:
            plan_key = None
    with recording() as recorded:
        out, lse, probs, nan_flags = _attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_left,
            window_right, softcap, alibi_slopes, rng_state, return_probs, sinks, descales, out_dtype)
    if plan_key is not None:
        # (no launch recorded: an empty problem, filled on the host; no plan either)
        launches = LaunchPlan.build(recorded, dict(q=q, k=k, v=v, out=out, lse=lse, flags=nan_flags, cu_q=cu_seqlens_q,
                                                   cu_k=cu_seqlens_k, alibi=alibi_slopes, rng=rng_state,
                                                   **_descale_slots(descales)),
                                    arch.is_hip) if recorded else None
        flags_spec = None if nan_flags is None else (tuple(nan_flags.shape), nan_flags.dtype, nan_flags.dim() == 3)
        memo_put(plan_key, rows, None if launches is None else (launches, tuple(lse.shape), flags_spec))
    return out, lse, probs


def _attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       window_left, window_right, softcap, alibi_slopes, rng_state, return_probs, sinks, descales,
                       out_dtype):
    """attention_forward's launches; returns (out, lse, probs, the V NaN flags or None)."""
    varlen, batch, hq, hk, d, seqlen_q, seqlen_k = shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = new_output(q, q.shape, out_dtype)
    lse = new_output(q, (hq, q.shape[0]) if varlen else (batch, hq, seqlen_q), torch.float32)
    # (empty unless asked for: no zero-fill dispatch per call)
    probs = q.new_zeros((batch, hq, max_seqlen_q, max_seqlen_k), dtype=out.dtype) if return_probs \
        else q.new_empty((0,), dtype=out.dtype)
    if batch == 0 or max_seqlen_q == 0 or hq == 0:
        # no query row is in a sequence: every token (e.g. past cu_seqlens_q[-1]) gets output 0, lse +inf
        return out.zero_(), lse.fill_(float("inf")), probs, None
    fp8 = descales is not None
    d_pad = head_dim_padded(d, fp8=fp8)
    scalars, flags, keep_scale = score_args(q, alibi_slopes, rng_state, dropout_p, softmax_scale,
                                             window_left, window_right, softcap, max_seqlen_q, max_seqlen_k)
    # causal / right-windowed rows and short rows (few keys each) may take smaller tiles from the table
    arch = arch_for(q)
    # a head dim that is not a power of two may run as two chunks (tables.HEAD_DIM_SPLIT_FAMILIES)
    d_lo, d_hi = (d_pad, 0) if fp8 else head_dim_chunks(arch, d, d_pad)
    cfg = get_fwd_config(arch, d_lo + d_hi, q.dtype == torch.float32, flags["HAS_RIGHT"], is_short(max_seqlen_k),
                         fp8=fp8)
    if d_hi and cfg["RELOAD_CHUNK"]:  # (a table that sets it: the reloading kernel takes one chunk)
        d_lo, d_hi = d_pad, 0
        cfg = get_fwd_config(arch, d_pad, q.dtype == torch.float32, flags["HAS_RIGHT"], is_short(max_seqlen_k))
    # plain tiles take the max of the raw scores where the tables say so (tables.FWD_RAW_MAX_FAMILIES)
    raw_max = family_of(arch) in tables.FWD_RAW_MAX_FAMILIES
    cu_q = cu_seqlens_q if varlen else q
    cu_k = cu_seqlens_k if varlen else q
    common = kernel_args(hq, hk, d, d_pad, varlen, flags, total_q=q.shape[0], total_k=k.shape[0])
    descale_args = _descale_args(descales, q, hq)
    # masks skip key blocks: NaN flags of V, so every row meets a NaN in V as in the reference -- from
    # a pass over V before the forward, or (tables.FWD_NAN_FIXUP_FAMILIES) marked inside it and written
    # by v_nan_fixup_kernel after it; without a left window (tables.FWD_NAN_FROM_OUT_FAMILIES) the fix-up finds
    # them in the last query block's output instead, and the forward marks nothing
    nan_fixup = nan_flags = None
    nan_from_out = marks = False  # marks: the forward's programs mark V's NaNs in the kept flags
    if flags["HAS_LEFT"] or flags["HAS_RIGHT"]:
        nan_fixup = family_of(arch) in tables.FWD_NAN_FIXUP_FAMILIES
        # (the interpreter's FP8 widening turns NaNs into numbers before the P.V dot: FP8 marks there)
        nan_from_out = nan_fixup and not flags["HAS_LEFT"] and family_of(arch) in tables.FWD_NAN_FROM_OUT_FAMILIES \
            and not (fp8 and arch.backend == "interpreter")
        marks = nan_fixup and not nan_from_out
        if marks:
            # (d_pad: the kernel's D_ROW, both chunks of a split head dim)
            nan_flags = kept_nan_flags(q, (batch, hk, d_pad))
        elif not nan_fixup:
            nan_flags = v_nan_flags(v, cu_k, varlen, batch, hk, d, d_pad, seqlen_k, max_seqlen_k)
    group_size = program_group(arch, "fwd", d_lo + d_hi, triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), flags["HAS_RIGHT"],
                               fp8)
    order = dict(pairs_per_group=group_size, GROUPED_ORDER=True) if grouped_order(arch, "fwd") else {}
    even = family_of(arch) in (tables.EVEN_QK_FP8_FAMILIES if fp8 else tables.EVEN_QK_FAMILIES)
    try:
        # varlen: one more program row (batch index `batch`) writes the tokens past cu_seqlens_q[-1]
        used = launch(attn_fwd_kernel, cfg, grid_blocks(max_seqlen_q, "BLOCK_M"), (hq, batch + varlen), (
            q, k, v, out, lse, cu_q, cu_k, seqlen_q, seqlen_k,
            *row_strides(q, varlen), *row_strides(k, varlen), *row_strides(v, varlen), v.stride(-1),
            *row_strides(out, varlen), *lse_strides(lse, varlen)),
            dict(keep_scale=keep_scale, **descale_args, **scalars, **dict(common, D_PAD=d_lo),
                 **({"D_HI": d_hi} if d_hi else {}), NanFlags=q if nan_flags is None else nan_flags,
                 nan_splits=0 if nan_flags is None or nan_fixup else nan_flags.shape[2],
                 **({"NAN_FIXUP": True} if nan_fixup else {}), **({"NAN_FROM_OUT": True} if nan_from_out else {}),
                 POSITIVE_SCALE=0 < softmax_scale <= tables.FWD_RAW_MAX_SCALE and raw_max, **order,
                 **(dict(Sinks=sinks, HAS_SINKS=True) if sinks is not None else {})),
            per_cfg=lambda c: dict(EVEN_QK=even and even_qk(varlen, seqlen_q, seqlen_k, (c["BLOCK_M"], c["BLOCK_N"]))))
        if nan_fixup:
            nan_cfg = nan_flags_config(arch)  # (the V NaN rule's table row: the fix-up's rows per block too)
            from_out = {}
            if nan_from_out:  # (the last query block's rows in loads of <= 8192 elements; V only where they are all NaN)
                stride_vb, stride_vn, stride_vh = row_strides(v, varlen)
                from_out = dict(FROM_OUT=True, FWD_BLOCK_M=used["BLOCK_M"],
                                OUT_ROWS=min(used["BLOCK_M"], max(1, 8192 // d_pad)), V=v, cu_seqlens_k=cu_k,
                                seqlen_k=seqlen_k, total_k=common["total_k"], stride_vb=stride_vb,
                                stride_vn=stride_vn, stride_vh=stride_vh,
                                **({"stride_vd": v.stride(-1)} if v.stride(-1) != 1 else {}),
                                BLOCK_N=max(16, nan_cfg["BLOCK_ELEMENTS"] // d_pad))
            jit_launch(v_nan_fixup_kernel, (hk, batch), (
                out, out if nan_flags is None else nan_flags, cu_q, seqlen_q, common["total_q"],
                *row_strides(out, varlen)),
                dict(GROUP=hq // hk, HEAD_DIM=d, D_ROW=d_pad, BLOCK_M=max(1, nan_cfg["BLOCK_ELEMENTS"] // d_pad),
                     IS_VARLEN=varlen, num_warps=nan_cfg["num_warps"], **from_out))
    except BaseException:
        if marks:
            forget_nan_flags(q)  # (kept flags: the forward may have left marks that no fix-up cleared)
        raise
    if return_probs:
        scalars.pop("SeedState")
        seed_state = rng_state if flags["HAS_DROPOUT"] else q
        probs_cfg = {k: v for k, v in cfg.items() if k != "FWD_MERGED_EDGES"}  # (attn_fwd_kernel's switch alone)
        launch(attn_probs_kernel, probs_cfg, grid_blocks(max_seqlen_q, "BLOCK_M"), (hq, batch), (
            q, k, lse, probs, cu_q, cu_k, seqlen_q, seqlen_k,
            *row_strides(q, varlen), *row_strides(k, varlen), *lse_strides(lse, varlen),
            probs.stride(0), probs.stride(1), probs.stride(2)),
            dict(SeedState=seed_state, **descale_args, **scalars, **common))
    return out, lse, probs, nan_flags
