"""The recipes never lose or poison a run (issue 16, point 6): bad options, NaN steps, damaged and
foreign checkpoints, resume mismatches, unusable output folders, bad data.

Every failing case must end with one clear line and a non-zero exit status, never a traceback.
The recipe runs are subprocesses (``run_in_one_process`` runs a batch of short ones in one), as are
the saves killed by a signal; the option and checkpoint-folder checks run in process (they build no
model).  Every checked case is tallied (tests/reliability_log.py) for .ci/reliability_counts.py.
"""
from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.recipe_helpers import (
    RECIPES, SMALL_CORPUS, TINY, read_metrics, recipe_environment, run_in_one_process, run_recipe,
)
from tests.reliability_log import record

sys.path.insert(0, str(RECIPES))

import finetune_checkpoints as ckpt  # noqa: E402
import finetune_common  # noqa: E402
import finetune_data  # noqa: E402
import finetune_options  # noqa: E402

# sdpa: these are about the training loop and the files, not the attention kernels.
FAST = ["--attn", "sdpa", *TINY]


# --------------------------------------------------------------------------- options (argparse, in process)

BAD_OPTIONS = [
    ("--lr", "0"), ("--lr", "-1e-3"), ("--lr", "nan"), ("--lr", "inf"), ("--lr", "abc"),
    ("--max-grad-norm", "-1"), ("--max-grad-norm", "nan"), ("--weight-decay", "-0.1"), ("--weight-decay", "inf"),
    ("--warmup-steps", "-1"), ("--save-every", "-1"), ("--keep-checkpoints", "-1"), ("--log-every", "0"),
    ("--log-every", "-1"), ("--save-every", "1.5"), ("--hidden-size", "abc"), ("--dropout", "nan"),
    ("--num-layers", "0"), ("--hidden-size", "0"), ("--num-heads", "0"), ("--num-kv-heads", "0"),
    ("--intermediate-size", "-5"), ("--seq-len", "1"), ("--batch-tokens", "0"), ("--max-steps", "0"),
    ("--grad-accum", "0"), ("--dropout", "1"), ("--dropout", "-0.1"), ("--lora-r", "0"), ("--lora-alpha", "0"),
    ("--lora-dropout", "1.5"), ("--seed", "-1"), ("--seed", str(2**40)), ("--sliding-window", "0"),
    ("--dataset", ""), ("--text-column", " "), ("--output-dir", ""), ("--resume", ""),
]


@pytest.mark.parametrize("option,value", BAD_OPTIONS, ids=[f"{o}={v}" for o, v in BAD_OPTIONS])
def test_every_numeric_option_is_range_checked(option, value, capsys):
    with pytest.raises(SystemExit) as stopped:
        finetune_options.build_parser("llama").parse_args([option, value])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, not the 40-line usage block
    assert f"argument {option}" in err and "error:" in err
    record("error", f"{option} {value}")


@pytest.mark.parametrize("script,option,value", [
    ("bench_train", "--steps", "0"), ("bench_train", "--lr", "nan"), ("bench_train", "--seq-lens", "1"),
    ("bench_train", "--dropout", "2"), ("sft_trl", "--max-steps", "0"), ("sft_trl", "--lr", "-1"),
    ("sft_trl", "--batch-size", "0"), ("sft_trl", "--seq-len", "1"),
])
def test_the_other_recipe_scripts_range_check_too(script, option, value, capsys):
    import importlib

    parser = importlib.import_module(script).build_parser()
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args([option, value])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument {option}" in err and err.count("\n") == 1, err
    record("error", f"{script}.py {option} {value}")


def test_zero_max_grad_norm_means_no_clipping_not_zero_gradients():
    args = finetune_options.build_parser("llama").parse_args(["--max-grad-norm", "0"])
    assert args.max_grad_norm == 0.0  # the loop clips to inf: the norm is still computed and checked
    record("right", "--max-grad-norm 0 (no clipping)")


