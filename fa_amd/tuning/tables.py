"""Default launch configurations, as data.

Keyed by arch family (fa_amd.arch names: "sm90", "gfx942", ...), then a list of
rows ordered by `head_dim` (the padded head dim, a power of two): the first row
whose head_dim >= the problem's padded head dim wins.

Each row holds "fwd", "dkdv" and "dq" launch dicts (and optionally
"dkdv_atomic", the dK/dV kernel of the deterministic=False backward; it falls
back to "dkdv"): BLOCK_M / BLOCK_N (tile sizes, constexpr), num_warps,
num_stages, and -- in HIP rows only, because only the AMD backend accepts them
-- waves_per_eu, matrix_instr_nonkdim and kpack; optionally the kernel switches
of KERNEL_SWITCHES (constexpr; RELOAD_CHUNK in the gfx1100 rows).
Optional override dicts per kernel: "causal" (causal or right-windowed
attention, where rows see fewer keys and smaller tiles waste less on the
diagonal), "short" (at most SHORT_SEQLEN_K keys per row: short loops, where
per-program set-up and the last wave's tail weigh more) and "fp32" (fp32
inputs: twice the shared memory per tile) and "fp8" (fp8 inputs, fwd only: half the
shared memory per tile; it may hold its own "causal" / "short" dicts, applied after it in those
cases), applied in that order (fa_amd.tuning.resolve_entry).

Numbers for sm90 were measured on an H100 (docs/PERFORMANCE.md, docs/TUNING_NOTES.md);
AMD rows are starting points chosen to compile with zero scratch for their
target (checked in CI by `fa-amd compile`, tests/test_aot_amd.py) and to keep
the register budget of 64-wide wavefronts; `fa-amd tune` refines them on the
user's GPU.
"""

# GQA backward: a dK/dV program sums its KV head's whole query-head group unless that program
# would be longer than this share of one SM's part of the launch's work (the rest of the GPU
# would idle in its tail); then each program takes one query head, and the group's slices are
# summed afterwards (fa_amd.kernels.backward.dkdv_heads_per_program).  H100, fused backward,
# 2026-11-23 (.ci/gqa_split.py, docs/TUNING_NOTES.md v7), forward+backward ms, whole group /
# 2 heads / 1 head per program (atomic sum): (8, 2048, 16/4) causal, whose whole-group program
# is ~28 % of an SM's share: 1.66 / 1.63 / 1.41; (2, 4096, 16/4) causal (~57 %): 1.58 / 1.51 /
# 1.25; (8, 2048, 16/4) non-causal (~15 %): 2.33 / 2.37 / 2.48.
DKDV_MAX_PROGRAM_SHARE = 0.2
# How the split slices of a GQA group are summed when atomics are allowed
# (deterministic=False; deterministic=True always uses "partials"), per arch family:
# "partials" writes one fp32 (.., hq, d) buffer and sums its slices afterwards; "atomic" adds
# every slice into one fp32 (.., hk, d) buffer with atomics (a quarter of the bytes at a 4:1
# group).  H100, same runs, one head per program: atomic 1.41 vs partials 1.51 ms at
# (8, 2048, 16/4) causal, 1.25 vs 1.36 at (2, 4096, 16/4) causal, 4.62 vs 4.83 at (2, 8192, 16/4)
# causal.  Families not listed: "partials" (not timed there; the atomic epilogue also made the
# gfx1100 d80 dK/dV kernel spill 20 B in the full AOT sweep).  "cpu" follows sm90 so CI runs it.
GQA_SPLIT_SUM = {"sm90": "atomic", "cpu": "atomic"}
# Families whose forward takes the row max of the raw scores on plain (unmasked) tiles and scales
# it once per row, so the exp2 argument is one FMA per element (POSITIVE_SCALE; softmax_scale > 0
# only).  H100 (docs/TUNING_NOTES.md v7): +1-5 % forward TFLOP/s.  Not on AMD until timed there
# (with it the gfx1100 d64 fp16 causal forward spilled 8 B in the full AOT sweep).
FWD_RAW_MAX_FAMILIES = ("sm90", "cpu")
# ... and for softmax_scale up to this only.  The FMA's exp2 argument for a row's max is the rounding residual of
# max * scale, up to half an ulp of the score: past 2**31 (log2 units) that is >= 128 and the row's exp2 is inf
# (NaN rows; softmax_scale = 1e30 did that on the H200).  At scales up to 16, |q.k| up to 9e7 stays below it; a
# larger one, the forward scales the scores first and takes their max (exact 0 for it), as on AMD.
FWD_RAW_MAX_SCALE = 16.0

