"""Ahead-of-time compile check: build every kernel variant the launchers launch with the
default tables, for AMD (and NVIDIA) targets, on any machine -- no GPU, no ROCm, no linker.

Triton's compiler lowers to amdgcn / PTX on the CPU; the amdgcn text reports VGPRs,
scratch (spills) and occupancy, the metadata the LDS bytes.  A table row whose kernel
spills to scratch on an AMD target is a bug in tables.py (it runs, but slowly), so the
check exits non-zero on any scratch and on compile errors.  It runs under every Triton
fa_amd supports (3.2 .. newest; `.ci/aot_matrix.py` runs them all, docs/AOT.md).

    fa-amd compile                       # the subset CI runs (heaviest variant per kernel)
    fa-amd compile --full                # every row x dtype x variant
    fa-amd compile --arch gfx942 --json out.json
    python -m fa_amd.aot --full

What is built is what runs: each job's kernel call is recorded from the real launcher
(fa_amd.aot_launches: tensors and their dtypes, ints, floats, constexprs, launch options) and
goes through the installed Triton's own argument binder (types, 16-divisibility, ints equal
to 1, AMD pointer ranges, as at a launch) and compiler.

Adding a kernel (or a launch route of one): one LAUNCHES entry in fa_amd/aot_launches.py
(and a `_run_*` function there if no existing one calls its launcher); `builds` below says
where it runs, if not everywhere.

Compiles run in worker subprocesses (the kernels must be real @triton.jit functions, so
the workers drop TRITON_INTERPRET, which tests set).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .aot_launches import (_DKDV_KERNELS, DECODE_LAUNCHES, DECODE_ONLY_VARIANTS, DECODE_VARIANTS, FP8_LAUNCHES,
                           LAUNCHES, SHORT_VARIANTS, TARGETS, VARIANTS, WHOLE_KERNELS, WHOLE_VARIANTS, _arch_of, _kernel,
                           launch_call, launch_config)

# the targets with their own table rows (what `fa-amd compile` builds by default), the AMD ones among
# them, and the RDNA parts that share the gfx1100 rows (built when named, or with --arch rdna / all)
DEFAULT_TARGETS = ("gfx908", "gfx90a", "gfx942", "gfx950", "gfx1100", "sm80", "sm90")
AMD_TARGETS = tuple(t for t in DEFAULT_TARGETS if TARGETS[t][0] == "hip")
RDNA_ALIAS_TARGETS = ("gfx1101", "gfx1102", "gfx1200", "gfx1201")
_TARGET_GROUPS = {"amd": AMD_TARGETS, "rdna": ("gfx1100",) + RDNA_ALIAS_TARGETS, "all": tuple(TARGETS)}
# dkdv_atomic: the dK/dV kernel that also accumulates dQ with fp32 atomics (deterministic=False where
# tables.NONDETERMINISTIC_DQ says "atomic"); dq is then not launched
# dkdv_fused: the dK/dV kernel whose extra programs compute dQ (FUSED_DQ), built only where the
# launcher fuses (tables.FUSED_DQ_FAMILIES, rows whose "dkdv" and "dq" entries share launch options)
# fwd_fp8, decode_fp8, decode_fp8kv, append_fp8: the FP8 paths (fa_amd.aot_launches.FP8_LAUNCHES), built
# where the target has an FP8 dot product under the installed triton (fp8_builds)
# decode, merge, append: the split-KV decode kernel, the merge of its key splits and the KV-cache append
# (fa_amd.aot_launches.DECODE_LAUNCHES), in the variants of aot_launches.DECODE_VARIANTS
FP8_KERNELS = tuple(FP8_LAUNCHES)
DECODE_KERNELS = tuple(DECODE_LAUNCHES)
NAN_RULE_KERNELS = ("nan_flags", "nan_fixup")
KERNELS = (("fwd", "dkdv", "dkdv_atomic", "dkdv_fused", "dq", "preprocess", "probs", "rotary") + NAN_RULE_KERNELS
           + DECODE_KERNELS + FP8_KERNELS)
DEFAULT_KERNELS = tuple(k for k in KERNELS if k != "probs")
# (HEAD_DIM, D_PAD): one per table row plus non-powers-of-two: 80 exercises padding (and the 64 + 16 head-dim
# split where the family splits, tables.HEAD_DIM_SPLIT_FAMILIES), 192 the 128 + 64 split
HEAD_DIMS = (64, 80, 128, 192, 256)
DTYPES = ("fp16", "bf16")
# the dtypes the full sweep builds per kernel: fp32 inputs too for the decode kernels, whose tables
# have an "fp32" override (the others' AMD rows have none)
ALL_DTYPES = DTYPES + ("fp32",)


def sweep_dtypes(kernel: str) -> tuple:
    return ALL_DTYPES if kernel in DECODE_KERNELS else DTYPES


# Spills that no table row avoids with the current kernel code, and why.
# Listed here they print as "known spill" and do not fail the check; the test
# fails once one of them stops spilling (stale_known_scratch), so the list
# cannot go stale.  key: (table family, kernel, table row head_dim[, dtype]) -> reason (with a
# dtype: that dtype's builds only).
# The gfx1100 training-kernel rows that spilled (every d128 backward and d256 kernel, the d64
# atomic-dQ dK/dV) run the reloading kernels (RELOAD_CHUNK) since 2026-11, with zero scratch
# (docs/AOT.md).  Left: fp32 decode at d256 on RDNA3, whose dots are FMA loops (no fp32 WMMA):
# 848..932 B under triton 3.6 (every route) at the row's 16x16 tile with 16 warps, more at every other tile tried
# (up to 16x32, 4 to 16 warps, RELOAD_CHUNK 0/16/32; tables.py, "gfx1100" decode rows).
KNOWN_SCRATCH: Dict[tuple, str] = {
    ("gfx1100", "decode", 256, "fp32"): "fp32 decode, d256, RDNA3 (FMA dots): spills at every tile tried "
                                        "(docs/AOT.md, 'Decode kernels')",
}
# The same for older Tritons only: {"triton<X.Y": {(table family, kernel, table row head_dim): reason}},
# covering results compiled by a triton older than X.Y (their measured figures are in docs/AOT.md).
# gfx1100 (and the RDNA parts that run its rows) before 3.6: the reloading kernels were fitted to
# 32-bit buffer offsets, which Triton uses on AMD from 3.6; with 64-bit pointer tensors they spill
# at every tile size (the dQ d256 kernel still spills 1576 B at 16x16, RELOAD_CHUNK 16, triton 3.5).
_RDNA_BEFORE_3_6 = ("spills under triton < 3.6 at every tile tried (64-bit pointer tensors: no AMD buffer "
                    "loads before 3.6); correct but slower; docs/AOT.md has the figures")
KNOWN_SCRATCH_BEFORE: Dict[str, Dict[tuple, str]] = {
    "triton<3.6": {("gfx1100", kernel, d): _RDNA_BEFORE_3_6
                   for kernel in ("fwd", "dkdv", "dkdv_atomic", "dq", "probs") for d in (64, 128, 256)}
                  | {("gfx1100", "rotary", d): _RDNA_BEFORE_3_6 + " (rotary d128 plain: 116 B under triton 3.2)"
                     for d in (64, 128, 256)}
                  | {("gfx1100", "decode", d): _RDNA_BEFORE_3_6 + " (split-KV decode: docs/AOT.md, 'Decode kernels')"
                     for d in (64, 128, 256)},
}


@dataclass
class CompileJob:
    target: str
    kernel: str
    head_dim: int
    dtype: str
    variant: str
    # explicit launch dict (BLOCK_M/BLOCK_N + options + switches) instead of the table's; for table searches
    config: Optional[Dict] = None

    @property
    def name(self) -> str:
        return f"d{self.head_dim}-{self.dtype}-{self.variant}"


@dataclass
class CompileResult:
    target: str
    kernel: str
    variant: str
    config: Dict = field(default_factory=dict)
    seconds: float = 0.0
    error: Optional[str] = None
    lds_bytes: Optional[int] = None
    # AMD
    vgprs: Optional[int] = None
    agprs: Optional[int] = None
    scratch_bytes: Optional[int] = None
    occupancy: Optional[int] = None
    # CUDA
    regs: Optional[int] = None
    stack_bytes: Optional[int] = None
    # sm90: ptxas serialized the kernel's wgmma (its C7515 performance warning: the matmuls no longer overlap;
    # TUNING_NOTES v35); None where not checked
    wgmma_serialized: Optional[bool] = None
    # the compiled signature: Triton type of every runtime argument ("*bf16", "i32", "fp32", ...),
    # and the constexpr values (flags, tiles, switches), as the launcher passed them
    signature: Dict[str, str] = field(default_factory=dict)
    constexprs: Dict[str, Any] = field(default_factory=dict)
    triton: Optional[str] = None  # the version that compiled it

    @property
    def is_hip(self) -> bool:
        return TARGETS[self.target][0] == "hip"

    @property
    def failed(self) -> bool:
        """Compile error, or scratch (spilled registers) on an AMD target not in KNOWN_SCRATCH."""
        return self.error is not None or (self.is_hip and bool(self.scratch_bytes) and not known_scratch(self))


def known_scratch(r: "CompileResult") -> Optional[str]:
    """The KNOWN_SCRATCH (or, for the triton that built it, KNOWN_SCRATCH_BEFORE) reason covering
    this result's (target, kernel, table row), if any."""
    keys = _known_scratch_keys(r)
    version = _version_tuple(r.triton) if r.triton else triton_version()
    for bound, rows in KNOWN_SCRATCH_BEFORE.items():
        if version < _version_tuple(bound.split("<")[1]):
            hit = next((rows[k] for k in keys if k in rows), None)
            if hit:
                return hit
    return next((KNOWN_SCRATCH[k] for k in keys if k in KNOWN_SCRATCH), None)


