"""Ahead-of-time compile check: build every kernel variant the default tables
select, for AMD (and NVIDIA) targets, on any machine -- no GPU needed.

Triton's compiler lowers to amdgcn / PTX on the CPU; the amdgcn text reports
VGPRs, scratch (spills) and occupancy, the metadata the LDS bytes.  A table row
whose kernel spills to scratch on an AMD target is a bug in tables.py (it runs,
but slowly), so the check exits non-zero on any scratch and on compile errors.

    fa-amd compile                       # the subset CI runs (heaviest variant per kernel)
    fa-amd compile --full                # every row x dtype x variant
    fa-amd compile --arch gfx942 --json out.json
    python -m fa_amd.aot --full

Compiles run in worker subprocesses (the kernels must be real @triton.jit
functions, so the workers drop TRITON_INTERPRET, which tests set).
"""
from __future__ import annotations

import argparse
import importlib
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
from typing import Dict, List, Optional

# target name -> (backend, arch passed to GPUTarget, warp size)
TARGETS = {
    "gfx908": ("hip", "gfx908", 64),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "gfx1100": ("hip", "gfx1100", 32),
    "sm80": ("cuda", 80, 32),
    "sm90": ("cuda", 90, 32),
}
# dkdv_atomic: the dK/dV kernel that also accumulates dQ with fp32 atomics
# (deterministic=False, flash-attn's default); dq is then not launched
# dkdv_fused: the dK/dV kernel whose extra programs compute dQ (FUSED_DQ), built only where the
# launcher fuses (tables.FUSED_DQ_FAMILIES, rows whose "dkdv" and "dq" entries share launch options)
KERNELS = ("fwd", "dkdv", "dkdv_atomic", "dkdv_fused", "dq", "preprocess", "probs")
DEFAULT_KERNELS = ("fwd", "dkdv", "dkdv_atomic", "dkdv_fused", "dq", "preprocess")
# (HEAD_DIM, D_PAD): one per table row plus a non-power-of-two that exercises padding
HEAD_DIMS = (64, 80, 128, 256)
DTYPES = ("fp16", "bf16")
ALL_FLAGS = dict(IS_VARLEN=True, IS_SOFTCAP=True, HAS_ALIBI=True, HAS_LEFT=True, HAS_RIGHT=True, HAS_DROPOUT=True)
# feature-flag sets that move register pressure; "all" is the heaviest
VARIANTS = {
    "plain": dict(GROUP=1),
    "causal": dict(GROUP=1, HAS_RIGHT=True),
    "all": dict(GROUP=2, **ALL_FLAGS),
    # every feature but the right edge, at the tile of the entry's "short" override (launches with
    # at most tables.SHORT_SEQLEN_K keys per row); built only for entries that have one
    "short": dict(GROUP=2, **{k: v for k, v in ALL_FLAGS.items() if k != "HAS_RIGHT"}),
}
# kernel -> (module of fa_amd.kernels, @triton.jit function name)
_KERNEL_FN = {
    "fwd": ("forward", "attn_fwd_kernel"),
    "dkdv": ("backward", "attn_bwd_dkdv_kernel"),
    "dkdv_atomic": ("backward", "attn_bwd_dkdv_kernel"),
    "dkdv_fused": ("backward", "attn_bwd_dkdv_kernel"),
    "dq": ("backward", "attn_bwd_dq_kernel"),
    "preprocess": ("backward", "bwd_preprocess_kernel"),
    "probs": ("forward", "attn_probs_kernel"),
}
# Spills that no table row avoids with the current kernel code, and why.
# Listed here they print as "known spill" and do not fail the check; the test
# fails once one of them stops spilling (stale_known_scratch), so the list
# cannot go stale.  key: (target, kernel, table row head_dim) -> reason.
# Empty: the gfx1100 rows that spilled (every d128 backward and d256 kernel,
# the d64 atomic-dQ dK/dV) run the reloading kernels (RELOAD_CHUNK) since
# 2026-11, with zero scratch (docs/AOT.md).
KNOWN_SCRATCH: Dict[tuple, str] = {}

# kernel -> the table entry whose launch config it uses
_TABLE_KERNEL = {"fwd": "fwd", "dkdv": "dkdv", "dkdv_atomic": "dkdv_atomic", "dkdv_fused": "dkdv", "dq": "dq",
                 "probs": "fwd", "preprocess": None}


