#!/usr/bin/env python
r"""Training-step benchmark of the attention implementations, in one process.

Throughput (default): tokens/s and peak memory of a full training step
(forward, backward, fused AdamW) of a random-init Llama for every
``--attn`` x ``--modes`` (packed / padded) x ``--seq-lens``:

    python recipes/bench_train.py                                  # 8 layers, hidden 2048, 16/4 heads, bf16
    python recipes/bench_train.py --seq-lens 2048 8192 --attn fa_amd sdpa
    python recipes/bench_train.py --data fixed --seq-lens 4096 --batch-tokens 8192 --modes padded   # (2, 4096) step

Loss curves (``--compare-loss``): the same model init, the same batches and
dropout 0 trained with each implementation for ``--steps`` steps; reports
the largest loss gap to the reference implementation.

    python recipes/bench_train.py --compare-loss --steps 50

SDPA runs twice over: ``sdpa`` with torch's own backend pick, and ``sdpa-flash`` /
``sdpa-efficient`` / ``sdpa-cudnn`` / ``sdpa-math`` forced to one backend
(torch.nn.attention.sdpa_kernel around every step).  Every sdpa cell names the
backend that actually ran, read from the profiler's op names in one untimed step
(the cuDNN one is what torch picks on Hopper), and each row shows its tokens/s
relative to ``sdpa``.  The end-to-end anchor step (8 layers, hidden 2048,
16/4 heads, (2, 4096), bf16, fused AdamW):

    python recipes/bench_train.py --data fixed --seq-lens 4096 --batch-tokens 8192 --modes padded \
        --attn fa_amd sdpa sdpa-cudnn sdpa-flash sdpa-efficient --rounds 3

Both print a table and write JSON (and a PNG for --compare-loss) to --output-dir.
Tokens/s counts real tokens only: padding is work the padded mode wastes.
Without a GPU it runs a tiny model through the Triton interpreter (a smoke
run of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune_common as common  # noqa: E402
import finetune_data as data  # noqa: E402
from finetune_options import MAX_SEED, OneLineArgumentParser, float_in, int_at_least  # noqa: E402

BENCH_SHAPE = common.ModelShape(hidden_size=2048, intermediate_size=5632, num_layers=8, num_heads=16, num_kv_heads=4)
# bench cells that run the sdpa model with SDPA forced to one backend (torch.nn.attention.SDPBackend names)
SDPA_FORCED = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
               "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-math": "MATH"}
ATTN_CHOICES = tuple(common.ATTN_IMPLEMENTATIONS) + tuple(SDPA_FORCED)
# the aten op SDPA dispatches to, per backend (what the profiler shows for the step)
SDPA_OPS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_efficient_attention": "efficient",
            "_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_attention_math": "math",
            "_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
            "_scaled_dot_product_fused_attention_overrideable": "overrideable"}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="bench_train.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-loss", action="store_true",
                        help="compare loss curves of the implementations instead of measuring throughput")
    parser.add_argument("--attn", nargs="+", choices=ATTN_CHOICES, default=None,
                        help="implementations (sdpa-<backend>: sdpa forced to that backend); default: fa_amd sdpa "
                             "eager, plus sdpa-flash sdpa-efficient sdpa-cudnn for throughput on an NVIDIA GPU")
    parser.add_argument("--modes", nargs="+", choices=("packed", "padded"), default=["packed", "padded"])
    parser.add_argument("--seq-lens", nargs="+", type=int_at_least(2), default=None, help="default: 2048 8192 (GPU), 64 (CPU)")
    parser.add_argument("--batch-tokens", type=positive_int, default=None,
                        help="token budget per step (default on GPU: 16384, 4096 for --compare-loss; raised to "
                             "the seq-len if smaller)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="timed steps (throughput, default 10) or trained steps (--compare-loss, default 50)")
    parser.add_argument("--warmup-steps", type=int_at_least(0), default=3, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="throughput: measure every implementation this many times, in alternating order "
                             "(a fresh model each time), and report the median round: the GPU's clock and "
                             "the order of the runs then favour no implementation")
    parser.add_argument("--data", choices=("synthetic", "fixed", "corpus"), default=None,
                        help="synthetic (throughput default): random tokens, lengths uniform in [seq-len/4, seq-len], "
                             "so every seq-len is really exercised; fixed: random tokens, every sample exactly "
                             "seq-len long (the plain (batch, seq-len) step: no padding, no packing boundaries "
                             "inside a sample); corpus (--compare-loss default): the built-in text, which a model "
                             "can learn, so the curves mean something")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="throughput: weights and optimizer in this dtype; --compare-loss: autocast dtype over "
                             "fp32 weights (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--dropout", type=float_in(0.0, 1.0, high_open=True), default=0.0, help="attention dropout (forced 0 for --compare-loss)")
    parser.add_argument("--lr", type=float_in(0.0, low_open=True), default=3e-4)
    parser.add_argument("--reference", choices=ATTN_CHOICES, default="sdpa",
                        help="--compare-loss: implementation the gaps are measured against")
    parser.add_argument("--no-fused-rope", action="store_true", help="fa_amd without the fused rotary patch")
    parser.add_argument("--hidden-size", type=positive_int, default=None)
    parser.add_argument("--intermediate-size", type=positive_int, default=None)
    parser.add_argument("--num-layers", type=positive_int, default=None)
    parser.add_argument("--num-heads", type=positive_int, default=None)
    parser.add_argument("--num-kv-heads", type=positive_int, default=None)
    parser.add_argument("--seed", type=int_at_least(0, MAX_SEED), default=0)
    parser.add_argument("--output-dir", default="runs/bench_train")
    return parser


def resolve(args) -> Namespace:
    gpu = common.has_gpu()
    shape = BENCH_SHAPE if gpu else common.CPU_SHAPE
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(shape, name))
    common.check_model_shape(args, "bench_train.py", uses_fa_amd=args.attn is None or "fa_amd" in args.attn)
    if args.seq_lens is None:
        args.seq_lens = [2048, 8192] if gpu else [64]
    if args.batch_tokens is None:
        # --compare-loss must fit eager on packed rows, whose block-diagonal mask
        # is dense: (batch tokens)^2 per head.
        args.batch_tokens = (4096 if args.compare_loss else 16384) if gpu else 256
    if args.steps is None:
        args.steps = 50 if args.compare_loss else 10
    if args.dtype is None:
        args.dtype = "bf16" if gpu else "fp32"
    if not gpu and args.dtype == "fp16":
        # (bf16 is right on the interpreter: fa_amd widens its bf16 math, TUNING_NOTES v21)
        print("[bench] no GPU: --dtype fp16 is for GPUs here, using --dtype fp32", flush=True)
        args.dtype = "fp32"
    if args.data is None:
        args.data = "corpus" if args.compare_loss else "synthetic"
    if args.attn is None:
        import torch

        forced = ["sdpa-flash", "sdpa-efficient", "sdpa-cudnn"] if gpu and torch.version.hip is None else []
        args.attn = list(common.ATTN_IMPLEMENTATIONS) + ([] if args.compare_loss else forced)
    if args.compare_loss:
        args.dropout = 0.0
        if args.reference not in args.attn:  # (else the gap table would be empty)
            print(f"[bench] --compare-loss: adding the reference --reference {args.reference} to --attn", flush=True)
            args.attn = [args.reference, *args.attn]
    return args


def model_attn(attn: str) -> str:
    """The model's attn_implementation for a bench cell (sdpa-<backend> cells run the sdpa model)."""
    return "sdpa" if attn in SDPA_FORCED else attn


