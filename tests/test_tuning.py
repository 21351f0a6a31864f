"""Tuned-table persistence and config selection (CPU only: no kernel runs)."""
import json
import subprocess
import sys
import warnings

import pytest

from fa_amd.arch import Arch
from fa_amd import autotune
from fa_amd.tuning import get_config, switches_of, tuned_table
from fa_amd.tuning.tables import HIP_ONLY_OPTIONS, KERNEL_SWITCHES, TABLES

GFX942 = Arch("hip", "gfx942", 64)
GFX1100 = Arch("hip", "gfx1100", 32)
SM90 = Arch("cuda", "sm90", 32)

FAKE_ROW = {
    "head_dim": 128,
    "fwd": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 3,
            "matrix_instr_nonkdim": 32, "kpack": 1},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "waves_per_eu": 1},
    "dq": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "waves_per_eu": 1},
    "tuned": {"device": "fake"},
}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA_AMD_CACHE_DIR", str(tmp_path))
    tuned_table.invalidate_cache()
    yield tmp_path
    tuned_table.invalidate_cache()


@pytest.mark.parametrize("arch", [SM90, Arch("cuda", "sm80", 32), Arch("interpreter", "cpu", 32)])
def test_hip_only_options_stripped_off_hip(arch, cache_dir):
    for d in (64, 128, 256):
        for kernel in ("fwd", "dkdv", "dq"):
            cfg = get_config(arch, kernel, d)
            assert not set(HIP_ONLY_OPTIONS) & set(cfg), (arch, kernel, d, cfg)
            assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(cfg)


def test_hip_options_present_on_hip(cache_dir):
    cfg = get_config(GFX942, "fwd", 128)
    assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= set(cfg)
    assert "waves_per_eu" in get_config(GFX1100, "fwd", 128)
    assert "matrix_instr_nonkdim" not in get_config(GFX1100, "fwd", 128)  # RDNA: no MFMA


def test_no_file_means_defaults(cache_dir):
    assert tuned_table.load_tuned_table() == {}
    assert get_config(GFX942, "fwd", 128)["BLOCK_M"] == next(r for r in TABLES["gfx942"] if r["head_dim"] == 128)["fwd"]["BLOCK_M"]


def test_save_and_load_merges_over_defaults(cache_dir):
    path = tuned_table.save_tuned_rows("gfx942", [FAKE_ROW])
    assert path == tuned_table.tuned_table_path() and path.parent == cache_dir
    table = tuned_table.load_tuned_table()
    rows = table["gfx942"]
    assert [r["head_dim"] for r in rows] == [64, 128, 256]  # untuned classes keep their default rows
    assert get_config(GFX942, "fwd", 128)["waves_per_eu"] == 3
    assert get_config(GFX942, "fwd", 64) == {**{k: v for k, v in TABLES["gfx942"][0]["fwd"].items() if k != "fp32"},
                                             **switches_of("fwd")}
    assert get_config(GFX942, "fwd", 256)["BLOCK_M"] == TABLES["gfx942"][2]["fwd"]["BLOCK_M"]
    # the same tuned row on a non-HIP family loses its AMD-only options
    tuned_table.save_tuned_rows("sm90", [FAKE_ROW])
    cfg = get_config(SM90, "fwd", 128)
    assert cfg["BLOCK_N"] == 16 and not set(HIP_ONLY_OPTIONS) & set(cfg)
    # a second save merges with what is on disk
    data = json.loads(path.read_text())
    assert set(data["families"]) == {"gfx942", "sm90"} and data["format"] == tuned_table.FILE_FORMAT