@dataclass
class CompileJob:
    target: str
    kernel: str
    head_dim: int
    dtype: str
    variant: str
    # explicit launch dict (BLOCK_M/BLOCK_N + options) instead of the table's; for table searches
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

    @property
    def is_hip(self) -> bool:
        return TARGETS[self.target][0] == "hip"

    @property
    def failed(self) -> bool:
        """Compile error, or scratch (spilled registers) on an AMD target not in KNOWN_SCRATCH."""
        return self.error is not None or (self.is_hip and bool(self.scratch_bytes) and not known_scratch(self))


def known_scratch(r: "CompileResult") -> Optional[str]:
    """The KNOWN_SCRATCH reason covering this result's (target, kernel, table row), if any."""
    head_dim = int(r.variant.split("-")[0][1:])
    return KNOWN_SCRATCH.get((r.target, r.kernel, _d_pad(head_dim)))


def stale_known_scratch(results: List["CompileResult"]) -> List[str]:
    """KNOWN_SCRATCH rows (as "target kernel dN") none of whose built variants spills any more."""
    spills: Dict[tuple, bool] = {}
    for r in results:
        if known_scratch(r) and r.error is None:
            row = (r.target, r.kernel, f"d{_d_pad(int(r.variant.split('-')[0][1:]))}")
            spills[row] = spills.get(row, False) or bool(r.scratch_bytes)
    return [" ".join(row) for row, spilled in spills.items() if not spilled]


# --------------------------------------------------------------------------- job lists

def _pressure(kernel: str, cfg: Dict, d_pad: int) -> int:
    """Rough register-pressure score of a tile config (fp32 accumulators + score tile)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if kernel in ("dkdv", "dkdv_atomic", "dkdv_fused"):
        return bn * (2 * d_pad + bm)
    if kernel == "dq":
        return bm * (d_pad + bn)
    return bm * (d_pad + bn)


def _table_entry(target: str, kernel: str, d_pad: int) -> Optional[Dict]:
    from .tuning.tables import TABLES

    table_kernel = _TABLE_KERNEL[kernel]
    if table_kernel is None:
        return None
    rows = TABLES[target]
    row = next((r for r in rows if r["head_dim"] >= d_pad), rows[-1])
    # a row without a dkdv_atomic entry uses its dkdv one (as fa_amd.tuning.get_config does)
    return row.get(table_kernel) or row["dkdv"]


def default_config(target: str, kernel: str, d_pad: int, causal: bool = False, short: bool = False) -> Dict:
    """Launch dict from the default tables (tuned overrides ignored) as the launcher would pass it."""
    from .tuning import resolve_entry
    from .tuning.tables import HIP_ONLY_OPTIONS

    entry = _table_entry(target, kernel, d_pad)
    if entry is None:  # preprocess: fixed block, default launch options, no switches (see attention_backward)
        return {"BLOCK_M": 64 if d_pad <= 128 else 32}
    cfg = resolve_entry(entry, causal=causal, short=short)
    if TARGETS[target][0] != "hip":
        for key in HIP_ONLY_OPTIONS:
            cfg.pop(key, None)
    return cfg


def builds(target: str, kernel: str, d_pad: int, causal: bool = False, variant: str = "") -> bool:
    """Whether the launcher runs this kernel for this table row: dkdv_fused only where fusable, the
    "short" variant only where the entry has a "short" override (elsewhere it is the plain tile)."""
    if variant == "short":
        entry = _table_entry(target, kernel, d_pad)
        return bool(entry and entry.get("short"))
    if kernel != "dkdv_fused":
        return True
    from .tuning import bwd_fusable

    return bwd_fusable(target, default_config(target, "dkdv", d_pad, causal),
                       default_config(target, "dq", d_pad, causal))


def _is_causal(variant: str) -> bool:
    """Variants with a right window edge launch with the table's "causal" override, as the launcher does."""
    return bool(VARIANTS.get(variant, {}).get("HAS_RIGHT"))


def _variant_config(target: str, kernel: str, head_dim: int, variant: str) -> Dict:
    """The launch dict the launcher uses for this job's variant."""
    return default_config(target, kernel, _d_pad(head_dim), _is_causal(variant), short=variant == "short")


def _d_pad(head_dim: int) -> int:
    # the launcher's own rule, so the AOT check compiles exactly what runs
    from .kernels.launch import head_dim_padded

    return head_dim_padded(head_dim)