def _known_scratch_keys(r: "CompileResult") -> tuple:
    """The known-scratch keys a result falls under: (family, kernel, row head dim, dtype), then without dtype."""
    head_dim, dtype = r.variant.split("-")[:2]
    row = (_family(r.target), r.kernel, _d_pad(int(head_dim[1:])))
    return row + (dtype,), row


def _family(target: str) -> str:
    """The table family whose rows a target runs (the RDNA aliases run gfx1100's): known spills are per row."""
    from .tuning import family_of

    return family_of(_arch_of(target))


def known_scratch_rows(version: Optional[tuple] = None) -> Dict[tuple, str]:
    """Every known-spill row that applies to this triton (default: the installed one)."""
    version = version or triton_version()
    rows = dict(KNOWN_SCRATCH)
    for bound, extra in KNOWN_SCRATCH_BEFORE.items():
        if version < _version_tuple(bound.split("<")[1]):
            rows.update(extra)
    return rows


def _version_tuple(text: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def stale_known_scratch(results: List["CompileResult"]) -> List[str]:
    """KNOWN_SCRATCH rows (as "target kernel dN") none of whose built variants spills any more.
    (KNOWN_SCRATCH_BEFORE rows cover several versions, which need not all spill: not checked.)"""
    spills: Dict[tuple, bool] = {}
    for r in results:
        key = next((k for k in _known_scratch_keys(r) if k in KNOWN_SCRATCH), None)
        if key is not None and r.error is None:
            spills[key] = spills.get(key, False) or bool(r.scratch_bytes)
    return [" ".join([family, kernel, f"d{d}", *dtype]) for (family, kernel, d, *dtype), spilled in spills.items()
            if not spilled]


# --------------------------------------------------------------------------- job lists

def _pressure(kernel: str, cfg: Dict, d_pad: int) -> int:
    """Rough register-pressure score of a tile config (fp32 accumulators + score tile)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if kernel in _DKDV_KERNELS:
        return bn * (2 * d_pad + bm)
    return bm * (d_pad + bn)


def default_config(target: str, kernel: str, d_pad: int, causal: bool = False, short: bool = False) -> Dict:
    """Launch dict from the default tables (tuned overrides ignored) as the launcher resolves it under
    the installed Triton (version-keyed entries included)."""
    from .tuning import default_config as table_config

    table_kernel = LAUNCHES[kernel].table_kernel
    if table_kernel is None:  # preprocess: tables.BWD_PREPROCESS (as attention_backward reads it)
        from .tuning import bwd_preprocess_config

        return bwd_preprocess_config(_arch_of(target), d_pad)
    if LAUNCHES[kernel].module == "decode":  # tables.DECODE_TABLES ("causal": the wide tile)
        return decode_config(target, kernel, d_pad, wide=causal)
    return table_config(_arch_of(target), table_kernel, d_pad, causal=causal, short=short, fp8=kernel in FP8_KERNELS)


def decode_config(target: str, kernel: str, d_pad: int, wide: bool = False, fp32: bool = False) -> Dict:
    """A decode kernel's launch dict from tables.DECODE_TABLES as the launcher resolves it ("wide": more
    than tables.DECODE_WIDE_ROWS query rows per KV head; the FP8 kernels take the tables.DECODE_FP8
    overrides)."""
    from .tuning import get_decode_config

    return dict(get_decode_config(_arch_of(target), d_pad, fp32, wide, fp8=kernel in FP8_KERNELS)[
        LAUNCHES[kernel].table_kernel])


def _has_short(target: str, kernel: str, d_pad: int) -> bool:
    from .tuning import default_entry

    table_kernel = LAUNCHES[kernel].table_kernel
    return bool(table_kernel and LAUNCHES[kernel].module != "decode"
                and default_entry(_arch_of(target), table_kernel, d_pad).get("short"))


def builds(target: str, kernel: str, d_pad: int, causal: bool = False, variant: str = "") -> bool:
    """Whether the launcher runs this kernel (and variant) on this target: dkdv_fused only where the
    tables fuse, dkdv_atomic only where they choose atomic dQ, "short" only for entries with a "short"
    override, "split" only for the dK/dV kernels, rotary only in its two variants, the decode kernels
    in their aot_launches.DECODE_VARIANTS (the decode-only variants nowhere else)."""
    from .tuning import bwd_fusable, family_of, nondeterministic_dq, tables

    family = family_of(_arch_of(target))
    if kernel in DECODE_KERNELS:
        if kernel == "merge" and family in tables.DECODE_FUSED_MERGE_FAMILIES:
            return False  # the decode kernel merges its splits there (no merge launch)
        return variant in ("",) + DECODE_VARIANTS[kernel]
    if variant in DECODE_ONLY_VARIANTS:
        return False
    if variant in WHOLE_VARIANTS and kernel not in WHOLE_KERNELS:
        return False
    if kernel == "nan_flags_fp8":  # (the fix-up families mark V's NaNs inside the FP8 forward too)
        return fp8_builds(target) and variant in ("", "causal", "all") and \
            family not in tables.FWD_NAN_FIXUP_FAMILIES
    if kernel in FP8_KERNELS:
        return fp8_builds(target) and (variant in ("", "plain", "causal", "all")
                                       or (kernel == "fwd_fp8" and variant == "short" and _has_short(target, kernel,
                                                                                                    d_pad)))
    if kernel == "rotary":
        return variant in ("", "plain", "all")
    if kernel in NAN_RULE_KERNELS:  # masked forwards only; the fix-up where the family lists it, else the pass
        return variant in ("", "causal", "all") and (
            (family in tables.FWD_NAN_FIXUP_FAMILIES) == (kernel == "nan_fixup"))
    if variant in SHORT_VARIANTS and not _has_short(target, kernel, d_pad):
        return False
    if variant == "split" and kernel not in _DKDV_KERNELS:
        return False
    if kernel == "dkdv_atomic":
        return nondeterministic_dq(family) == "atomic"
    if kernel == "dkdv_fused":
        return bwd_fusable(family, default_config(target, "dkdv", d_pad, causal),
                           default_config(target, "dq", d_pad, causal))
    return True


def fp8_builds(target: str) -> bool:
    """Whether the FP8 kernels build for this target: it has an FP8 dot product (tables.FP8_DTYPES)
    and the installed triton is at least its tables.FP8_MIN_TRITON (the launcher refuses FP8 below)."""
    import torch

    from .tuning import fp8_dtype_names, fp8_min_triton

    arch = _arch_of(target)
    names = fp8_dtype_names(arch)
    return bool(names) and hasattr(torch, names[0]) and triton_version() >= fp8_min_triton(arch)


def _fp8_ci_jobs(target: str, kernel: str) -> List[CompileJob]:
    """The CI subset of an FP8 kernel: all features on, bf16 out / q; the forward at its heaviest
    table row (as ci_jobs picks) and the tiles of its "short" overrides, the decode kernels at their
    heaviest row (d256: 16 x 32 tiles of a 256-wide head), the append at d128.  The full sweep
    (--full, .ci/aot_matrix.py) builds every row."""
    if not builds(target, kernel, 128, causal=True, variant="all"):
        return []
    if kernel == "fwd_fp8":
        heaviest = max((128, 256, 64), key=lambda d: _pressure(kernel, default_config(target, kernel, d, True), d))
        return [CompileJob(target, kernel, heaviest, "bf16", "all")] + [
            CompileJob(target, kernel, d, "bf16", "short") for d in (64, 128, 256)
            if builds(target, kernel, d, variant="short")]
    return [CompileJob(target, kernel, 128 if kernel == "append_fp8" else 256, "bf16", "all")]


def _is_causal(variant: str) -> bool:
    return bool(VARIANTS.get(variant, {}).get("HAS_RIGHT"))


def _d_pad(head_dim: int) -> int:
    # the launcher's own rule
    from .kernels.launch import head_dim_padded

    return head_dim_padded(head_dim)


def full_jobs(targets, kernels, dtypes=None, variants=tuple(VARIANTS), head_dims=HEAD_DIMS) -> List[CompileJob]:
    """Every head dim x dtype (default: sweep_dtypes) x variant the launchers run, per target and kernel."""
    return [CompileJob(t, k, d, dt, v)
            for t in targets for k in kernels for d in head_dims for dt in (dtypes or sweep_dtypes(k))
            for v in (variants if k != "preprocess" else ("plain",))
            if not (k == "preprocess" and d == 80) and builds(t, k, _d_pad(d), _is_causal(v), v)]


def _decode_ci_jobs(target: str, kernel: str, dtype: str) -> List[CompileJob]:
    """The CI subset of a decode kernel: the decode kernel with every feature of the paged route ("all")
    at its heaviest table row, the merge (with sinks) and the append (paged, rotary) at the largest head
    dim.  (The other routes, the wide tile and fp32: the full sweep; under triton 3.2 a decode build
    takes 10-30 s on one core.)"""
    if not builds(target, kernel, 256, variant="all"):  # (the merge, where the decode kernel merges)
        return []
    d = 256
    if kernel == "decode":
        d = max((64, 128, 256), key=lambda d: _pressure(kernel, decode_config(target, kernel, d), d))
    return [CompileJob(target, kernel, d, dtype, "all")]


def ci_jobs(targets, kernels) -> List[CompileJob]:
    """Every (target, kernel) pair at its heaviest variant: all features on, the
    table row with the largest register-pressure score that is expected to be
    spill-free, bf16 (fp16 on gfx908); plus every KNOWN_SCRATCH row, so a fixed
    one is noticed, and the tiles of "short" overrides."""
    from .tuning import tables

    jobs = []
    # KNOWN_SCRATCH rows only: an older triton's known spills (KNOWN_SCRATCH_BEFORE) do not change the
    # subset (its heaviest variants still build, and must not fail); the full sweep reports them all
    known = KNOWN_SCRATCH
    for t in targets:
        dtype = "fp16" if t == "gfx908" else "bf16"
        for k in kernels:
            if k in FP8_KERNELS:
                jobs += _fp8_ci_jobs(t, k)
                continue
            if k in DECODE_KERNELS:
                jobs += _decode_ci_jobs(t, k, dtype)
                continue
            if k in ("preprocess", "rotary"):
                jobs.append(CompileJob(t, k, 256 if k == "preprocess" else 128, dtype, "plain"))
                continue
            if k in NAN_RULE_KERNELS:  # (one masked launch: these kernels have no table row)
                jobs += [CompileJob(t, k, 256, dtype, "all")] if builds(t, k, 256, causal=True, variant="all") else []
                continue
            rows = [d for d in (128, 256, 64) if (t, k, d) not in known and builds(t, k, d, causal=True)]
            if rows:
                heaviest = max(rows, key=lambda d: _pressure(k, default_config(t, k, d, causal=True), d))
                jobs.append(CompileJob(t, k, heaviest, dtype, "all"))
            # known rows in both extremes: the allocator is not monotone in features (a row can
            # spill plain and not with everything on, or the reverse), and an entry is stale
            # only when neither spills
            jobs += [CompileJob(t, k, d, dtype, v) for d in (64, 128, 256) if (t, k, d) in known
                     for v in ("plain", "all")]
            # the tiles of "short" overrides, with every feature they can meet
            jobs += [CompileJob(t, k, d, dtype, v) for d in (64, 128, 256) for v in SHORT_VARIANTS
                     if builds(t, k, d, variant=v)]
            # the whole-block kernels (EVEN_QK) where the tables run them
            if _family(t) in tables.EVEN_QK_FAMILIES:
                jobs += [CompileJob(t, k, d, dtype, v) for d in (64, 128, 256) for v in WHOLE_VARIANTS
                         if builds(t, k, d, causal=True, variant=v)]
    return jobs


def tune_candidate_jobs(targets, head_dims=(64, 128, 256)) -> List[CompileJob]:
    """Every launch config `fa-amd tune` may time (fa_amd.tuning.candidates, the default excepted),
    per target, tuned kernel and head-dim class, with all features on (bf16; fp16 on gfx908)."""
    from .tuning.candidates import candidates

    jobs = []
    for t in targets:
        dtype = "fp16" if t == "gfx908" else "bf16"
        for kernel in ("fwd", "dkdv", "dq", "dkdv_atomic"):
            for d in head_dims:
                if builds(t, kernel, d, causal=True):
                    jobs += [CompileJob(t, kernel, d, dtype, "all", config=cfg)
                             for cfg in candidates(_arch_of(t), kernel, default_config(t, kernel, d, True), d)[1:]]
    return jobs


def target_of(arch) -> Optional[str]:
    """The AOT target that builds what runs on `arch` (a GPU's fa_amd.arch.Arch): its own name, else
    its table family's; None if neither is a target here."""
    from .tuning import family_of

    return next((t for t in (arch.name, family_of(arch)) if t in TARGETS), None)


# the feature extremes a tune candidate must build spill-free in: the allocator is not monotone in
# features (a config can spill plain and not with everything on, or the reverse)
SCREEN_VARIANTS = ("all", "plain")


def screen_configs(target: str, kernel: str, head_dim: int, dtype: str, configs: List[Dict],
                   workers: Optional[int] = None) -> List[Optional[str]]:
    """Why each launch config (configs[0]: the table's) may not run as `kernel`'s row on `target` under
    the installed triton, None where it may: every SCREEN_VARIANTS build must compile, and on AMD spill
    no more scratch than configs[0] does (zero wherever the table's row is spill-free, which the AOT
    check holds on CDNA under every supported triton).  `fa-amd tune` times only the configs this
    passes, so no tuned row compiles worse than the table's."""
    jobs = [CompileJob(target, kernel, head_dim, dtype, v, config=dict(cfg)) for cfg in configs
            for v in SCREEN_VARIANTS]
    results = run_jobs(jobs, max(1, min(len(jobs), workers or os.cpu_count() or 1)))
    per_config = [results[i:i + len(SCREEN_VARIANTS)] for i in range(0, len(results), len(SCREEN_VARIANTS))]
    allowed = {r.variant: (r.scratch_bytes or 0) for r in per_config[0] if r.error is None}
    reasons = []
    for rows in per_config:
        why = None
        for r in rows:
            if r.error is not None:
                why = f"does not compile ({r.variant.split('-')[-1]}): {' '.join(r.error.split())[:300]}"
            elif r.is_hip and (r.scratch_bytes or 0) > allowed.get(r.variant, 0):
                why = f"spills {r.scratch_bytes} B of scratch ({r.variant.split('-')[-1]})"
            if why:
                break
        reasons.append(why)
    return reasons


def compile_options(cfg: Dict) -> Dict:
    """The launch dict's compiler options (num_warps, num_stages, HIP options): everything
    but the tiles and the kernel switches, which are constexpr arguments of the kernel."""
    from .tuning.tables import KERNEL_SWITCHES

    return {k: v for k, v in cfg.items() if k not in ("BLOCK_M", "BLOCK_N") and k not in KERNEL_SWITCHES}


# --------------------------------------------------------------------------- Triton version differences
# Everything that differs between the supported Tritons (3.2 .. newest) lives in this section,
# keyed on the version: how a call becomes an ASTSource, and how far the pipeline can run here.

def triton_version() -> tuple:
    import triton

    return _version_tuple(triton.__version__)


def _specialized_source(fn, target, args, kwargs):
    """(ASTSource, compiler options, {argument: Triton type}) of what JITFunction.run compiles for
    `fn[grid](*args, **kwargs)` on `target`, from the installed Triton's own binder."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    if triton_version() < (3, 3):
        # 3.2: the signature holds the runtime arguments only; constexprs and ints equal to 1 are
        # "constants" by name; specialization is an AttrsDescriptor from the values
        bound, sig_and_spec, _, _, options = binder(*args, **kwargs)
        values = tuple(bound.values())
        names = [p.name for p in fn.params if not p.is_constexpr]
        signature = {n: ("*i8" if t == "none" else t) for n, t in zip(names, sig_and_spec)}
        attrs = backend.get_attrs_descriptor(fn.params, values)
        specialized = attrs.get_constants()
        constants = {p.name: v for v, p in zip(values, fn.params)
                     if p.is_constexpr or p.num in specialized or v is None}
        types = {n: t for n, t in signature.items() if n not in constants}
        return ASTSource(fn, signature, constants, attrs), options, types
    # 3.3+: every parameter in the signature ("constexpr" for constexprs and specialized ints),
    # constexpr values and attributes keyed by (index,)
    bound, specialization, options = binder(*args, **kwargs)
    values = list(bound.values())
    signature = {p.name: spec[0] for p, spec in zip(fn.params, specialization)}
    constexprs = {(i,): values[i] for i, spec in enumerate(specialization) if spec[0] == "constexpr"}
    attrs = {(i,): backend.parse_attr(spec[1]) for i, spec in enumerate(specialization) if isinstance(spec[1], str)}
    types = {n: t for n, t in signature.items() if t != "constexpr"}
    return ASTSource(fn, signature, constexprs, attrs), options, types


def bound_arguments(fn, args, kwargs) -> Dict:
    """Every parameter of `fn[grid](*args, **kwargs)` by name, defaults included (optional features
    such as Sinks=None, HAS_SINKS=False are left out of the launches that do not use them)."""
    import inspect

    params = inspect.signature(getattr(fn, "fn", fn)).parameters  # JITFunction or the interpreter's wrapper
    bound = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    bound.update(zip(fn.arg_names, args))
    bound.update(kwargs)
    return bound


def _needs_missing_linker(target) -> bool:
    """Triton < 3.5 links HSACO with an external ld.lld (ROCm's); without one, triton.compile fails."""
    if target.backend != "hip" or triton_version() >= (3, 5):
        return False
    from triton.backends.amd.compiler import HIPBackend

    try:
        HIPBackend.path_to_rocm_lld()
        return False
    except Exception:
        return True


def _build(src, target, options: Dict):
    """(asm text by stage, LDS / shared bytes).  triton.compile where it can run here; where the HIP
    backend would need an external linker that is not installed, the same stages up to "amdgcn",
    whose text carries every number this check reads (the HSACO link adds none)."""
    import triton

    if not _needs_missing_linker(target):
        compiled = triton.compile(src, target=target, options=options)
        return compiled.asm, int(getattr(compiled.metadata, "shared", 0) or 0)
    from triton._C.libtriton import ir
    from triton.compiler import make_backend

    version = triton_version()
    backend = make_backend(target)
    opts = backend.parse_options(dict(options))
    stages: Dict[str, Callable] = {}
    if version >= (3, 4):
        backend.add_stages(stages, opts, src.language)
    else:
        backend.add_stages(stages, opts)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(opts) if version >= (3, 3) else backend.get_codegen_implementation()
    module = src.make_ir(opts, codegen, backend.get_module_map(), context)
    metadata = {"hash": "fa-amd-aot", "target": target, **opts.__dict__}
    asm = {}
    for ext, stage in stages.items():
        if ext == "hsaco":
            break
        module = stage(module, metadata)
        asm[ext] = str(module)
    return asm, int(metadata.get("shared", 0) or 0)


# --------------------------------------------------------------------------- compiling (worker side)

def _nvidia_tool(name: str) -> Optional[str]:
    """The CUDA tool `name` Triton bundles, else one on PATH."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.path.exists(bundled) else shutil.which(name)


def _amd_stat(text: str, key: str) -> Optional[int]:
    m = re.search(rf";\s*{key}:\s*(\d+)", text)
    return int(m.group(1)) if m else None


def compile_one(job: CompileJob) -> CompileResult:
    try:
        return _compile_one(job)
    except Exception as exc:  # e.g. a launcher that does not run this job's problem
        return CompileResult(job.target, job.kernel, job.name, error=f"{type(exc).__name__}: {exc}"[:300])


def _json_value(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


def _compile_one(job: CompileJob) -> CompileResult:
    from triton.backends.compiler import GPUTarget

    backend, arch, warp = TARGETS[job.target]
    spec = LAUNCHES[job.kernel]
    call = launch_call(job)
    fn = _kernel(spec)
    import triton

    result = CompileResult(job.target, job.kernel, job.name, config=launch_config(spec, call),
                           triton=triton.__version__)
    target = GPUTarget(backend, arch, warp)
    start = time.perf_counter()
    try:
        src, options, types = _specialized_source(fn, target, call.args, call.kwargs)
        result.signature = types
        constexpr_names = {p.name for p in fn.params if p.is_constexpr}
        bound = bound_arguments(fn, call.args, call.kwargs)
        result.constexprs = {n: _json_value(bound[n]) for n in fn.arg_names if n in constexpr_names}
        asm, result.lds_bytes = _build(src, target, options)
    except Exception as exc:  # report every failure, keep compiling the rest
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    if backend == "hip":
        text = asm["amdgcn"]
        result.vgprs = _amd_stat(text, "NumVgprs")
        result.agprs = _amd_stat(text, "NumAgprs")
        result.scratch_bytes = _amd_stat(text, "ScratchSize")
        result.occupancy = _amd_stat(text, "Occupancy")
    else:
        result.regs, result.stack_bytes = _cuda_usage(asm)
        if arch == 90:
            result.wgmma_serialized = _wgmma_serialized(asm)
    return result


def _cuda_usage(asm):
    """(registers, stack bytes) from the cubin via cuobjdump; ptxas spills land on the stack."""
    tool = _nvidia_tool("cuobjdump")
    if tool is None or "cubin" not in asm:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def _ptxas_path(arch: int) -> Optional[str]:
    """The ptxas Triton itself assembles `arch` with (get_ptxas: from triton 3.9 sm90 takes the newer, CUDA 13
    one), else the bundled one, else one on PATH."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
        if path and os.path.exists(path):
            return path
    except Exception:  # (older tritons: no get_ptxas, or knobs without it)
        pass
    return _nvidia_tool("ptxas")


def _wgmma_serialized(asm) -> Optional[bool]:
    """Whether ptxas, assembling the kernel's PTX for sm_90a, reports its wgmma serialized (C7515: "wgmma.mma_async
    instructions are serialized due to ..."), which Triton's own ptxas call does not show.  None without ptxas."""
    tool = _ptxas_path(90)
    if tool is None or "ptx" not in asm:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(asm["ptx"])
        out = subprocess.run([tool, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, timeout=300)
    if out.returncode != 0:  # (a ptxas older than the PTX: no answer rather than a wrong one)
        return None
    return "C7515" in out.stderr + out.stdout


def _worker_main():
    """Reads one JSON job per stdin line, answers one JSON result per stdout line."""
    warnings.simplefilter("ignore")
    out = sys.stdout
    sys.stdout = sys.stderr  # compiler chatter must not corrupt the result stream
    for line in sys.stdin:
        job = CompileJob(**json.loads(line))
        out.write(json.dumps(asdict(compile_one(job))) + "\n")
        out.flush()


# --------------------------------------------------------------------------- driving (parent side)

def target_supported(target: str) -> Optional[str]:
    """None if the target is known here, else why not (the installed triton is probed separately)."""
    if target not in TARGETS:
        return f"unknown target {target!r} (choose from {', '.join(TARGETS)})"
    from .tuning import family_of
    from .tuning.tables import TABLES

    if family_of(_arch_of(target)) not in TABLES:
        return f"no {target} rows in fa_amd/tuning/tables.py"
    return None


# targets that older Triton releases may not know; probed with one tiny compile
_PROBED_TARGETS = ("gfx950", "gfx1200", "gfx1201")


def probe_targets(targets) -> Dict[str, str]:
    """{target: reason} for targets the installed triton cannot compile for."""
    probes = [CompileJob(t, "preprocess", 64, "fp16", "plain") for t in targets if t in _PROBED_TARGETS]
    if not probes:
        return {}
    return {r.target: f"the installed triton cannot build it ({r.error})"
            for r in run_jobs(probes, len(probes)) if r.error}


def run_jobs(jobs: List[CompileJob], workers: int, progress=None, fresh_cache: bool = False) -> List[CompileResult]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default the launcher gets; silences a 3.9 warning
    env.setdefault("CUDA_VISIBLE_DEVICES", "")  # the workers run launchers on CPU tensors only
    tmp_cache = None
    if fresh_cache:
        tmp_cache = tempfile.mkdtemp(prefix="fa_amd_aot_cache_")
        env["TRITON_CACHE_DIR"] = tmp_cache
    todo: "queue.Queue[int]" = queue.Queue()
    for i in range(len(jobs)):
        todo.put(i)
    results: List[Optional[CompileResult]] = [None] * len(jobs)
    lock = threading.Lock()

    def start_worker():
        log = tempfile.TemporaryFile(mode="w+")  # the worker's stderr, for the report if it dies
        proc = subprocess.Popen([sys.executable, "-m", "fa_amd.aot", "--_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        return proc, log

    def ask(proc, job) -> Optional[str]:
        try:
            proc.stdin.write(json.dumps(asdict(job)) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return proc.stdout.readline() or None

    def drive():
        proc, log = start_worker()
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                job = jobs[i]
                line = ask(proc, job)
                if line is None:  # the worker died (e.g. a compiler crash): report it, start a new one
                    proc.kill()
                    log.seek(0)
                    tail = " | ".join(log.read().strip().splitlines()[-3:])
                    results[i] = CompileResult(job.target, job.kernel, job.name,
                                               error=f"compiler process died (exit {proc.wait()}): {tail}"[:400])
                    log.close()
                    proc, log = start_worker()
                else:
                    results[i] = CompileResult(**json.loads(line))
                if progress:
                    with lock:
                        progress(results[i])
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
            proc.wait()
            log.close()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(max(1, min(workers, len(jobs))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if tmp_cache:
        shutil.rmtree(tmp_cache, ignore_errors=True)
    missing = [i for i, r in enumerate(results) if r is None]
    for i in missing:  # a driver thread failed outright: never drop a job silently
        job = jobs[i]
        results[i] = CompileResult(job.target, job.kernel, job.name, error="not compiled (driver thread failed)")
    return results


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def format_tables(results: List[CompileResult]) -> str:
    """One markdown table per kernel."""
    lines = []
    for kernel in KERNELS:
        rows = [r for r in results if r.kernel == kernel]
        if not rows:
            continue
        lines += [f"\n### {kernel}\n",
                  "| target | variant | tiles (M x N, warps, stages) | VGPRs (AMD) / regs (CUDA) | AGPRs "
                  "| LDS / shared B | scratch / stack B | occupancy | compile s | status |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (list(TARGETS).index(r.target), r.variant)):
            c = r.config
            tile_rows = c.get("BLOCK_M", c.get("BLOCK_T", c.get("BLOCK_R", "-")))
            tiles = f"{tile_rows}x{c.get('BLOCK_N', '-')}, {c.get('num_warps', 4)}w, {c.get('num_stages', '-')}s"
            if "waves_per_eu" in c:
                tiles += f", wpe{c['waves_per_eu']}"
            if c.get("RELOAD_CHUNK"):
                tiles += f", reload{c['RELOAD_CHUNK']}"
            if r.error:
                status = "ERROR: " + r.error
            elif r.failed:
                status = "SPILLS"
            elif r.is_hip and r.scratch_bytes:
                status = "known spill"
            elif r.wgmma_serialized:
                status = "wgmma serialized"
            else:
                status = "ok"
            lines.append(f"| {r.target} | {r.variant} | {tiles} | {_fmt(r.vgprs if r.is_hip else r.regs)} "
                         f"| {_fmt(r.agprs)} | {_fmt(r.lds_bytes)} "
                         f"| {_fmt(r.scratch_bytes if r.is_hip else r.stack_bytes)} | {_fmt(r.occupancy)} "
                         f"| {r.seconds:.1f} | {status} |")
    return "\n".join(lines)


def summary_table(results: List[CompileResult]) -> str:
    """One line per (target, kernel): worst case over all compiled variants."""
    lines = ["| target | kernel | variants | max VGPRs / regs | max LDS / shared B | max scratch / stack B "
             "| min occupancy | status |", "|---|---|---|---|---|---|---|---|"]
    for target in TARGETS:
        for kernel in KERNELS:
            rows = [r for r in results if (r.target, r.kernel) == (target, kernel)]
            if not rows:
                continue
            hip = rows[0].is_hip

            def worst(get, pick=max):
                vals = [get(r) for r in rows if get(r) is not None]
                return pick(vals) if vals else None

            errors = sum(r.error is not None for r in rows)
            spills = [r for r in rows if r.is_hip and r.scratch_bytes]
            unknown = [r for r in spills if not known_scratch(r)]
            status = (f"{errors} errors" if errors else
                      f"{len(unknown)} SPILL" if unknown else
                      f"{len(spills)} known spill" if spills else "ok")
            serial = sum(bool(r.wgmma_serialized) for r in rows)
            if serial:
                status += f", {serial} wgmma serialized"
            lines.append(f"| {target} | {kernel} | {len(rows)} "
                         f"| {_fmt(worst(lambda r: r.vgprs if hip else r.regs))} | {_fmt(worst(lambda r: r.lds_bytes))} "
                         f"| {_fmt(worst(lambda r: r.scratch_bytes if hip else r.stack_bytes))} "
                         f"| {_fmt(worst(lambda r: r.occupancy, min))} | {status} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--arch", nargs="+", default=None, metavar="TARGET",
                        help=f"targets to build (default: {' '.join(DEFAULT_TARGETS)}; also {' '.join(RDNA_ALIAS_TARGETS)}; "
                             f"groups: amd = {' '.join(AMD_TARGETS)}, rdna = gfx1100 and the RDNA parts sharing its "
                             "rows, all)")
    parser.add_argument("--kernels", nargs="+", default=None, choices=KERNELS,
                        help=f"kernels to build (default: {' '.join(DEFAULT_KERNELS)}; probs with --full)")
    parser.add_argument("--full", action="store_true",
                        help="every table row x head dim (64/80/128/192/256) x dtype x variant (slow: ~1 CPU-hour)")
    # default None (the whole sweep): given without --full they are an error, not silently ignored
    parser.add_argument("--dtypes", nargs="+", choices=ALL_DTYPES, default=None,
                        help=f"with --full: dtypes (default: {' '.join(DTYPES)}; fp32 too for "
                             f"{' '.join(DECODE_KERNELS)})")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                        help="with --full: feature variants (default: all)")
    parser.add_argument("--head-dims", nargs="+", type=int, choices=HEAD_DIMS, default=None,
                        help=f"with --full: head dims (default: {' '.join(map(str, HEAD_DIMS))})")
    parser.add_argument("--tune-candidates", action="store_true",
                        help="instead: every candidate config `fa-amd tune` may time (all features; compile errors "
                             "fail, scratch is reported: the tuner itself skips any candidate that spills more than the table's "
                             "row, screen_configs)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    parser.add_argument("--json", metavar="PATH", help="write every result as JSON")
    parser.add_argument("--from-json", metavar="PATH", help="do not compile; print the tables of an earlier --json")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="compile into an empty Triton cache (honest timings)")


def _read_results(path: str):
    """(header line, results) of an earlier --json run; ValueError (one line) if `path` is not one."""
    try:
        with open(path) as f:
            payload = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})")
    try:
        results = [CompileResult(**r) for r in payload["results"]]
        unknown = sorted({r.target for r in results} - set(TARGETS))
        if unknown:  # (else a KeyError halfway through the tables)
            raise ValueError(f"unknown targets {', '.join(map(str, unknown))}")
        header = f"triton {payload['triton']}, {len(results)} variants, {payload['wall_seconds']:.0f} s wall"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not the JSON that `fa-amd compile --json` writes ({type(exc).__name__}: {exc})")
    return header, results


def run_cli(args) -> int:
    if args.jobs < 1:
        print(f"error: -j/--jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    sweep = [opt for opt, value in (("--dtypes", args.dtypes), ("--variants", args.variants),
                                    ("--head-dims", args.head_dims)) if value]
    if sweep and (not args.full or args.tune_candidates):
        print(f"error: {', '.join(sweep)} narrow{'s' if len(sweep) == 1 else ''} the --full sweep: "
              f"{'it needs' if len(sweep) == 1 else 'they need'} --full (and not --tune-candidates)", file=sys.stderr)
        return 2
    if args.from_json:
        try:
            header, results = _read_results(args.from_json)
        except (OSError, ValueError) as exc:
            print(f"error: cannot use {args.from_json}: {exc}", file=sys.stderr)
            return 2
        print(header)
        print("\n### Summary (worst case per target and kernel)\n")
        print(summary_table(results))
        print(format_tables(results))
        return 1 if any(r.failed for r in results) else 0
    import triton

    targets = [t for name in (args.arch or DEFAULT_TARGETS) for t in _TARGET_GROUPS.get(name, (name,))]
    for t in targets:
        if t not in TARGETS:
            print(f"error: unknown target {t!r}; choose from {', '.join(TARGETS)} (or {', '.join(_TARGET_GROUPS)})",
                  file=sys.stderr)
            return 2
    usable = []
    for t in targets:
        reason = target_supported(t)
        if reason:
            print(f"note: skipping {t}: {reason}")
        else:
            usable.append(t)
    for t, reason in probe_targets(usable).items():
        print(f"note: skipping {t}: {reason}")
        usable.remove(t)
    kernels = args.kernels or (KERNELS if args.full else DEFAULT_KERNELS)
    if args.tune_candidates:
        jobs = [j for j in tune_candidate_jobs(usable) if j.kernel in kernels]
    else:
        jobs = (full_jobs(usable, kernels, args.dtypes, args.variants or tuple(VARIANTS), args.head_dims or HEAD_DIMS)
                if args.full else ci_jobs(usable, kernels))
    # slowest first (large tiles, RDNA) so the parallel tail is short
    jobs.sort(key=lambda j: (j.kernel in ("preprocess", "rotary", "merge", "append", "append_fp8"),
                             j.target != "gfx1100", -j.head_dim))
    print(f"triton {triton.__version__}: compiling {len(jobs)} kernel variants for {', '.join(usable)} "
          f"with {args.jobs} processes ...", flush=True)
    start = time.perf_counter()
    done = [0]

    def progress(r: CompileResult):
        done[0] += 1
        if r.error if args.tune_candidates else r.failed:
            what = r.error or f"scratch {r.scratch_bytes} B"
            print(f"  [{done[0]}/{len(jobs)}] {r.target} {r.kernel} {r.variant}: {what}", flush=True)

    results = run_jobs(jobs, args.jobs, progress, fresh_cache=args.fresh_cache)
    wall = time.perf_counter() - start
    if args.tune_candidates:  # a spilling candidate is never timed: the tuner screens them (screen_configs)
        spilling = [r for r in results if r.error is None and r.scratch_bytes]
        print(f"{len(spilling)} of {len(results)} tune candidates spill (reported, not fatal)")
    if args.full:
        print("\n### Summary (worst case per target and kernel)\n")
        print(summary_table(results))
        if args.json:
            print(f"(per-variant rows: {args.json})")
    else:
        print(format_tables(results))
    failed = [r for r in results if (r.error is not None if args.tune_candidates else r.failed)]
    cpu = sum(r.seconds for r in results)
    print(f"\n{len(results)} variants compiled in {wall:.0f} s wall ({cpu:.0f} s compiler time, "
          f"{args.jobs} processes, triton {triton.__version__}); {len(failed)} failed")
    cuda_stack = [r for r in results if not r.is_hip and r.stack_bytes]
    if cuda_stack:
        print(f"note: {len(cuda_stack)} CUDA variants use stack (ptxas spills); reported, not fatal")
    serialized = [r for r in results if r.wgmma_serialized]
    if serialized:
        print(f"note: {len(serialized)} sm90 variants have their wgmma serialized by ptxas (C7515: "
              f"{', '.join(f'{r.kernel} {r.variant}' for r in serialized[:8])}); reported, not fatal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "wall_seconds": wall, "targets": usable,
                       "results": [asdict(r) for r in results]}, f, indent=1)
    for r in failed:
        print(f"FAIL {r.target} {r.kernel} {r.variant}: {r.error or f'scratch {r.scratch_bytes} B'}",
              file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--_worker"]:
        _worker_main()
        return 0
    parser = argparse.ArgumentParser(prog="fa-amd compile", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
