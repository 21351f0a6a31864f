"""`fa-amd` CLI smoke tests (CPU, Triton interpreter)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from fa_amd import arch, bench, cli

ENV = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")


def run_cli(*args, timeout=300):  # generous: CI's 2 cores may be busy with other workers
    if arch.TRITON_VERSION < arch.MIN_INTERPRETER_TRITON:  # e.g. a GPU machine with triton 3.6
        pytest.skip(f"these runs use Triton's interpreter, which needs triton >= "
                    f"{'.'.join(map(str, arch.MIN_INTERPRETER_TRITON))}")
    return subprocess.run([sys.executable, "-m", "fa_amd.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def test_info():
    res = run_cli("info")
    assert res.returncode == 0, res.stderr
    for needle in ("backend", "interpreter", "triton", "torch", "d64:", "d128:", "d256:", "BLOCK_M"):
        assert needle in res.stdout


def test_bench_smoke(tmp_path):
    res = run_cli("bench", "--smoke", "--host-time", "--out", str(tmp_path), "--markdown", str(tmp_path / "PERF.md"))
    assert res.returncode == 0, res.stdout + res.stderr
    payload = json.loads((tmp_path / "results.json").read_text())
    fa = [r for r in payload["results"] if r["method"] == "fa_amd"]
    assert fa and all(r["tflops"] and r["tflops"] > 0 for r in fa)
    modes = {(r["kind"], r["mode"]) for r in fa}
    assert {("dense", "fwd"), ("gqa", "fwd+bwd"), ("varlen", "fwd+bwd")} <= modes
    assert "n/a" in res.stdout  # SDPA/eager have no varlen row: reported, not crashed
    assert (tmp_path / "bench.png").stat().st_size > 0
    doc = (tmp_path / "PERF.md").read_text()
    assert "triton" in doc and "| fa_amd" not in doc.splitlines()[0]
    # the plot sits next to the doc and is linked from it; the rows a rival wins are listed
    assert (tmp_path / "PERF.png").stat().st_size > 0 and "](PERF.png)" in doc
    assert "Where fa_amd trails" in doc
    # the SDPA route row: an SDPA-calling model timed without and with fa_amd.sdpa_route()
    route = [r for r in payload["results"] if r["kind"] == "sdpa_route" and r["method"] == "fa_amd route"]
    assert len(route) == 2 and all(r["ms"] > 0 for r in route) and "fa_amd.sdpa_route()" in doc
    # --host-time: the CPU time to issue each forward+backward (no CUDA graph without a GPU)
    fb = [r for r in fa if r["mode"] == "fwd+bwd"]
    assert all(r["host_ms"] > 0 for r in fb) and "Host vs GPU time" in doc
    # the doc regenerates from the JSON alone
    res2 = run_cli("bench", "--from-json", str(tmp_path / "results.json"), "--markdown", str(tmp_path / "P2.md"))
    assert res2.returncode == 0 and (tmp_path / "P2.md").read_text() == doc.replace("PERF.png", "P2.png")


def test_bench_fp8_smoke(tmp_path):
    """--fp8: fa_amd's FP8 forward rows beside its bf16 forward, with the speedup lines; torch's
    FP8 SDPA is probed (n/a on CPU) and FA3-style FP8 inputs have no fwd+bwd row."""
    res = run_cli("bench", "--smoke", "--fp8", "--methods", "fa_amd", "sdpa_cudnn", "fa_amd_fp8", "fa_amd_fp8_func",
                  "sdpa_cudnn_fp8", "--out", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    rows = {(r["method"], r["mode"], r["kind"]): r for r in results}
    for method in ("fa_amd", "fa_amd_fp8", "fa_amd_fp8_func"):
        assert rows[(method, "fwd", "gqa")]["tflops"] > 0
    assert rows[("fa_amd_fp8_func", "fwd+bwd", "dense")]["tflops"] > 0
    # forward-only methods have no fwd+bwd rows (not an error cell saying "forward only")
    assert not [key for key in rows if key[0] in ("fa_amd_fp8", "sdpa_cudnn_fp8") and key[1] == "fwd+bwd"]
    assert "forward only" not in res.stdout
    bwd_table = res.stdout.split("### Forward + backward")[1].split("###")[0]
    assert "fa_amd_fp8_func" in bwd_table and "fa_amd_fp8 " not in bwd_table and "sdpa_cudnn_fp8" not in bwd_table
    assert rows[("sdpa_cudnn_fp8", "fwd", "dense")]["note"].startswith("n/a")
    if not cli_gpu():  # the bf16 cuDNN peer: not torch's "No viable backend ... turning off" message
        assert rows[("sdpa_cudnn", "fwd", "dense")]["note"] == "n/a: the cuDNN SDPA backend is NVIDIA-only"
        assert "No viable backend" not in res.stdout
    assert "FP8 forward vs fa_amd bf16 forward" in res.stdout and "fa_amd_fp8 " in res.stdout


def test_bench_rounds_interleave_peers(monkeypatch):
    """Every (method, mode) of a shape is timed once per round, rounds start with another method each
    time, the median round is reported, and a peer that fails mid-run becomes a note, not a crash."""
    order = []

    def maker(name, fail_after=None):
        def make(shape, device):
            def fn(q, k, v):
                order.append(name)
                if fail_after is not None and order.count(name) > fail_after:
                    raise RuntimeError("out of memory")
                return q * 2.0
            return fn, "bshd"
        return make

    monkeypatch.setattr(bench, "MAKERS", {"a": maker("a"), "b": maker("b"), "c": maker("c", fail_after=12)})
    shape = bench.Shape(1, 8, 2, 2, 16, False)
    results = bench.bench_shape(["a", "b", "c"], shape, torch.float32, "cpu", smoke=True, rounds=3)
    by = {(r.method, r.mode): r for r in results}
    assert len(by["a", "fwd"].rounds_ms) == 3
    assert by["a", "fwd"].ms == pytest.approx(sorted(by["a", "fwd"].rounds_ms)[1], abs=1e-5)
    assert by["b", "fwd+bwd"].tflops > 0
    assert by["c", "fwd+bwd"].ms is None and "RuntimeError: out of memory" in by["c", "fwd+bwd"].note
    # each smoke timing makes 3 calls per mode (6 per method and round): round 2 starts with b, round 3 with c
    firsts = [order[i] for i in (0, 18, 36)]
    assert firsts == ["a", "b", "c"]


def test_bench_round_starts_with_the_methods_own_calls(monkeypatch):
    """On a GPU every timed round begins with ~ROUND_WARM_MS of the method's own untimed calls (its own power
    state, not the one its predecessor left), at most MAX_WARM_CALLS, before the timed calls."""
    calls, seen = [], []
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "gpu_round_ms",
                        lambda fn, grads, n, flush="zero", warm=1: seen.append(len(calls) + warm) or 1.0)
    clock = iter(float(t) for t in range(1000))  # each perf_counter() one second later: a 1000 ms call
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    slow = bench._Timed({}, "fwd", lambda: calls.append(1), (), [])
    bench._time_round(slow, smoke=False, first=True)
    bench._time_round(slow, smoke=False, first=False)
    # compile and estimate, then gpu_round_ms's one warm call per round: a call this long is its own warm-up
    assert slow.warm_calls == 0 and seen == [2 + 1, 2 + 1]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: 0.0)  # a call too short to clock: the cap
    calls.clear(), seen.clear()
    fast = bench._Timed({}, "fwd", lambda: calls.append(1), (), [])
    bench._time_round(fast, smoke=False, first=True)
    bench._time_round(fast, smoke=False, first=False)
    assert fast.warm_calls == bench.MAX_WARM_CALLS
    assert seen == [2 + 1 + bench.MAX_WARM_CALLS, 2 + 1 + bench.MAX_WARM_CALLS]  # (the fake gpu_round_ms calls nothing)
    assert fast.rounds == [1.0, 1.0]


def test_calls_per_round_bounds():
    """Short calls fill ROUND_REP_MS; long ones still get MIN_CALLS_PER_ROUND (a median of several
    calls); very long ones are capped near MAX_ROUND_MS but never below one call."""
    assert bench._calls_per_round(1.0) == round(bench.ROUND_REP_MS / 1.0)
    assert bench._calls_per_round(17.0) == bench.MIN_CALLS_PER_ROUND
    assert bench._calls_per_round(150.0) * 150.0 <= bench.MAX_ROUND_MS
    assert bench._calls_per_round(10_000.0) == 1


def test_trailing_rows_names_every_faster_rival():
    from fa_amd.bench import Result, trailing_rows

    def result(method, mode, tflops):
        return Result(shape={}, label="b1 s64", kind="dense", method=method, mode=mode, ms=1.0, tflops=tflops)

    rows = [result("fa_amd", "fwd", 100.0), result("flex", "fwd", 120.0), result("sdpa_flash", "fwd", 90.0),
            result("fa_amd", "fwd+bwd", 80.0), result("flex", "fwd+bwd", 70.0),
            result("sdpa_cudnn", "fwd+bwd", 200.0)]  # cuDNN is the stretch goal, not a rival
    assert trailing_rows(rows) == ["- b1 s64, fwd: fa_amd 100 < flex 120"]


def test_bench_needs_gpu_without_smoke(capsys):
    if cli_gpu():
        pytest.skip("has a GPU")
    assert cli.main(["bench", "--quick"]) == 2
    assert "no GPU" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--dtype", "fp8"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
    res = run_cli("bench", "--smoke", "--rounds", "0")
    assert res.returncode == 2 and "--rounds must be >= 1, got 0" in res.stderr
    assert cli.main(["compile", "--arch", "gfx999"]) == 2
    assert "unknown target" in capsys.readouterr().err
    if not cli_gpu():
        assert cli.main(["tune"]) == 2
        assert "needs a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2


def test_bench_seqlens_keeps_only_those_dense_rows(capsys):
    """`--seqlens` keeps the dense rows of those sequence lengths (every head dim and mask, the
    in-between head dims too), no GQA or varlen rows; a length the bench has no row for is an error."""
    rows = bench.shapes(seqlens=[512, 16384])
    assert rows and {r.seqlen for r in rows} == {512, 16384} and {r.kind for r in rows} == {"dense"}
    assert {r.head_dim for r in rows} == set(bench.HEAD_DIMS) | set(bench.BETWEEN_HEAD_DIMS)
    assert {r.causal for r in rows} == {False, True}
    assert {(r.head_dim, r.seqlen) for r in bench.shapes(head_dims=[64], seqlens=[1024])} == {(64, 1024)}
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--seqlens", "777"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def cli_gpu():
    import torch

    return torch.cuda.is_available()


def test_flop_counts():
    dense = bench.Shape(2, 1024, 16, 16, 128, False)
    assert dense.fwd_flops() == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.Shape(2, 1024, 16, 16, 128, True).fwd_flops() == dense.fwd_flops() / 2
    docs = [64, 2048, 100]
    varlen = bench.Shape(1, 2048, 16, 16, 128, True, doc_lens=docs)
    assert varlen.fwd_flops() == sum(4 * n * n * 16 * 128 for n in docs) / 2
    full = bench.shapes()
    dense_rows = [s for s in full if s.kind == "dense"]
    # (head dims between the table rows, d96 / d192, hold HIDDEN // d heads)
    assert all(s.batch * s.seqlen == bench.TOKENS and s.heads_q == bench.HIDDEN // s.head_dim for s in dense_rows)
    assert {s.seqlen for s in dense_rows} == set(bench.SEQLENS)
    assert {s.head_dim for s in dense_rows} == {64, 96, 128, 192, 256}
    assert {s.seqlen for s in dense_rows if s.head_dim in (96, 192)} == set(bench.BETWEEN_SEQLENS)
    assert any(s.kind == "gqa" for s in full)
    (v,) = [s for s in full if s.kind == "varlen"]
    assert sum(v.doc_lens) == bench.TOKENS and len(v.doc_lens) == 17 and min(v.doc_lens) >= 64


@pytest.mark.cpu_only
def test_check_cpu():
    res = run_cli("check", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all checks passed" in res.stdout


def test_parser_has_all_commands():
    parser = cli.build_parser()
    for cmd in ("info", "check", "bench", "tune", "compile"):
        assert parser.parse_args([cmd]).command == cmd


@pytest.mark.gpu
def test_host_time_columns_on_gpu():
    """On a GPU, --host-time gives both numbers for fa_amd: the CPU time to issue a forward+backward
    and the GPU time of the same call replayed from a CUDA graph."""
    shape = bench.Shape(2, 256, 4, 2, 64, True)
    results = bench.bench_method("fa_amd", shape, torch.bfloat16, "cuda", False, host_time=True)
    fb = next(r for r in results if r.mode == "fwd+bwd")
    assert fb.host_ms > 0 and fb.graph_ms is not None and fb.graph_ms > 0


def _option_strings(parser):
    return [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")
            and opt != "--help"]


def test_every_bench_option_is_documented():
    """Every `fa-amd bench` option is in the README and has help text in --help."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="fa-amd bench")
    bench.add_arguments(parser)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    options = _option_strings(parser)
    assert {"--smoke", "--quick", "--host-time", "--from-json"} <= set(options)
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert action.help, f"{action.option_strings} has no help text"
    missing = [opt for opt in options if f"`{opt}" not in readme]
    assert not missing, f"README does not document fa-amd bench {missing}"
    assert "n/a (reason)" in parser.format_help()


