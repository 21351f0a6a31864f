#!/usr/bin/env python
"""TRL's SFTTrainer with padding-free batches on fa_amd attention.

    python recipes/sft_trl.py                      # no download: random-init Llama, built-in corpus
    python recipes/sft_trl.py --model /models/Llama-3.2-1B --dataset train.jsonl --lr 2e-5
    accelerate launch recipes/sft_trl.py           # the same through Accelerate (several GPUs: data parallel)

``SFTConfig(padding_free=True)``: each batch's samples are concatenated into
one row with ``position_ids`` restarting per sample and ``cu_seq_lens_q/k``
kwargs, which fa_amd's attention runs through its variable-length kernels.
No padding is computed and no token attends across a sample boundary.

Without ``--model`` it trains the recipes' random-init model (fa_amd attention
and fused rotary) with the built-in tokenizer on the built-in corpus, split
into ``--seq-len`` token samples, so nothing is downloaded:

* on a GPU: 8 layers, hidden 2048, 16/4 heads, bf16, 8 x 2048-token samples
  per step, 100 steps;
* without a GPU: the tiny CPU model through the Triton interpreter in fp32,
  20 steps of 8 x 64 tokens, where the loss falls from 9.0 to about 7.

Writes ``metrics.json`` (per-step loss, tokens/s) and ``loss_curve.png`` to
``--output-dir`` (default runs/sft_trl), and the trained model to
``final_model/`` unless ``--no-save-model``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune_common as common  # noqa: E402
import finetune_data as data  # noqa: E402
from finetune_options import OneLineArgumentParser, float_in, int_at_least, non_empty  # noqa: E402

# (gpu, cpu)
DEFAULTS = {"seq_len": (2048, 64), "batch_size": (8, 8), "max_steps": (100, 20), "lr": (3e-4, 1e-2),
            "warmup_steps": (10, 3)}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="sft_trl.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    positive = int_at_least(1)
    parser.add_argument("--model", type=non_empty, default=None,
                        help="local path or hub name of a pretrained causal LM (default: random-init Llama)")
    parser.add_argument("--attn", choices=common.ATTN_IMPLEMENTATIONS, default="fa_amd")
    parser.add_argument("--dataset", type=non_empty, default=None,
                        help="the recipes' --dataset (local .txt/.md/.json/.jsonl/.parquet/.csv or a hub name); "
                             "default: the built-in corpus")
    parser.add_argument("--text-column", type=non_empty, default="text")
    parser.add_argument("--seq-len", type=int_at_least(2), default=None,
                        help="longest sample in tokens; longer documents are split (default: 2048 GPU / 64 CPU)")
    parser.add_argument("--batch-size", type=positive, default=None, help="samples per step per process (default 8)")
    parser.add_argument("--max-steps", type=positive, default=None, help="default: 100 GPU / 20 CPU")
    parser.add_argument("--lr", type=float_in(0.0, low_open=True), default=None,
                        help="default: 3e-4 GPU / 1e-2 CPU random init, 2e-5 with --model")
    parser.add_argument("--warmup-steps", type=int_at_least(0), default=None)
    parser.add_argument("--dropout", type=float_in(0.0, 1.0, high_open=True), default=None,
                        help="attention dropout (default 0.1 random init, the checkpoint's otherwise)")
    parser.add_argument("--seed", type=int_at_least(0, 2**31 - 1), default=0)
    parser.add_argument("--output-dir", type=non_empty, default="runs/sft_trl")
    parser.add_argument("--no-save-model", action="store_true")
    return parser


class StepRecorder:
    """A TrainerCallback keeping per-step loss, time and tokens (TRL logs every step here)."""

    def __init__(self):
        from transformers import TrainerCallback

        recorder = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                recorder.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                recorder.seconds[state.global_step] = time.perf_counter() - recorder.started

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    recorder.logs[state.global_step] = dict(logs)

        self.callback = _Callback()
        self.started = time.perf_counter()
        self.seconds: dict = {}
        self.logs: dict = {}

    def history(self) -> list:
        records, previous_tokens = [], 0.0
        for step in sorted(self.logs):
            logs, seconds = self.logs[step], self.seconds.get(step, float("nan"))
            tokens = logs.get("num_tokens", previous_tokens) - previous_tokens
            previous_tokens = logs.get("num_tokens", previous_tokens)
            records.append({"step": step, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                            "grad_norm": logs.get("grad_norm"), "tokens": tokens, "step_seconds": seconds,
                            "tokens_per_s": tokens / seconds if seconds and math.isfinite(seconds) else 0.0,
                            "mean_token_accuracy": logs.get("mean_token_accuracy")})
        return records


def checkpointing_option(config_class) -> str:
    """Transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name warns)."""
    fields = getattr(config_class, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    gpu = common.has_gpu()
    column = 0 if gpu else 1
    if args.lr is None and args.model is not None:
        args.lr = 2e-5
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[column])
    interpreting = common.prepare_triton_interpreter(tile=common.interpreter_tile(args.seq_len))
    dtype = common.default_dtype()
    if interpreting:
        dtype = "fp32"  # the interpreter's bf16 dots are wrong
        print(f"[sft] no GPU: the tiny CPU model through the Triton interpreter in fp32, {args.max_steps} steps",
              flush=True)

    try:
        import datasets
        from trl import SFTConfig, SFTTrainer
    except ImportError as err:
        raise SystemExit(f"sft_trl.py needs trl and datasets ({err}): pip install -e \".[hf]\"") from None

    try:
        texts = data.load_texts(args.dataset, args.text_column)
        if args.model is None:
            corpus = texts if args.dataset is None else data.load_builtin_corpus()
            tokenizer = data.builtin_tokenizer(corpus, common.BUILTIN_VOCAB_SIZE)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
        samples, stats = data.tokenize_and_chunk(texts, tokenizer, args.seq_len)
    except data.DataError as err:
        raise SystemExit(f"data error: {err}") from None
    except (OSError, ValueError) as err:
        raise SystemExit(f"sft_trl.py: error: --model {args.model}: could not load its tokenizer: "
                         f"{common.first_line(err)}") from None
    print(f"[sft] data: {stats['documents']} documents -> {stats['samples']} samples of <= {args.seq_len} tokens",
          flush=True)
    # Already tokenized (with EOS per document): SFTTrainer uses input_ids as they are.
    train_dataset = datasets.Dataset.from_dict({"input_ids": samples})

    shape = common.GPU_SHAPE if gpu else common.CPU_SHAPE
    model_args = Namespace(
        model=args.model, model_type="llama", attn=args.attn, no_fused_rope=False,
        dropout=args.dropout if args.dropout is not None else (0.1 if args.model is None else None),
        sliding_window=None, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        seq_len=args.seq_len, lora=False, gradient_checkpointing=False, dtype=dtype,
    )
    import torch

    torch.manual_seed(args.seed)
    try:
        model = common.build_model(model_args, tokenizer)
    except common.RecipeError as err:
        raise SystemExit(f"sft_trl.py: error: {err}") from None

    output_dir = Path(args.output_dir)
    config = SFTConfig(
        output_dir=str(output_dir),
        padding_free=True,  # the point of this example: one row per batch, varlen attention
        packing=False,
        max_length=None,  # samples are already at most --seq-len tokens
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=0.1,
        max_grad_norm=1.0,
        adam_beta2=0.95,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu=not gpu,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=False,
        # SFTConfig turns activation checkpointing on by default; the model fits without it, and recomputing
        # every layer's forward would run the attention kernels a third time per step.
        **{checkpointing_option(SFTConfig): False},
    )
    recorder = StepRecorder()
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_dataset, processing_class=tokenizer,
                         callbacks=[recorder.callback])
    print(f"[sft] SFTTrainer, padding_free=True, attn={args.attn}, {dtype}, {args.batch_size} x <= {args.seq_len} "
          f"tokens per step, {args.max_steps} steps, lr {args.lr:g}", flush=True)
    result = trainer.train()

    history = recorder.history()
    losses = [h["loss"] for h in history]
    timed = history[max(1, len(history) // 10):] or history
    summary = {
        "steps": len(history), "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None, "min_loss": min(losses) if losses else None,
        "median_tokens_per_s": sorted(h["tokens_per_s"] for h in timed)[len(timed) // 2] if timed else 0.0,
        "train_runtime_s": result.metrics.get("train_runtime"),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else common.peak_memory_gb(torch.device("cpu")),
    }
    run = {"attn": args.attn, "dtype": dtype, "padding_free": True, "seq_len": args.seq_len,
           "batch_size": args.batch_size, "max_steps": args.max_steps, "lr": args.lr, "model": args.model,
           "dataset": args.dataset, "data": stats, "triton_interpret": interpreting,
           "attn_implementation": model.config._attn_implementation}
    if trainer.is_world_process_zero():
        output_dir.mkdir(parents=True, exist_ok=True)
        common.atomic_write_text(output_dir / "metrics.json",
                                 json.dumps({"config": run, "summary": summary, "steps": history}, indent=2))
        common.plot_loss_curve(output_dir, history, f"TRL SFTTrainer, padding_free, {args.attn}, {dtype}")
        if losses:
            print(f"[sft] done: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"({(losses[-1] - losses[0]) / losses[0]:+.0%}) in {len(losses)} steps, "
                  f"{summary['median_tokens_per_s']:,.0f} tokens/s (median step); {output_dir / 'metrics.json'}",
                  flush=True)
    if not args.no_save_model:
        trainer.save_model(str(output_dir / "final_model"))
    return {"summary": summary, "steps": history}


if __name__ == "__main__":
    main()
