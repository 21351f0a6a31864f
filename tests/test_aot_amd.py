"""AOT compile check: the kernels the default tables select compile for every
AMD (and NVIDIA) target with zero scratch on AMD -- on a CPU, no GPU needed.

CI runs the heaviest variant per (target, kernel) pair (`fa-amd compile`, about
2 minutes on 2 cores); FA_AMD_AOT_FULL=1 runs the whole sweep (`--full`, about
an hour of compiler time).
"""
import json
import os
import subprocess
import sys

import pytest

from fa_amd import aot
from fa_amd.tuning.tables import HIP_ONLY_OPTIONS, TABLES

FULL = os.environ.get("FA_AMD_AOT_FULL", "0") == "1"


def supported_targets():
    return [t for t in aot.TARGETS if aot.target_supported(t) is None]


def test_job_lists_cover_every_target_and_kernel():
    targets = supported_targets()
    assert {"gfx908", "gfx90a", "gfx942", "gfx1100", "sm80", "sm90"} <= set(targets)
    ci = aot.ci_jobs(targets, aot.DEFAULT_KERNELS)
    # every kernel the launcher runs on each target: the fused backward only where it fuses
    runs = {(t, k) for t in targets for k in aot.DEFAULT_KERNELS
            if any(aot.builds(t, k, d, causal=True) for d in (64, 128, 256))}
    assert {(j.target, j.kernel) for j in ci} == runs
    assert ("sm90", "dkdv_fused") in runs and ("gfx942", "dkdv_fused") not in runs
    variants = {}
    for j in ci:
        variants.setdefault((j.target, j.kernel, aot._d_pad(j.head_dim)), set()).add(j.variant)
    for (t, k, d), got in variants.items():
        expect = {"plain"} if k == "preprocess" else {"plain", "all"} if (t, k, d) in aot.KNOWN_SCRATCH else {"all"}
        # the tile of a "short" override is built with its own variant; entries without one are not
        assert got - {"short"} <= expect and ("short" in got) == aot.builds(t, k, d, variant="short"), (t, k, d, got)
    # the sm90 d128 forward has a "short" override (tables.SHORT_SEQLEN_K): its tile is in the CI subset
    assert any((j.target, j.kernel, j.head_dim, j.variant) == ("sm90", "fwd", 128, "short") for j in ci)
    full = aot.full_jobs(targets, aot.KERNELS)
    for t in targets:
        for k in ("fwd", "dkdv", "dq"):
            got = {(j.head_dim, j.dtype, j.variant) for j in full if (j.target, j.kernel) == (t, k)}
            assert got == {(d, dt, v) for d in aot.HEAD_DIMS for dt in aot.DTYPES for v in aot.VARIANTS
                           if v != "short" or aot.builds(t, k, aot._d_pad(d), variant="short")}


def test_default_config_matches_tables():
    for target in ("gfx942", "sm90"):
        for d in (64, 80, 128, 256):
            cfg = aot.default_config(target, "fwd", aot._d_pad(d))
            row = next(r for r in TABLES[target] if r["head_dim"] >= aot._d_pad(d))
            assert cfg["BLOCK_M"] == row["fwd"]["BLOCK_M"] and "fp32" not in cfg
            assert bool(set(HIP_ONLY_OPTIONS) & set(cfg)) == (target == "gfx942")


def test_signature_marks_types_and_alignment():
    from fa_amd.kernels import backward, forward

    fn = forward.attn_fwd_kernel
    job = aot.CompileJob("gfx942", "fwd", 80, "bf16", "all")
    constexprs = aot._job_constexprs(job, fn, aot.default_config("gfx942", "fwd", 128))
    assert constexprs["HEAD_DIM"] == 80 and constexprs["D_PAD"] == 128 and constexprs["HAS_DROPOUT"]
    assert constexprs["RELOAD_CHUNK"] == 0  # the kernel switch is a constexpr argument, not an option
    rdna = aot._job_constexprs(aot.CompileJob("gfx1100", "dkdv", 128, "bf16", "all"), backward.attn_bwd_dkdv_kernel,
                               aot.default_config("gfx1100", "dkdv", 128))
    assert rdna["RELOAD_CHUNK"] == 32
    sig, attrs = aot._signature(fn, constexprs, "bf16")
    assert sig["Q"] == "*bf16" and sig["Lse"] == "*fp32" and sig["SeedState"] == "*i64"
    assert sig["cu_seqlens_q"] == "*i32" and sig["qk_scale_log2"] == "fp32" and sig["win_left"] == "i32"
    assert sig["BLOCK_M"] == "constexpr"
    names = fn.arg_names
    assert (names.index("stride_qm"),) in attrs and (names.index("win_left"),) not in attrs