def test_na_cells_say_why():
    """A CPU run has no memory / CUDA-graph numbers, and a peer that cannot run a shape has no row:
    each such cell says which, and the reasons are explained under the tables."""
    from fa_amd.bench import NA_REASONS, Result, markdown_tables

    def result(method, mode, tflops, **extra):
        return Result(shape={}, label="b1 s64", kind="dense", method=method, mode=mode,
                      ms=1.0 if tflops else None, tflops=tflops, **extra)

    rows = [result("fa_amd", "fwd", 1.0), result("fa_amd", "fwd+bwd", 1.0, host_ms=2.0),
            result("eager", "fwd", None, note="n/a: Unavailable: skipped"),
            result("eager", "fwd+bwd", None, note="n/a: Unavailable: skipped")]
    text = markdown_tables(rows)
    memory = text.split("Peak memory")[1].split("###")[0]
    assert "n/a (no GPU)" in memory and "n/a (not run)" in memory
    assert "2.000 / n/a (no GPU)" in text
    assert NA_REASONS["no GPU"] in text and NA_REASONS["not run"] in text
    assert "eager: Unavailable: skipped" in text


def test_bench_only_sdpa_route(tmp_path):
    """--only sdpa-route: the SDPA route row alone (no kernel shapes), and clear errors for options it
    cannot combine with."""
    res = run_cli("bench", "--smoke", "--only", "sdpa-route", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    payload = json.loads((tmp_path / "results.json").read_text())
    assert {r["kind"] for r in payload["results"]} == {"sdpa_route"}
    route = [r for r in payload["results"] if r["method"] == "fa_amd route"]
    assert len(route) == 2 and all(r["ms"] > 0 for r in route)
    assert "fa_amd.sdpa_route()" in res.stdout and "TFLOP/s" not in res.stdout
    for extra in (["--no-sdpa-route"], ["--fp8"], ["--methods", "fa_amd"], ["--decode"]):
        bad = run_cli("bench", "--smoke", "--only", "sdpa-route", *extra)
        assert bad.returncode == 2 and "--only" in bad.stderr, (extra, bad.stderr)


@pytest.mark.cpu_only
def test_info_without_interpreter_is_consistent():
    """No GPU and no TRITON_INTERPRET: one story (no backend, interpreter off), never "backend
    interpreter" beside "interpreter off" (issue 15)."""
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "fa_amd.cli", "info"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    backend = [line for line in res.stdout.splitlines() if line.startswith("backend")]
    assert len(backend) == 1 and backend[0].split()[1] == "none:" and "TRITON_INTERPRET=1" in backend[0]
    assert "interpreter off" in res.stdout and "arch " not in res.stdout


# --------------------------------------------------------------------------- bad arguments: one line, exit 2

def _one_line_error(capsys, needle):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    return err


def test_compile_from_json_bad_files_are_one_line_errors(tmp_path, capsys):
    """`fa-amd compile --from-json`: a missing file, a non-JSON file and JSON of another kind (`{}`, a
    `fa-amd bench` results.json) are one-line errors naming the file, exit 2, not tracebacks."""
    not_json, empty, bench_json = tmp_path / "x.txt", tmp_path / "empty.json", tmp_path / "results.json"
    not_json.write_text("not json")
    empty.write_text("{}")
    bench_json.write_text(json.dumps({"environment": {}, "dtype": "bf16", "results": [{"shape": {}, "label": "x"}]}))
    for path, needle in ((tmp_path / "nope.json", "No such file"), (not_json, "not JSON"),
                         (empty, "fa-amd compile --json"), (bench_json, "fa-amd compile --json")):
        assert cli.main(["compile", "--from-json", str(path)]) == 2
        assert f"cannot use {path}: " in _one_line_error(capsys, needle)


def test_bench_from_json_of_another_kind_is_a_one_line_error(tmp_path, capsys):
    """`fa-amd bench --from-json` with valid JSON that is not a bench results.json (`{}`, the JSON that
    `fa-amd compile --json` writes, a list): one-line error naming the file, exit 2."""
    empty, aot_json, listed = tmp_path / "empty.json", tmp_path / "aot.json", tmp_path / "list.json"
    empty.write_text("{}")
    aot_json.write_text(json.dumps({"triton": "3.5", "wall_seconds": 1.0, "targets": ["gfx942"],
                                    "results": [{"target": "gfx942", "kernel": "fwd", "variant": "x"}]}))
    listed.write_text("[1, 2]")
    for path, needle in ((empty, "no environment, dtype, results"), (aot_json, "fa-amd compile --json"),
                         (listed, "not an object")):
        assert cli.main(["bench", "--from-json", str(path)]) == 2
        err = _one_line_error(capsys, needle)
        assert f"cannot use {path}: not a results.json" in err


def test_decode_rows_are_validated(capsys):
    """--decode-rows takes BxCACHE with integers >= 1, nothing else (no third field read as heads)."""
    for item in ("abc", "-1x2048", "0x2048", "1x0", "1x2048x3", "1.5x2048", "x2048"):
        assert cli.main(["bench", "--decode", "--smoke", f"--decode-rows={item}"]) == 2, item
        _one_line_error(capsys, f"got {item!r}")
    from fa_amd.bench_decode import DecodeRow, parse_decode_rows

    assert parse_decode_rows(["1x2048", "64X131072"]) == [DecodeRow(1, 2048), DecodeRow(64, 131072)]


def test_ignored_option_combinations_are_errors(capsys):
    """Options that a run would silently ignore are one-line errors naming the option and what it needs."""
    cases = [
        (["bench", "--smoke", "--seqlens", "512", "--head-dims", "256"], "--head-dims and --seqlens"),
        (["bench", "--smoke", "--fp8", "--head-dims", "128"], "--smoke runs its own shapes"),
        (["bench", "--fp8", "--seqlens", "1024"], "--fp8 runs its own shapes"),
        (["bench", "--smoke", "--decode-rows", "1x2048"], "--decode-rows applies to the decode rows"),
        (["bench", "--smoke", "--decode-methods", "sdpa"], "it needs --decode"),
        (["bench", "--smoke", "--generate", "--hbm-peak-gbs", "3000"], "--hbm-peak-gbs"),
        (["bench", "--smoke", "--decode", "--generate-rounds", "5"], "--generate-rounds applies to the generate() rows"),
        (["bench", "--smoke", "--generate-padded"], "--generate-padded applies to the generate() rows"),
        (["bench", "--smoke", "--generate", "--generate-rounds", "0"], "--generate-rounds must be >= 1, got 0"),
        (["bench", "--smoke", "--decode", "--methods", "fa_amd"], "--methods picks prefill-side rows"),
        (["bench", "--head-dims", "96", "--seqlens", "512"], "no benchmark row matches"),
        (["bench", "--quick", "--head-dims", "64"], "no benchmark row matches --head-dims 64 with --quick"),
        (["compile", "--head-dims", "64"], "--head-dims narrows the --full sweep: it needs --full"),
        (["compile", "--dtypes", "fp16", "--variants", "plain"], "they need --full"),
        (["compile", "-j", "0"], "-j/--jobs must be >= 1, got 0"),
    ]
    for argv, needle in cases:
        assert cli.main(argv) == 2, argv
        _one_line_error(capsys, needle)


@pytest.mark.cpu_only
def test_decode_and_generate_without_interpreter_fail_early(monkeypatch, capsys):
    """On CPU without TRITON_INTERPRET=1, --decode / --generate give the prefill path's one-line error
    (exit 2) instead of failing row by row."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for extra in (["--decode"], ["--generate"]):
        assert cli.main(["bench", "--smoke", *extra]) == 2
        _one_line_error(capsys, "set TRITON_INTERPRET=1")


def test_generate_fails_when_every_fa_amd_cell_failed(monkeypatch, capsys):
    """--generate exits 1 when every fa_amd generate measurement failed, as --decode and the prefill rows do."""
    from fa_amd import bench_decode

    def failed(dtype, device, smoke=False, rounds=1, **kw):
        return [bench_decode.GenerateResult("fa_amd", "dynamic", note="n/a: ValueError: no kernels here"),
                bench_decode.GenerateResult("sdpa", "dynamic", tokens_per_s=900.0, seconds=0.1)]

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bench_decode, "run_generate", failed)
    assert cli.main(["bench", "--generate", "--smoke"]) == 1
    assert "every fa_amd generate measurement failed" in capsys.readouterr().err


def test_bench_text_says_what_ran(monkeypatch, capsys):
    """The environment says whether the interpreter is on, and the CPU decode smoke run's heading names
    the dtype and heads it computed in (fp32, its tiny GQA rows), not bf16 GQA 32/8 d128."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench.environment("cpu")["gpu"] == "none (CPU, no Triton interpreter)"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert bench.environment("cpu")["gpu"] == "none (CPU, Triton interpreter)"
    if cli_gpu():
        return
    # (no fa_amd rows: not a failure)
    assert cli.main(["bench", "--decode", "--smoke", "--decode-methods", "sdpa"]) == 0
    out = capsys.readouterr().out
    assert "### Decode: KV GB/s (us per call); fp32, GQA 4/2 and 4/1, d32, one query token" in out
    assert "bf16" not in out and "(cpu)" not in out


@pytest.mark.cpu_only
def test_sdpa_backends_without_a_cpu_kernel_say_so():
    """On CPU a forced SDPA backend with no kernel here reads "not available", not torch's "No viable
    backend ... turning off both the math kernel and the fused kernels"."""
    shape = bench.Shape(1, 16, 2, 2, 16, False)
    notes = {m: [t.note for t in bench._prepare(m, shape, torch.float32, "cpu")]
             for m in ("sdpa_cudnn", "sdpa_efficient")}
    assert notes["sdpa_cudnn"] == ["n/a: the cuDNN SDPA backend is NVIDIA-only"] * 2
    assert all("no CPU kernel" in note for note in notes["sdpa_efficient"])
    # a forward-only method gets a forward row alone
    assert [t.mode for t in bench._prepare("sdpa_cudnn_fp8", shape, torch.float32, "cpu")] == ["fwd"]


def test_setup_accelerate_unwritable_path_is_a_one_line_error(tmp_path):
    import subprocess as sp
    from pathlib import Path

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    script = Path(__file__).resolve().parents[1] / "recipes" / "setup_accelerate.py"
    res = sp.run([sys.executable, str(script), "--config-file", str(blocker / "x.yaml")], capture_output=True,
                 text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: cannot write the Accelerate config") and res.stderr.count("\n") == 1