BAD_COMBINATIONS = [
    (["--hidden-size", "60", "--num-heads", "8"], "is not a multiple of --num-heads"),
    (["--num-heads", "4", "--num-kv-heads", "3"], "is not a multiple of --num-kv-heads"),
    (["--hidden-size", "60", "--num-heads", "4", "--num-kv-heads", "2"], "must be even"),
    (["--seq-len", "256", "--batch-tokens", "128"], "--batch-tokens (128) must be at least --seq-len (256)"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
    (["--sliding-window", "8"], "--sliding-window applies to Mistral"),
]


@pytest.mark.parametrize("argv,expected", BAD_COMBINATIONS, ids=[a[1] for a, _ in BAD_COMBINATIONS])
def test_option_combinations_give_one_line(argv, expected, capsys):
    args = finetune_options.build_parser("llama").parse_args(argv)
    with pytest.raises(SystemExit) as stopped:
        finetune_options.resolve_args(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    record("error", " ".join(argv))


def test_bad_options_from_the_command_line_have_no_traceback(tmp_path):
    """As a user runs it: one line on stderr, exit status 2, before anything is built."""
    env = recipe_environment(tmp_path / "cache")
    for argv, expected in ((["--hidden-size", "0"], "argument --hidden-size: must be an integer >= 1, got '0'"),
                           (["--num-kv-heads", "0"], "argument --num-kv-heads"),
                           (["--model", "/nonexistent"], "--model /nonexistent: no such folder")):
        code, output = run_recipe([sys.executable, RECIPES / "finetune_llama.py", *argv], env, expect_ok=False)
        assert code == 2 and expected in output and "Traceback" not in output, output
        assert output.strip().count("\n") == 0, output
        record("error", f"finetune_llama.py {' '.join(argv)}", isolated=True)


# --------------------------------------------------------------------------- checkpoint files (in process)


def fake_checkpoint(output_dir: Path, step: int, run_id: str | None, files=None) -> Path:
    """A checkpoint folder as write_checkpoint leaves it (run_id None: no marker, like a half-written one)."""
    folder = ckpt.checkpoint_root(output_dir) / f"step_{step:07d}"
    folder.mkdir(parents=True)
    files = files or {"model.safetensors": b"w" * 10, "optimizer.bin": b"o" * 20, "random_states_0.pkl": b"r"}
    for name, content in files.items():
        (folder / name).write_bytes(content)
    if run_id is not None:
        marker = {"format": 1, "complete": True, "run_id": run_id, "step": step, "config": {},
                  "files": {name: len(content) for name, content in files.items()}}
        (folder / ckpt.MARKER).write_text(json.dumps(marker))
    return folder


def test_rotation_never_deletes_another_runs_checkpoint(tmp_path):
    other = fake_checkpoint(tmp_path, 3, "other-run")
    unmarked = fake_checkpoint(tmp_path, 4, None)
    ours = [fake_checkpoint(tmp_path, s, "this-run") for s in (1, 2, 5, 6)]
    deleted = ckpt.rotate_checkpoints(tmp_path, "this-run", keep=1)
    assert sorted(p.name for p in deleted) == ["step_0000001", "step_0000002", "step_0000005"]
    assert other.is_dir() and unmarked.is_dir() and ours[-1].is_dir()
    assert not any(p.is_dir() for p in ours[:-1])
    assert ckpt.rotate_checkpoints(tmp_path, "this-run", keep=0) == []  # 0: keep all
    record("right", "rotation next to another run's and an unmarked checkpoint")


def test_resume_lookup_takes_the_newest_complete_checkpoint(tmp_path):
    warnings = []
    with pytest.raises(ckpt.RecipeError, match="no checkpoint"):
        ckpt.find_resume_checkpoint("latest", tmp_path)
    fake_checkpoint(tmp_path, 2, "run")
    fake_checkpoint(tmp_path, 10, "run")
    fake_checkpoint(tmp_path, 12, None)  # half-written: no marker
    truncated = fake_checkpoint(tmp_path, 11, "run")
    (truncated / "optimizer.bin").write_bytes(b"o" * 3)
    found = ckpt.find_resume_checkpoint("latest", tmp_path, warn=warnings.append)
    assert found.name == "step_0000010"
    assert any("step_0000012" in w and "no completeness marker" in w for w in warnings)
    assert any("step_0000011" in w and "optimizer.bin has 3 bytes" in w for w in warnings)
    record("right", "resume lookup past an unmarked and a truncated checkpoint")
    # An output folder given to --resume: its newest complete one.  A named damaged checkpoint: an error.
    assert ckpt.find_resume_checkpoint(str(tmp_path), tmp_path / "other", warn=warnings.append).name == "step_0000010"
    with pytest.raises(ckpt.RecipeError, match="cannot resume from it: optimizer.bin"):
        ckpt.find_resume_checkpoint(str(truncated), tmp_path)
    record("error", "--resume naming a truncated checkpoint")
    # A missing RNG-state file does not make a checkpoint damaged (resume warns instead).
    (tmp_path / "checkpoints" / "step_0000010" / "random_states_0.pkl").unlink()
    assert ckpt.checkpoint_problem(tmp_path / "checkpoints" / "step_0000010") is None
    assert ckpt.missing_rng_states(tmp_path / "checkpoints" / "step_0000010", 0)


def test_output_dir_checks(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(ckpt.RecipeError, match="is a file, not a folder"):
        ckpt.check_output_dir(file, fresh_run=True, overwrite=False)
    record("error", "--output-dir is a file")
    with pytest.raises(ckpt.RecipeError, match="cannot create"):
        ckpt.check_output_dir(file / "sub", fresh_run=True, overwrite=False)
    record("error", "--output-dir below a file")
    fake_checkpoint(tmp_path / "out", 3, "old-run")
    with pytest.raises(ckpt.RecipeError, match="already holds checkpoints of an earlier run.*--resume.*--output-dir"):
        ckpt.check_output_dir(tmp_path / "out", fresh_run=True, overwrite=False)
    record("error", "fresh run into another run's --output-dir")
    ckpt.check_output_dir(tmp_path / "out", fresh_run=False, overwrite=False)  # --resume is fine
    stale = ckpt.checkpoint_root(tmp_path / "out") / ".tmp-step_0000004-old-run"
    stale.mkdir()
    logged = []
    ckpt.check_output_dir(tmp_path / "out", fresh_run=True, overwrite=True, log=logged.append)
    assert not stale.exists() and ckpt.list_checkpoints(tmp_path / "out") == []
    record("right", "--overwrite-output-dir over an earlier run and a stale temporary")
    with pytest.raises(ckpt.RecipeError, match="not enough disk space.*are free"):
        ckpt.check_free_space(tmp_path, 1 << 60, "checkpoints")
    record("error", "not enough disk space for the checkpoints")


class _FakeAccelerator:
    is_main_process = True
    num_processes = 1

    def __init__(self, fail_with=None):
        self.fail_with = fail_with

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"w" * 100)
        if self.fail_with:
            raise OSError(self.fail_with, "No space left on device")


def test_checkpoint_write_is_atomic_and_disk_full_is_one_line(tmp_path):
    path = ckpt.write_checkpoint(_FakeAccelerator(), tmp_path, 7, "run", {"seed": 0}, {}, weights_finite=True)
    assert path.name == "step_0000007" and ckpt.checkpoint_problem(path) is None
    assert ckpt.read_marker(path)["run_id"] == "run"
    with pytest.raises(ckpt.RecipeError, match="could not write checkpoint .*step_0000008: No space left on device "
                                               r"\(the disk is full"):
        ckpt.write_checkpoint(_FakeAccelerator(errno.ENOSPC), tmp_path, 8, "run", {}, {}, weights_finite=True)
    # Nothing half-written is left under a checkpoint's name, and the temporary folder is gone.
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000007"]
    record("error", "disk full during a checkpoint save")
    with pytest.raises(ckpt.RecipeError, match="NaN"):
        ckpt.write_checkpoint(_FakeAccelerator(), tmp_path, 9, "run", {}, {}, weights_finite=False)
    record("error", "a checkpoint of NaN weights")


def test_checkpoint_files_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    """Point 6's recipe: a temporary folder, every file (the marker too) fsynced, then one rename
    to step_N, then the parent folder fsynced."""
    events = []
    real_fsync_path, real_replace = ckpt.fsync_path, os.replace
    monkeypatch.setattr(ckpt, "fsync_path", lambda path: events.append(("fsync", Path(path))) or real_fsync_path(path))
    monkeypatch.setattr(ckpt.os, "replace",
                        lambda a, b: events.append(("rename", Path(a), Path(b))) or real_replace(a, b))
    final = ckpt.write_checkpoint(_FakeAccelerator(), tmp_path, 4, "run", {}, {}, weights_finite=True)
    renames = [e for e in events if e[0] == "rename"]
    assert len(renames) == 1 and renames[0][2] == final and renames[0][1].name.startswith(ckpt.TMP_PREFIX)
    tmp, at = renames[0][1], events.index(renames[0])
    synced = {e[1] for e in events[:at] if e[0] == "fsync"}
    assert {tmp / "model.safetensors", tmp / ckpt.MARKER} <= synced
    assert ("fsync", final.parent) in events[at:]
    record("right", "checkpoint written atomically (fsync, rename, marker)")


def test_run_signature_records_what_resume_compares():
    """Every option MUST_MATCH names is in the configuration a checkpoint records (else its change
    would pass unnoticed)."""
    args = finetune_options.resolve_args(finetune_options.build_parser("llama").parse_args(list(TINY)))
    model = SimpleNamespace(config=SimpleNamespace(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100, sliding_window=None))
    signature = finetune_common.run_signature(args, model, "0" * 64, 1)
    assert set(ckpt.MUST_MATCH) <= set(signature), set(ckpt.MUST_MATCH) - set(signature)


def _signature(**changes):
    base = {"model": None, "model_type": "llama", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "intermediate_size": 128, "vocab_size": 100, "sliding_window": None, "lora": False,
            "lora_r": None, "lora_alpha": None, "lora_dropout": None, "dataset": None, "dataset_config": None,
            "dataset_split": "train", "text_column": "text", "data_sha256": "a" * 64, "seq_len": 64,
            "packing": True, "batch_tokens": 128, "grad_accum": 1, "seed": 0, "num_processes": 1, "lr": 1e-3}
    return dict(base, **changes)


RESUME_MISMATCHES = [
    ({"hidden_size": 128}, "hidden size: checkpoint 64, now 128"), ({"num_layers": 3}, "layers: checkpoint 2"),
    ({"num_kv_heads": 1}, "KV heads"), ({"vocab_size": 120}, "vocabulary size"),
    ({"model": "/models/other"}, "--model: checkpoint (none), now /models/other"),
    ({"lora": True, "lora_r": 16, "lora_alpha": 32.0, "lora_dropout": 0.05}, "--lora: checkpoint False, now True"),
    ({"dataset_split": "test"}, "--dataset-split"), ({"text_column": "body"}, "--text-column"),
    ({"data_sha256": "b" * 64}, "the data (tokenized samples): checkpoint aaaaaaaaaaaa"),
    ({"grad_accum": 2}, "--grad-accum"), ({"num_processes": 2}, "the number of processes"),
]


@pytest.mark.parametrize("changes,expected", RESUME_MISMATCHES, ids=[e for _, e in RESUME_MISMATCHES])
def test_resume_refuses_a_different_model_shape_lora_or_data(tmp_path, changes, expected):
    """The in-process side of the resume check (the recipe runs below cover --seed, --batch-tokens
    and --dataset): a different model shape, LoRA setting or data is refused by name, unless
    --allow-resume-mismatch is passed."""
    checkpoint = fake_checkpoint(tmp_path, 5, "run")
    marker = ckpt.read_marker(checkpoint)
    marker["config"] = _signature()
    (checkpoint / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ckpt.RecipeError, match="--allow-resume-mismatch") as refused:
        ckpt.check_resume_config(checkpoint, _signature(**changes), allow_mismatch=False)
    assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    warnings = []
    ckpt.check_resume_config(checkpoint, _signature(**changes, lr=2e-3), allow_mismatch=True, warn=warnings.append)
    assert any("resuming despite differences" in w and expected in w for w in warnings), warnings
    assert any("lr 0.001 -> 0.002" in w for w in warnings), warnings  # allowed changes are noted
    record("error", f"resume with a different {expected.split(':')[0]}")


KILL_POINTS = ("while writing the state files", "after the marker, before the rename", "while rotating")

_KILLED_SAVE = r"""
import os, shutil, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import finetune_checkpoints as ckpt

out, sig, point = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


def die():
    os.kill(os.getpid(), sig)


class Accelerator:
    is_main_process, num_processes, kill = True, 1, False

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"w" * 100)
        with open(Path(path) / "optimizer.bin", "wb") as f:
            f.write(b"o" * 50)
            f.flush()
            if self.kill and point == "while writing the state files":
                die()
            f.write(b"o" * 50)


accelerator = Accelerator()
for step in (1, 2):
    ckpt.write_checkpoint(accelerator, out, step, "run", {}, {}, weights_finite=True)
accelerator.kill = True
if point == "after the marker, before the rename":
    ckpt.replace_folder = lambda tmp, final: die()
if point == "while rotating":
    ckpt.write_checkpoint(accelerator, out, 3, "run", {}, {}, weights_finite=True)
    shutil.rmtree = lambda *args, **kwargs: die()
    ckpt.rotate_checkpoints(out, "run", keep=1)
else:
    ckpt.write_checkpoint(accelerator, out, 3, "run", {}, {}, weights_finite=True)
print("not killed")
"""


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_save_killed_by_a_signal_loses_nothing(tmp_path, sig, point):
    """A real kill (SIGKILL, or SIGTERM's default action) at three moments of a save: the complete
    checkpoints stay complete, resume takes the newest complete one without a traceback, and the
    next run cleans up what the killed one left."""
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(RECIPES), str(tmp_path), str(int(sig)), point],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -sig, (done.returncode, done.stdout, done.stderr)
    newest = "step_0000003" if point == "while rotating" else "step_0000002"
    complete = [p.name for p in ckpt.list_checkpoints(tmp_path) if ckpt.checkpoint_problem(p) is None]
    assert complete[-1] == newest, complete
    assert ckpt.find_resume_checkpoint("latest", tmp_path, warn=lambda m: None).name == newest
    left = ckpt.stale_temporaries(tmp_path)
    assert left, "the kill left no temporary folder: it did not happen mid-save"
    logged = []
    ckpt.check_output_dir(tmp_path, fresh_run=False, overwrite=False, log=logged.append)
    assert ckpt.stale_temporaries(tmp_path) == [] and len(logged) == len(left)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)][-1] == newest
    record("right", f"{signal.Signals(sig).name} {point}", isolated=True)