def sdpa_backend_context(attn: str):
    """sdpa_kernel(backend) for a forced sdpa cell, else a no-op context."""
    import contextlib

    if attn not in SDPA_FORCED:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_FORCED[attn]))


def sdpa_backends_run(step) -> str:
    """The SDPA backend(s) one call of `step` ran, from the aten ops the profiler records (CPU side)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ran = {SDPA_OPS[name] for name in (e.key.removeprefix("aten::") for e in prof.key_averages()) if name in SDPA_OPS}
    return "+".join(sorted(ran)) or "none seen"


def model_args(args, attn: str, seq_len: int) -> Namespace:
    """The Namespace finetune_common.build_model reads, for one benchmark cell."""
    return Namespace(
        model=None, model_type="llama", attn=model_attn(attn), no_fused_rope=args.no_fused_rope, dropout=args.dropout,
        sliding_window=None, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        seq_len=seq_len, lora=False, gradient_checkpointing=False, dtype="fp32",
    )


class VocabOnly:
    """What build_model needs of a tokenizer when the data is synthetic."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = 0
        self.pad_token_id = 1

    def __len__(self):
        return self.vocab_size


def make_samples(args, seq_len: int, count_tokens: int):
    """Samples worth at least ``count_tokens`` tokens, and the tokenizer-like object for the model."""
    rng = random.Random(args.seed)
    if args.data == "corpus":
        texts = data.load_builtin_corpus()
        tokenizer = data.builtin_tokenizer(texts, common.BUILTIN_VOCAB_SIZE)
        samples, _ = data.tokenize_and_chunk(texts, tokenizer, seq_len)
        rng.shuffle(samples)
        return samples, tokenizer
    vocab = VocabOnly(common.BUILTIN_VOCAB_SIZE)
    samples, total = [], 0
    while total < count_tokens:
        length = seq_len if args.data == "fixed" else rng.randint(max(2, seq_len // 4), seq_len)
        samples.append([rng.randrange(2, vocab.vocab_size) for _ in range(length)])
        total += length
    return samples, vocab


def make_batches(samples, batch_tokens: int, packed: bool, pad_token_id: int, count: int, seed: int):
    sampler = data.TokenBudgetBatchSampler([len(s) for s in samples], batch_tokens, packed=packed, seed=seed)
    collate = data.make_collator(packed, pad_token_id)
    batches = []
    while len(batches) < count:
        for indices in sampler:
            batches.append(collate([{"input_ids": samples[i]} for i in indices]))
            if len(batches) == count:
                break
        sampler.set_epoch(sampler.epoch + 1)
    return batches


def to_device(batch, device):
    import torch

    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def build(args, attn: str, seq_len: int, tokenizer, weights_dtype, device):
    import torch

    torch.manual_seed(args.seed)
    model = common.build_model(model_args(args, attn, seq_len), tokenizer).to(device=device, dtype=weights_dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    return model, optimizer


def train_step(model, optimizer, batch, autocast_dtype, device):
    import torch

    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device, attn: str | None = None):
    import torch

    if attn == "fa_amd":
        # The fused-rotary patch swaps a module-level function for the whole
        # process; undo it so the next sdpa/eager model runs stock code.
        from fa_amd.integrations.monkey_patch import revert_fa_amd_patches

        revert_fa_amd_patches()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_throughput(args, device) -> list[dict]:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    results = []
    for seq_len in args.seq_lens:
        batch_tokens = max(args.batch_tokens, seq_len)
        samples, tokenizer = make_samples(args, seq_len, batch_tokens * (args.warmup_steps + args.steps + 2) * 2)
        for mode in args.modes:
            batches = make_batches(samples, batch_tokens, mode == "packed", tokenizer.pad_token_id,
                                   args.warmup_steps + args.steps, args.seed)
            real_tokens = sum(data.real_token_count(b) for b in batches[args.warmup_steps:])
            computed_tokens = sum(b["input_ids"].numel() for b in batches[args.warmup_steps:])
            rounds = {attn: [] for attn in args.attn}
            for round_index in range(args.rounds):
                for attn in args.attn if round_index % 2 == 0 else args.attn[::-1]:
                    cell = {"attn": attn, "mode": mode, "seq_len": seq_len, "batch_tokens": batch_tokens,
                            "padding_fraction": 1 - real_tokens / computed_tokens}
                    measure_cell(args, attn, cell, batches, seq_len, tokenizer, dtype, device, real_tokens)
                    rounds[attn].append(cell)
                    print(f"[bench] {format_row(cell)}", flush=True)
            medians = [_median_round(rounds[attn]) for attn in args.attn]
            sdpa = next((c for c in medians if c["attn"] == "sdpa" and c["status"] == "ok"), None)
            for cell in medians:
                if sdpa is not None and cell["status"] == "ok":
                    cell["vs_sdpa"] = cell["tokens_per_s"] / sdpa["tokens_per_s"]
            results += medians
    return results


def measure_cell(args, attn: str, cell: dict, batches, seq_len: int, tokenizer, dtype, device, real_tokens: int) -> dict:
    """Train `args.warmup_steps` untimed then `args.steps` timed steps of a fresh model; fills in `cell`."""
    import torch

    model = optimizer = None
    try:
        model, optimizer = build(args, attn, seq_len, tokenizer, dtype, device)
        device_batches = [to_device(b, device) for b in batches]
        with sdpa_backend_context(attn):
            for batch in device_batches[: args.warmup_steps]:
                train_step(model, optimizer, batch, None, device)
            if model_attn(attn) == "sdpa":  # one more untimed step, profiled: which backend ran
                cell["backend"] = sdpa_backends_run(
                    lambda: train_step(model, optimizer, device_batches[0], None, device))
            synchronize(device)
            release(device)
            started = time.perf_counter()
            for batch in device_batches[args.warmup_steps:]:
                loss = train_step(model, optimizer, batch, None, device)
            synchronize(device)
            seconds = time.perf_counter() - started
        cell.update({
            "status": "ok",
            "tokens_per_s": real_tokens / seconds,
            "step_ms": 1000 * seconds / args.steps,
            "peak_mem_gb": common.peak_memory_gb(device),
            "final_loss": float(loss),
        })
    except torch.OutOfMemoryError:
        cell.update({"status": "OOM"})
    except Exception as err:  # one failing cell must not lose the whole table
        if attn in SDPA_FORCED and "No viable backend" in str(err):
            # (torch blames "the math kernel and the fused kernels" being off: the forced one does not run here)
            cell.update({"status": f"n/a: SDPA's {SDPA_FORCED[attn]} backend does not run on this device "
                                   f"({device.type}) with these inputs"})
        else:
            cell.update({"status": f"error: {type(err).__name__}: {err}"[:300]})
    finally:
        del model, optimizer
        device_batches = None
        release(device, attn)
    return cell


def _median_round(cells: list) -> dict:
    """The round with the median tokens/s (any failed round is reported instead), with every round's tokens/s."""
    failed = [c for c in cells if c["status"] != "ok"]
    if failed or len(cells) == 1:
        return (failed or cells)[0]
    ranked = sorted(cells, key=lambda c: c["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "tokens_per_s_rounds": [c["tokens_per_s"] for c in cells]}


def format_row(cell) -> str:
    if cell["status"] != "ok":
        return f"{cell['attn']:>14} {cell['mode']:>7} {cell['seq_len']:>7} {cell['status']}"
    vs = f"{cell['vs_sdpa']:.3f}x" if "vs_sdpa" in cell else ""
    return (f"{cell['attn']:>14} {cell['mode']:>7} {cell['seq_len']:>7} {cell['tokens_per_s']:>12,.0f} "
            f"{cell['step_ms']:>9.1f} {cell['peak_mem_gb']:>9.2f} {100 * cell['padding_fraction']:>6.1f}% "
            f"{vs:>8} {cell.get('backend', '-'):>10}")


def print_throughput_table(results):
    print(f"{'attn':>14} {'mode':>7} {'seq_len':>7} {'tokens/s':>12} {'step ms':>9} {'peak GB':>9} {'pad':>7} "
          f"{'vs sdpa':>8} {'backend':>10}")
    for cell in results:
        print(format_row(cell))


def compare_losses(args, device) -> dict:
    import torch

    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    seq_len = args.seq_lens[0]
    batch_tokens = max(args.batch_tokens, seq_len)
    samples, tokenizer = make_samples(args, seq_len, batch_tokens * (args.steps + 2) * 2)
    curves, status = {}, {}
    for mode in args.modes:
        batches = make_batches(samples, batch_tokens, mode == "packed", tokenizer.pad_token_id, args.steps, args.seed)
        for attn in args.attn:
            key = f"{attn}/{mode}"
            model = optimizer = None
            try:
                model, optimizer = build(args, attn, seq_len, tokenizer, torch.float32, device)
                losses = []
                with sdpa_backend_context(attn):
                    for batch in batches:
                        losses.append(float(train_step(model, optimizer, to_device(batch, device), autocast_dtype,
                                                       device)))
                curves[key] = losses
                status[key] = "ok"
                print(f"[bench] {key}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
            except torch.OutOfMemoryError:
                status[key] = "OOM"
            except Exception as err:
                status[key] = f"error: {type(err).__name__}: {err}"[:300]
            finally:
                del model, optimizer
                release(device, attn)
            if status[key] != "ok":
                print(f"[bench] {key}: {status[key]}", flush=True)
    gaps = {}
    for mode in args.modes:
        reference = curves.get(f"{args.reference}/{mode}")
        for attn in args.attn:
            key = f"{attn}/{mode}"
            if reference is None or key not in curves or attn == args.reference:
                continue
            diffs = [abs(a - b) for a, b in zip(curves[key], reference)]
            gaps[key] = {"vs": f"{args.reference}/{mode}", "max_abs_gap": max(diffs),
                         "max_gap_step": 1 + diffs.index(max(diffs)), "final_abs_gap": diffs[-1]}
    return {"curves": curves, "status": status, "gaps": gaps, "seq_len": seq_len, "batch_tokens": batch_tokens}


def plot_curves(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 5))
    for key, losses in curves.items():
        axis.plot(range(1, len(losses) + 1), losses, label=key, linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(device) -> dict:
    import platform

    import torch

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "hip": torch.version.hip,
        "cuda": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    interpreting = common.prepare_triton_interpreter()
    args = resolve(args)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if interpreting:
        print("[bench] no GPU: a tiny model through the Triton interpreter. This checks the script, it measures "
              "nothing; run it on a GPU for numbers.", flush=True)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()}
    config["environment"] = environment(device)
    if args.compare_loss:
        result = compare_losses(args, device)
        report = {"config": config, **result}
        json_path = output_dir / "compare_loss.json"
        png_path = output_dir / "compare_loss.png"
        plot_curves(result["curves"], png_path, f"dropout 0, seed {args.seed}, seq-len {result['seq_len']}, "
                                                f"{args.dtype}")
        print(f"{'run':>15} {'vs':>15} {'max |gap|':>10} {'at step':>8} {'final |gap|':>12}")
        for key, gap in result["gaps"].items():
            print(f"{key:>15} {gap['vs']:>15} {gap['max_abs_gap']:>10.4f} {gap['max_gap_step']:>8} "
                  f"{gap['final_abs_gap']:>12.4f}")
        print(f"[bench] wrote {json_path} and {png_path}")
    else:
        results = measure_throughput(args, device)
        report = {"config": config, "results": results}
        json_path = output_dir / "bench_train.json"
        print_throughput_table(results)
        print(f"[bench] wrote {json_path}")
    json_path.write_text(json.dumps(report, indent=2))
    return report


def exit_code(report: dict) -> int:
    """1 when no cell measured anything (every attention failed: nothing was benchmarked), else 0."""
    if "results" in report:
        return 0 if any(cell["status"] == "ok" for cell in report["results"]) else 1
    return 0 if any(status == "ok" for status in report.get("status", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(exit_code(main()))