# How the deterministic=False backward gets dQ, per arch family: "atomic" adds each dS K tile
# into an fp32 dQ buffer from the dK/dV programs (5 matmuls per tile pair instead of 7, but the
# buffer is zeroed, added into with atomics and converted afterwards); "recompute" runs dQ
# programs that recompute S and dP, as deterministic=True does (fused into the dK/dV launch when
# the "dkdv" and "dq" entries share launch options).  H100, 2026-11-23 (.ci/kernel_profile.py,
# docs/TUNING_NOTES.md v7), forward+backward ms, atomic / recompute in a second launch / fused:
# d128 (16, 1024) 1.48 / 1.37 / 1.29, (16, 1024) causal 1.04 / 1.23 / 0.91, GQA (8, 2048, 16/4)
# causal 2.12 / 1.76 / 1.66 (before the GQA split rule above).
# Families not listed use "atomic" (not measured there).
NONDETERMINISTIC_DQ = {"sm90": "recompute"}
# Families whose dQ programs run in the dK/dV launch (FUSED_DQ) when the row's "dkdv" and "dq"
# entries share launch options: one launch instead of two, the dQ programs fill the GPU beside
# the dK/dV ones, no idle tail between the kernels.  Measured on the H100 only; AMD families keep
# two launches until timed there (the AOT check also showed the fused gfx908 d64 kernel spilling
# 36 B).  "cpu" (the interpreter) fuses so CI tests the fused path.
FUSED_DQ_FAMILIES = ("sm90", "cpu")
# Families whose backward, when dQ has a launch of its own (backward_dq_mode "separate": the "dkdv" and "dq"
# entries do not share launch options: e.g. a tuned row; no default sm90 row since its d64 dK/dV entry took 4 warps),
# runs that launch first and lets each dQ program compute
# its rows' delta = rowsum(dO * O) (DELTA_FROM_O) for the dK/dV launch after it: no preprocess launch (a
# memory-bound pass over O and dO: 57 us at b32 s512 h16 d128 on the H100), its reads overlapping the dQ
# programs' matmuls.  H100 (.ci/bwd_delta_ab.py, 5 interleaved rounds, 2026-11-24, d64 h32 fwd+bwd TFLOP/s,
# dQ first / preprocess / Flex): b32 s512 full 254 / 248 / 255, causal 152 / 146 / 146; b16 s1024 full
# 314 / 309 / 293, causal 217 / 210 / 204; b4 s4096 causal 313 / 310 / 287; b1 s16384 full 373 / 351 / 344.
# The sm90 dQ build is unchanged (d64: 174 / 197 / 255 registers, 0 / 0 / 96 B stack, plain / causal / all
# features, with and without).  (The fused d64 launch with its 64x64/w4 dK/dV tiles then beat both: 289 vs 254
# at b32 s512 full, .ci/short_ab.py, the d64 row.)  "cpu" so CI tests it; AMD families keep the preprocess.
BWD_DELTA_IN_DQ_FAMILIES = ("sm90", "cpu")
# Families whose masked forwards mark V's NaN features with relaxed atomics from the lanes that see one (no
# reduction, barrier or acq_rel RMW per program) and let a small launch after the forward write the NaNs
# (forward.v_nan_fixup_kernel); the others take a pass over V before the forward (forward.v_nan_flags_kernel).
# It replaced an in-kernel scan (each program scanned a share of V and ordered its NaN writes by acq_rel
# atomics on a flag word per (sequence, KV head)), which cost 20-25 % of the short causal forwards (v16).  H100, 5
# interleaved rounds, causal forward TFLOP/s, fixup / scan / Flex (TUNING_NOTES v17): d64 b32 s512 173 / 157 /
# 178, b16 s1024 255 / 237 / 253; d128 198 / 188 / 188, 277 / 267 / 262; d96 / d192 / d256 s1024 253 / 219,
# 242 / 229, 251 / 239.  FP8 forwards too since 2026-11-24 (FP8 V's NaNs read off the bits, score_mods.is_nan):
# the pass was 20-25 us of a 0.5 ms b4 s4k h16 d128 causal FP8 call on the H100 (torch profiler), the fix-up 1.6.
# AMD families: untimed there, but no acq_rel atomic is left (the reason they did not scan), it saves the pass's
# launch over all of V, and it builds with zero scratch under triton 3.2-3.6 where the pass's forward spills
# 68 B at d64 causal under 3.2 (gfx908 / gfx942 / gfx950; docs/AOT.md, "The V NaN fix-up on AMD").  sm80 keeps the
# pass (untimed, unchecked).  "cpu" (the interpreter) marks, so CI tests this path; the tests switch to the pass too.
FWD_NAN_FIXUP_FAMILIES = ("sm90", "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1100", "cpu")
# Families of FWD_NAN_FIXUP_FAMILIES whose masked forwards without a left window mark nothing while they run: the
# forward's last query block read every key block into every one of its rows, so the fix-up launch finds V's NaN
# features in that block's output -- the features NaN in every row of a head whose block holds a number (a NaN in
# q or k makes whole rows NaN); where none does, the fix-up reads V (forward._v_nan_features_from_out).  The
# marks' share-out before the key loop cost every causal forward, in its prologue and in ptxas's schedule of the
# key loop (the same loop instructions, ~7 % fewer cycles per FP8 block without the marks' code in the kernel).
# NVIDIA H200, triton 3.6, d128 causal, forward kernel span in SM cycles, median per-round change over 7 rounds
# (.ci/fwd_timeline.py, TUNING_NOTES v43): b4 s4k h16 FP8 -10.5 %, bf16 -4.8 %; h16/kv4 FP8 -5.8 %, bf16 -1.2 %;
# b2 s8k FP8 -9.3 %, bf16 -2.6 %; the fix-up launch 2.8-3.3 us (torch profiler).  Windows with a left edge keep
# the marks.  "cpu": not for FP8 (the interpreter turns FP8 NaNs into numbers when it widens them, so they never
# reach the P.V dot there: _attention_forward keeps the marks); AMD: untimed, and whether its MFMA FP8 / bf16
# products keep 0 * NaN = NaN is unchecked on hardware.
FWD_NAN_FROM_OUT_FAMILIES = ("sm90", "cpu")
# The causal kernels' program order (kernels/blocks.grouped_program_ids): (batch, head) pairs run in groups of
# G = T // (programs per pair), clamped to [1, PROGRAM_GROUP_MAX]; each group's heavy programs (the forward's late
# query blocks, the backward's early key blocks) start before its light ones, so the light ones fill the last
# wave.  G = 1 is the grid order (each pair's programs in turn, heaviest first): non-causal launches (equal work
# per program), and every family, kernel, row and case not listed.  T by family, then kernel ("fwd": the forward,
# "bwd": the dK/dV launch with its fused dQ programs), then the kernel's table row (head_dim), then "fp8" (FP8
# inputs) or "causal" (the others).  H100, .ci/order_ab.py (docs/TUNING_NOTES.md v23; CUDA graphs, 7 interleaved
# rounds, TFLOP/s, grid order -> this rule):
# - forward: bf16 d128 causal b16 s1k 274 -> 280, b4 s4k 414 -> 430, b2 s8k 424 -> 437, h16/kv4 b4 s4k 448 -> 467;
#   FP8 d128 causal b4 s4k 599 -> 642, h16/kv4 b4 s4k 617 -> 672, b2 s8k 672 -> 694; bf16 d256 causal b4 s4k
#   416 -> 451, b1 s16k 533 -> 545.  T stays at 256 query blocks of 64 rows for bf16 d128: G = 4 and 8 cost b1
#   s16k 3-5 % (450 vs 467-473 in two runs), where the grid order already balances (256 blocks per pair).
# - backward (forward+backward, the forward at this table): bf16 d128 causal h16/kv4 b2 s4k (the end-to-end
#   anchor's shape) 371 at G = 1 / 383 / 392 / 389 at G = 2 / 4 / 8, b4 s4k 366 / 368 / 375 / 372, b1 s16k 415 /
#   419 / 421 / 418.  d256 and d64 lost 1-4 % at G >= 4 (not listed).
# H200 (bash .ci/gpu order, 2026-11-27, 5 rounds, grid order -> this rule): FP8 d128 causal b4 s4k 628 -> 650,
# h16/kv4 b4 s4k 625 -> 654, b2 s8k 674 -> 688; bf16 d128 causal h16/kv4 b4 s4k 429 -> 445, b4 s4k 422 -> 418 (level);
# bf16 d256 causal b4 s4k 414 -> 458; forward+backward h16/kv4 b2 s4k 371 -> 385.
# Not listed: d64 (FP8 causal forward b4 s4k 447 -> 419-425 at G = 4-16), the split head dims (untimed), AMD
# (untimed); non-causal rows moved within the rounds' spread (FP8 d128 full b1 s16k 818 -> 797 at G = 2).
PROGRAM_GROUPS = {"sm90": {"fwd": {128: {"causal": 256, "fp8": 512}, 256: {"causal": 256, "fp8": 256}},
                           "bwd": {128: {"causal": 512}}},
                  # the interpreter (one table row): groups of 2-8 pairs on the tests' short sequences
                  "cpu": {"fwd": {256: {"causal": 8, "fp8": 8}}, "bwd": {256: {"causal": 8}}}}
