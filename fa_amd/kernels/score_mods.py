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
  * softcap maps  s -> softcap * tanh(s / softcap)  before ALiBi and masking.
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


# --------------------------------------------------------------------------- FP8 operands
# FP8 is a dtype path of the same kernels, not a copy: a kernel's FP8 constexpr is Q's element type
# being an fp8 type (a compile-time fact, so a mismatch between flag and data cannot happen).
# Then S = (q8 . k8) * q_descale * k_descale (folded into the scalar score scales), P is rounded
# to V's fp8 type for the P.V dot, and out = (P8 . v8) / l * v_descale.  P (<= 1) is scaled by
# 2**FP8_P_LOG2 before the rounding so small probabilities stay in fp8's normal range instead of
# flushing to zero; l is summed from the same scaled P, so the factor cancels in out = acc / l and
# only the lse subtracts it.  2**7: P*128 <= 128 fits every fp8 type (e4m3fnuz's max is 240).
FP8_P_LOG2 = tl.constexpr(7.0)


@triton.jit
def load_descales(Descale, b, h, nheads, FP8: tl.constexpr):
    """(q, k, v) descale of (batch b, query head h): Descale is fp32 (batch, nheads, 3), contiguous,
    holding each query head's q descale and its KV head's k and v descales; 1.0 without FP8."""
    q_descale = 1.0
    k_descale = 1.0
    v_descale = 1.0
    if FP8:
        ptr = Descale + (b.to(tl.int64) * nheads + h) * 3
        q_descale = tl.load(ptr)
        k_descale = tl.load(ptr + 1)
        v_descale = tl.load(ptr + 2)
    return q_descale, k_descale, v_descale


@triton.jit
def p_shift(m_shift, FP8: tl.constexpr):
    """The row offset P = exp2(s - offset) is taken from: the row max, less FP8_P_LOG2 with FP8."""
    offset = m_shift
    if FP8:
        offset = m_shift - FP8_P_LOG2
    return offset


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