def test_loaded_in_another_process(cache_dir):
    tuned_table.save_tuned_rows("gfx942", [FAKE_ROW])
    code = ("from fa_amd.arch import Arch; from fa_amd.tuning import get_config; "
            "print(get_config(Arch('hip', 'gfx942', 64), 'fwd', 128)['waves_per_eu'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"


def test_broken_file_warns_and_uses_defaults(cache_dir):
    (cache_dir / "tuned_table.json").write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuned_table.load_tuned_table() == {}
    assert any("unreadable tuned table" in str(w.message) for w in caught)
    assert "BLOCK_M" in get_config(GFX942, "fwd", 128)


def test_malformed_rows_are_dropped(cache_dir):
    bad = dict(FAKE_ROW, fwd={"num_warps": 4})  # no tile sizes
    (cache_dir / "tuned_table.json").write_text(json.dumps({"format": 1, "families": {"gfx942": [bad]}}))
    assert tuned_table.load_tuned_table() == {}


def test_candidate_lists_respect_backend():
    default = get_config(GFX942, "fwd", 128)
    hip = autotune.candidates(GFX942, "fwd", default, 128)
    assert hip[0] == default and len(hip) > 4
    assert all("waves_per_eu" in c for c in hip)
    cuda = autotune.candidates(SM90, "fwd", get_config(SM90, "fwd", 128), 128)
    assert all(not set(HIP_ONLY_OPTIONS) & set(c) for c in cuda)
    rdna = autotune.candidates(GFX1100, "dq", get_config(GFX1100, "dq", 256), 256)
    assert all("matrix_instr_nonkdim" not in c and "kpack" not in c for c in rdna)
    assert all(c["BLOCK_M"] * c["BLOCK_N"] <= 64 * 64 for c in rdna[1:])
    assert len({json.dumps(c, sort_keys=True) for c in hip}) == len(hip)  # no duplicates


def test_kernel_switches(cache_dir):
    """RELOAD_CHUNK: every launch dict carries it (KERNEL_SWITCHES' default where a row does not
    set it), only the gfx1100 rows switch it on, it is never a compiler option, and tuning keeps it."""
    from fa_amd import aot

    for arch in (GFX942, SM90, Arch("cuda", "sm80", 32), Arch("interpreter", "cpu", 32), GFX1100):
        for d in (64, 128, 256):
            for kernel in ("fwd", "dkdv", "dq", "dkdv_atomic"):
                cfg = get_config(arch, kernel, d)
                assert set(switches_of(kernel)) <= set(cfg)
                assert not (set(KERNEL_SWITCHES) - set(switches_of(kernel))) & set(cfg)  # others' switches
                assert (cfg["RELOAD_CHUNK"] > 0) == (arch is GFX1100), (arch, kernel, d, cfg)
                assert not set(KERNEL_SWITCHES) & set(aot.compile_options(cfg))
                assert {"num_warps", "num_stages"} <= set(aot.compile_options(cfg))
    rdna = autotune.candidates(GFX1100, "dkdv", get_config(GFX1100, "dkdv", 128), 128)
    assert all(c["RELOAD_CHUNK"] == 32 for c in rdna if c["BLOCK_M"] * c["BLOCK_N"] != 16 * 64)
    assert {c["RELOAD_CHUNK"] for c in rdna} == {0, 32, 64}  # the other chunks at the default tile
    assert all("RELOAD_CHUNK" not in c for c in autotune.candidates(SM90, "fwd", TABLES["sm90"][1]["fwd"], 128))


def test_dkdv_col_bounds_where_the_tables_say(cache_dir):
    """DKDV_COL_BOUNDS (TUNING_NOTES v29) is on for sm90's d128 non-causal dK/dV launches under triton < 3.7 only:
    off for causal ones (they lost), for newer Triton (more stack, untimed), for other head dims and families."""
    from fa_amd import tuning

    row = tuning.row_for(TABLES["sm90"], 128)["dkdv"]
    for version, causal, on in (((3, 6, 0), False, 1), ((3, 2, 0), False, 1), ((3, 6, 0), True, 0),
                                ((3, 7, 0), False, 0), ((3, 9, 0), True, 0)):
        cfg = tuning.resolve_entry(row, causal=causal, kernel="dkdv", triton_version=version)
        assert cfg["DKDV_COL_BOUNDS"] == on, (version, causal, cfg)
    for arch in (GFX942, Arch("cuda", "sm80", 32), GFX1100):
        for d in (64, 128, 256):
            assert get_config(arch, "dkdv", d)["DKDV_COL_BOUNDS"] == 0
    for d in (64, 256):
        assert get_config(SM90, "dkdv", d)["DKDV_COL_BOUNDS"] == 0
    assert "DKDV_COL_BOUNDS" not in get_config(SM90, "dq", 128)


def test_dkdv_one_masked_loop_where_the_tables_say(cache_dir):
    """DKDV_ONE_MASKED_LOOP (TUNING_NOTES v34) is on for sm90's short causal d64 / d128 dK/dV launches only (the
    launcher passes short = at most SHORT_SEQLEN_K keys): off for long or non-causal ones, other head dims and
    families; the dQ entry never takes it, so the launch still fuses."""
    from fa_amd.tuning import bwd_fusable, get_bwd_config

    for d in (64, 128):
        for causal, short, on in ((True, True, 1), (True, False, 0), (False, True, 0), (False, False, 0)):
            cfgs = get_bwd_config(SM90, d, causal=causal, short=short)
            assert cfgs["dkdv"]["DKDV_ONE_MASKED_LOOP"] == on, (d, causal, short)
            assert "DKDV_ONE_MASKED_LOOP" not in cfgs["dq"] and bwd_fusable("sm90", cfgs["dkdv"], cfgs["dq"])
    for arch, d in ((SM90, 256), (SM90, 96), (GFX942, 128), (GFX1100, 64), (Arch("cuda", "sm80", 32), 128)):
        assert get_bwd_config(arch, d, causal=True, short=True)["dkdv"]["DKDV_ONE_MASKED_LOOP"] == 0, (arch, d)


def test_ensure_tuned_is_a_noop_without_gpu_or_env(cache_dir, monkeypatch):
    monkeypatch.delenv(autotune.AUTOTUNE_ENV, raising=False)
    autotune.ensure_tuned(GFX942, 128)  # env off: nothing happens
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    autotune.ensure_tuned(Arch("interpreter", "cpu", 32), 128)  # no GPU backend: nothing happens
    assert not (cache_dir / "tuned_table.json").exists()


def test_ensure_tuned_skips_when_already_tuned(cache_dir, monkeypatch):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    tuned_table.save_tuned_rows("gfx942", [FAKE_ROW])
    called = []
    monkeypatch.setattr(autotune, "tune_head_dim", lambda *a, **k: called.append(a))
    autotune.ensure_tuned(GFX942, 128)
    assert not called


def test_ensure_tuned_failure_warns_never_raises(cache_dir, monkeypatch):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(autotune, "_tuned_this_process", set())

    def boom(*a, **k):
        raise RuntimeError("OutOfResources: shared memory")

    monkeypatch.setattr(autotune, "tune_head_dim", boom)
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotune.ensure_tuned(GFX942, 256)
        autotune.ensure_tuned(GFX942, 256)  # one attempt per process
    msgs = [str(w.message) for w in caught]
    assert sum("tuning launch configs" in m for m in msgs) == 1
    assert sum("failed" in m for m in msgs) == 1
    assert not (cache_dir / "tuned_table.json").exists()


def test_ensure_tuned_persists(cache_dir, monkeypatch):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(autotune, "_tuned_this_process", set())
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "tune_head_dim", lambda arch, d, **k: dict(FAKE_ROW, head_dim=d))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autotune.ensure_tuned(GFX942, 128)
    assert get_config(GFX942, "fwd", 128)["waves_per_eu"] == 3