PROGRAM_GROUP_MAX = 16
# Families whose forward and backward kernels run a head dim that is not a power of two as two power-of-two
# chunks, e.g. 192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16 (constexpr D_HI; fa_amd.tuning.head_dim_chunks),
# instead of padding it to the next power of two: every head-dim-wide matmul then does d / d_pad of the
# padded one's work (3/4 at d192 and d96).  The launch reads the table row of the chunks' sum (sm90: rows 96
# and 192).  Not with RELOAD_CHUNK (gfx1100) or FP8 inputs.
HEAD_DIM_SPLIT_FAMILIES = ("sm90", "cpu")
# Families whose split dK/dV programs (DKDV_SPLIT) return early for a key block past their sequence (varlen),
# as the unsplit ones do, instead of running with empty query ranges (kernels/backward._dkdv_program).  The
# empty ranges keep AMD's split builds free of scratch under triton 3.4 / 3.5 (with the early return they kept
# the kernel's two calls of _dkdv_program as real calls and spilled 376-1032 B, TUNING_NOTES v15); on the H100
# (triton 3.6) the early return ran the d256 / d192 full forward+backward rows ~2.5 % faster (v16).  "cpu" so CI
# tests both forms (tests/kernels/test_dkdv_split.py switches it off too).
DKDV_SPLIT_EARLY_RETURN_FAMILIES = ("sm90", "cpu")
# EVEN_QK (kernels/launch.even_qk): a dense call whose query and key counts are whole multiples of a launch's tiles
# runs kernels whose masked blocks (causal diagonal, window edges) load q / k / v / dO / lse / delta without row or
# key bounds and mask only the window edges in their scores, as FlexAttention's IS_DIVISIBLE does.  sm90 SASS of the
# short causal d128 launches (triton 3.6): the fused dK/dV + dQ kernel's masked loops 817 -> 720 (dK/dV) and
# 562 -> 508 (dQ) instructions, its dK/dV prologue 956 -> 784; the forward 168 -> 128 registers, its masked loop
# 354 -> 335.  H200 (.ci/even_ab.py, 5-7 interleaved rounds, 2026-11-29, ms whole / bounded): bf16 forwards gained
# or tied on every row (d96 b16 s1k causal 12 %, d256 b32 s512 causal 5 %, d128 b4 s4k causal 3 %, GQA causal
# 0-0.5 %); the FP8 forward lost 1.2-3.2 % on causal rows; forward+backward gained on short rows (d128 b32 s512
# causal 0.631 / 0.646, b16 s1k causal 3 %, d64 b16 s1k causal 5 %) but lost on long ones (b1 s16k d128 full 17.52
# / 17.22, h16/kv4 b2 s4k causal 1.224 / 1.177) and on the short d64 full ones (b16 s1k 1.70 / 1.38, b32 s512
# 0.97 / 0.82; d128 full gained 2-3 %) -- so:
#   EVEN_QK_FAMILIES:           forwards of fp16 / bf16 / fp32 inputs, and backwards of short (is_short) masked
#                               (causal or windowed) launches;
#   EVEN_QK_FP8_FAMILIES:       FP8 forwards (sm90 since FWD_MERGED_EDGES: whole blocks then take one loop, 1.7-4.4 %
#                               faster on the causal rows; alone, whole blocks were level on the same run: 0.4 / 0.7 /
#                               -0.6 % at b4 s4k, its GQA row, b2 s8k);
#   EVEN_QK_OTHER_BWD_FAMILIES: the other backwards (longer or unmasked launches).
# Not on AMD until timed there.  "cpu" in all three so CI tests both forms of every kernel (odd and whole lengths).
EVEN_QK_FAMILIES = ("sm90", "cpu")
EVEN_QK_FP8_FAMILIES = ("sm90", "cpu")
EVEN_QK_OTHER_BWD_FAMILIES = ("cpu",)
# Only head dims padded to at least this split (first chunk >= 64 columns), and only where the second chunk
# has no padded columns (80, 96, 160, 192; not 72 or 40, tuning.head_dim_chunks): on the H100 under triton 3.6
# a second chunk whose columns are partly masked (40 = 32 + 8 of 16, 72 = 64 + 8 of 16) computed wrong outputs
# and once hit an illegal address, while the interpreter with the same tiles matched the reference; 80 / 96 /
# 160 / 192 passed the GPU sweep (tests/kernels/test_attention_gpu.py::test_head_dims).
HEAD_DIM_SPLIT_MIN_PADDED = 128

# Per-Triton overrides: an entry may hold "triton<X.Y" dicts, applied when the installed triton is
# older than X.Y, before the case overrides below (fa_amd.tuning.resolve_entry; broadest bound
# first, so a narrower one refines it).  Why: older compilers allocate registers differently, and
# a row that is spill-free under the newest one can spill under them; the AOT matrix
# (.ci/aot_matrix.py, docs/AOT.md) builds every row under every supported triton.
TRITON_OVERRIDES = ("triton<3.7", "triton<3.6", "triton<3.5", "triton<3.4", "triton<3.3")
# The override dicts an entry may hold, in the order they are applied (resolve_entry).
OVERRIDES = TRITON_OVERRIDES + ("causal", "short", "fp32", "fp8")
# A launch with at most this many keys per row (max_seqlen_k) applies its entries' "short" overrides.
SHORT_SEQLEN_K = 1024

_FP32_HALF_N = {"BLOCK_N": 32, "num_stages": 1}
# gfx950 FP8 forward: 32x32 MFMAs (v_mfma_f32_32x32x64_f8f6f4).  With the 16x16 ones the AOT build of
# the all-features FP8 forward crashes Triton 3.4/3.5's AMD backend (an assertion in
# ConvertTritonAMDGPUToLLVM on the P.V dot) and spills 12 B on 3.6 at d128; with 32x32 every head dim
# compiles with zero scratch on 3.6 and 3.9 (3.4/3.5 still crash at d256: FP8_MIN_TRITON).
_GFX950_FP8 = {"matrix_instr_nonkdim": 32}

