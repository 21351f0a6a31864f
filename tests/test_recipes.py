"""The fine-tuning recipes (recipes/) on CPU: end-to-end smoke runs, resume, data errors.

The end-to-end runs are subprocesses, as a user runs them (one through
``accelerate launch``); without a GPU they train the tiny CPU model through
the Triton interpreter in fp32, a few steps each.  Nothing here needs the
network: the corpus and tokenizer are built from files Python ships.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "recipes"
sys.path.insert(0, str(RECIPES))

import finetune_common  # noqa: E402
import finetune_data  # noqa: E402

# Small on purpose: the interpreter runs every kernel program in Python.
# On CPU these are the recipe's own defaults; spelled out so a GPU machine runs the same small model.
TINY_MODEL = ["--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads", "4",
              "--num-kv-heads", "2"]
TINY = ["--seq-len", "64", "--batch-tokens", "128", "--log-every", "1", *TINY_MODEL]
RUN_TIMEOUT_S = 300
ON_CPU = not torch.cuda.is_available()

# Seven short paragraphs (blank-line separated) of different lengths: with
# --seq-len 64 / --batch-tokens 128 an epoch is a few micro-batches, so a
# 4-step run with --grad-accum 2 crosses an epoch boundary.
SMALL_CORPUS = "\n\n".join(
    " ".join(f"Paragraph {i} sentence {j} tells the model something about flash attention." for j in range(n))
    for i, n in enumerate([1, 3, 2, 5, 1, 4, 2])
)


@pytest.fixture(scope="session")
def recipe_env(tmp_path_factory):
    """Environment for recipe subprocesses: a private corpus/tokenizer cache, the interpreter on."""
    env = dict(os.environ)
    env["FA_AMD_RECIPES_CACHE"] = str(tmp_path_factory.mktemp("recipes_cache"))
    if ON_CPU:
        env["TRITON_INTERPRET"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FA_AMD_RECIPES_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run_recipe(command, env, expect_ok=True):
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    output = result.stdout + result.stderr
    if expect_ok and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {result.returncode}:\n{output[-6000:]}")
    return result.returncode, output


def read_metrics(output_dir: Path) -> dict:
    return json.loads((output_dir / "metrics.json").read_text())


def assert_trained(metrics: dict, steps: int):
    assert [h["step"] for h in metrics["steps"]] == list(range(1, steps + 1))
    for record in metrics["steps"]:
        assert math.isfinite(record["loss"]) and record["loss"] > 0
        assert record["tokens"] > 0 and record["tokens_per_s"] > 0 and record["peak_mem_gb"] > 0
    assert metrics["summary"]["steps"] == steps


# --------------------------------------------------------------------------- end to end


def test_default_llama_recipe_through_accelerate_launch(tmp_path, recipe_env):
    """The default recipe (fa_amd + fused rotary, packed, dropout) for 2 steps via accelerate launch."""
    output_dir = tmp_path / "llama"
    _, output = run_recipe(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(RECIPES / "configs" / "cpu.yaml"),
         str(RECIPES / "finetune_llama.py"), "--max-steps", "2", "--output-dir", str(output_dir), *TINY],
        recipe_env,
    )
    metrics = read_metrics(output_dir)
    assert_trained(metrics, 2)
    config = metrics["config"]
    assert config["attn"] == "fa_amd" and config["fused_rope"] and config["packing"]
    assert config["dropout"] > 0 and config["model_type"] == "llama"
    assert config["num_kv_heads"] < config["num_heads"]  # GQA
    if ON_CPU:
        assert config["triton_interpret"] and config["dtype"] == "fp32"
        assert "CPU smoke run" in output
    assert "split into 64-token chunks" in output
    assert (output_dir / "loss_curve.png").stat().st_size > 0
    assert (output_dir / "final_model" / "model.safetensors").exists()
    assert (output_dir / "final_model" / "tokenizer.json").exists()

    # The saved model loads back through --model (from_pretrained + its tokenizer) for a LoRA run.
    lora_dir = tmp_path / "lora"
    run_recipe(
        [sys.executable, str(RECIPES / "finetune_llama.py"), "--model", str(output_dir / "final_model"), "--lora",
         "--attn", "sdpa", "--gradient-checkpointing", "--max-steps", "1", "--save-every", "0",
         "--output-dir", str(lora_dir), *TINY],
        recipe_env,
    )
    lora_config = read_metrics(lora_dir)["config"]
    assert lora_config["lora"] and 0 < lora_config["parameters_trained"] < lora_config["parameters_total"] / 10
    assert lora_config["dropout"] == config["dropout"]  # kept from the checkpoint's config
    assert (lora_dir / "final_model" / "adapter_model.safetensors").exists()


def test_mistral_recipe_with_sliding_window_padded(tmp_path, recipe_env):
    """The Mistral recipe, padded batches this time (fa_amd's unpad -> varlen -> pad path)."""
    output_dir = tmp_path / "mistral"
    run_recipe(
        [sys.executable, str(RECIPES / "finetune_mistral.py"), "--max-steps", "2", "--output-dir", str(output_dir),
         "--save-every", "0", "--no-packing", *TINY],
        recipe_env,
    )
    metrics = read_metrics(output_dir)
    assert_trained(metrics, 2)
    config = metrics["config"]
    assert config["model_type"] == "mistral" and config["attn"] == "fa_amd" and config["fused_rope"]
    assert not config["packing"]
    saved = json.loads((output_dir / "final_model" / "config.json").read_text())
    assert saved["model_type"] == "mistral"
    assert saved["sliding_window"] == 32  # seq-len // 2, so the window really cuts attention


def test_resume_restores_step_optimizer_and_data_position(tmp_path, recipe_env):
    """Stop at step 2, resume, and land exactly where the uninterrupted run is at step 4.

    sdpa keeps this fast; the state machinery does not depend on the attention.
    Dropout stays on so the RNG restore matters too.
    """
    corpus = tmp_path / "small.txt"
    corpus.write_text(SMALL_CORPUS)
    common = [sys.executable, str(RECIPES / "finetune_llama.py"), "--attn", "sdpa", "--dataset", str(corpus),
              "--max-steps", "4", "--grad-accum", "2", "--save-every", "2", "--keep-checkpoints", "0",
              "--no-save-model", *TINY]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe([*common, "--output-dir", str(straight)], recipe_env)
    straight_metrics = read_metrics(straight)
    assert_trained(straight_metrics, 4)
    # The small corpus must make the run cross an epoch boundary after the resume point.
    assert straight_metrics["steps"][-1]["epoch"] >= 1

    # The resumed run starts from a copy holding only the step-2 checkpoint: --resume (latest) picks it up.
    shutil.copytree(straight / "checkpoints" / "step_0000002", resumed / "checkpoints" / "step_0000002")
    _, output = run_recipe([*common, "--output-dir", str(resumed), "--resume"], recipe_env)
    assert "resumed from" in output and "step 2," in output
    resumed_metrics = read_metrics(resumed)
    assert [h["step"] for h in resumed_metrics["steps"]] == [1, 2, 3, 4]

    for before, after in zip(straight_metrics["steps"], resumed_metrics["steps"]):
        # Same batches (data-loader position, epoch reshuffle) ...
        assert after["data_checksum"] == before["data_checksum"], before["step"]
        assert after["tokens"] == before["tokens"] and after["epoch"] == before["epoch"]
        # ... and the same losses and schedule (model, optimizer, scheduler, dropout RNG).
        # (exact on CPU; GPU backward kernels may use atomics, so bf16 runs differ in the last bits)
        assert after["loss"] == pytest.approx(before["loss"], abs=1e-5 if ON_CPU else 5e-3), before["step"]
        assert after["lr"] == pytest.approx(before["lr"], rel=1e-9)

    straight_optimizer = torch.load(straight / "checkpoints" / "step_0000004" / "optimizer.bin", weights_only=False)
    resumed_optimizer = torch.load(resumed / "checkpoints" / "step_0000004" / "optimizer.bin", weights_only=False)
    assert straight_optimizer["state"].keys() == resumed_optimizer["state"].keys()
    for key, state in straight_optimizer["state"].items():
        assert float(resumed_optimizer["state"][key]["step"]) == float(state["step"]) == 4.0
        if ON_CPU:
            torch.testing.assert_close(resumed_optimizer["state"][key]["exp_avg"], state["exp_avg"],
                                       atol=1e-6, rtol=1e-4)
            torch.testing.assert_close(resumed_optimizer["state"][key]["exp_avg_sq"], state["exp_avg_sq"],
                                       atol=1e-9, rtol=1e-4)


def test_recipe_reports_missing_text_column(tmp_path, data_cache):
    """The recipe stops with a one-line data error (no traceback) before building any model."""
    records = tmp_path / "records.jsonl"
    records.write_text('{"body": "some text"}\n{"body": "more text"}\n')
    argv = ["--dataset", str(records), "--attn", "sdpa", "--output-dir", str(tmp_path / "out"), *TINY]
    with pytest.raises(SystemExit) as stopped:
        finetune_common.main("llama", argv)
    message = str(stopped.value)
    assert message.startswith("data error:")
    assert "'text'" in message and "body" in message and "--text-column" in message


def test_bench_compare_loss_fa_amd_matches_sdpa(tmp_path, recipe_env):
    """bench_train's loss comparison: with dropout 0 and fp32, fa_amd trains like sdpa."""
    output_dir = tmp_path / "bench"
    _, output = run_recipe(
        [sys.executable, str(RECIPES / "bench_train.py"), "--compare-loss", "--attn", "fa_amd", "sdpa",
         "--modes", "packed", "--steps", "2", "--seq-lens", "64", "--batch-tokens", "128",
         "--output-dir", str(output_dir), *TINY_MODEL],
        recipe_env,
    )
    report = json.loads((output_dir / "compare_loss.json").read_text())
    assert report["status"] == {"fa_amd/packed": "ok", "sdpa/packed": "ok"}, output[-3000:]
    gap = report["gaps"]["fa_amd/packed"]["max_abs_gap"]
    tolerance = 1e-3 if ON_CPU else 5e-2
    assert gap < tolerance, report["gaps"]
    assert (output_dir / "compare_loss.png").exists()


def test_bench_throughput_table(tmp_path, recipe_env):
    output_dir = tmp_path / "bench"
    _, output = run_recipe(
        [sys.executable, str(RECIPES / "bench_train.py"), "--attn", "eager", "--modes", "padded", "packed",
         "--steps", "1", "--warmup-steps", "1", "--seq-lens", "64", "--batch-tokens", "128", "--rounds", "3",
         "--output-dir", str(output_dir), *TINY_MODEL],
        recipe_env,
    )
    report = json.loads((output_dir / "bench_train.json").read_text())
    cells = {(c["attn"], c["mode"]): c for c in report["results"]}
    assert set(cells) == {("eager", "padded"), ("eager", "packed")}
    assert all(c["status"] == "ok" and c["tokens_per_s"] > 0 for c in cells.values()), report["results"]
    assert cells[("eager", "packed")]["padding_fraction"] == 0
    # --rounds 3: each cell is the median of three measurements, all of them kept
    rounds = cells[("eager", "padded")]["tokens_per_s_rounds"]
    assert len(rounds) == 3 and cells[("eager", "padded")]["tokens_per_s"] == sorted(rounds)[1]
    assert "tokens/s" in output


# --------------------------------------------------------------------------- data (in process)


def test_builtin_corpus_is_real_english(data_cache):
    texts = finetune_data.load_texts(None)
    total = sum(len(t) for t in texts)
    assert len(texts) > 500 and total > 500_000
    joined = " ".join(texts[:50]).lower()
    assert all(word in joined for word in (" the ", " and ", " is "))
    # The second call reads the cache and gives the same corpus.
    assert finetune_data.load_texts(None) == texts


def test_tokenizer_training_is_deterministic():
    texts = [f"The quick brown fox {i} jumps over the lazy dog. " * 3 for i in range(50)]
    first = finetune_data.train_bpe_tokenizer(texts, 300).to_str()
    assert finetune_data.train_bpe_tokenizer(texts, 300).to_str() == first


def test_bench_rounds_must_be_positive(capsys):
    import bench_train

    with pytest.raises(SystemExit):
        bench_train.build_parser().parse_args(["--rounds", "0"])
    assert "--rounds: must be >= 1, got 0" in capsys.readouterr().err


def test_empty_dataset_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    with pytest.raises(finetune_data.DataError, match="empty"):
        finetune_data.load_texts(str(tmp_path / "empty.txt"))
    (tmp_path / "blank.jsonl").write_text('{"text": "   "}\n{"text": null}\n')
    with pytest.raises(finetune_data.DataError, match="empty"):
        finetune_data.load_texts(str(tmp_path / "blank.jsonl"))


def test_missing_text_column_names_the_columns(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([{"content": "a"}, {"content": "b"}]))
    with pytest.raises(finetune_data.DataError, match=r"no text column 'text'.*content.*--text-column"):
        finetune_data.load_texts(str(tmp_path / "data.json"))
    assert finetune_data.load_texts(str(tmp_path / "data.json"), text_column="content") == ["a", "b"]


def test_missing_local_file_and_missing_datasets_package(tmp_path):
    with pytest.raises(finetune_data.DataError, match="no such file"):
        finetune_data.load_texts(str(tmp_path / "nope.jsonl"))
    parquet = tmp_path / "data.parquet"
    parquet.write_bytes(b"PAR1")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(finetune_data.DataError, match="needs the `datasets` package"):
            finetune_data.load_texts(str(parquet))


def test_long_documents_are_split_into_chunks(data_cache):
    texts = ["word " * 50, "short"]
    tokenizer = finetune_data.builtin_tokenizer(texts * 20, 300)
    samples, stats = finetune_data.tokenize_and_chunk(texts, tokenizer, seq_len=16)
    assert all(2 <= len(s) <= 16 for s in samples)
    assert stats["documents"] == 2 and stats["documents_split"] == 1
    full = tokenizer(texts[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    chunks = [s for s in samples[: math.ceil(len(full) / 16)]]
    assert sum(chunks, []) == full[: sum(len(c) for c in chunks)]


def test_token_budget_batches():
    lengths = [5, 60, 33, 64, 2, 17, 40, 64, 9, 25, 50, 3]
    for packed in (True, False):
        sampler = finetune_data.TokenBudgetBatchSampler(lengths, batch_tokens=128, packed=packed, seed=3)
        epoch0 = list(sampler)
        assert sorted(i for batch in epoch0 for i in batch) == list(range(len(lengths)))
        for batch in epoch0:
            cost = sum(lengths[i] for i in batch) if packed else len(batch) * max(lengths[i] for i in batch)
            assert cost <= 128
        assert list(sampler) == epoch0 and len(sampler) == len(epoch0)
        sampler.set_epoch(1)
        assert list(sampler) != epoch0
    with pytest.raises(finetune_data.DataError, match="batch-tokens"):
        finetune_data.TokenBudgetBatchSampler(lengths, batch_tokens=32, packed=True, seed=0)


def test_packing_and_padding_collators():
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    packed = finetune_data.make_collator(True, pad_token_id=1)(features)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 5] and packed["max_length_q"] == 3
    assert finetune_data.real_token_count(packed) == 5
    padded = finetune_data.make_collator(False, pad_token_id=1)(features)
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 9, 1]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert padded["labels"].tolist() == [[5, 6, 7], [8, 9, -100]]
    assert finetune_data.real_token_count(padded) == 5


def test_resume_latest_checkpoint_lookup(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint"):
        finetune_common.find_resume_checkpoint("latest", tmp_path)
    for step in (2, 10, 4):
        (tmp_path / "checkpoints" / f"step_{step:07d}").mkdir(parents=True)
    assert finetune_common.find_resume_checkpoint("latest", tmp_path).name == "step_0000010"
    assert finetune_common.find_resume_checkpoint(str(tmp_path), tmp_path / "other").name == "step_0000010"
