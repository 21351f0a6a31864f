"""The launch configs `fa-amd tune` may time (fa_amd.autotune), per arch, kernel and head-dim
class: data around a table row, no kernel code.  Here (not in autotune) so the AOT check
(fa_amd.aot) can build every candidate without importing the tuner, and the tuner can ask the
AOT check which candidates compile spill-free without an import cycle."""
from __future__ import annotations

import os
from typing import Dict, List

from .tables import HIP_ONLY_OPTIONS, KERNEL_SWITCHES, OVERRIDES


def _strip_for(arch, cfg: Dict) -> Dict:
    cfg = {k: v for k, v in cfg.items() if k not in OVERRIDES}
    if arch.backend != "hip":
        for key in HIP_ONLY_OPTIONS:
            cfg.pop(key, None)
    elif not arch.name.startswith("gfx94"):
        cfg.pop("kpack", None)  # kpack only means something on CDNA3 (gfx942)
    if arch.backend == "hip" and arch.name.startswith("gfx1"):
        cfg.pop("matrix_instr_nonkdim", None)  # RDNA has WMMA, no MFMA shapes
        cfg.pop("kpack", None)
    return cfg


def candidates(arch, kernel: str, default: Dict, head_dim_padded: int) -> List[Dict]:
    """A small per-arch list of launch dicts around the default one (default first)."""
    if kernel == "fwd":
        tiles = [(128, 64), (128, 32), (64, 64), (64, 32), (128, 128)]
    elif kernel in ("dkdv", "dkdv_atomic"):
        tiles = [(32, 128), (32, 64), (16, 64), (64, 64), (16, 128)]
    else:
        tiles = [(128, 32), (64, 32), (64, 16), (64, 64), (128, 64)]
    if head_dim_padded >= 256:  # twice the registers per row: drop the largest tiles
        tiles = [(m, n) for m, n in tiles if m * n <= 64 * 64]
    warps = (4, 8)
    if arch.backend == "hip":
        stages = (1, 2)
        extra = [{"waves_per_eu": w} for w in (1, 2)]
        if not arch.name.startswith("gfx1"):
            extra = [dict(e, matrix_instr_nonkdim=16) for e in extra] + [{"waves_per_eu": 1, "matrix_instr_nonkdim": 32}]
        if arch.name.startswith("gfx94"):
            extra = [dict(e, kpack=2) for e in extra]
    else:
        stages = (2, 3)
        extra = [{}]
    out = [_strip_for(arch, default)]
    # kernel switches (RELOAD_CHUNK) pick the kernel variant the row was built for: every
    # candidate keeps the default's, and a row that sets one also tries its other values
    switches = {k: default[k] for k in KERNEL_SWITCHES if k in default}

    def add(cfg):
        cfg = _strip_for(arch, cfg)
        if cfg not in out:
            out.append(cfg)

    # most informative first (the list is capped): other tiles at the default's
    # options, then other options at the default tile, then everything else
    for bm, bn in tiles:
        add(dict(default, BLOCK_M=bm, BLOCK_N=bn))
    if kernel in ("dkdv", "dkdv_atomic") and head_dim_padded >= 256:
        # dK and dV in separate programs, one accumulator each (DKDV_SPLIT): the register-bound d256 rows
        # can then take 2-4x the keys per program (docs/TUNING_NOTES.md v9)
        for bm, bn in ((16, 64), (16, 128), (32, 64)):
            add(dict(default, BLOCK_M=bm, BLOCK_N=bn, DKDV_SPLIT=1))
    if switches.get("RELOAD_CHUNK"):
        for chunk in (0, 32, 64):  # 0: the resident-operand kernel
            add(dict(default, RELOAD_CHUNK=chunk))
    for nw in warps:
        for ns in stages:
            for e in extra:
                add(dict(BLOCK_M=default["BLOCK_M"], BLOCK_N=default["BLOCK_N"], num_warps=nw, num_stages=ns, **e,
                         **switches))
    for bm, bn in tiles:
        for nw in warps:
            for ns in stages:
                for e in extra:
                    add(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns, **e, **switches))
    return out[:1 + max_candidates()]


def max_candidates() -> int:
    return int(os.environ.get("FA_AMD_AUTOTUNE_MAX_CANDIDATES", "24"))