TABLES = {
    # Triton interpreter (CPU): small asymmetric tiles so tests exercise the
    # masked and unmasked paths on short sequences.
    "cpu": [
        {"head_dim": 256,
         # (FWD_MERGED_EDGES: whole-block calls run the merged loop, other calls the separate ones)
         "fwd": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "FWD_MERGED_EDGES": 1},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
    ],
    # H100 sweeps 2026-11-22 (bf16, b*s=16k, hidden 2048; TFLOP/s; docs/TUNING_NOTES.md v4):
    # long non-causal rows want big tiles, causal / short rows 64x64 ones (less
    # diagonal waste, more programs); dK/dV 64x128/w8/s3 won at every length.
    "sm90": [
        # fwd s16k: 128x64/w8 425 vs 128x64/w4 409; causal s1k: 64x64/w4 283 vs 248.
        # dK/dV 64x64/w4/s3 (.ci/short_ab.py PART=bwd / bwd2, 5 interleaved rounds, 2026-11-24, fwd+bwd TFLOP/s):
        # its dQ programs (same warps / stages) join the launch; vs the previous 64x128/w8 dK/dV with a dQ
        # launch of its own: b32 s512 full 289 vs 250 (Flex 253), causal 162 vs 151 (146); b16 s1k causal 232
        # vs 217 (205); b8 s2k full 385 vs 356; b4 s4k causal 332 vs 316; b1 s16k full 376 vs 369, causal
        # 354 vs 336
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "FWD_MERGED_EDGES": 1,
                 "causal": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}},
         # short causal launches: DKDV_ONE_MASKED_LOOP (the d128 entry's timing; d64 b16 s1k causal fwd+bwd 0.990
         # vs 1.008 ms, b32 s512 0.692 vs 0.796 at best, b4 s4k level)
         "dkdv": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                  "short": {"causal": {"DKDV_ONE_MASKED_LOOP": 1}}},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}},
        # Head dims run as 64 + 32 (HEAD_DIM_SPLIT_FAMILIES: d96; d80 = 64 + 16 too): the d128 row but a
        # causal forward tile of 128x64/w4/s3 (.ci/head_split_ab.py --tiles, TILESET=d96, H100, 2026-11-24,
        # d96 h21 causal fwd TFLOP/s s1k / s4k: 214 / 345 vs 64x64/w4/s3 203 / 330, 64x64/w4/s4 199 / 325; rows
        # of at most SHORT_SEQLEN_K keys take the "short" tile, which the overrides apply after "causal").
        # Causal short launches: 64x32 (.ci/short_ab.py PART=fwd2, 2026-11-24: b16 s1k h21 fwd 220 vs 64x64 203,
        # Flex 217; fwd+bwd 213 vs 209).
        {"head_dim": 96,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "FWD_MERGED_EDGES": 1,
                 "causal": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4},
                 "short": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "causal": {"BLOCK_N": 32}},
                 "fp32": {"BLOCK_N": 32, "num_stages": 2}},
         "dkdv": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "fp32": {"num_stages": 2}},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "fp32": {"num_stages": 2}}},
        # fwd s16k: 128x128/w8 488 vs 64x64/w4 466; causal s1k: 64x64/w4 318 vs 262, s4k 439 vs 396;
        # short (non-causal, 5 alternating rounds, 2026-11-23): s1k 64x64/w4/s3 406 vs 128x128/w8/s3 388
        # (Flex 402), s2k 437 vs 449, s4k 426 vs 469;
        # dK/dV (atomic dQ) s16k 402 vs 32x128: 335; deterministic dQ 128x64/w8/s3 361 vs 128x32/s2 273;
        # causal short: 64x32/w4/s3 (.ci/short_ab.py PART=fwd, 5 interleaved rounds, 2026-11-24, fwd TFLOP/s):
        # b32 s512 187 vs 64x64 167 (Flex 186), b16 s1k 265 vs 255 (Flex 260)
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "FWD_MERGED_EDGES": 1,
                 "causal": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
                 "short": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "causal": {"BLOCK_N": 32}},
                 "fp32": {"BLOCK_N": 32, "num_stages": 2},
                 # FP8 (.ci/fp8_ab.py, 5 interleaved rounds, 2026-11-23): 64x128/w4/s3 fastest on 3 of 4
                 # rows, e.g. s8k full 1.611 ms vs this entry's 128x128/w8 1.848 (bf16 2.138), s8k causal
                 # 1.069 vs 1.194; s4k causal tied with 64x64/w4/s3 (0.716)
                 # Causal rows keep it too (.ci/fp8_ab.py, 5 interleaved rounds, 2026-11-24, V read in place and
                 # its NaNs marked in the forward): b4 s4k / b2 s8k 0.440 / 0.759 ms vs 64x64/w4/s3 at maxnreg 168
                 # 0.469 / 0.886, 128x64/w4/s3 0.490 / 0.894, 64x64/w4/s3 0.520 / 0.954 (bf16 0.657 / 1.220)
                 # FWD_MERGED_EDGES (every sm90 forward entry) on whole blocks (.ci/twin_ab.py, H200, 2026-11-29, 9
                 # interleaved rounds of CUDA graph replays, us, separate loops -> merged): FP8 (EVEN_QK_FP8_FAMILIES
                 # with sm90 in both) b4 s4k causal 421.9 -> 405.4 and 422.9 -> 413.6 in a second run, h16/kv4 402.4 ->
                 # 385.5 / 388.7, b2 s8k 792.4 -> 779.2 / 783.0 -> 749.6; bf16 b4 s4k causal 648.4 -> 639.9, h16/kv4
                 # 639.4 -> 611.6, b2 s8k 1235 -> 1231; fwd+bwd causal d128 b32 s512 610.8 -> 603.1, b16 s1k 871.4 ->
                 # 864.2, h16/kv4 b4 s4k 2478 -> 2438, d64 b32 s512 343.0 -> 326.9, b16 s1k 493.5 -> 476.4; full rows
                 # level.  (d96 / d192 / d256 untimed: the same loop structure.)
                 "fp8": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}},
         # fp32 inputs: the fused dK/dV + dQ launch needs 296 KB of shared memory at 3 stages.
         # DKDV_COL_BOUNDS (KERNEL_SWITCHES) on non-causal launches under triton 3.6 (.ci/bwd_spill_ab.py, H200,
         # 2026-11-28, 7 interleaved rounds, fwd+bwd ms, off -> on, Flex): b32 s512 0.785 -> 0.771 (0.782), b16 s1k
         # 1.269 -> 1.254, b8 s2k 2.291 -> 2.283, b2 s8k 8.568 -> 8.517, h16/kv4 b4 s4k 4.415 -> 4.199, b1 s16k
         # 17.51 -> 16.90; causal lost (5 rounds: b32 s512 0.673 -> 0.692, b4 s4k 2.430 -> 2.900, h16/kv4 b2 s4k
         # 1.171 -> 1.403).  Not under triton >= 3.7 (more stack there, untimed).
         # DKDV_ONE_MASKED_LOOP on short causal launches (.ci/bwd_spill_ab.py, H200, 2026-11-29, 5 interleaved
         # rounds, fwd+bwd ms, off -> on, Flex): b32 s512 0.669 -> 0.647 (0.652), b16 s1k 0.930 -> 0.905 (0.933);
         # b4 s4k level (2.503 -> 2.501), h16/kv4 b2 s4k 1.176 -> 1.225, full rows lost (b32 s512 0.755 -> 0.785).
         # sm90 causal build (triton 3.6): 144 -> 40 B of ptxas stack, spill loads in the masked loop 23 -> 3.
         "dkdv": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "fp32": {"num_stages": 2},
                  "triton<3.7": {"DKDV_COL_BOUNDS": 1}, "causal": {"DKDV_COL_BOUNDS": 0},
                  "short": {"causal": {"DKDV_ONE_MASKED_LOOP": 1}}},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "fp32": {"num_stages": 2}}},
        # Head dims run as 128 + 64 (HEAD_DIM_SPLIT_FAMILIES: d192; d144 / d160 = 128 + 16 / 32 too).
        # .ci/head_split_ab.py --tiles (H100, 2026-11-24, 5 interleaved rounds, d192 h10 causal, TFLOP/s, s1k / s4k): fwd 128x64/w8/s3
        # 227 / 389 vs the d256 row's s2 202 / 327 (FA2 225 / 278); fwd+bwd with dK/dV 64x128/w8/s2 202 / 289 vs
        # the d256 row's 32x128 189 / 261 (FA2 193 / 253), dQ 128x64/w8/s2 197 / 281 vs 128x32.  fp32 inputs:
        # the d256 row's fp32 launches.
        {"head_dim": 192,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "FWD_MERGED_EDGES": 1, "fp32": _FP32_HALF_N},
         "dkdv": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "DKDV_SPLIT": 1,
                  "fp32": {"BLOCK_M": 32, "BLOCK_N": 64, "DKDV_SPLIT": 0}},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
                "fp32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1}}},
        # fwd 128x64/w8/s2 437 (causal s4k) vs 64x64/w8/s2 229.  dK/dV: dK and dV in separate programs
        # (DKDV_SPLIT) at 32x128/w8/s2 with the dQ programs (128x32/w8/s2) fused into the launch
        # (.ci/d256_ab.py, 3 interleaved rounds, 2026-11-23, fwd+bwd TFLOP/s): full 1k 302 vs the previous
        # row (32x64/w8/s2 unsplit, dQ 64x32/w8/s1 in a second launch) 152, split 16x128 246, SDPA FA2 218;
        # full 16k 346 vs 158 (FA2 280); causal 4k 296 vs 153 (FA2 230); causal 16k 330 vs 171 (FA2 266).
        # fp32 inputs keep the previous row (the split tiles' shared memory is sized for 16-bit operands).
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "FWD_MERGED_EDGES": 1, "fp32": _FP32_HALF_N},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "DKDV_SPLIT": 1,
                  "fp32": {"BLOCK_N": 64, "DKDV_SPLIT": 0}},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2,
                "fp32": {"BLOCK_M": 64, "num_stages": 1}}},
    ],
    "sm80": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}},
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
    ],
    # _ATOMIC_DKDV_NOTE: the atomic-dQ dK/dV kernel (deterministic=False) has its own d64 / d128 entries on
    # gfx942 and gfx950: at the dK/dV tiles (32x128, 32x64) it spilled under triton 3.2 in fp16 (16..144 B,
    # d64/d80/d128 "all" / "split"), gfx942 also under 3.4 (d80 bf16 "split", 8 B) and 3.9 (d128 fp16 "all",
    # 24 B): the full AOT sweep, docs/AOT.md.  32x64 (d64) and 16x64 (d128) build clean with room to spare.
    # CDNA3 (MI300): 64-wide waves, 512 VGPRs incl. AGPRs, 64 KiB LDS.
    # fwd rows use waves_per_eu=1 on every CDNA family: at 2 the register budget
    # halves to 256 and the all-features fwd kernel spills (docs/AOT.md).
    "gfx942": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         # atomic-dQ dK/dV (_ATOMIC_DKDV_NOTE): 32x64
         "dkdv_atomic": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                         "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}},
        # triton 3.5 / 3.6 spill the all-features fwd at 2 stages (80 / 36 B); 1 stage: zero (docs/AOT.md);
        # triton 3.2 / 3.3 also spill the causal one at 1 stage (68 B): 128x32 there
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2, "triton<3.7": {"num_stages": 1},
                 "triton<3.4": {"BLOCK_N": 32}},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         # atomic-dQ dK/dV (_ATOMIC_DKDV_NOTE): 16x64
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                         "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2, "triton<3.4": {"DKDV_SPLIT": 1}},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}},
    ],
    # CDNA3+ (MI350): 160 KiB LDS; kpack is a no-op there, so it is left out.
    # d256 dK/dV (here, gfx942, gfx90a): triton 3.2 spilled 132..348 B at 16x32 with both VGPR and AGPR
    # files full; dK and dV in separate programs (DKDV_SPLIT) build clean under 3.2 / 3.3 (gfx90a 3.2 also
    # with 16-key tiles), but spilled ~1 KB under 3.4, where the plain kernel is clean: "triton<3.4" (since
    # the split programs lost their early return they build clean under 3.4-3.6 too, TUNING_NOTES v15;
    # untimed on AMD, so the bound stays)
    "gfx950": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "fp8": _GFX950_FP8},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv_atomic": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                         "waves_per_eu": 1, "matrix_instr_nonkdim": 16},  # _ATOMIC_DKDV_NOTE
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        # triton 3.4 / 3.5 spill the all-features fwd at 2 stages (164 / 8 B); 1 stage: zero (docs/AOT.md);
        # triton 3.3 spills the causal one at 1 stage (68 B): 128x32 there
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "triton<3.6": {"num_stages": 1},
                 "triton<3.4": {"BLOCK_N": 32}, "fp8": _GFX950_FP8},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                         "waves_per_eu": 1, "matrix_instr_nonkdim": 16},  # _ATOMIC_DKDV_NOTE
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "fp8": _GFX950_FP8},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "triton<3.4": {"DKDV_SPLIT": 1}},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
    ],
    # CDNA2 (MI200): like MI300 but no kpack, smaller caches.
    "gfx90a": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        # triton 3.6 spills the all-features fwd at 128x32 (36 B); 64x32: zero (docs/AOT.md)
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "triton<3.7": {"BLOCK_M": 64}},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "triton<3.4": {"DKDV_SPLIT": 1},
                  "triton<3.3": {"BLOCK_N": 16}},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
    ],
    # CDNA1 (MI100): no bf16 MFMA fast path (use fp16, README), 256 VGPRs.
    "gfx908": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 2, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
    ],
    # RDNA3 (gfx1100): 32-wide waves, WMMA; no MFMA options.  WMMA operands are
    # replicated across the two lane halves, so a 16-row slice of a d-wide
    # operand costs d/2 of the 256 VGPRs: with the operands resident in registers
    # the d128 backward and every d256 kernel spilled at every tile size (256
    # VGPRs and 276..2180 B scratch at 16x16).  These rows run the reloading
    # kernels (RELOAD_CHUNK=N: d-wide operands reloaded from L1/L2 per block, S
    # and dP reduced N head-dim columns at a time; 16 where 32 spilled) at the
    # largest tiles found that compile with zero scratch in every AOT variant
    # (docs/AOT.md); 8 warps (4 spilled more), no waves_per_eu hint (0).  Not
    # timed on an RDNA3 GPU yet; `fa-amd tune` there also tries RELOAD_CHUNK 0/32/64.
    "gfx1100": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 16},
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0,
                         "RELOAD_CHUNK": 32},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32}},
        # fwd 64x16 and atomic-dQ dK/dV RELOAD_CHUNK 16: at 64x32 / chunk 32 the d80 builds (this row,
        # head-dim masks) spilled 36 B (fwd "all", triton 3.6 and 3.9) and 8 B (atomic "split", 3.9)
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0,
                         "RELOAD_CHUNK": 16},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32,
                 # triton 3.6 spills 52 B here with all features (NaN flags, sinks); BLOCK_N 16 is spill-free
                 "triton<3.7": {"BLOCK_N": 16}},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         # atomic-dQ dK/dV d256: 308 B (3.9) / 16 B (3.6) with dK and dV in one program; split: 0 B under
         # 3.9 but 2.1 KB under 3.6, where one program at 16 warps is clean (AOT, all/split/causal)
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0,
                         "RELOAD_CHUNK": 32, "DKDV_SPLIT": 1, "triton<3.7": {"DKDV_SPLIT": 0, "num_warps": 16}},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32}},
    ],
}