def test_backward_dq_policy_is_table_data(monkeypatch):
    """deterministic=False's dQ (atomics or recompute), the GQA slice sum and the fused dK/dV + dQ
    launch come from the tables, per arch family."""
    from fa_amd.tuning import bwd_fusable, get_bwd_config, nondeterministic_dq, tables

    sm90, gfx942 = Arch("cuda", "sm90", 32), Arch("hip", "gfx942", 64)
    assert nondeterministic_dq("sm90") == "recompute"
    assert nondeterministic_dq("gfx942") == "atomic"  # not measured there: the old default
    d128 = get_bwd_config(sm90, 128)
    assert bwd_fusable("sm90", d128["dkdv"], d128["dq"])
    d64 = get_bwd_config(sm90, 64)  # both entries run 4 warps / 3 stages: one launch
    assert bwd_fusable("sm90", d64["dkdv"], d64["dq"])
    assert not bwd_fusable("sm90", d64["dkdv"], dict(d64["dq"], num_warps=8))
    amd = get_bwd_config(gfx942, 128)
    assert not bwd_fusable("gfx942", amd["dkdv"], amd["dq"])
    from fa_amd.tuning import gqa_split_sum

    assert gqa_split_sum("sm90") == "atomic" and gqa_split_sum("gfx942") == "partials"
    monkeypatch.setitem(tables.NONDETERMINISTIC_DQ, "sm90", "atomics")
    with pytest.raises(ValueError, match=r"NONDETERMINISTIC_DQ\['sm90'\] must be 'atomic' or 'recompute'"):
        nondeterministic_dq("sm90")