def full_jobs(targets, kernels) -> List[CompileJob]:
    return [CompileJob(t, k, d, dt, v)
            for t in targets for k in kernels for d in HEAD_DIMS for dt in DTYPES
            for v in (VARIANTS if k != "preprocess" else ("plain",))
            if not (k == "preprocess" and d == 80) and builds(t, k, _d_pad(d), _is_causal(v), v)]


def ci_jobs(targets, kernels) -> List[CompileJob]:
    """Every (target, kernel) pair at its heaviest variant: all features on, the
    table row with the largest register-pressure score that is expected to be
    spill-free, bf16 (fp16 on gfx908); plus every KNOWN_SCRATCH row, so a fixed
    one is noticed."""
    jobs = []
    for t in targets:
        dtype = "fp16" if t == "gfx908" else "bf16"
        for k in kernels:
            if k == "preprocess":
                jobs.append(CompileJob(t, k, 256, dtype, "plain"))
                continue
            rows = [d for d in (128, 256, 64) if (t, k, d) not in KNOWN_SCRATCH and builds(t, k, d, causal=True)]
            if rows:
                heaviest = max(rows, key=lambda d: _pressure(k, default_config(t, k, d, causal=True), d))
                jobs.append(CompileJob(t, k, heaviest, dtype, "all"))
            # known rows in both extremes: the allocator is not monotone in features (a row can
            # spill plain and not with everything on, or the reverse), and an entry is stale
            # only when neither spills
            jobs += [CompileJob(t, k, d, dtype, v) for d in (64, 128, 256) if (t, k, d) in KNOWN_SCRATCH
                     for v in ("plain", "all")]
            # the tiles of "short" overrides, with every feature they can meet
            jobs += [CompileJob(t, k, d, dtype, "short") for d in (64, 128, 256) if builds(t, k, d, variant="short")]
    return jobs


# --------------------------------------------------------------------------- compiling (worker side)

_POINTER_DTYPE = {"Lse": "*fp32", "Delta": "*fp32", "Alibi": "*fp32", "SeedState": "*i64",
                  "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32"}
_IO_TENSORS = ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV", "Probs")
_FLOAT_SCALARS = ("qk_scale_log2", "softcap_div", "softcap_log2", "keep_scale", "sm_scale")
# pointers and these ints are multiples of 16 in every real launch (contiguous
# heads of a padded-to-16 head dim), and Triton specializes on that at run time,
# so the AOT build gets the same hint to produce the same (vectorized) code
_NOT_DIVISIBLE = ("stride_ab", "win_left", "win_right", "keep_threshold", "GROUP", "heads_per_prog")


def _signature(fn, constexprs: Dict, dtype: str):
    sig, attrs = {}, {}
    known = set(_POINTER_DTYPE) | set(_IO_TENSORS) | set(_FLOAT_SCALARS)
    unknown = [n for n in fn.arg_names if n[0].isupper() and n not in known and n not in constexprs
               and n != "GROUP"]
    if unknown:  # a new pointer argument: say so instead of guessing its type
        raise ValueError(f"{fn.__name__}: unknown tensor arguments {unknown}; add them to fa_amd/aot.py")
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in _POINTER_DTYPE:
            sig[name] = _POINTER_DTYPE[name]
        elif name in _IO_TENSORS:
            sig[name] = "*" + dtype
        elif name in _FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or (sig[name] == "i32" and name not in _NOT_DIVISIBLE):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _constexpr_params(fn) -> List[str]:
    """Names of fn's tl.constexpr parameters (JITFunction, or the interpreter's wrapper in tests)."""
    if hasattr(fn, "params"):
        return [p.name for p in fn.params if p.is_constexpr]
    import inspect

    import triton.language as tl

    sig = inspect.signature(fn.fn)
    return [n for n, p in sig.parameters.items() if p.annotation is tl.constexpr or "constexpr" in str(p.annotation)]


