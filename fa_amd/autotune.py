"""The launch-config tuner (opt-in): times candidate configs of the real kernels and
saves the best to the tuned table on disk (fa_amd.tuning.tuned_table).

Who tunes:
  * `fa-amd tune --head-dims 64 128 256` -- explicit, on the current GPU;
  * with FA_AMD_AUTOTUNE=1, `ensure_tuned(arch, head_dim_padded)` tunes a head-dim
    class the first time it is used (warning once, a few minutes) and persists it;
    importing this module installs it as the chooser's first-use hook.

Each candidate is timed with triton.testing.do_bench and must reproduce the
default config's output; a candidate that fails to compile or launch (e.g.
OutOfResources) or disagrees is skipped, so no tuning error reaches the caller.
On AMD a candidate is timed only if the AOT check (fa_amd.aot.screen_configs) builds it
with every feature on and plain, under the installed triton, with no more scratch than
the table's row (zero on CDNA): so every config tune can choose is spill-free where the
table's is, on the user's own triton.

It launches kernels, so it sits above fa_amd.kernels (as bench and aot do); the
kernels only read tables.
"""
from __future__ import annotations

import datetime
import sys
import threading
import time
import warnings
from typing import Dict, List, Optional

from .tuning import family_of, row_for, tuned_table
from .tuning.candidates import _strip_for, candidates, max_candidates
from .tuning.tables import TABLES
from .tuning.tuned_table import (AUTOTUNE_ENV, OPTIONAL_KERNELS, ROW_KERNELS, _read_file, autotune_enabled,
                                 merge_rows, save_tuned_rows, tuned_table_path)

__all__ = ["AUTOTUNE_ENV", "OPTIONAL_KERNELS", "ROW_KERNELS", "candidates", "ensure_tuned", "max_candidates",
           "tune_head_dim", "tuned_table_path", "save_tuned_rows"]


# --------------------------------------------------------------------------- tuning

def _close(got, ref, dtype) -> bool:
    import torch

    if got.shape != ref.shape or not torch.isfinite(got).all():
        return False
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3  # tile order changes rounding, not results
    scale = max(1.0, ref.float().abs().max().item())
    return (got.float() - ref.float()).abs().max().item() <= tol * scale