def test_stale_known_scratch_entries_are_flagged(monkeypatch):
    """A KNOWN_SCRATCH row is stale once none of its variants spills (d80 counts for the d128 row)."""
    monkeypatch.setattr(aot, "KNOWN_SCRATCH", {("gfx1100", "dq", 128): "why", ("gfx1100", "fwd", 256): "why"})

    def res(kernel, variant, scratch):
        return aot.CompileResult("gfx1100", kernel, variant, scratch_bytes=scratch)

    results = [res("dq", "d128-bf16-plain", 0), res("dq", "d80-bf16-all", 0), res("fwd", "d256-bf16-plain", 0),
               res("fwd", "d256-bf16-all", 24), res("dkdv", "d128-bf16-all", 0)]
    assert aot.stale_known_scratch(results) == ["gfx1100 dq d128"]
    assert not results[3].failed and results[3].is_hip  # a known spill does not fail the check
    assert not aot.stale_known_scratch(results[3:4])


def test_rdna_rows_reload_and_nothing_is_exempt():
    """gfx1100 needs the reloading kernels to compile without scratch; no other target uses them."""
    assert aot.KNOWN_SCRATCH == {}
    for target in aot.TARGETS:
        for kernel in ("fwd", "dkdv", "dkdv_atomic", "dq", "probs"):
            for d in (64, 128, 256):
                chunk = aot.default_config(target, kernel, d)["RELOAD_CHUNK"]
                assert (chunk > 0) == (target == "gfx1100"), (target, kernel, d)
                assert "RELOAD_CHUNK" not in aot.compile_options(aot.default_config(target, kernel, d))


def test_amdgcn_stats_parser():
    text = "; NumVgprs: 212\n; NumAgprs: 12\n; ScratchSize: 0\n; Occupancy: 2\n"
    assert aot._amd_stat(text, "NumVgprs") == 212 and aot._amd_stat(text, "Occupancy") == 2
    assert aot._amd_stat(text, "ScratchSize") == 0 and aot._amd_stat(text, "LDSByteSize") is None


def _run_compile(tmp_path, *extra):
    out = tmp_path / "aot.json"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-m", "fa_amd.aot", "--json", str(out), *extra],
                         capture_output=True, text=True, env=env, timeout=3600)
    return res, json.loads(out.read_text()) if out.exists() else None


def _check(res, payload, kernels):
    assert payload is not None, res.stdout + res.stderr
    # every target but the probed ones (gfx950 needs a recent triton) must have been built
    assert set(supported_targets()) - set(aot._PROBED_TARGETS) <= set(payload["targets"]), res.stdout
    # every kernel the launcher runs there (the fused backward only where it fuses)
    expect_pairs = {(t, k) for t in payload["targets"] for k in kernels
                    if any(aot.builds(t, k, d, causal=True) for d in (64, 128, 256))}
    results = [aot.CompileResult(**r) for r in payload["results"]]
    errors = [f"{r.target} {r.kernel} {r.variant}: {r.error}" for r in results if r.error]
    assert not errors, "compile errors:\n" + "\n".join(errors)
    spills = [f"{r.target} {r.kernel} {r.variant}: scratch {r.scratch_bytes} B" for r in results
              if r.is_hip and r.scratch_bytes and not aot.known_scratch(r)]
    assert not spills, "AMD scratch (fix the row in tables.py):\n" + "\n".join(spills)
    # a KNOWN_SCRATCH row is stale when none of its built variants spills any more
    fixed = aot.stale_known_scratch(results)
    assert not fixed, "listed in aot.KNOWN_SCRATCH but no longer spills; remove the entry:\n" + "\n".join(fixed)
    assert {(r.target, r.kernel) for r in results} >= expect_pairs
    for r in results:
        assert r.lds_bytes is not None
        assert (r.vgprs if r.is_hip else r.regs), f"no register count for {r.target} {r.kernel}"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_compile_heaviest_variants(tmp_path):
    """Every (target, kernel) pair, all features on, the table's largest-tile row."""
    res, payload = _run_compile(tmp_path)
    _check(res, payload, aot.DEFAULT_KERNELS)
    print(f"\nAOT compile check: {len(payload['results'])} variants in {payload['wall_seconds']:.0f} s wall")


@pytest.mark.skipif(not FULL, reason="full AOT sweep is opt-in: FA_AMD_AOT_FULL=1")
def test_compile_full_sweep(tmp_path):
    res, payload = _run_compile(tmp_path, "--full")
    _check(res, payload, aot.KERNELS)