def _job_constexprs(job: CompileJob, fn, cfg: Dict) -> Dict:
    """Values of the kernel's constexpr parameters for this job, plus runtime ints
    equal to 1 (Triton specializes those at launch, so the AOT build does too)."""
    from .tuning.tables import KERNEL_SWITCHES

    values = dict(HEAD_DIM=job.head_dim, D_PAD=_d_pad(job.head_dim), INPUT_PRECISION="ieee",
                  IS_VARLEN=False, IS_SOFTCAP=False, HAS_ALIBI=False, HAS_LEFT=False, HAS_RIGHT=False,
                  HAS_DROPOUT=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg.get("BLOCK_N"),
                  ATOMIC_DQ=job.kernel == "dkdv_atomic",
                  FUSED_DQ=job.kernel == "dkdv_fused", DQ_BLOCK_M=16, DQ_BLOCK_N=16,
                  # the raw-score max (softmax_scale > 0, as every default scale is) where the tables use it
                  POSITIVE_SCALE=job.target in _tables().FWD_RAW_MAX_FAMILIES,
                  # split GQA groups summed with atomics (tables.GQA_SPLIT_SUM): only where atomics are
                  # allowed, i.e. the deterministic=False backward (atomic dQ, or fused on the tables' say)
                  ATOMIC_DKDV=job.kernel in ("dkdv_atomic", "dkdv_fused") and _gqa_split_sum(job.target) == "atomic")
    if job.kernel == "dkdv_fused":  # the dQ programs' tiles, as the launcher passes them
        dq_cfg = _variant_config(job.target, "dq", job.head_dim, job.variant)
        values.update(DQ_BLOCK_M=dq_cfg["BLOCK_M"], DQ_BLOCK_N=dq_cfg["BLOCK_N"])
    # kernel switches (RELOAD_CHUNK): the launch dict's value, else the launcher's default
    values.update({name: cfg.get(name, default) for name, default in KERNEL_SWITCHES.items()})
    values.update(VARIANTS[job.variant])
    constexpr_names = _constexpr_params(fn)
    constexprs = {}
    for name in fn.arg_names:
        if name in values and (name in constexpr_names or values[name] == 1):
            constexprs[name] = values[name]
    # parameters with a default (optional features, e.g. Sinks=None, HAS_SINKS=False) keep it, as every
    # launch without the feature does (a None pointer is a constexpr there too)
    import inspect

    for name, param in inspect.signature(getattr(fn, "fn", fn)).parameters.items():
        if param.default is not inspect.Parameter.empty and name not in constexprs:
            constexprs[name] = param.default
    missing = [name for name in constexpr_names if name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no AOT value for constexpr parameters {missing}; update fa_amd/aot.py")
    return constexprs


def _tables():
    from .tuning import tables

    return tables


def _gqa_split_sum(target: str) -> str:
    from .tuning import gqa_split_sum

    return gqa_split_sum(target)  # AOT target names are table family names


def compile_options(cfg: Dict) -> Dict:
    """The launch dict's compiler options (num_warps, num_stages, HIP options): everything
    but the tiles and the kernel switches, which are constexpr arguments of the kernel."""
    from .tuning.tables import KERNEL_SWITCHES

    return {k: v for k, v in cfg.items() if k not in ("BLOCK_M", "BLOCK_N") and k not in KERNEL_SWITCHES}


def _cuobjdump_path() -> Optional[str]:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def _amd_stat(text: str, key: str) -> Optional[int]:
    m = re.search(rf";\s*{key}:\s*(\d+)", text)
    return int(m.group(1)) if m else None


def compile_one(job: CompileJob) -> CompileResult:
    try:
        return _compile_one(job)
    except Exception as exc:  # e.g. a kernel signature this module does not know yet
        return CompileResult(job.target, job.kernel, job.name, error=f"{type(exc).__name__}: {exc}"[:300])


def _compile_one(job: CompileJob) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource


    backend, arch, warp = TARGETS[job.target]
    cfg = job.config or _variant_config(job.target, job.kernel, job.head_dim, job.variant)
    result = CompileResult(job.target, job.kernel, job.name, config=cfg)
    module, fn_name = _KERNEL_FN[job.kernel]
    fn = getattr(importlib.import_module(f"fa_amd.kernels.{module}"), fn_name)
    constexprs = _job_constexprs(job, fn, cfg)
    sig, attrs = _signature(fn, constexprs, job.dtype)
    options = compile_options(cfg)
    start = time.perf_counter()
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
    except Exception as exc:  # report every failure, keep compiling the rest
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    result.lds_bytes = int(getattr(compiled.metadata, "shared", 0) or 0)
    if backend == "hip":
        text = compiled.asm["amdgcn"]
        result.vgprs = _amd_stat(text, "NumVgprs")
        result.agprs = _amd_stat(text, "NumAgprs")
        result.scratch_bytes = _amd_stat(text, "ScratchSize")
        result.occupancy = _amd_stat(text, "Occupancy")
    else:
        result.regs, result.stack_bytes = _cuda_usage(compiled)
    return result


def _cuda_usage(compiled):
    """(registers, stack bytes) from the cubin via cuobjdump; ptxas spills land on the stack."""
    n_regs = getattr(compiled.metadata, "n_regs", None)  # only set once loaded on a GPU
    tool = _cuobjdump_path()
    if tool is None or "cubin" not in compiled.asm:
        return n_regs, None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else n_regs), (int(stack.group(1)) if stack else None)


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
    from .tuning.tables import TABLES

    if target not in TABLES:
        return f"no {target} rows in fa_amd/tuning/tables.py"
    return None