# Arch names not in TABLES map to the closest family.
FAMILY_ALIASES = {
    "sm86": "sm80", "sm87": "sm80", "sm89": "sm80", "sm100": "sm90", "sm103": "sm90", "sm120": "sm80",
    "gfx940": "gfx942", "gfx941": "gfx942",
    "gfx1101": "gfx1100", "gfx1102": "gfx1100", "gfx1200": "gfx1100", "gfx1201": "gfx1100",
}

HIP_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

# Kernel constexprs a launch dict may set besides the tiles, with the value every
# entry that does not name them launches with (filled in by
# fa_amd.tuning.resolve_entry, so rows stay short).  They reach the kernels as
# arguments, never as compiler options.
#   RELOAD_CHUNK: 0 keeps the kernels' loop-invariant d-wide dot operands in
#   registers; N > 0 reloads them from memory per block and reduces the head dim
#   N columns at a time (fa_amd/kernels/forward.py, backward.py) -- for register-bound RDNA.
#   DKDV_SPLIT (dK/dV kernel only): 1 computes dK and dV in separate programs of one launch, each
#   holding one [BLOCK_N, D] fp32 accumulator instead of two (S is computed by both: 5 matmuls per
#   tile pair instead of 4); for register-bound head dims (d256), where it lets 8 warps take
#   128-key tiles.  Off everywhere until timed (.ci/d256_ab.py, docs/TUNING_NOTES.md v9).
#   DKDV_COL_BOUNDS (dK/dV kernel only; RELOAD_CHUNK=0): 1 builds the query-block loads from the block's
#   scalar start plus loop-invariant offsets and masks the masked blocks' scores with per-key-column row
#   bounds (rows past the end get lse 0 and a -inf score instead of lse +inf): no row vector or load mask
#   crosses the software pipeline's stages.  Same gradients for finite inputs.  sm90 d128 64x128/w8/s3 bf16
#   under triton 3.6: ptxas stack 104 / 144 B -> 32 / 0 B (plain / causal fused launch); under 3.9 it is worse,
#   64 / 112 -> 144 / 176 B.  On for sm90 d128 non-causal launches under triton < 3.7 (its table entry has the timing).
#   DKDV_ONE_MASKED_LOOP (dK/dV kernel only): 1 runs a dK/dV program's masked query blocks (the causal diagonal's
#   and the ragged or windowed tail's) in one loop before the unmasked ones, instead of one loop on each side: one
#   software pipeline fewer to fill and drain per program (its prologue issues predicated loads even when the tail
#   is empty).  Sums dK / dV in another order (deterministic still).
#   FWD_MERGED_EDGES (forward kernel only): 1 runs a masked forward program (causal, windowed) on whole blocks
#   (EVEN_QK) as one loop over all its key blocks, the edge blocks' window mask applied under a branch, instead of
#   a loop per masked edge beside the unmasked one: each loop of its own filled and drained its software pipeline
#   for one block (the causal diagonal).  Launches without EVEN_QK keep the separate loops.
KERNEL_SWITCHES = {"RELOAD_CHUNK": 0, "DKDV_SPLIT": 0, "DKDV_COL_BOUNDS": 0, "DKDV_ONE_MASKED_LOOP": 0,
                   "FWD_MERGED_EDGES": 0}
# Switches that only some kernels take, with the table kernels whose launch dicts carry them
# (the others never see them: an entry that sets one is an error); unlisted switches: every kernel.
SWITCH_KERNELS = {"DKDV_SPLIT": ("dkdv", "dkdv_atomic"), "DKDV_COL_BOUNDS": ("dkdv", "dkdv_atomic"),
                  "DKDV_ONE_MASKED_LOOP": ("dkdv", "dkdv_atomic"), "FWD_MERGED_EDGES": ("fwd",)}