def test_short_override_is_table_data(monkeypatch):
    """Launches with at most tables.SHORT_SEQLEN_K keys per row take their entries' "short" override
    (the sm90 d128 forward: smaller tiles), applied after "causal" and before "fp32"; entries without
    one (every AMD row) resolve the same either way."""
    from fa_amd.tuning import is_short, resolve_entry, tables

    assert is_short(tables.SHORT_SEQLEN_K) and not is_short(tables.SHORT_SEQLEN_K + 1)
    long_cfg, short_cfg = get_config(SM90, "fwd", 128), get_config(SM90, "fwd", 128, short=True)
    assert (long_cfg["BLOCK_M"], long_cfg["num_warps"]) == (128, 8)
    assert (short_cfg["BLOCK_M"], short_cfg["BLOCK_N"], short_cfg["num_warps"]) == (64, 64, 4)
    assert "short" not in short_cfg and short_cfg["num_stages"] == long_cfg["num_stages"]
    for d in (64, 128, 256):
        assert get_config(GFX942, "fwd", d, short=True) == get_config(GFX942, "fwd", d)
        assert get_config(SM90, "dkdv", d, short=True) == get_config(SM90, "dkdv", d)
    entry = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
             "causal": {"BLOCK_N": 64}, "short": {"BLOCK_N": 32, "num_stages": 2}, "fp32": {"num_stages": 1}}
    assert resolve_entry(entry, is_fp32=True, causal=True, short=True)["BLOCK_N"] == 32
    assert resolve_entry(entry, is_fp32=True, short=True)["num_stages"] == 1
    # an override's own dict of another case: causal launches that are also short (the sm90 d128 forward)
    entry["short"]["causal"] = {"BLOCK_N": 16}
    assert resolve_entry(entry, causal=True, short=True)["BLOCK_N"] == 16
    assert resolve_entry(entry, short=True)["BLOCK_N"] == 32 and resolve_entry(entry, causal=True)["BLOCK_N"] == 64
    assert resolve_entry(entry, is_fp32=True, causal=True, short=True)["num_stages"] == 1
    assert "causal" not in resolve_entry(entry, causal=True, short=True)
    causal_short = get_config(SM90, "fwd", 128, causal=True, short=True)
    assert (causal_short["BLOCK_M"], causal_short["BLOCK_N"], causal_short["num_warps"]) == (64, 32, 4)
    assert get_config(SM90, "fwd", 128, causal=True, short=True, fp8=True)["BLOCK_N"] == 128  # "fp8" comes last


def test_tuner_times_only_candidates_the_aot_check_passes(monkeypatch):
    """On AMD the tuner asks the AOT check (aot.screen_configs) first: a candidate that spills or does
    not compile under the installed triton is never timed, so it can never become a tuned row; the
    table's row (first) always stays.  Off AMD nothing is screened."""
    from fa_amd import aot

    cfgs = [{"BLOCK_M": 64}, {"BLOCK_M": 128}, {"BLOCK_M": 256}, {"BLOCK_M": 32}]
    asked = []

    def screen(target, kernel, head_dim, dtype, configs, workers=None):
        asked.append((target, kernel, head_dim, dtype, len(configs)))
        return [None, "spills 36 B of scratch (all)", "does not compile (plain): boom", None]

    monkeypatch.setattr(aot, "screen_configs", screen)
    logged = []
    import torch

    kept = autotune._compilable(GFX942, "fwd", cfgs, 128, torch.bfloat16, logged.append)
    assert kept == [cfgs[0], cfgs[3]]
    assert asked == [("gfx942", "fwd", 128, "bf16", 4)]
    assert any("spills 36 B" in m for m in logged) and any("does not compile" in m for m in logged)
    # an RDNA part without its own target builds as its family's (gfx1100 rows)
    autotune._compilable(Arch("hip", "gfx1103", 32), "dq", cfgs, 256, torch.float16, logged.append)
    assert asked[-1][:4] == ("gfx1100", "dq", 256, "fp16")
    assert autotune._compilable(SM90, "fwd", cfgs, 128, torch.bfloat16, logged.append) == cfgs
    assert len(asked) == 2


def test_bandwidth_pass_grids_are_table_data():
    """The V NaN-flag pass and the FP8 quantiser split each (sequence, head) by one rule
    (launch.head_scan_grid): blocks of BLOCK_ELEMENTS, at most MAX_SPLITS programs, and with PROGRAMS
    only as many as bring the grid to that size; every family's flag pass fits the forward's flag rows."""
    from fa_amd.kernels.forward import NAN_SPLITS_MAX
    from fa_amd.kernels.launch import head_scan_grid
    from fa_amd.tuning import tables

    cfg = {"BLOCK_ELEMENTS": 4096, "MAX_SPLITS": 32, "PROGRAMS": 2048}
    assert head_scan_grid(cfg, 128, 512, heads=32 * 16) == (32, 4)       # 512 pairs: 4 programs each
    assert head_scan_grid(cfg, 128, 16384, heads=16) == (32, 32)         # few pairs: up to MAX_SPLITS
    assert head_scan_grid(cfg, 128, 16384, 8, heads=16) == (32, 8)       # the caller's cap
    assert head_scan_grid(cfg, 256, 20, heads=1) == (16, 2)              # never more programs than blocks
    assert head_scan_grid({"BLOCK_ELEMENTS": 8192, "MAX_SPLITS": 64}, 64, 9000) == (128, 64)  # no PROGRAMS key
    for family, entry in tables.V_NAN_FLAGS.items():
        assert 1 <= entry["MAX_SPLITS"] <= NAN_SPLITS_MAX.value, family
    for family, entry in tables.BWD_PREPROCESS.items():
        assert entry["BLOCK_ELEMENTS"] >= 16 and entry["num_warps"] in (1, 2, 4, 8, 16), family
