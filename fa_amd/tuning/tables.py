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
diagonal) and "fp32" (fp32 inputs: twice the shared memory per tile), applied
in that order (fa_amd.tuning.resolve_entry).

Numbers for sm90 were measured on an H100 (docs/PERFORMANCE.md, docs/TUNING_NOTES.md);
AMD rows are starting points chosen to compile with zero scratch for their
target (checked in CI by `fa-amd compile`, tests/test_aot_amd.py) and to keep
the register budget of 64-wide wavefronts; `fa-amd tune` refines them on the
user's GPU.
"""

# GQA backward: when the dK/dV grid (key blocks x KV heads x batch) gives fewer
# programs than this per SM/CU, each program takes a slice of its KV head's
# query-head group instead of all of it (fa_amd.kernels.attention.dkdv_heads_per_program):
# more, shorter programs fill the GPU and balance causal tails, at the cost of
# fp32 partial dK/dV buffers summed afterwards.
DKDV_MIN_PROGRAMS_PER_SM = 4
# How the split slices of a GQA group are summed when dQ already uses atomics
# (deterministic=False): "partials" writes one fp32 (.., hq / heads_per_program, d)
# buffer per slice and sums it afterwards (bitwise reproducible dK/dV); "atomic"
# adds every slice into one fp32 (.., hk, d) buffer with atomics (a 1/slices of the
# bytes, which may stay in L2; dK/dV then carry last-bit noise like dQ).
# Prediction (not yet measured, docs/TUNING_NOTES.md "Open"): at (8, 2048, 16/4)
# causal the GQA backward moves toward the MHA one with the same FLOPs (1.68 vs
# 2.14 ms forward+backward on an H100).  Default stays "partials" until measured.
GQA_SPLIT_SUM = "partials"

_FP32_HALF_N = {"BLOCK_N": 32, "num_stages": 1}

TABLES = {
    # Triton interpreter (CPU): small asymmetric tiles so tests exercise the
    # masked and unmasked paths on short sequences.
    "cpu": [
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
    ],
    # H100 sweeps 2026-11-22 (bf16, b*s=16k, hidden 2048; TFLOP/s; docs/TUNING_NOTES.md v4):
    # long non-causal rows want big tiles, causal / short rows 64x64 ones (less
    # diagonal waste, more programs); dK/dV 64x128/w8/s3 won at every length.
    "sm90": [
        # fwd s16k: 128x64/w8 425 vs 128x64/w4 409; causal s1k: 64x64/w4 283 vs 248
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                 "causal": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}},
         "dkdv": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}},
        # fwd s16k: 128x128/w8 488 vs 64x64/w4 466; causal s1k: 64x64/w4 318 vs 262, s4k 439 vs 396;
        # dK/dV (atomic dQ) s16k 402 vs 32x128: 335; deterministic dQ 128x64/w8/s3 361 vs 128x32/s2 273
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
                 "causal": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}, "fp32": {"BLOCK_N": 32, "num_stages": 2}},
         "dkdv": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}},
        # fwd 128x64/w8/s2 437 (causal s4k) vs 64x64/w8/s2 229; dK/dV 32x64/w8/s2 155 vs s1 97
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "fp32": _FP32_HALF_N},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}},
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
    # CDNA3 (MI300): 64-wide waves, 512 VGPRs incl. AGPRs, 64 KiB LDS.
    # fwd rows use waves_per_eu=1 on every CDNA family: at 2 the register budget
    # halves to 256 and the all-features fwd kernel spills (docs/AOT.md).
    "gfx942": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}},
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}},
    ],
    # CDNA3+ (MI350): 160 KiB LDS; kpack is a no-op there, so it is left out.
    "gfx950": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
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
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                "waves_per_eu": 1, "matrix_instr_nonkdim": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                 "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                  "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
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
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0,
                         "RELOAD_CHUNK": 32},
         "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 16}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0, "RELOAD_CHUNK": 32},
         "dkdv_atomic": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0,
                         "RELOAD_CHUNK": 32},
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
#   N columns at a time (fa_amd/kernels/attention.py) -- for register-bound RDNA.
KERNEL_SWITCHES = {"RELOAD_CHUNK": 0}

