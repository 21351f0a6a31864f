"""AOT compile check: the kernels the launchers launch with the default tables compile for every
AMD (and NVIDIA) target with zero scratch on AMD -- on a CPU, no GPU needed.

CI runs the heaviest variant per (target, kernel) pair (`fa-amd compile`, about
2 minutes on 2 cores) under the installed (newest) triton here, and under the oldest
supported one (3.2) in .ci/run; FA_AMD_AOT_FULL=1 runs the whole sweep (`--full`, about
an hour of compiler time); `.ci/aot_matrix.py` runs it under every supported triton.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from fa_amd import aot, aot_launches
from fa_amd.tuning import family_of, tables
from fa_amd.tuning.tables import HIP_ONLY_OPTIONS, TABLES

FULL = os.environ.get("FA_AMD_AOT_FULL", "0") == "1"


def supported_targets():
    return [t for t in aot.DEFAULT_TARGETS if aot.target_supported(t) is None]


def test_job_lists_cover_every_target_and_kernel():
    targets = supported_targets()
    assert {"gfx908", "gfx90a", "gfx942", "gfx950", "gfx1100", "sm80", "sm90"} <= set(targets)
    # the RDNA parts that run the gfx1100 rows are targets too (built when asked for)
    assert all(aot.target_supported(t) is None for t in aot.RDNA_ALIAS_TARGETS)
    rdna = aot.ci_jobs(["gfx1201"], aot.DEFAULT_KERNELS)
    assert {j.kernel for j in rdna} == {k for k in aot.DEFAULT_KERNELS if aot.builds("gfx1100", k, 128, True)}
    ci = aot.ci_jobs(targets, aot.DEFAULT_KERNELS)
    # every kernel the launcher runs on each target: the fused backward only where it fuses, the
    # atomic-dQ one only where the tables choose atomics
    runs = {(t, k) for t in targets for k in aot.DEFAULT_KERNELS
            if any(aot.builds(t, k, d, causal=True) for d in (64, 128, 256))}
    assert {(j.target, j.kernel) for j in ci} == runs
    assert ("sm90", "dkdv_fused") in runs and ("gfx942", "dkdv_fused") not in runs
    assert ("gfx942", "dkdv_atomic") in runs and ("sm90", "dkdv_atomic") not in runs
    # the V NaN rule of masked forwards: the fix-up launch where the family lists it, else the pass over V
    for t in targets:
        fixup = family_of(aot._arch_of(t)) in tables.FWD_NAN_FIXUP_FAMILIES
        assert ((t, "nan_fixup") in runs, (t, "nan_flags") in runs) == (fixup, not fixup), t
    variants = {}
    for j in ci:
        variants.setdefault((j.target, j.kernel, aot._d_pad(j.head_dim)), set()).add(j.variant)
    for (t, k, d), got in variants.items():
        if k in aot.DECODE_KERNELS:  # the decode routes' variants: tests/test_aot_decode.py
            continue
        known = aot.KNOWN_SCRATCH
        expect = {"plain"} if k in ("preprocess", "rotary") else {"plain", "all"} if (t, k, d) in known else {"all"}
        # the tiles of a "short" override (and its causal case; FP8: one tile) are built with their own variants;
        # entries without one are not
        short = {"short"} if k in aot.FP8_KERNELS else set(aot.SHORT_VARIANTS)
        # the whole-block kernels (EVEN_QK) where the tables run them (tables.EVEN_QK_FAMILIES)
        whole = set(aot.WHOLE_VARIANTS)
        assert got - short - whole <= expect and (got & short == short) == aot.builds(t, k, d, variant="short"), \
            (t, k, d, got)
        assert bool(got & whole) == (family_of(aot._arch_of(t)) in tables.EVEN_QK_FAMILIES
                                     and k in aot.WHOLE_KERNELS), (t, k, d, got)
    # the sm90 d128 forward has a "short" override (tables.SHORT_SEQLEN_K): its tile is in the CI subset
    assert any((j.target, j.kernel, j.head_dim, j.variant) == ("sm90", "fwd", 128, "short") for j in ci)
    full = aot.full_jobs(targets, aot.KERNELS)
    for t in targets:
        for k in ("fwd", "dkdv", "dq"):
            got = {(j.head_dim, j.dtype, j.variant) for j in full if (j.target, j.kernel) == (t, k)}
            assert got == {(d, dt, v) for d in aot.HEAD_DIMS for dt in aot.DTYPES for v in aot.VARIANTS
                           if aot.builds(t, k, aot._d_pad(d), aot._is_causal(v), v)}
        # split GQA groups (fp32 partial dK/dV) are built for the dK/dV kernels only
        assert {j.kernel for j in full if j.target == t and j.variant == "split"} <= set(aot._DKDV_KERNELS)
        assert any(j.kernel == "dkdv" and j.variant == "split" for j in full if j.target == t)
        assert {j.variant for j in full if (j.target, j.kernel) == (t, "rotary")} == {"plain", "all"}


def test_default_config_matches_tables():
    for target in ("gfx942", "sm90"):
        for d in (64, 80, 128, 256):
            cfg = aot.default_config(target, "fwd", aot._d_pad(d))
            row = next(r for r in TABLES[target] if r["head_dim"] >= aot._d_pad(d))
            assert cfg["BLOCK_M"] == row["fwd"]["BLOCK_M"] and "fp32" not in cfg
            assert bool(set(HIP_ONLY_OPTIONS) & set(cfg)) == (target == "gfx942")


def test_triton_version_overrides_are_table_data():
    """"triton<X.Y" entries apply below X.Y only, before the case overrides; the tuner strips them,
    and the AOT check builds what the installed version resolves."""
    from fa_amd import autotune
    from fa_amd.tuning import resolve_entry
    from fa_amd.tuning.tables import OVERRIDES, TRITON_OVERRIDES

    entry = {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "triton<3.7": {"num_stages": 1},
             "triton<3.4": {"BLOCK_N": 32}, "causal": {"BLOCK_M": 64}}
    assert resolve_entry(entry, triton_version=(3, 9))["num_stages"] == 2
    switches = {"RELOAD_CHUNK": 0, "FWD_MERGED_EDGES": 0}  # (the forward's switches, at their defaults)
    assert resolve_entry(entry, kernel="fwd", triton_version=(3, 6)) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 1,
                                                                         **switches}
    assert resolve_entry(entry, causal=True, kernel="fwd", triton_version=(3, 2)) == {"BLOCK_M": 64, "BLOCK_N": 32,
                                                                                      "num_stages": 1, **switches}
    assert set(TRITON_OVERRIDES) <= set(OVERRIDES)
    used = {k for rows in TABLES.values() for row in rows for e in row.values() if isinstance(e, dict)
            for k in e if k.startswith("triton")}
    assert used <= set(TRITON_OVERRIDES), used
    assert "triton<3.7" not in autotune._strip_for(aot._arch_of("gfx942"), TABLES["gfx942"][1]["fwd"])
    version = aot.triton_version()
    want = resolve_entry(TABLES["gfx942"][1]["fwd"], triton_version=version)["num_stages"]
    assert aot.default_config("gfx942", "fwd", 128)["num_stages"] == want == (1 if version < (3, 7) else 2)


def _arguments(kernel_fn, call):
    """Every argument of a recorded call by parameter name: tensors as (dtype, shape, strides)."""
    bound = aot.bound_arguments(kernel_fn, call.args, call.kwargs)
    return {name: (x.dtype, tuple(x.shape), x.stride()) if isinstance(x, torch.Tensor) else x
            for name, x in bound.items()}


def test_launch_calls_carry_the_launchers_dtypes():
    """The AOT job's call comes from the launcher: the atomic-dQ accumulator and split-GQA dK/dV
    buffers are fp32, tiles and options are the target's table entry, flags are the variant's."""
    def args(target, kernel, variant, d=80):
        job = aot.CompileJob(target, kernel, d, "bf16", variant)
        call = aot.launch_call(job)
        return _arguments(aot._kernel(aot.LAUNCHES[kernel]), call), call

    a, call = args("gfx942", "dkdv_atomic", "all")
    assert a["DQ"][0] == torch.float32 and a["DK"][0] == torch.bfloat16 and a["Q"][0] == torch.bfloat16
    assert a["ATOMIC_DQ"] and not a["FUSED_DQ"] and a["HEAD_DIM"] == 80 and a["D_PAD"] == 128
    assert a["IS_VARLEN"] and a["HAS_DROPOUT"] and a["HAS_ALIBI"] and a["HAS_LEFT"] and a["HAS_RIGHT"]
    assert a["GROUP"] == 2 and a["heads_per_prog"] == 2
    cfg = aot.default_config("gfx942", "dkdv_atomic", 128, causal=True)
    assert aot.launch_config(aot.LAUNCHES["dkdv_atomic"], call) == cfg
    a, _ = args("gfx942", "dkdv", "split")
    assert a["DK"][0] == a["DV"][0] == torch.float32 and a["heads_per_prog"] == 1 and a["DQ"][0] == torch.bfloat16
    a, _ = args("sm90", "dkdv_fused", "split")
    assert a["ATOMIC_DKDV"] and a["FUSED_DQ"] and a["DK"][0] == torch.float32
    a, _ = args("gfx1100", "fwd", "plain", d=256)
    assert a["RELOAD_CHUNK"] == 32 and a["GROUP"] == 1 and not a["POSITIVE_SCALE"]
    assert a["Lse"][0] == torch.float32 and a["Out"][0] == torch.bfloat16
    a, call = args("sm90", "fwd", "short", d=128)
    assert call.kwargs["BLOCK_N"] == 64 and a["POSITIVE_SCALE"]  # the "short" override's tile, sm90's raw max
    assert "waves_per_eu" not in call.kwargs
    a, call = args("sm90", "fwd", "short_causal", d=128)
    assert call.kwargs["BLOCK_N"] == 32 and a["HAS_RIGHT"]  # the "short" override's causal case
    a, call = args("sm90", "dkdv_fused", "short_causal", d=128)
    assert call.kwargs["DKDV_ONE_MASKED_LOOP"] == 1 and a["HAS_RIGHT"] and a["FUSED_DQ"]
    # whole blocks (EVEN_QK) where tables.EVEN_QK_FAMILIES lists the family, the same launch bounded elsewhere
    for kernel in ("fwd", "dkdv_fused"):
        a, call = args("sm90", kernel, "whole_causal", d=128)
        assert call.kwargs["EVEN_QK"] and a["HAS_RIGHT"] and not a["IS_VARLEN"]
    a, call = args("gfx942", "fwd", "whole_causal", d=128)
    assert not call.kwargs["EVEN_QK"] and a["HAS_RIGHT"]


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel,variant", [("fwd", "all"), ("probs", "all"), ("preprocess", "all"),
                                            ("dkdv", "split"), ("dq", "all"), ("dkdv_atomic", "all"),
                                            ("dkdv_fused", "all"), ("rotary", "plain"), ("rotary", "all"),
                                            ("nan_fixup", "all"), ("nan_fixup", "causal")])
def test_aot_signatures_are_the_launchers_real_arguments(kernel, variant):
    """What the AOT check builds for a job == what the public API launches for the same problem:
    every argument (tensor dtypes, shapes and strides, ints, floats, constexprs, launch options).
    Run here on the interpreter's table family, with the kernels recorded rather than run."""
    from fa_amd.kernels import backward, forward, launch, rotary

    job = aot.CompileJob("cpu", kernel, 40, "bf16", variant)
    spec = aot.LAUNCHES[kernel]
    expected = aot.launch_call(job)
    p = aot_launches.Problem.of(job)
    calls = []
    hooks = dict(spec.hooks)
    if kernel in aot._DKDV_KERNELS:
        hooks["backward.DKDV_HEADS_PER_PROGRAM"] = 1 if p.split else p.group
    with aot_launches._as_on("cpu", [launch, forward, backward, rotary], hooks, calls):
        if kernel == "rotary":
            from fa_amd.kernels.rotary import apply_rotary_emb

            x = torch.zeros(2, 1024, 8, 40, dtype=torch.bfloat16, requires_grad=True)
            cos = torch.zeros(1024, 40 if variant == "plain" else 20)
            out, _ = apply_rotary_emb(x, None, cos, cos, interleaved=variant != "plain", heads_first=False)
            if variant != "plain":
                out.backward(torch.zeros_like(out))
        else:
            import fa_amd

            a = aot_launches._attention_inputs(p)
            q, k, v = (a[n].requires_grad_() for n in "qkv")
            kw = dict(dropout_p=a["dropout_p"], softmax_scale=a["softmax_scale"], causal=p.right,
                      window_size=(a["window_left"], -1), softcap=a["softcap"], alibi_slopes=a["alibi_slopes"],
                      deterministic=spec.run_kwargs.get("deterministic", True),
                      return_attn_probs=spec.run_kwargs.get("return_probs", False))
            if p.varlen:
                out = fa_amd.flash_attn_varlen_func(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"],
                                                    a["max_seqlen_q"], a["max_seqlen_k"], **kw)
            else:
                out = fa_amd.flash_attn_func(q, k, v, **kw)
            out = out[0] if isinstance(out, tuple) else out
            if kernel not in ("fwd", "probs", "nan_fixup"):
                out.backward(torch.zeros_like(out))
    fn = aot._kernel(spec)
    got = [_arguments(fn, c) for c in calls if c.kernel == spec.kernel_fn]
    want = _arguments(fn, expected)
    if kernel == "rotary":  # forward and (for "all") backward calls: the one with the job's direction
        got = [g for g in got if g["BACKWARD"] == want["BACKWARD"]]
    assert len(got) == 1, [c.kernel for c in calls]
    assert got[0].keys() == want.keys() == set(fn.arg_names) | set(aot.launch_config(spec, expected))
    # rng_state values differ per call (drawn from torch's generator); everything else is identical
    assert got[0] == want


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


