"""@triton.jit tile helpers shared by the forward, backward and decode kernels: which key
(query) blocks a query (key) tile visits under causal / window masks, and the
head-dim-chunked dot product of the register-light RELOAD_CHUNK kernels.

Loops over key (or query) blocks are split in three ranges:
  [lo, full_lo)      boundary blocks of the left window edge  -> element mask
  [full_lo, full_hi) blocks every row sees completely          -> no mask
  [full_hi, hi)      diagonal / right edge / ragged tail       -> element mask
and blocks outside [lo, hi) are never touched.
"""
import triton
import triton.language as tl


@triton.jit
def div_small(x, d):
    """x // d for 0 <= x < 2**22 and 1 <= d < 2**22 (the caller guarantees it): an fp32 quotient, within one of
    the true one there, and one correction step.  About a dozen instructions where Triton's exact integer
    division by a runtime value takes ~40 in a serial chain (sm90 SASS): the program-id arithmetic at the start of
    every program of the short launches (TUNING_NOTES v34).  x and d may be constexprs (Triton specializes an int
    argument equal to 1), hence tl.cast rather than .to()."""
    q = tl.cast(tl.cast(x, tl.float32) / tl.cast(d, tl.float32), tl.int32)
    r = x - q * d
    return tl.where(r < 0, q - 1, tl.where(r >= d, q + 1, q))


@triton.jit
def grouped_program_ids(group_size, GROUPED: tl.constexpr):
    """(axis-0 index, head, batch index) of this program on a (per-pair programs, heads, batch) grid, in groups
    of `group_size` (>= 1) consecutive (batch, head) pairs, heads fastest (a GQA group's heads stay together):
    the groups run in turn, and within a group the axis-0 index varies slowest, so every pair's first axis-0
    programs start before any pair's last ones.  GPUs start programs in about linear grid order; the causal
    kernels put their heaviest programs first on axis 0, and grouping pairs lets the light ones of a whole
    group fill the last wave instead of one pair's (tables.PROGRAM_GROUPS).  group_size 1 is the grid
    order: each pair's programs in turn.  GROUPED False (families without PROGRAM_GROUPS entries) compiles the
    grid order alone: no index arithmetic live in the kernel (it cost gfx908 a 28 B spill under triton 3.2)."""
    if not GROUPED:
        return tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_0 = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if group_size > 1:  # (group_size 1: the grid order, no arithmetic)
        n_h = tl.num_programs(1)
        n_bh = n_h * tl.num_programs(2)
        if tl.num_programs(0) * group_size < 4194304 and n_bh < 4194304:  # (2**22: div_small's range)
            pid_0, h, b = _grouped_ids(pid_0, h + n_h * b, n_h, n_bh, group_size, True)
        else:
            pid_0, h, b = _grouped_ids(pid_0, h + n_h * b, n_h, n_bh, group_size, False)
    return pid_0, h, b


@triton.jit
def _grouped_ids(pid_0, pair, n_h, n_bh, group_size, SMALL: tl.constexpr):
    """grouped_program_ids' remapping of program (pid_0, pair in grid order); SMALL: every index below 2**22
    (divisions through div_small).  The grid-order linear index pid_0 + n_0 * pair falls in group
    pair // group_size, at rank pid_0 + n_0 * (pair % group_size) within it."""
    group = _div(pair, group_size, SMALL)
    rank = pid_0 + tl.num_programs(0) * (pair - group * group_size)
    size = tl.minimum(n_bh - group * group_size, group_size)  # the last group may be partial
    pid_0 = _div(rank, size, SMALL)
    bh = group * group_size + (rank - pid_0 * size)
    b = _div(bh, n_h, SMALL)
    return pid_0, bh - b * n_h, b


@triton.jit
def _div(x, d, SMALL: tl.constexpr):
    if SMALL:
        return div_small(x, d)
    return x // d