def test_main_reports_disk_full_in_one_line(monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.json")

    monkeypatch.setattr(finetune_common, "train", full)
    with pytest.raises(SystemExit) as stopped:
        finetune_common.main("llama", [])
    assert "runs/x/metrics.json: No space left on device (the disk is full" in str(stopped.value)
    record("error", "disk full while writing metrics")


def test_data_file_errors_are_one_line(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(finetune_data.DataError, match=r"latin1.txt: not UTF-8 text \(byte 14, line 2"):
        finetune_data.load_texts(str(latin1))
    record("error", "a non-UTF-8 data file")
    lines = tmp_path / "records.jsonl"
    lines.write_text('{"text": "fine"}\n["not", "an", "object"]\n')
    with pytest.raises(finetune_data.DataError, match=r"records.jsonl:2: expected a JSON object.*got list"):
        finetune_data.load_texts(str(lines))
    record("error", "a JSON line that is not an object")
    array = tmp_path / "array.json"
    array.write_text('[\n{"text": "a"},\n"b"\n]')
    with pytest.raises(finetune_data.DataError, match=r"array.json: record 1: expected a JSON object.*got str"):
        finetune_data.load_texts(str(array))
    record("error", "a JSON array record that is not an object")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n\n{"text": \n')
    with pytest.raises(finetune_data.DataError, match=r"broken.jsonl:3: not valid JSON lines"):
        finetune_data.load_texts(str(broken))
    record("error", "a JSON lines file with a broken line")


# --------------------------------------------------------------------------- recipe runs (subprocesses)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def env(workdir):
    return recipe_environment(workdir / "cache")


@pytest.fixture(scope="module")
def parquet_corpus(workdir):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = workdir / "small.parquet"
    pd.DataFrame({"text": SMALL_CORPUS.split("\n\n")}).to_parquet(path)
    return path


@pytest.fixture(scope="module")
def mounts(workdir):
    """A read-only folder and a 6 MiB file system (tmpfs mounts), or None where mounting is not allowed."""
    readonly, tiny = workdir / "readonly", workdir / "tiny"
    readonly.mkdir()
    tiny.mkdir()
    mounted = []
    for target, options in ((readonly, "ro,size=1m"), (tiny, "size=6m")):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            mounted.append(target)
    try:
        yield (readonly, tiny) if len(mounted) == 2 else None
    finally:
        for target in mounted:
            subprocess.run(["umount", str(target)], capture_output=True)


DAMAGED = ("truncated", "no_marker", "nan_weights", "stale_tmp", "no_rng", "all_damaged", "explicit")
MISMATCHED = ("seed", "batch_tokens", "dataset", "override", "fresh", "overwrite")


@pytest.fixture(scope="module")
def outcomes(workdir, env, parquet_corpus, mounts):
    """One three-step run with a checkpoint after each step (trained from a local parquet file, through
    `datasets`, offline), copies of its folder damaged in every way, and recipe runs over them; plus runs
    that must stop on NaN, bad data and bad folders.  All in one subprocess."""
    base = workdir / "base"
    step3 = Path("checkpoints") / "step_0000003"
    marker = ckpt.MARKER
    dirs = {name: workdir / name for name in DAMAGED + MISMATCHED}
    scenarios = {"base": {"argv": [*FAST, "--dataset", str(parquet_corpus), "--max-steps", "3", "--save-every", "1",
                                   "--keep-checkpoints", "0", "--no-save-model", "--output-dir", str(base)]}}
    for name, folder in dirs.items():
        scenarios[f"copy {name}"] = {"call": "copy_tree", "args": [str(base), str(folder)]}
    # A save killed mid-write by an older recipe version, or a disk error:
    scenarios["damage 1"] = {"call": "truncate_file", "args": [str(dirs["truncated"] / step3 / "model.safetensors"), 100]}
    # Half-written: the marker is written last.
    scenarios["damage 2"] = {"call": "remove_file", "args": [str(dirs["no_marker"] / step3 / marker)]}
    scenarios["damage 3"] = {"call": "poison_weights", "args": [str(dirs["nan_weights"] / step3), marker]}
    # SIGKILL during a save leaves a temporary folder.
    scenarios["damage 4"] = {"call": "write_file", "args": [
        str(dirs["stale_tmp"] / "checkpoints" / ".tmp-step_0000004-x" / "model.safetensors"), "half"]}
    scenarios["damage 5"] = {"call": "remove_file", "args": [str(dirs["no_rng"] / step3 / "random_states_0.pkl")]}
    for step in (1, 2, 3):
        scenarios[f"damage 6.{step}"] = {"call": "remove_file", "args": [
            str(dirs["all_damaged"] / "checkpoints" / f"step_{step:07d}" / marker)]}
    scenarios["damage 7"] = {"call": "truncate_file", "args": [str(dirs["explicit"] / step3 / "optimizer.bin"), 10]}
    other_text = workdir / "other.txt"
    other_text.write_text(SMALL_CORPUS.replace("flash", "paged"))

    resume = [*FAST, "--dataset", str(parquet_corpus), "--max-steps", "3", "--no-save-model", "--save-every", "0"]
    for name in DAMAGED[:-1]:
        scenarios[name] = {"argv": [*resume, "--output-dir", str(dirs[name]), "--resume"]}
    scenarios["explicit"] = {"argv": [*resume, "--output-dir", str(dirs["explicit"]),
                                      "--resume", str(dirs["explicit"] / step3)]}
    scenarios["seed"] = {"argv": [*resume, "--output-dir", str(dirs["seed"]), "--resume", "--seed", "1"]}
    scenarios["batch_tokens"] = {"argv": [*resume, "--output-dir", str(dirs["batch_tokens"]), "--resume",
                                          "--batch-tokens", "192"]}
    scenarios["dataset"] = {"argv": [*FAST, "--dataset", str(other_text), "--max-steps", "3", "--no-save-model",
                                     "--output-dir", str(dirs["dataset"]), "--resume"]}
    scenarios["override"] = {"argv": [*resume, "--output-dir", str(dirs["override"]), "--resume", "--seed", "1",
                                      "--allow-resume-mismatch"]}
    scenarios["fresh"] = {"argv": [*resume, "--output-dir", str(dirs["fresh"])]}
    scenarios["overwrite"] = {"argv": [*resume, "--output-dir", str(dirs["overwrite"]), "--overwrite-output-dir",
                                       "--max-steps", "1"]}
    fresh = [*FAST, "--dataset", str(parquet_corpus), "--max-steps", "3"]
    scenarios["nan_stop"] = {"argv": [*fresh, "--save-every", "1", "--output-dir", str(workdir / "nan_stop")],
                             "nan_at_forward": 3}
    scenarios["nan_skip"] = {"argv": [*fresh, "--save-every", "0", "--output-dir", str(workdir / "nan_skip"),
                                      "--skip-nonfinite-steps"], "nan_at_forward": 3}
    scenarios["huge_lr"] = {"argv": [*fresh, "--save-every", "1", "--output-dir", str(workdir / "huge_lr"),
                                     "--lr", "1e30", "--max-steps", "4"]}
    a_file = workdir / "a_file"
    a_file.write_text("not a folder")
    scenarios["output_is_file"] = {"argv": [*fresh, "--output-dir", str(a_file)]}
    latin1 = workdir / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n\nna\u00efve".encode("latin-1"))
    scenarios["not_utf8"] = {"argv": [*fresh, "--dataset", str(latin1), "--output-dir", str(workdir / "u")]}
    records = workdir / "records.jsonl"
    records.write_text('{"text": "one"}\n{"text": "two"}\n"three"\n')
    scenarios["json_not_object"] = {"argv": [*fresh, "--dataset", str(records), "--output-dir", str(workdir / "j")]}
    scenarios["missing_model"] = {"argv": [*fresh, "--model", "no-such-owner/no-such-model",
                                           "--output-dir", str(workdir / "m")]}
    if mounts is not None:
        readonly, tiny = mounts
        scenarios["readonly"] = {"argv": [*fresh, "--output-dir", str(readonly / "run")]}
        scenarios["disk_full"] = {"argv": [*fresh, "--output-dir", str(tiny / "run")]}
    results = run_in_one_process(scenarios, env, workdir)
    assert results["base"]["code"] == 0, results["base"]["output"][-4000:]
    assert [p.name for p in ckpt.list_checkpoints(base)] == ["step_0000001", "step_0000002", "step_0000003"]
    return {"dirs": dirs, "results": results, "workdir": workdir}


def _outcome(outcomes, name):
    result = outcomes["results"][name]
    assert result["code"] != "crash", result["message"]
    assert "Traceback" not in result["output"] + result["message"], result["output"][-4000:]
    return result


def _failed_in_one_line(outcomes, name, *expected):
    result = _outcome(outcomes, name)
    assert result["code"] not in (0, None), result["output"][-3000:]
    assert result["message"] and "\n" not in result["message"].strip(), result["message"]
    for text in expected:
        assert text in result["message"], result["message"]
    record("error", f"recipe run: {name}", isolated=True)
    return result


@pytest.mark.parametrize("name,reason", [
    ("truncated", "model.safetensors has 100 bytes"),
    ("no_marker", "no completeness marker"),
    ("nan_weights", "hold NaN/inf"),
])
def test_resume_skips_a_damaged_checkpoint(outcomes, name, reason):
    result = _outcome(outcomes, name)
    output = result["output"]
    assert result["code"] == 0, output[-3000:]
    assert "warning: skipping damaged checkpoint" in output and "step_0000003" in output and reason in output, output
    assert f"resumed from {outcomes['dirs'][name] / 'checkpoints' / 'step_0000002'} (run " in output, output
    assert "): step 2, epoch" in output
    assert [h["step"] for h in read_metrics(outcomes["dirs"][name])["steps"]] == [1, 2, 3]
    record("right", f"recipe run: resume past a damaged checkpoint ({name})", isolated=True)


def test_resume_ignores_and_cleans_a_half_written_save(outcomes):
    result = _outcome(outcomes, "stale_tmp")
    assert result["code"] == 0 and "step_0000003 (run " in result["output"], result["output"][-3000:]
    assert "): step 3, epoch" in result["output"]
    assert "removing" in result["output"]
    assert not (outcomes["dirs"]["stale_tmp"] / "checkpoints" / ".tmp-step_0000004-x").exists()
    record("right", "recipe run: resume next to a half-written save", isolated=True)


def test_resume_without_rng_state_warns_that_exactness_is_lost(outcomes):
    result = _outcome(outcomes, "no_rng")
    assert result["code"] == 0, result["output"][-3000:]
    assert "no RNG state" in result["output"] and "not an exact continuation" in result["output"]
    record("right", "recipe run: resume without the RNG state (warns)", isolated=True)


def test_resume_with_every_checkpoint_damaged_or_named_damaged_fails_clearly(outcomes):
    _failed_in_one_line(outcomes, "all_damaged", "no usable checkpoint")
    _failed_in_one_line(outcomes, "explicit", "cannot resume from it", "optimizer.bin")


@pytest.mark.parametrize("name,option", [("seed", "--seed"), ("batch_tokens", "--batch-tokens"),
                                         ("dataset", "--dataset")])
def test_resume_refuses_a_different_run_configuration(outcomes, name, option):
    _failed_in_one_line(outcomes, name, option, "--allow-resume-mismatch")
    assert "resumed from" not in outcomes["results"][name]["output"]  # refused before loading anything


def test_resume_mismatch_override(outcomes):
    result = _outcome(outcomes, "override")
    assert result["code"] == 0 and "resuming despite differences" in result["output"], result["output"][-3000:]
    record("right", "recipe run: --allow-resume-mismatch", isolated=True)


def test_fresh_run_refuses_a_folder_with_another_runs_checkpoints(outcomes):
    _failed_in_one_line(outcomes, "fresh", "already holds checkpoints", "--resume", "--output-dir")
    assert [p.name for p in ckpt.list_checkpoints(outcomes["dirs"]["fresh"])][-1] == "step_0000003"
    result = _outcome(outcomes, "overwrite")
    assert result["code"] == 0 and "deleting the earlier run's checkpoints" in result["output"]
    record("right", "recipe run: --overwrite-output-dir", isolated=True)


def test_nonfinite_loss_stops_without_a_final_model(outcomes):
    _failed_in_one_line(outcomes, "nan_stop", "non-finite loss at step 3", "no final model")
    folder = outcomes["workdir"] / "nan_stop"
    assert not (folder / "final_model").exists()
    metrics = read_metrics(folder)
    assert "non-finite loss" in metrics["summary"]["stopped"] and len(metrics["steps"]) == 2
    # The checkpoints written before the bad step are intact.
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step_0000001", "step_0000002"]
    assert all(ckpt.checkpoint_problem(p) is None for p in ckpt.list_checkpoints(folder))


def test_skip_nonfinite_steps_drops_the_step_and_says_so(outcomes):
    result = _outcome(outcomes, "nan_skip")
    assert result["code"] == 0, result["output"][-3000:]
    assert "step dropped (--skip-nonfinite-steps" in result["output"]
    metrics = read_metrics(outcomes["workdir"] / "nan_skip")
    assert metrics["summary"]["skipped_steps"] == 1 and len(metrics["steps"]) == 3
    assert all(math.isfinite(h["loss"]) for h in metrics["steps"])
    from safetensors.torch import load_file

    weights = load_file(outcomes["workdir"] / "nan_skip" / "final_model" / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in weights.values())
    record("right", "recipe run: --skip-nonfinite-steps over a NaN loss", isolated=True)


def test_huge_learning_rate_stops_before_poisoning_the_model(outcomes):
    _failed_in_one_line(outcomes, "huge_lr", "non-finite")
    folder = outcomes["workdir"] / "huge_lr"
    assert not (folder / "final_model").exists()
    from safetensors.torch import load_file

    for checkpoint in ckpt.list_checkpoints(folder):
        weights = load_file(checkpoint / "model.safetensors")
        assert all(bool(t.isfinite().all()) for t in weights.values()), checkpoint


def test_unusable_inputs_and_outputs_are_one_line(outcomes):
    _failed_in_one_line(outcomes, "output_is_file", "is a file, not a folder")
    _failed_in_one_line(outcomes, "not_utf8", "data error:", "not UTF-8")
    _failed_in_one_line(outcomes, "json_not_object", "data error:", "records.jsonl:3", "expected a JSON object")
    _failed_in_one_line(outcomes, "missing_model", "--model no-such-owner/no-such-model: could not load it")


def test_read_only_and_full_output_dirs_stop_before_training(outcomes):
    """Real unwritable folders: a read-only tmpfs, and a 6 MiB one that cannot hold a checkpoint."""
    if "readonly" not in outcomes["results"]:
        pytest.skip("cannot mount a tmpfs here")
    for name, expected in (("readonly", "Read-only file system"), ("disk_full", "not enough disk space")):
        result = _failed_in_one_line(outcomes, name, expected)
        assert "step 1/" not in result["output"]  # found before any step trained