def test_known_scratch_before_a_triton_covers_only_older_builds(monkeypatch):
    monkeypatch.setattr(aot, "KNOWN_SCRATCH_BEFORE", {"triton<3.6": {("gfx1100", "dq", 256): "why"}})
    old = aot.CompileResult("gfx1100", "dq", "d256-bf16-all", scratch_bytes=40, triton="3.2.0")
    new = aot.CompileResult("gfx1100", "dq", "d256-bf16-all", scratch_bytes=40, triton="3.6.0")
    assert aot.known_scratch(old) == "why" and not old.failed
    assert aot.known_scratch(new) is None and new.failed
    assert ("gfx1100", "dq", 256) in aot.known_scratch_rows((3, 5))
    assert aot.known_scratch_rows((3, 6)) == aot.KNOWN_SCRATCH


def test_rdna_rows_reload_and_nothing_is_exempt():
    """gfx1100 needs the reloading kernels to compile without scratch; no other target uses them.
    Nothing but fp32 decode at d256 on RDNA3 is exempt (tests/test_aot_decode.py)."""
    assert set(aot.KNOWN_SCRATCH) == {("gfx1100", "decode", 256, "fp32")}
    for target in aot.TARGETS:
        rdna = target.startswith("gfx1")  # gfx1100 and the RDNA parts that share its rows
        for kernel in ("fwd", "dkdv", "dkdv_atomic", "dq", "probs"):
            for d in (64, 128, 256):
                chunk = aot.default_config(target, kernel, d)["RELOAD_CHUNK"]
                assert (chunk > 0) == rdna, (target, kernel, d)
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
        # the compiled signature is the launcher's: fp32 atomic-dQ accumulator, int32 cu_seqlens, ...
        if r.kernel == "dkdv_atomic":
            assert r.signature["DQ"] == "*fp32" and r.constexprs["ATOMIC_DQ"], r
        if r.kernel in ("fwd", "dq", "dkdv") and r.variant.endswith("-all"):
            dtype = r.variant.split("-")[1]
            assert r.signature["Q"] == f"*{dtype}" and r.signature["cu_seqlens_q"] == "*i32", r
            assert r.signature["Lse"] == "*fp32" and r.signature["SeedState"] == "*i64", r
            assert r.constexprs["IS_VARLEN"] and r.constexprs["HAS_DROPOUT"], r
    # no sm90 launch the tables run has its wgmma serialized by ptxas (C7515: its matmuls would not overlap)
    serialized = [f"{r.target} {r.kernel} {r.variant}" for r in results if r.wgmma_serialized]
    assert not serialized, "ptxas serialized these kernels' wgmma (TUNING_NOTES v35):\n" + "\n".join(serialized)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("says,code,expect", [
    ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized", 0, True),
    ("ptxas info    : Used 184 registers", 0, False),
    ("ptxas fatal   : Unsupported .version 9.4", 255, None),
])
def test_wgmma_serialization_is_read_off_ptxas(tmp_path, monkeypatch, says, code, expect):
    """aot._wgmma_serialized reads ptxas's C7515 performance warning (what sm90 builds report as "wgmma
    serialized"); a ptxas that cannot assemble the PTX gives no answer rather than a wrong one."""
    fake = tmp_path / "ptxas"
    fake.write_text(f"#!/bin/sh\necho '{says}' >&2\nexit {code}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(aot, "_ptxas_path", lambda arch: str(fake))
    assert aot._wgmma_serialized({"ptx": ".version 8.0"}) is expect
    assert aot._wgmma_serialized({}) is None


def test_compile_heaviest_variants(tmp_path):
    """Every (target, kernel) pair, all features on, the table's largest-tile row."""
    res, payload = _run_compile(tmp_path)
    _check(res, payload, aot.DEFAULT_KERNELS)
    print(f"\nAOT compile check: {len(payload['results'])} variants in {payload['wall_seconds']:.0f} s wall")


def test_screen_rejects_spilling_and_broken_tune_candidates():
    """What `fa-amd tune` may time on gfx942 (aot.screen_configs): the table's row passes, a 256-row
    forward tile (spills with every feature on) and a 48-row one (not a power of two: no compile) do not."""
    table = aot.default_config("gfx942", "fwd", 128, False)
    reasons = aot.screen_configs("gfx942", "fwd", 128, "bf16",
                                 [table, dict(table, BLOCK_M=256), dict(table, BLOCK_M=48)], workers=2)
    assert reasons[0] is None, reasons
    assert reasons[1] and reasons[1].startswith("spills"), reasons
    assert reasons[2] and reasons[2].startswith("does not compile"), reasons


@pytest.mark.skipif(not FULL, reason="full AOT sweep is opt-in: FA_AMD_AOT_FULL=1")
def test_compile_full_sweep(tmp_path):
    res, payload = _run_compile(tmp_path, "--full")
    _check(res, payload, aot.KERNELS)
