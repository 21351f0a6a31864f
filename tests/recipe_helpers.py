"""Helpers shared by the recipe test files (tests/test_recipes.py, tests/test_recipes_reliability.py).

Recipe runs go through subprocesses, so a crash in one cannot take the test
session down.  ``run_in_one_process`` runs many short recipe invocations in one
subprocess (one interpreter start-up for all of them): each is
``finetune_common.main(model_type, argv)`` with its output and exit status
captured.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "recipes"
# Small on purpose: the interpreter runs every kernel program in Python.
TINY_MODEL = ["--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads", "4",
              "--num-kv-heads", "2"]
TINY = ["--seq-len", "64", "--batch-tokens", "128", "--log-every", "1", *TINY_MODEL]
RUN_TIMEOUT_S = 420
ON_CPU = not torch.cuda.is_available()
ACCELERATE_WARNING = "were not passed to `accelerate launch`"

# Seven short paragraphs (blank-line separated) of different lengths: with
# --seq-len 64 / --batch-tokens 128 an epoch is a few micro-batches.
SMALL_CORPUS = "\n\n".join(
    " ".join(f"Paragraph {i} sentence {j} tells the model something about flash attention." for j in range(n))
    for i, n in enumerate([1, 3, 2, 5, 1, 4, 2])
)


def recipe_environment(cache_dir: Path) -> dict:
    """Environment for recipe subprocesses: a private corpus/tokenizer cache, the interpreter on, no network."""
    env = dict(os.environ)
    env["FA_AMD_RECIPES_CACHE"] = str(cache_dir)
    if ON_CPU:
        env["TRITON_INTERPRET"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_recipe(command, env, expect_ok=True, cwd=REPO_ROOT):
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    output = result.stdout + result.stderr
    if expect_ok and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {result.returncode}:\n{output[-6000:]}")
    return result.returncode, output


def read_metrics(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "metrics.json").read_text())


_DRIVER = r'''
import contextlib, io, json, sys, time, traceback
sys.path.insert(0, sys.argv[1])
import finetune_common as common

scenarios = json.loads(open(sys.argv[2]).read())
real_build_model = common.build_model
results = []
for scenario in scenarios:
    if "call" in scenario:  # a helper of tests/recipe_helpers.py preparing folders between runs
        import tests.recipe_helpers as helpers
        getattr(helpers, scenario["call"])(*scenario.get("args", []))
        results.append({"code": 0, "message": "", "output": "", "cpu_s": 0.0})
        continue
    nan_at = scenario.get("nan_at_forward")

    def build_model(args, tokenizer, _nan_at=nan_at):
        model = real_build_model(args, tokenizer)
        if _nan_at:
            calls = [0]

            def poison(module, inputs, output):  # the loss of forward call number _nan_at becomes NaN
                calls[0] += 1
                if calls[0] == _nan_at:
                    output["loss"] = output["loss"] * float("nan")
                return output

            model.register_forward_hook(poison)
        return model

    common.build_model = build_model
    captured = io.StringIO()
    code, message = 0, ""
    started = time.process_time()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        try:
            common.main(scenario.get("model_type", "llama"), scenario["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            message = "" if isinstance(exc.code, int) or exc.code is None else str(exc.code)
        except BaseException:
            code, message = "crash", traceback.format_exc()
    results.append({"code": code, "message": message, "output": captured.getvalue(),
                    "cpu_s": time.process_time() - started})
open(sys.argv[3], "w").write(json.dumps(results))
'''


def run_in_one_process(scenarios: dict, env: dict, workdir: Path) -> dict:
    """{name: {"code", "message", "output", "cpu_s"}} for {name: {"argv": [...], "nan_at_forward": k?}}, run in
    order in one subprocess.  A scenario {"call": "helper", "args": [...]} runs that function of this module
    instead (to prepare folders between runs)."""
    names = list(scenarios)
    spec, out = Path(workdir) / "scenarios.json", Path(workdir) / "results.json"
    spec.write_text(json.dumps([scenarios[n] for n in names]))
    result = subprocess.run([sys.executable, "-c", _DRIVER, str(RECIPES), str(spec), str(out)], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if result.returncode != 0 or not out.exists():
        pytest.fail(f"scenario driver exited {result.returncode}:\n{(result.stdout + result.stderr)[-6000:]}")
    return dict(zip(names, json.loads(out.read_text())))


# --------------------------------------------------------------------------- damaging checkpoints (for the driver)


def copy_tree(source: str, target: str) -> None:
    import shutil

    shutil.copytree(source, target)


def truncate_file(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def remove_file(path: str) -> None:
    Path(path).unlink()


def write_file(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def poison_weights(checkpoint: str, marker_name: str) -> None:
    """Overwrite one tensor of a checkpoint's model.safetensors with NaN, keeping its completeness marker valid."""
    from safetensors.torch import load_file, save_file

    folder = Path(checkpoint)
    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone().fill_(float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    marker = json.loads((folder / marker_name).read_text())
    marker["files"]["model.safetensors"] = (folder / "model.safetensors").stat().st_size
    (folder / marker_name).write_text(json.dumps(marker))