# targets that older Triton releases may not know; probed with one tiny compile
_PROBED_TARGETS = ("gfx950",)


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
            tiles = f"{c.get('BLOCK_M')}x{c.get('BLOCK_N', '-')}, {c.get('num_warps', 4)}w, {c.get('num_stages', '-')}s"
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
            lines.append(f"| {target} | {kernel} | {len(rows)} "
                         f"| {_fmt(worst(lambda r: r.vgprs if hip else r.regs))} | {_fmt(worst(lambda r: r.lds_bytes))} "
                         f"| {_fmt(worst(lambda r: r.scratch_bytes if hip else r.stack_bytes))} "
                         f"| {_fmt(worst(lambda r: r.occupancy, min))} | {status} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--arch", nargs="+", default=None, metavar="TARGET",
                        help=f"targets to build (default: all of {' '.join(TARGETS)})")
    parser.add_argument("--kernels", nargs="+", default=None, choices=KERNELS,
                        help=f"kernels to build (default: {' '.join(DEFAULT_KERNELS)}; probs with --full)")
    parser.add_argument("--full", action="store_true",
                        help="every table row x head dim (64/80/128/256) x dtype x variant (slow: ~1 CPU-hour)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    parser.add_argument("--json", metavar="PATH", help="write every result as JSON")
    parser.add_argument("--from-json", metavar="PATH", help="do not compile; print the tables of an earlier --json")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="compile into an empty Triton cache (honest timings)")


def run_cli(args) -> int:
    if args.from_json:
        with open(args.from_json) as f:
            payload = json.load(f)
        results = [CompileResult(**r) for r in payload["results"]]
        print(f"triton {payload['triton']}, {len(results)} variants, {payload['wall_seconds']:.0f} s wall")
        print("\n### Summary (worst case per target and kernel)\n")
        print(summary_table(results))
        print(format_tables(results))
        return 1 if any(r.failed for r in results) else 0
    targets = args.arch or list(TARGETS)
    for t in targets:
        if t not in TARGETS:
            print(f"error: unknown target {t!r}; choose from {', '.join(TARGETS)}", file=sys.stderr)
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
    jobs = full_jobs(usable, kernels) if args.full else ci_jobs(usable, kernels)
    # slowest first (large tiles, RDNA) so the parallel tail is short
    jobs.sort(key=lambda j: (j.kernel == "preprocess", j.target != "gfx1100", -j.head_dim))
    print(f"compiling {len(jobs)} kernel variants for {', '.join(usable)} with {args.jobs} processes ...",
          flush=True)
    start = time.perf_counter()
    done = [0]

    def progress(r: CompileResult):
        done[0] += 1
        if r.failed:
            what = r.error or f"scratch {r.scratch_bytes} B"
            print(f"  [{done[0]}/{len(jobs)}] {r.target} {r.kernel} {r.variant}: {what}", flush=True)

    results = run_jobs(jobs, args.jobs, progress, fresh_cache=args.fresh_cache)
    wall = time.perf_counter() - start
    if args.full:
        print("\n### Summary (worst case per target and kernel)\n")
        print(summary_table(results))
        if args.json:
            print(f"(per-variant rows: {args.json})")
    else:
        print(format_tables(results))
    failed = [r for r in results if r.failed]
    cpu = sum(r.seconds for r in results)
    print(f"\n{len(results)} variants compiled in {wall:.0f} s wall ({cpu:.0f} s compiler time, "
          f"{args.jobs} processes); {len(failed)} failed")
    cuda_stack = [r for r in results if not r.is_hip and r.stack_bytes]
    if cuda_stack:
        print(f"note: {len(cuda_stack)} CUDA variants use stack (ptxas spills); reported, not fatal")
    if args.json:
        import triton

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