# --------------------------------------------------------------------------- decode (kernels/decode.py)
# Launch dicts of the decode kernels per family, rows by padded head dim as in TABLES:
#   "decode": the split-KV attention kernel.  BLOCK_M = query rows per tile, a row being one
#             (query token, head of the KV group) pair, at least 16 (tl.dot's minimum); BLOCK_N =
#             keys per loop iteration.  Its "wide" override applies when one KV head has more than
#             DECODE_WIDE_ROWS rows (seqlen_q x GQA group: chunked prefill or paged prefill on a
#             cache), where taller tiles read each K/V block for more rows; "fp32" for fp32 inputs.
#   "append": the in-place cache write of new k/v (+ rotary); BLOCK_M = new tokens per program.
#   "merge": the log-sum-exp merge of the key splits; BLOCK_M = (token, head) rows per program.
# A "decode" entry may set the kernel switch RELOAD_CHUNK (KERNEL_SWITCHES; q reloaded per key block).
# Each of these dicts (the "wide" and "fp32" ones too) may carry "triton<X.Y" overrides (TRITON_OVERRIDES:
# applied first, when the installed triton is older; fa_amd.tuning.decode_entry_config).
# Starting points, not yet timed on a GPU (.ci/decode_ab.py times the candidates); the AMD rows
# compile with zero scratch for their targets under every supported triton (`fa-amd compile`'s
# decode, merge and append kernels, .ci/aot_matrix.py; docs/AOT.md has the figures).
DECODE_WIDE_ROWS = 16
# Decode launches of many short programs (unsplit, at least "min_programs_per_sm" programs per SM, caches of at
# most "max_keys" keys): the family's "head_dims" override of its table row's own decode tile (not the wide,
# fp32 or FP8-cache variants).  Why: with 16x128/w4/s3 (139 KB of shared memory, one CTA per SM) a short
# program's set-up and epilogue are not hidden behind another CTA's loads; 16x64/w4/s2 (39 KB) fits four.
# H200 (.ci/decode_ab.py stage "tiles", 3 rounds, 2026-11-28, KV GB/s, table -> 16x64/w4/s2, SDPA): b64 2k
# 3866 -> 4189 (4220), b64 8k 4411 -> 4439 (4446), but b64 32k 4535 -> 4511 and 128k 4555 -> 4520, and every
# b1 / b8 row lower (b8 8k 3825 -> 2458); H100 (v18): b64 2k 2890 -> 2939 (SDPA 2963).
# maxnreg 128 keeps the four CTAs: with an int32 cache_seqlens tensor (its load) ptxas took the kernel to 148
# registers (three CTAs per SM) and b64 2k ran 153 us against 124 without cache_seqlens (H200, triton 3.6,
# .ci/decode_lens_probe.py, TUNING_NOTES v29); capped it builds at 128 with no stack (sm90, triton 3.6).
DECODE_MANY = {"sm90": {"min_programs_per_sm": 2, "max_keys": 4096,
                        "head_dims": {128: {"BLOCK_N": 64, "num_stages": 2, "maxnreg": 128}}}}
# Software-pipeline stages of the decode kernel's masked key loops (the front below a left window or leftpad, the
# ragged tail), per family and table row head dim: 0 (absent) pipelines them like the unmasked loop, 1 runs them
# unpipelined.  A masked loop runs at most a block or two, so its pipeline prologue / epilogue are pure fixed
# cost: sm90 d128 (16x128/w4/s3, b1 2k SASS, triton 3.6) 656 instructions between the unmasked and the tail loop
# -> 50, the tail body 582 -> 639, 209 -> 219 registers, the same shared memory.  A launch with it also drops the
# masked front loop where nothing can mask the front (no left window, no leftpad): b1 2k 769 + 568 instructions of
# set-up and front-loop copies before the first key block -> 713.  The table row's own tile takes it, not the
# DECODE_MANY tile (16x64/s2 at 128 registers spilled 8 B with it).  H200 (.ci/decode_b1_ab.py, CUDA graphs, 5
# rounds, 2026-11-28, us, pipelined -> this, SDPA): b1 2k 15.94 -> 13.47 (12.45), 8k 22.08 -> 20.16 (19.20), 32k
# 44.03 -> 42.08 (40.70), 128k 132.26 -> 130.40 (129.57), b8 2k 26.75 -> 25.02 (25.95).  Two stages instead of
# three for splits of at most 4 key blocks lost at b1 2k / 8k (14.02 / 23.26 us): not kept.
DECODE_MASKED_STAGES = {"sm90": {128: 1}}
_DECODE_TAIL = {"append": {"BLOCK_M": 16, "num_warps": 4}, "merge": {"BLOCK_M": 16, "num_warps": 4}}
_DECODE_FP32 = {"BLOCK_N": 32, "num_stages": 1}


def _decode_rows(decode64, decode128, decode256, wide, hip=None, fp32=None):
    """The three head-dim rows of a family: the "decode" entries given with their "wide" and "fp32"
    overrides by head dim (fp32 default: _DECODE_FP32), the shared append / merge ones."""
    hip = hip or {}
    fp32 = fp32 or {}
    rows = []
    for d, entry in ((64, decode64), (128, decode128), (256, decode256)):
        decode = dict(entry, **hip)
        decode["wide"] = dict(wide.get(d, {}))
        decode["fp32"] = dict(fp32.get(d, _DECODE_FP32))
        rows.append({"head_dim": d, "decode": decode,
                     "append": dict(_DECODE_TAIL["append"], **hip), "merge": dict(_DECODE_TAIL["merge"], **hip)})
    return rows


_WIDE = {64: {"BLOCK_M": 64}, 128: {"BLOCK_M": 64}, 256: {"BLOCK_M": 32, "BLOCK_N": 32}}
_CDNA = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}
# CDNA under older Tritons (AOT, every decode route, docs/AOT.md "Decode kernels"): their register
# allocation (64-bit pointer tensors before 3.6) spills the 3.9-fitted rows at d128 and d256 --
# triton 3.2: 16..464 B in nearly every route; 3.3: the 64x64 wide tile 160 B; 3.4: 8..44 B; 3.6: the
# Transformers route (per-key mask) 36 B, an SGPR spill slot, at gfx90a d128 and gfx942 d256.  Fixes:
# 32-key tiles at d128 (and the wide 64x32 tile, one stage) and waves_per_eu 1 (512 registers) at d256,
# which also cures the SGPR slot; at wpe 2 16x16 tiles still spilled 120 B (gfx942, 3.2).  fp32
# inputs (twice the registers per element) spilled at d128/d256 under every version, 3.9 included
# (8..1064 B): waves_per_eu 1 there, and 16-key tiles at d256 (16x32 at wpe 1 still spilled 40..464 B
# in the per-key-mask route under 3.2).
_CDNA_WIDE = {64: {"BLOCK_M": 64}, 128: {"BLOCK_M": 64, "triton<3.5": {"BLOCK_N": 32, "num_stages": 1}},
              256: {"BLOCK_M": 32, "BLOCK_N": 32}}
