"""Default launch configurations, as data.

Keyed by arch family (fa_amd.arch names: "sm90", "gfx942", ...), then a list of
rows ordered by `head_dim` (the padded head dim, a power of two): the first row
whose head_dim >= the problem's padded head dim wins.

Each row holds "fwd", "dkdv" and "dq" launch dicts: BLOCK_M / BLOCK_N (tile
sizes, constexpr), num_warps, num_stages, and -- in HIP rows only, because only
the AMD backend accepts them -- waves_per_eu, matrix_instr_nonkdim and kpack.
An optional "fp32" dict per kernel overrides fields for fp32 inputs (twice the
shared memory per tile).

Numbers for sm90 were measured on an H100 (docs/PERFORMANCE.md, docs/TUNING_NOTES.md);
AMD rows are starting points chosen to compile with zero scratch for their
target (checked in CI by `fa-amd compile`, tests/test_aot_amd.py) and to keep
the register budget of 64-wide wavefronts; `fa-amd tune` refines them on the
user's GPU.
"""

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
    "sm90": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}},
        # H100 sweep 2026-11-22 (bf16, b*s=16k, hidden 2048, s=4096): fwd 128x128/w8/s3 484 TFLOP/s
        # (128x64/w8/s3: 472); atomic-dQ dK/dV 32x128/w8/s3 350 fwd+bwd (w4: 141, spills)
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "fp32": {"BLOCK_N": 64, "num_stages": 2}},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
         "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "fp32": _FP32_HALF_N},
         "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1},
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
    # replicated across lanes, so a 16-row slice of a d128 operand costs 64
    # VGPRs: only small tiles with 8 warps fit 256 VGPRs, and the d128 backward
    # and every d256 kernel still spill (aot.KNOWN_SCRATCH, docs/AOT.md).
    # waves_per_eu=0 (no hint): the hint made the allocator spill more.
    "gfx1100": [
        {"head_dim": 64,
         "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0}},
        {"head_dim": 128,
         "fwd": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0},
         "dq": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0}},
        {"head_dim": 256,
         "fwd": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0},
         "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0},
         "dq": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0}},
    ],
}

# Arch names not in TABLES map to the closest family.
FAMILY_ALIASES = {
    "sm86": "sm80", "sm87": "sm80", "sm89": "sm80", "sm100": "sm90", "sm103": "sm90", "sm120": "sm80",
    "gfx940": "gfx942", "gfx941": "gfx942",
    "gfx1101": "gfx1100", "gfx1102": "gfx1100", "gfx1200": "gfx1100", "gfx1201": "gfx1100",
}

HIP_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
