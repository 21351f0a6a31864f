"""Score modifiers shared by every attention kernel (forward, both backward
kernels and the probability dump), so the directions cannot drift apart.

All helpers are elementwise and shape-agnostic: `rows`/`cols` broadcast against
the score tile, so the dK/dV kernel can call them on its transposed (keys x
queries) tile exactly as the forward calls them on (queries x keys).

Conventions (flash-attn >= 2.1):
  * scores live in log2 units (`exp2` is the fast path on every GPU);
  * `rel = col - (row + seqlen_k - seqlen_q)` is the distance of a key from the
    query's bottom-right aligned diagonal.  causal == window right bound 0;
    window (left, right) keeps  -left <= rel <= right;
  * ALiBi adds  -slope * |rel|;
  * softcap maps  s -> softcap * tanh(s / softcap)  before ALiBi and masking;
  * a learnable sink (one logit per query head, gpt-oss's s_aux) joins the softmax
    denominator only: lse_i = log(sum_j exp(s_ij) + exp(sink_h)), out_i = sum_j
    exp(s_ij - lse_i) v_j.  The forward starts its online softmax from it (sink_init);
    the backward's dP/dS are unchanged given that lse, and d sink_h = -sum_i
    exp(sink_h - lse_i) * delta_i (sink_grad_rows).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Philox with 7 rounds (as cuRAND's default philox4x32-7); one draw per element.
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN: tl.constexpr):
    """(q_start, q_len, k_start, k_len) of sequence `b`: dense is varlen with
    implicit offsets, so one kernel serves both layouts.

    Varlen bounds are clamped into the packed tensors (total_q / total_k tokens) and to
    max_seqlen (seqlen_q / seqlen_k), so no cu_seqlens content -- decreasing, negative, past
    the end, validated on the host or not -- moves a load or store outside q, k, v, the
    outputs or lse, nor past the 32-bit in-sequence offsets the entry points checked."""
    if IS_VARLEN:
        q_start, q_len = clamped_segment(cu_seqlens_q, b, seqlen_q, total_q)
        k_start, k_len = clamped_segment(cu_seqlens_k, b, seqlen_k, total_k)
    else:
        q_start = b * 0
        q_len = b * 0 + seqlen_q
        k_start = b * 0
        k_len = b * 0 + seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def clamped_segment(cu_seqlens, b, max_len, total):
    """(start, length) of segment b: start in [0, total], end in [start, total], length <= max_len."""
    start = tl.minimum(tl.maximum(tl.load(cu_seqlens + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens + b + 1), start), total)
    return start, tl.minimum(end - start, max_len)


@triton.jit
def tail_start(cu_seqlens, batch, total):
    """First token past the last segment (cu_seqlens[batch], clamped into [0, total]): tokens
    [tail_start, total) belong to no sequence (static buffers) and get zeros / lse +inf."""
    return tl.minimum(tl.maximum(tl.load(cu_seqlens + batch), 0), total)


# tanh(x) = x + x^3 P(x^2) on |x| < TANH_POLY_MAX: a float64 relative-error fit, about 1 ulp in
# float32 there.  Past it 1 - 2/(e^2x + 1) loses nothing (|tanh| > 0.5); below it that form cancels
# (absolute error ~1e-7, so softcap = 1e6 moved scores by ~0.1).
TANH_POLY_MAX = tl.constexpr(0.55)
TANH_C3 = tl.constexpr(-0.33333317663932405)
TANH_C5 = tl.constexpr(0.13332589918998028)
TANH_C7 = tl.constexpr(-0.053852723964205554)
TANH_C9 = tl.constexpr(0.021073437047738224)
TANH_C11 = tl.constexpr(-0.006276784303751259)


@triton.jit
def tanh(x):
    # Written with exp2 and a polynomial because libdevice/ocml tanh is not reachable portably;
    # relative error <= ~4e-7 everywhere, exactly +-1 for large |x| and at +-inf.
    e = tl.exp2(x * (2.0 * LOG2E))
    big = 1.0 - 2.0 / (e + 1.0)
    x2 = x * x
    poly = (((TANH_C11 * x2 + TANH_C9) * x2 + TANH_C7) * x2 + TANH_C5) * x2 + TANH_C3
    return tl.where(tl.abs(x) < TANH_POLY_MAX, x + x * x2 * poly, big)


@triton.jit
def score_log2(qk, rows, cols, diag, seqlen_k, qk_scale_log2, softcap_div, softcap_log2, slope_log2,
               win_left, win_right,
               MASK: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr = True):
    """Raw q.k tile -> (modified score in log2 units, tanh term for softcap's derivative).  KEY_BOUND False: every
    key column is below seqlen_k (whole key blocks, EVEN_QK), so MASK masks the window edges alone."""
    if IS_SOFTCAP:
        t = tanh(qk * softcap_div)
        s = t * softcap_log2
    else:
        t = qk
        s = qk * qk_scale_log2
    rel = cols - rows - diag
    if HAS_ALIBI:
        s = s - slope_log2 * tl.abs(rel).to(tl.float32)
    if MASK:
        if KEY_BOUND:
            keep = cols < seqlen_k
            if HAS_RIGHT:
                keep = keep & (rel <= win_right)
            if HAS_LEFT:
                keep = keep & (rel >= -win_left)
            s = tl.where(keep, s, float("-inf"))
        elif HAS_RIGHT:
            keep = rel <= win_right
            if HAS_LEFT:
                keep = keep & (rel >= -win_left)
            s = tl.where(keep, s, float("-inf"))
        elif HAS_LEFT:
            s = tl.where(rel >= -win_left, s, float("-inf"))
    return s, t


@triton.jit
def mask_keys(x, rows, cols, diag, seqlen_k, win_left, win_right,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr):
    """x with -inf where key `cols` is masked for query `rows`: outside the window -win_left <= rel <= win_right,
    or (KEY_BOUND) at or past seqlen_k.  Each bound is one limit per row, so a tile element costs one compare per
    bound and a select (not a rel tile and two compares); the windows are clipped so the limits stay in int32."""
    base = rows + diag  # the key on each row's diagonal: rel = cols - base
    if HAS_RIGHT:
        hi = base + 1 + tl.minimum(win_right, tl.maximum(seqlen_k - base - 1, 0))
        if KEY_BOUND:
            hi = tl.minimum(hi, seqlen_k)
        x = tl.where(cols < hi, x, float("-inf"))
    elif KEY_BOUND:
        x = tl.where(cols < seqlen_k, x, float("-inf"))
    if HAS_LEFT:
        x = tl.where(cols >= base - tl.minimum(win_left, tl.maximum(base, 0)), x, float("-inf"))
    return x


@triton.jit
def dropout_keep(seed, seed_offset, bh, rows, cols, keep_threshold):
    """Keep-mask of dropout: a pure function of (seed, offset, batch*head, row, col),
    so forward, both backward kernels and the probability dump agree bit for bit."""
    zero = (rows + cols) * 0
    r, _, _, _ = tl.philox(seed, cols + zero, rows + zero, zero + bh, zero + seed_offset, PHILOX_ROUNDS)
    # 24 random bits against round(p * 2**24): exact in int32, no float rounding.
    return (r >> 8).to(tl.int32) >= keep_threshold


@triton.jit
def alibi_slope_log2(Alibi, stride_ab, b, h, HAS_ALIBI: tl.constexpr):
    """ALiBi slope of (batch b, head h) in log2 units; stride_ab is 0 for per-head slopes."""
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h).to(tl.float32) * LOG2E
    return slope_log2


@triton.jit
def dropout_seed(SeedState, HAS_DROPOUT: tl.constexpr):
    """(seed, offset) of this call's Philox stream, read from the device tensor torch drew."""
    seed = 0
    seed_offset = 0
    if HAS_DROPOUT:
        seed = tl.load(SeedState)
        seed_offset = tl.load(SeedState + 1).to(tl.int32)
    return seed, seed_offset


@triton.jit
def sink_init(Sinks, h, BLOCK_M: tl.constexpr):
    """Online-softmax start state (m, l), in log2 units, of the rows of query head h with a
    learnable attention sink: the sink is one more logit in the softmax denominator, with no
    value row, so before any key is seen the running max is the sink and the running sum
    exp(sink - max) is 1; the key loop then rescales it like any other term.  A row that sees
    no key keeps output 0 and gets lse = sink.  A -inf sink (a head without one) gives the plain
    start (m = -inf, l = 0)."""
    sink_log2 = tl.load(Sinks + h).to(tl.float32) * LOG2E
    m = tl.zeros([BLOCK_M], dtype=tl.float32) + sink_log2
    l = tl.where(m == float("-inf"), 0.0, 1.0)
    return m, l


@triton.jit
def sink_grad_rows(Sinks, h, lse, delta, row_ok):
    """This tile's share of d sink_h = -sum_i exp(sink_h - lse_i) * delta_i (delta_i = rowsum(dO_i * O_i)):
    the sink's probability times its softmax gradient (its dP is 0: it has no value row)."""
    sink = tl.load(Sinks + h).to(tl.float32)
    p_sink = tl.exp2((sink - lse) * LOG2E)
    return -tl.sum(tl.where(row_ok, p_sink * delta, 0.0), 0)


# --------------------------------------------------------------------------- FP8 operands
# FP8 is a dtype path of the same kernels, not a copy: a kernel's FP8 constexpr is Q's element type
# being an fp8 type (a compile-time fact, so a mismatch between flag and data cannot happen).
# Then S = (q8 . k8) * q_descale * k_descale (folded into the scalar score scales), P is rounded
# to V's fp8 type for the P.V dot, and out = (P8 . v8) / l * v_descale.  P (<= 1) is scaled by
# 2**FP8_P_LOG2 before the rounding so small probabilities stay in fp8's normal range instead of
# flushing to zero; l is summed from the same scaled P, so the factor cancels in out = acc / l and
# only the lse subtracts it.  2**7: P*128 <= 128 fits every fp8 type (e4m3fnuz's max is 240).
FP8_P_LOG2 = tl.constexpr(7.0)
FP8_P_SCALE = tl.constexpr(128.0)  # 2**FP8_P_LOG2


@triton.jit
def load_head_descales(QDescale, KDescale, VDescale, b, h, hk, stride_qdb, stride_qdh, stride_kdb, stride_kdh,
                       stride_vdb, stride_vdh, Q_DESCALE_PER_KV_HEAD: tl.constexpr, FP8: tl.constexpr):
    """(q, k, v) descale of (batch b, query head h, KV head hk), read from the caller's own fp32 tensors
    (any strides; an absent descale is a one-element ones tensor with strides 0): k and v per (batch, KV
    head), q per (batch, query head) or, with Q_DESCALE_PER_KV_HEAD, per (batch, KV head) as in FA3.
    Reading them in place saves the FP8 forward and decode calls a stacking launch (2-3 us of GPU time,
    TUNING_NOTES v27).  1.0 without FP8 (then every argument may be None)."""
    q_descale = 1.0
    k_descale = 1.0
    v_descale = 1.0
    if FP8:
        b64 = b.to(tl.int64)
        if Q_DESCALE_PER_KV_HEAD:
            q_descale = tl.load(QDescale + b64 * stride_qdb + hk * stride_qdh)
        else:
            q_descale = tl.load(QDescale + b64 * stride_qdb + h * stride_qdh)
        k_descale = tl.load(KDescale + b64 * stride_kdb + hk * stride_kdh)
        v_descale = tl.load(VDescale + b64 * stride_vdb + hk * stride_vdh)
    return q_descale, k_descale, v_descale


@triton.jit
def saturate(x, limit):
    """x clamped to [-limit, limit], NaN kept NaN (a plain min / max returns the other operand for a NaN: a NaN
    appended to an FP8 cache was stored as -limit)."""
    return tl.minimum(tl.maximum(x, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def p_shift(m_shift, FP8: tl.constexpr):
    """The row offset P = exp2(s - offset) is taken from: the row max, less FP8_P_LOG2 with FP8."""
    offset = m_shift
    if FP8:
        offset = m_shift - FP8_P_LOG2
    return offset


@triton.jit
def is_nan(v):
    """v != v, for FP8 read off the bits (Triton's interpreter converts FP8 NaNs to finite values; the
    GPUs' conversions keep them): e4m3fn S.1111.111, e5m2 S.11111.xx with xx != 0, the fnuz types 0x80."""
    if v.dtype.is_fp8():
        bits = v.to(tl.uint8, bitcast=True)
        if v.dtype == tl.float8e4nv:
            nan = (bits & 0x7F) == 0x7F
        elif v.dtype == tl.float8e5:
            nan = (bits & 0x7F) > 0x7C
        else:
            nan = bits == 0x80
    else:
        nan = v != v
    return nan


@triton.jit
def fp8_v_ptrs(V_head, cols, offs_d, stride_vn, stride_vd, FP8: tl.constexpr):
    """[keys, head dim] pointers of a V tile.  With FP8, V may also be stored token-major per head
    (stride_vn == 1, which Triton specializes): the P.V dot's B operand is then K-major in memory,
    which Hopper's fp8 wgmma needs (tables.FP8_V_TOKEN_MAJOR); other dtypes have stride_vd == 1."""
    if FP8:
        ptrs = V_head + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
    else:
        ptrs = V_head + cols[:, None] * stride_vn + offs_d[None, :]
    return ptrs