_CDNA_FP32 = {128: dict(_DECODE_FP32, waves_per_eu=1), 256: dict(_DECODE_FP32, BLOCK_N=16, waves_per_eu=1)}
# gfx90a d256 row and gfx1100 d128 / d256 rows under triton 3.6 (AOT full sweep, 2026-11-25): the Transformers
# route (per-key mask, leftpad) at d192 (gfx90a, gfx1100) and d80 (gfx1100) left a 36 B SGPR spill slot at
# 32-key tiles; 16-key tiles build with zero scratch under 3.2-3.6 (gfx90a) and 3.6 (gfx1100).
# MI300 (gfx942) and MI350 (gfx950) decode tiles, d64 / d128 / d256 (the same AOT results on both)
_CDNA3_DECODE_TILES = (
    {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "triton<3.5": {"BLOCK_N": 32}},
    {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "triton<3.7": {"waves_per_eu": 1}},
)
DECODE_TABLES = {
    # interpreter: tiny tiles, so CPU tests cross key blocks and pages on short caches
    "cpu": [{"head_dim": 256, "decode": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                                          "wide": {"BLOCK_M": 32}},
             "append": {"BLOCK_M": 8, "num_warps": 4}, "merge": {"BLOCK_M": 16, "num_warps": 4}}],
    # d128: 128-key tiles, 3 stages (two 64 KB K/V blocks in flight per program; .ci/decode_ab.py stage
    # "kernel", H100, 2026-11-24: b8 8k 2782 vs 2665 GB/s at 16x64/w4/s4, b1 32k 2325 vs 2045 with the
    # sm90 split rule below); the wide tile stays 64x64/w4/s4
    "sm90": _decode_rows({"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
                         {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
                         {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
                         {**_WIDE, 128: {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 4}}),
    "sm80": _decode_rows({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                         {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                         {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}, _WIDE),
    "gfx942": _decode_rows(*_CDNA3_DECODE_TILES, _CDNA_WIDE, dict(_CDNA, kpack=2), _CDNA_FP32),
    "gfx950": _decode_rows(*_CDNA3_DECODE_TILES, _CDNA_WIDE, _CDNA, _CDNA_FP32),
    # (d64 and d128 at 32 keys up to 3.6: 16x64 left the 36 B SGPR slot of the per-key-mask route in 3.6)
    "gfx90a": _decode_rows({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                            "triton<3.7": {"BLOCK_N": 32}},
                           {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                            "triton<3.7": {"BLOCK_N": 32}},
                           {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                            "triton<3.7": {"waves_per_eu": 1, "BLOCK_N": 16}}, _CDNA_WIDE, _CDNA, _CDNA_FP32),
    "gfx908": _decode_rows({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                            "triton<3.7": {"BLOCK_N": 32}},
                           {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
                           {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                            "triton<3.4": {"waves_per_eu": 1}}, _CDNA_WIDE, _CDNA, _CDNA_FP32),
    # RDNA3: q streamed in 32-column chunks (RELOAD_CHUNK, as the prefill rows do); with q and K
    # resident every tile spilled (AOT: 12..1208 B scratch at 16x16..16x64, 4 or 8 warps).  fp32 inputs
    # (no fp32 WMMA: FMA dots, which hold a whole reduction slice per thread) spilled 164..3180 B at these
    # tiles under 3.6 and 3.9; 16x16 tiles with q resident (RELOAD_CHUNK 0) and 8 (d64) / 16 (d128) warps
    # build clean; d256 still spills at every tile tried (aot.KNOWN_SCRATCH, docs/AOT.md).
    "gfx1100": _decode_rows({"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "RELOAD_CHUNK": 32},
                            {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "RELOAD_CHUNK": 32,
                             "triton<3.7": {"BLOCK_N": 16}},
                            {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "RELOAD_CHUNK": 32,
                             "triton<3.7": {"BLOCK_N": 16}},
                            {64: {"BLOCK_M": 32}, 128: {"BLOCK_M": 32}, 256: {"BLOCK_M": 32, "BLOCK_N": 16}},
                            {"waves_per_eu": 0},
                            {d: {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8 if d == 64 else 16, "num_stages": 1,
                                 "RELOAD_CHUNK": 0} for d in (64, 128, 256)}),
}

# FP8 KV caches (fa_amd.fp8, kernels/decode.py): overrides of the "decode" entry, per family and
# table row head dim, applied after "wide" / "fp32" (fa_amd.tuning.get_decode_config).  gfx942 (AOT,
# every feature on, docs/AOT.md): at 16x64 the FP8 decode kernels spill under triton 3.2 .. 3.6
# (16..308 B; FP8 q and widened K/V alike), 16x32 builds with zero scratch at occupancy 2-4 under
# 3.2 .. 3.9; at d256 (16x32 already) only waves_per_eu 1 (512 VGPRs) avoids scratch under every
# version (132..440 B at 2, with 16x16 tiles or 8 warps too).  An entry's "wide" dict applies on top
# for the wide tile: at d128 the FP8-cache / bf16-q kernel spilled with 64-row tiles (gfx942 64x32:
# 36 B under 3.9; gfx950 64x64: 12 B under 3.6); gfx942 32x32 and gfx950 64x32 build clean under
# every version they support.  sm90: no override needed.
DECODE_FP8 = {
    "gfx942": {64: {"BLOCK_N": 32}, 128: {"BLOCK_N": 32, "wide": {"BLOCK_M": 32}}, 256: {"waves_per_eu": 1}},
    # (triton 3.6: the leftpad-masked V load of an FP8-cache / fp16-q call took 16x64 to 256 VGPRs and 20 B of
    # scratch, AOT 2026-11-25; 16x32 builds clean)
    "gfx950": {128: {"wide": {"BLOCK_N": 32}, "triton<3.7": {"BLOCK_N": 32}}},
}

# How the decode launcher splits the key axis when num_splits=0, per family (flash-attn 2's
# wave-efficiency rule): no split once the (batch x KV heads x row tiles) programs reach
# `full_fraction` of `programs_per_sm` x the GPU's SM/CU count; otherwise the fewest splits whose
# last wave is at least `efficiency` of the best one, at most `max_splits`, each holding at least
# `min_blocks_per_split` key blocks (the merge reads every split's partial output back).  A family's
# "head_dims" maps a table row's head dim to overrides of its rule (the tile decides how many bytes one
# program keeps in flight, and so how many programs it takes to read at HBM speed).
_DEFAULT_SPLITS = {"programs_per_sm": 2, "full_fraction": 0.8, "efficiency": 0.85, "max_splits": 128,
                   "min_blocks_per_split": 2}
DECODE_SPLITS = {
    "default": _DEFAULT_SPLITS,
    # H100 (.ci/decode_ab.py stage "kernel", graph replays, 2026-11-24): with d128's 16x128/w4/s3 tile about
    # 64 programs already read at HBM speed (one pulls ~45 GB/s); more splits only add partials to merge:
    # batch 1 best at 8 splits (64 programs) at every cache length, batch 8 unsplit.  d64 and d256 (32 KB
    # per stage) want about one program per SM: batch 1 best at 16 splits (d256 b1 32k: 2640 GB/s vs 2372
    # at the default rule's 29), batch 8 at 2 (d256 b8 8k: 2898 vs 2856 at 4; d64: 2461 vs 2393)
    # H200 (.ci/decode_ab.py stage "kernel", graph replays, 5 rounds, 2026-11-28): d128 now wants one program
    # per SM as well -- the merge no longer serialises its loads (TUNING_NOTES v18) and 64 programs read only
    # ~3.1-3.3 of the H200's 4.8 TB/s: b1 32k 8 splits 2548 GB/s -> 16 splits 3102 (SDPA 3308), b1 128k 3092
    # -> 4077 (4151), b8 8k unsplit 2973 -> 2 splits 3792 (3780), b8 128k 3346 -> 4516 (4518); on the H100 b8 32k
    # at 2 splits read 3015 vs 3002 unsplit (v18).  d128 splits down to one key block since the fused merge loads
    # its partials a step at a time (DECODE_MERGE_STEP; same run): b1 2k at 16 splits 724 GB/s vs the 8 of two
    # blocks each 697 (SDPA 684); with the two-pass merge 16 had lost (536 vs 566, v28)
    "sm90": {**_DEFAULT_SPLITS,
             "head_dims": {64: {"programs_per_sm": 1, "efficiency": 0.95},
                           128: {"programs_per_sm": 1, "efficiency": 0.95, "min_blocks_per_split": 1},
                           256: {"programs_per_sm": 1, "efficiency": 0.95}}},
}
# Families whose split decode merges the key splits inside the decode kernel: the last split program
# of each tile to finish (an acq_rel counter per tile, reset by that program) merges the tile's partials
# (decode._last_split_merges), instead of a split_merge_kernel launch after it -- one launch less per
# call (host time at small batches) and no merge kernel on the GPU.  H100 (.ci/decode_ab.py --stages merge,
# 7 interleaved rounds, 2026-11-24, bf16 GQA 32/8 d128, KV GB/s fused / launched): b1 2k 454 / 103, b1 8k
# 935 / 890, b1 32k 1668 / 1397, b8 8k 2439 / 2379, b8 32k 2890 / 2866; rows without splits (b64) equal
# (0.998-1.000x).  AMD families keep the
# merge launch (untimed there; on multi-XCD CDNA3 each release writes back the XCD's L2).  "cpu" (the
# interpreter) fuses, so CI tests this path; the tests switch to the merge launch too.
DECODE_FUSED_MERGE_FAMILIES = ("sm90", "cpu")
# The fused merge's steps (decode._last_split_merges): the last split program merges its tile's live rows (query
# tokens x the KV group's heads: at one query token and GQA 32/8, 4 of the 16-row tile) in chunks of that count
# rounded up to a power of two, and loads SLOTS // chunk rows split partials per step (2..MAX_SPLITS), each step
# one wave of independent L2 loads (an online log-sum-exp merge, no max pass first).  SLOTS 32 keeps the 16-row
# tile at 2 splits per step, the step that fitted it (TUNING_NOTES v28: wider steps cost that tile registers in
# the whole kernel); MAX_SPLITS 8: the one-row merge (MHA) unrolled 16 times put 16-24 B on sm90's stack at d64.
# H200 (.ci/decode_ab.py stage "kernel", 5 rounds, 2026-11-28, GB/s, the two-pass merge of 16 rows -> this,
# SDPA): b1 2k 633 -> 697 (686 / 684), 8k 1711 -> 1928 (1774 / 1796), 32k 3216 -> 3380 (3292 / 3290).
DECODE_MERGE_STEP = {"default": {"SLOTS": 32, "MAX_SPLITS": 8}}


# --------------------------------------------------------------------------- FP8 (fa_amd/fp8.py)
# FP8 element types (torch dtype names) that have a dot product on each target, looked up by arch
# name first, then by family (so sm89 and sm120, whose tiles alias to the sm80 rows, still get
# FP8; sm100/sm103 inherit sm90's through the alias).  The first entry is the type the quantising
# functions (flash_attn_fp8_func, ...) produce.  MI300 (gfx942) has the "fnuz" types (no negative
# zero, exponent bias 8: e4m3 max 240); MI350 (gfx950) and NVIDIA sm89+ the OCP types (e4m3 max 448).
# The interpreter ("cpu", CI) pins the OCP types; tests pin the gfx942 types by patching this
# entry.  Families not listed (gfx908, gfx90a, gfx1100, sm80) have no FP8 dot: FP8 calls raise.
FP8_DTYPES = {
    "gfx942": ("float8_e4m3fnuz", "float8_e5m2fnuz"),
    "gfx950": ("float8_e4m3fn", "float8_e5m2"),
    "sm89": ("float8_e4m3fn", "float8_e5m2"),
    "sm90": ("float8_e4m3fn", "float8_e5m2"),
    "sm120": ("float8_e4m3fn", "float8_e5m2"),
    "cpu": ("float8_e4m3fn", "float8_e5m2"),
}
# The oldest Triton that builds the family's FP8 forward, checked by AOT builds of every head dim with
# all features (a version difference is a table key).  gfx942: 3.2 .. 3.9 all compile with zero scratch.
# gfx950: 3.2 has no OCP fp8 dot for it; 3.3 spills (216..2104 B); 3.4 and 3.5 crash on the d256 build
# (and on every head dim with 16x16 MFMAs); 3.6 and 3.9 build every head dim with zero scratch.
FP8_MIN_TRITON = {"gfx950": (3, 6)}
# Targets (arch names, then families) whose forward reads FP8 V token-major per head (dense calls;
# fa_amd.fp8 lays V out so: the quantising functions write it so at no cost, FA3-style FP8 inputs in
# the other layout are copied once per call).  The P.V dot's B operand is then K-major in memory.
# AOT evidence (Triton 3.9, d128 forward unless said):
#   sm90   head-dim-major V: every V tile goes through registers into shared memory with byte stores
#          (128-192 st.shared.b8) and no cp.async pipelining, 254 regs; token-major: 0 byte stores,
#          V copied by cp.async like K, 227 regs; wgmma e4m3 x e4m3 in both dots either way.
#   sm89   (mma.sync m16n8k32 e4m3) head-dim-major: 512 ld.shared.u8 + 400 prmt; token-major: none.
#   gfx942 d64 head-dim-major: 256-384 ds_read/ds_write_u8 and 180 VGPRs; token-major: none, 162.
#   gfx950 no byte LDS traffic in either layout (150 vs 146 VGPRs at d64): left head-dim-major, so
#          FA3-style inputs there pay no copy.  (sm120 follows sm89: the same mma.sync path.)
FP8_V_TOKEN_MAJOR = ("sm89", "sm90", "sm120", "gfx942")
# How a Triton CompiledKernel's launcher takes a call's arguments (kernels/launch.CompiledLaunch, which
# replays the decode loop's launches without the JIT's dispatch): every parameter's value in order, or,
# before triton 3.3, the non-constexpr ones only (the JIT's own launch passed those).  "hooks": where
# Triton keeps its launch hooks (profilers register them; with none registered a replay calls the
# launcher itself, skipping the runner closure and its per-launch metadata): triton.knobs.runtime from
# 3.4, CompiledKernel's class attributes before.
COMPILED_LAUNCH = {"args": "all", "hooks": "knobs", "triton<3.4": {"hooks": "compiled_kernel"},
                   "triton<3.3": {"args": "runtime"}}
# The FP8 quantisation kernels of the quantising functions (fa_amd/kernels/quantize.py), by arch name,
# then family, then "default": BLOCK_ELEMENTS elements (tokens x padded head dim) per block, at most
# MAX_SPLITS programs per (sequence, head) (each walks every MAX_SPLITS-th block), num_warps.  Both
# passes are memory-bound: 8192-element blocks (16 KB of bf16) keep enough bytes in flight per SM.
# "cpu": tiny blocks and two splits, so the interpreter tests walk several blocks per program.
# The fused RoPE kernel (kernels/rotary.py): elements per program (token rows x heads x half the
# rotary dim, padded).  gfx1100 (wave32: half the lanes of a wave64 program) spilled 220-256 B in the
# d80 rotate-half build at 8192 under triton 3.6 (AOT full sweep); 4096: zero, 161 VGPRs.
ROTARY_TILE = {
    "default": {"MAX_TILE": 8192},
    "gfx1100": {"MAX_TILE": 4096},
}

# The V NaN-flag pass of masked forwards (kernels/forward.v_nan_flags: a NaN in V reaches every row, as in
# the eager reference, also rows whose mask skips its block), the same layout as FP8_QUANTIZE: blocks of
# BLOCK_ELEMENTS elements, at most MAX_SPLITS (<= forward.NAN_SPLITS_MAX) programs per (sequence, KV
# head).  A read-only pass at memory bandwidth; its V stays in L2 for the forward that follows.  The
# families of FWD_NAN_FIXUP_FAMILIES read it for their fix-up launch instead: BLOCK_ELEMENTS per block of rows
# (query rows x padded head dim) and num_warps.
V_NAN_FLAGS = {
    "default": {"BLOCK_ELEMENTS": 4096, "MAX_SPLITS": 32, "PROGRAMS": 2048, "num_warps": 4},
}
# The backward's delta preprocess (rowsum(dO * O) per query row; kernels/backward.bwd_preprocess_kernel):
# BLOCK_ELEMENTS elements (query rows x padded head dim) per program.  On the H100 (.ci/pass_ab.py,
# 2026-11-24) 4096-32768 elements and 4 or 8 warps all read O and dO at 2.2-2.3 TB/s (after an L2 flush).
BWD_PREPROCESS = {
    "default": {"BLOCK_ELEMENTS": 8192, "num_warps": 4},
}

FP8_QUANTIZE = {
    "default": {"BLOCK_ELEMENTS": 8192, "MAX_SPLITS": 64, "num_warps": 4},
    "cpu": {"BLOCK_ELEMENTS": 128, "MAX_SPLITS": 2, "num_warps": 4},
}