class _Problem:
    """One benchmark problem: inputs plus the fwd / bwd calls through the ordinary launchers."""

    def __init__(self, head_dim: int, seqlen: int, causal: bool, dtype, device, tokens: int = 16384,
                 hidden: int = 2048):
        import torch

        self.batch = max(1, tokens // seqlen)
        self.heads = max(1, hidden // head_dim)
        self.causal = causal
        self.scale = head_dim ** -0.5
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (self.batch, seqlen, self.heads, head_dim)
        self.q, self.k, self.v, self.do = (torch.randn(shape, generator=gen, device=device, dtype=dtype)
                                           for _ in range(4))
        self.seqlen = seqlen

    def forward(self):
        from .kernels.forward import attention_forward

        out, lse, _ = attention_forward(self.q, self.k, self.v, None, None, self.seqlen, self.seqlen, 0.0,
                                        self.scale, -1, 0 if self.causal else -1, 0.0, None, None, False)
        return out, lse

    def backward(self, out, lse, deterministic=True):
        from .kernels.backward import attention_backward

        extra = {} if deterministic else {"deterministic": False}
        return attention_backward(self.do, self.q, self.k, self.v, out, lse, None, None, self.seqlen,
                                  self.seqlen, 0.0, self.scale, -1, 0 if self.causal else -1, 0.0, None, None,
                                  **extra)


def _has_atomic_backward() -> bool:
    import inspect

    from .kernels.backward import attention_backward

    return "deterministic" in inspect.signature(attention_backward).parameters


def _time_candidate(fn, check, reps_ms: int) -> Optional[float]:
    """Median ms of fn(), or None if it fails to compile/launch or its output disagrees."""
    import triton

    try:
        if not check(fn()):
            return None
        return float(triton.testing.do_bench(fn, warmup=max(5, reps_ms // 4), rep=reps_ms, return_mode="median"))
    except Exception:  # OutOfResources, compile errors, ...: the candidate is unusable here
        return None


def _compilable(arch, kernel: str, cfgs: List[Dict], head_dim_padded: int, dtype, log) -> List[Dict]:
    """On AMD, the candidates (cfgs[0]: the table's) that the AOT check (fa_amd.aot.screen_configs)
    builds with every feature on and plain, under this triton, with no more scratch than the table's
    row: a spilling config can time fastest on the plain benchmark problem and then spill in the
    feature-laden calls it is used for.  Rejected ones are logged; the table's row always stays."""
    if arch.backend != "hip":
        return cfgs
    import torch

    from . import aot
    from .aot_launches import _TORCH_DTYPES

    target = aot.target_of(arch)
    if target is None:
        _warn_once(("screen", arch.name), f"fa_amd: no AOT target builds {arch.name}'s kernels, so tune candidates "
                                          "cannot be checked for spills; keeping the table rows")
        return cfgs[:1]
    name = next(short for short, full in _TORCH_DTYPES.items() if getattr(torch, full) == dtype)
    kept = cfgs[:1]
    for cfg, why in zip(cfgs[1:], aot.screen_configs(target, kernel, head_dim_padded, name, cfgs)[1:]):
        if why:
            log(f"  {kernel} {cfg}: skipped ({why})")
        else:
            kept.append(cfg)
    return kept


def tune_head_dim(arch, head_dim_padded: int, seqlen: int = 4096, causal: bool = False, dtype=None,
                  rep_ms: int = 50, log=None) -> dict:
    """Tune the (fwd, dkdv, dq) row for one head-dim class on the current GPU; returns the row."""
    import torch
    import triton


    log = log or (lambda msg: None)
    family = family_of(arch)
    default_rows = TABLES[family]
    default_row = row_for(default_rows, head_dim_padded)
    if dtype is None:
        dtype = torch.float16 if arch.name == "gfx908" else torch.bfloat16
    problem = _Problem(head_dim_padded, seqlen, causal, dtype, "cuda")
    best = {"head_dim": head_dim_padded}
    timings = {}

    def install(row):
        tuned_table._candidate_override = {family: merge_rows(default_rows, [row])}

    try:
        base = {"head_dim": head_dim_padded, **{k: _strip_for(arch, default_row[k]) for k in ROW_KERNELS}}
        install(base)
        ref_out, ref_lse = problem.forward()
        ref_grads = problem.backward(ref_out, ref_lse)
        kernels = ROW_KERNELS + (("dkdv_atomic",) if _has_atomic_backward() else ())
        base["dkdv_atomic"] = _strip_for(arch, default_row.get("dkdv_atomic") or default_row["dkdv"])
        for kernel in kernels:
            results = []
            for cfg in _compilable(arch, kernel, candidates(arch, kernel, base[kernel], head_dim_padded),
                                   head_dim_padded, dtype, log):
                row = dict(base, **{k: best[k] for k in best if k in kernels})
                row[kernel] = cfg
                install(row)
                if kernel == "fwd":
                    ms = _time_candidate(problem.forward, lambda r: _close(r[0], ref_out, dtype), rep_ms)
                else:
                    deterministic = kernel != "dkdv_atomic"
                    ms = _time_candidate(lambda: problem.backward(ref_out, ref_lse, deterministic),
                                         lambda g: all(_close(a, b, dtype) for a, b in zip(g, ref_grads)), rep_ms)
                log(f"  {kernel} {cfg}: " + ("skipped (failed or wrong)" if ms is None else f"{ms:.3f} ms"))
                if ms is not None:
                    results.append((ms, cfg))
            if not results:  # even the default failed here: keep it, the tables decide
                best[kernel] = base[kernel]
                continue
            ms, cfg = min(results, key=lambda x: x[0])
            best[kernel] = cfg
            timings[kernel] = {"best_ms": round(ms, 4),
                               "default_ms": round(next((m for m, c in results if c == base[kernel]), float("nan")), 4)}
    finally:
        tuned_table._candidate_override = None
    best["tuned"] = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                     "problem": {"seqlen": seqlen, "batch": problem.batch, "heads": problem.heads,
                                 "causal": causal, "dtype": str(dtype).replace("torch.", "")},
                     "timings_ms": timings}
    return best


# --------------------------------------------------------------------------- tune on first use

_tuned_this_process = set()
_tune_lock = threading.Lock()
_warned = set()


def _warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


def ensure_tuned(arch, head_dim_padded: int) -> None:
    """With FA_AMD_AUTOTUNE=1: tune this head-dim class on first use and persist it.

    Cheap after the first call per (family, class).  Never raises: a failed
    tuning run warns and leaves the default configs in place.
    """
    if not autotune_enabled() or arch.backend not in ("hip", "cuda") or tuned_table._candidate_override is not None:
        return

    family = family_of(arch)
    row_dim = row_for(TABLES[family], head_dim_padded)["head_dim"]
    key = (family, row_dim)
    if key in _tuned_this_process:
        return
    with _tune_lock:
        if key in _tuned_this_process:
            return
        tuned = _read_file(tuned_table_path()).get(family, [])
        if any(r["head_dim"] == row_dim for r in tuned):
            _tuned_this_process.add(key)
            return
        import torch

        # a trace or a CUDA-graph capture must not launch benchmark kernels: use defaults for now
        compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)()
        if compiling or torch.cuda.is_current_stream_capturing():
            _warn_once(("busy",) + key, f"fa_amd: {AUTOTUNE_ENV}=1 but head_dim {row_dim} on {family} is untuned "
                                        "and this call is being traced/captured; using default configs "
                                        "(run `fa-amd tune` or one eager call first)")
            return
        _tuned_this_process.add(key)  # one attempt per process, even if it fails
        path = tuned_table_path()
        _warn_once(("tune",) + key, f"fa_amd: {AUTOTUNE_ENV}=1: tuning launch configs for head_dim class "
                                    f"{row_dim} on {arch.name} (one time, about a minute or more); "
                                    f"results go to {path}")
        try:
            start = time.perf_counter()
            row = tune_head_dim(arch, row_dim, seqlen=2048)
            save_tuned_rows(family, [row], path)
            print(f"fa_amd: tuned head_dim {row_dim} on {arch.name} in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)
        except Exception as exc:
            warnings.warn(f"fa_amd: tuning head_dim {row_dim} on {arch.name} failed ({type(exc).__name__}: "
                          f"{exc}); using default configs")


# the chooser asks this before each GPU lookup (a no-op unless FA_AMD_AUTOTUNE=1)
tuned_table.first_use_hook = ensure_tuned