@triton.jit
def whole_blocks(q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """(q_len, k_len) as a kernel of an EVEN_QK launch uses them: the host passes EVEN only when every sequence's
    lengths are whole multiples of the tiles, and the kernel then loads whole blocks without row / key bounds.
    Rounding down here keeps every such load inside the sequence even if that promise were broken."""
    if EVEN:
        q_len = q_len // BLOCK_M * BLOCK_M
        k_len = k_len // BLOCK_N * BLOCK_N
    return q_len, k_len


@triton.jit
def key_ranges(m0, q_len, k_len, diag, win_left, win_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key-block ranges (lo, full_lo, full_hi, hi) for query rows [m0, m0+BLOCK_M)."""
    lo = m0 * 0
    hi = k_len
    if HAS_RIGHT:
        hi = tl.minimum(hi, m0 + BLOCK_M + diag + win_right)
    if HAS_LEFT:
        lo = tl.maximum(lo, m0 + diag - win_left) // BLOCK_N * BLOCK_N
    full_lo = lo
    if HAS_LEFT:
        full_lo = (tl.maximum(full_lo, m0 + BLOCK_M - 1 + diag - win_left) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    # q is loaded (masked) once per program, so rows past the end only need
    # the key tail masked
    full_hi = k_len // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, tl.maximum(m0 + diag + win_right + 1, 0) // BLOCK_N * BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_ranges(n0, q_len, k_len, diag, win_left, win_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query-block ranges (lo, full_lo, full_hi, hi) that see keys [n0, n0+BLOCK_N)."""
    lo = n0 * 0
    hi = q_len
    if HAS_RIGHT:
        lo = tl.maximum(lo, n0 - diag - win_right) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(hi, n0 + BLOCK_N - diag + win_left)
    full_lo = lo
    if HAS_RIGHT:
        full_lo = (tl.maximum(full_lo, n0 + BLOCK_N - 1 - diag - win_right) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    # query rows are loaded per block here: the ragged row tail needs masked loads,
    # and a ragged key block needs its dead columns masked out of every row
    full_hi = q_len // BLOCK_M * BLOCK_M
    if n0 + BLOCK_N > k_len:
        full_hi = full_lo
    if HAS_LEFT:
        full_hi = tl.minimum(full_hi, tl.maximum(n0 - diag + win_left + 1, 0) // BLOCK_M * BLOCK_M)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def in_loop(n, it, end):
    """n, tied to the loop iteration `it` (it < end inside the loop, so this is n): a load
    masked with it is not loop-invariant, so loop-invariant code motion cannot hoist it
    (and its register-hungry dot-operand copy) out of the loop (RELOAD_CHUNK)."""
    return tl.minimum(n, n + (end - it))


@triton.jit
def dot_rows_nt(acc, A_rows, a_ok, B_rows, b_ok, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 D_CHUNK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + A @ B^T for A, B row-major [rows, HEAD_DIM] in memory (A_rows / B_rows: [R, 1] row
    pointers, a_ok / b_ok: [R, 1] row masks; masked rows read as 0), loaded D_CHUNK head-dim
    columns at a time: only one slice of each operand is ever held in registers."""
    # a conditional expression, not min(): before triton 3.6 min() of constexprs is tl.minimum (a tensor)
    CHUNK: tl.constexpr = D_CHUNK if D_CHUNK < D_PAD else D_PAD
    offs = tl.arange(0, CHUNK)
    for c in tl.static_range(0, D_PAD, CHUNK):
        col_ok = (c + offs[None, :]) < HEAD_DIM
        a = tl.load(A_rows + (c + offs[None, :]), mask=a_ok & col_ok, other=0.0)
        b = tl.load(B_rows + (c + offs[None, :]), mask=b_ok & col_ok, other=0.0)
        # B in A's dtype: a no-op but for an FP8 KV cache under a high-precision q (kernels/decode.py)
        acc = tl.dot(a, tl.trans(b.to(a.dtype)), acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def load_row_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASK: tl.constexpr):
    """A [rows, D_PAD] tile; rows at or past n_rows (with MASK) and padded head-dim columns read as 0."""
    if MASK:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif D_PAD > HEAD_DIM:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def load_cols_t(row_ptrs, row_ok, cols, HEAD_DIM: tl.constexpr, CHUNK_END: tl.constexpr, MASK: tl.constexpr):
    """The head-dim columns `cols` (ending at CHUNK_END) of rows `row_ptrs`, in either orientation (row_ptrs
    and row_ok broadcast against cols); rows not row_ok (with MASK) and columns past HEAD_DIM read as 0."""
    if MASK:
        tile = tl.load(row_ptrs + cols, mask=row_ok & (cols < HEAD_DIM), other=0.0)
    elif CHUNK_END > HEAD_DIM:
        tile = tl.load(row_ptrs + cols, mask=cols < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(row_ptrs + cols)
    return tile


@triton.jit
def store_cols_t(row_ptrs, row_ok, cols, value, HEAD_DIM: tl.constexpr, CHUNK_END: tl.constexpr,
                 MASK: tl.constexpr, ATOMIC: tl.constexpr):
    """load_cols_t's store: `value` into the columns `cols` of rows `row_ptrs` (cast to the output's dtype), or
    added into them with fp32 atomics (ATOMIC); rows not row_ok (with MASK) and columns past HEAD_DIM untouched."""
    ptrs = row_ptrs + cols
    if ATOMIC:
        if MASK:
            tl.atomic_add(ptrs, value, mask=row_ok & (cols < HEAD_DIM), sem="relaxed")
        elif CHUNK_END > HEAD_DIM:
            tl.atomic_add(ptrs, value, mask=cols < HEAD_DIM, sem="relaxed")
        else:
            tl.atomic_add(ptrs, value, sem="relaxed")
    else:
        value = value.to(ptrs.dtype.element_ty)
        if MASK:
            tl.store(ptrs, value, mask=row_ok & (cols < HEAD_DIM))
        elif CHUNK_END > HEAD_DIM:
            tl.store(ptrs, value, mask=cols < HEAD_DIM)
        else:
            tl.store(ptrs, value)


@triton.jit
def zero_rows(Base, stride_row, n_rows, first_block, num_blocks,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Zero rows [0, n_rows) of a [rows, HEAD_DIM] view (row stride stride_row): this program takes
    row blocks first_block, first_block + num_blocks, ...  Row bases are int64: n_rows (the tokens
    past the last varlen segment) is not bounded by max_seqlen."""
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_PAD)
    zeros = tl.zeros([BLOCK, D_PAD], dtype=Base.dtype.element_ty)
    for r0 in range(first_block * BLOCK, n_rows, num_blocks * BLOCK):
        tl.store(Base + tl.cast(r0, tl.int64) * stride_row + offs[:, None] * stride_row + offs_d[None, :], zeros,
                 mask=((r0 + offs[:, None]) < n_rows) & (offs_d[None, :] < HEAD_DIM))
