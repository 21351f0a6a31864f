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
def seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, q_len, k_start, k_len) of sequence `b`: dense is varlen with
    implicit offsets, so one kernel serves both layouts."""
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        q_len = tl.load(cu_seqlens_q + b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + b)
        k_len = tl.load(cu_seqlens_k + b + 1) - k_start
    else:
        q_start = b * 0
        q_len = b * 0 + seqlen_q
        k_start = b * 0
        k_len = b * 0 + seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def tanh(x):
    # Written with exp2 because libdevice/ocml tanh is not reachable portably;
    # saturates cleanly to +-1 for large |x|.
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def score_log2(qk, rows, cols, diag, seqlen_k, qk_scale_log2, softcap_div, softcap_log2, slope_log2,
               win_left, win_right,
               MASK: tl.constexpr, IS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Raw q.k tile -> (modified score in log2 units, tanh term for softcap's derivative)."""
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
        keep = cols < seqlen_k
        if HAS_RIGHT:
            keep = keep & (rel <= win_right)
        if HAS_LEFT:
            keep = keep & (rel >= -win_left)
        s = tl.where(keep, s, float("-inf"))
    return s, t


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
