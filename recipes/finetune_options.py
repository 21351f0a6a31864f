"""Command-line options of the fine-tuning recipes: the parser, its range checks, per-device defaults.

Every numeric option is checked by argparse itself (the ``type=`` functions
below), so a bad value stops the run before anything is built, with one line:

    finetune_llama.py: error: argument --lr: must be a finite number > 0, got 'nan' (--help lists the options)

Checks that involve several options (heads vs width, batch vs sequence) run in
:func:`resolve_args` and report the same way.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

MODEL_TYPES = ("llama", "mistral")
ATTN_IMPLEMENTATIONS = ("fa_amd", "sdpa", "eager")
DTYPES = ("auto", "bf16", "fp16", "fp32")
# np.random.seed (accelerate's set_seed) takes seeds below 2**32; each process adds its index.
MAX_SEED = 2**31 - 1
# fa_amd's kernels take head dims up to this.
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class ModelShape:
    """Size of a random-init model (used when --model is not given)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


# GQA (4 query heads per KV head) so the kernels' grouped path is what trains.
GPU_SHAPE = ModelShape(hidden_size=2048, intermediate_size=5632, num_layers=8, num_heads=16, num_kv_heads=4)
# Small enough that the Triton interpreter runs a step in about two seconds: the interpreter's cost is
# per (sample, head), so few heads; still grouped (2 query heads share 1 KV head).
CPU_SHAPE = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)

# Defaults that depend on whether a GPU is there: (gpu, cpu).  The CPU column is
# sized so the README's command shows learning within about a minute on two
# cores: the loss falls from ln(8192) = 9.0 to about 7 (docs/RECIPES.md).
# Eight 64-token samples per step keep the step-to-step noise of the loss small.
DEVICE_DEFAULTS = {
    "seq_len": (2048, 64),
    "batch_tokens": (16384, 512),
    "max_steps": (300, 20),
    "log_every": (10, 2),
}
# Peak learning rate of a random-init model, (gpu, cpu): the tiny CPU model takes a large one.
RANDOM_INIT_LR = (3e-4, 1e-2)
# Warm-up of the tiny CPU model: a few steps, then it learns the token statistics fast.
CPU_WARMUP_STEPS = 3


# --------------------------------------------------------------------------- range-checked types


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")


def int_at_least(low: int, high: int | None = None):
    """argparse type: an integer in [low, high]."""
    def check(text: str) -> int:
        value = _number(text, int)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value
    check.__name__ = f"int>={low}"
    return check


def float_in(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    """argparse type: a finite float in the interval (open or closed at each end as asked)."""
    def check(text: str) -> float:
        value = _number(text, float)
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            left = "(" if low_open else "["
            right = ")" if high_open or high == math.inf else "]"
            if high == math.inf:
                bound = f"> {low:g}" if low_open else f">= {low:g}"
            else:
                bound = f"in {left}{low:g}, {high:g}{right}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value
    check.__name__ = "number"
    return check


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the recipes' usage block is 40 lines long)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


# --------------------------------------------------------------------------- parser


def build_parser(model_type: str) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog=f"finetune_{model_type}.py",
        description=(
            f"Fine-tune (or train from scratch) a {model_type.capitalize()}-style causal LM with fa_amd attention, "
            "through Hugging Face Accelerate. With no arguments: a random-init model on a built-in corpus "
            "(Python's own reference docs), no download needed."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    positive = int_at_least(1)
    count = int_at_least(0)
    probability = float_in(0.0, 1.0, high_open=True)

    model = parser.add_argument_group("model")
    model.add_argument("--model", type=non_empty, default=None,
                       help="local path or hub name of a pretrained causal LM (loaded with from_pretrained); "
                            "default: a random-init model with the built-in tokenizer")
    model.add_argument("--model-type", choices=MODEL_TYPES, default=model_type,
                       help="architecture of the random-init model and which fused-rotary patch to apply")
    model.add_argument("--attn", choices=ATTN_IMPLEMENTATIONS, default="fa_amd", help="attention implementation")
    model.add_argument("--no-fused-rope", action="store_true",
                       help="with --attn fa_amd, keep the stock rotary embedding instead of fa_amd's fused one")
    model.add_argument("--dropout", type=probability, default=None,
                       help="attention dropout in [0, 1) (default: 0.1 for a random-init model, the checkpoint's "
                            "value otherwise)")
    model.add_argument("--sliding-window", type=positive, default=None,
                       help="Mistral sliding window (default for a random-init model: seq-len // 2, so it bites)")
    model.add_argument("--hidden-size", type=positive, default=None, help="random-init model width (default: per device)")
    model.add_argument("--num-layers", type=positive, default=None)
    model.add_argument("--num-heads", type=positive, default=None)
    model.add_argument("--num-kv-heads", type=positive, default=None, help="must divide --num-heads")
    model.add_argument("--intermediate-size", type=positive, default=None)
    model.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) instead of every weight")
    model.add_argument("--lora-r", type=positive, default=16)
    model.add_argument("--lora-alpha", type=float_in(0.0, low_open=True), default=32.0)
    model.add_argument("--lora-dropout", type=probability, default=0.05)
    model.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")

    dataset = parser.add_argument_group("data")
    dataset.add_argument("--dataset", type=non_empty, default=None,
                         help="local .txt/.md/.json/.jsonl file or folder (read directly; in .txt, blank lines separate "
                              "documents), local .parquet/.csv, or a `datasets` hub name (both through `datasets`); "
                              "default: the built-in corpus")
    dataset.add_argument("--dataset-config", default=None, help="`datasets` config name for a hub dataset")
    dataset.add_argument("--dataset-split", type=non_empty, default="train")
    dataset.add_argument("--text-column", type=non_empty, default="text", help="column holding the text")
    dataset.add_argument("--seq-len", type=int_at_least(2), default=None,
                         help="longest sample in tokens; LONGER DOCUMENTS ARE SPLIT INTO CHUNKS of this length "
                              "(default: 2048 on GPU, 64 on CPU)")
    dataset.add_argument("--batch-tokens", type=positive, default=None,
                         help="token budget per micro-batch per process: packed, the sum of sample lengths; "
                              "padded, rows x longest row (default: 16384 on GPU, 512 on CPU)")
    dataset.add_argument("--no-packing", action="store_true",
                         help="pad samples to the batch's longest (with attention_mask) instead of packing them "
                              "into one row with DataCollatorWithFlattening")

    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=positive, default=None, help="optimizer steps (default: 300 on GPU, 20 on CPU)")
    train.add_argument("--lr", type=float_in(0.0, low_open=True), default=None,
                       help="peak learning rate (default: 3e-4 random init, 2e-5 full fine-tune, 2e-4 LoRA; "
                            "1e-2 for the tiny CPU model)")
    train.add_argument("--warmup-steps", type=count, default=None,
                       help="linear warmup (default: 10%% of max-steps, <= 100; 3 for the tiny CPU model)")
    train.add_argument("--weight-decay", type=float_in(0.0), default=0.1, help="AdamW weight decay (>= 0)")
    train.add_argument("--max-grad-norm", type=float_in(0.0), default=1.0,
                       help="clip the gradient norm to this (0: no clipping; the norm is still checked and logged)")
    train.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step")
    train.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="compute precision (fp32 master weights + autocast; fp16 adds a GradScaler). "
                            "auto: bf16 on GPUs with bf16 (MI200/MI300, NVIDIA Ampere+), fp16 on MI100, fp32 on CPU")
    train.add_argument("--seed", type=int_at_least(0, MAX_SEED), default=0)
    train.add_argument("--skip-nonfinite-steps", action="store_true",
                       help="when a step's loss or gradient is NaN/inf, drop that step (logged) instead of stopping; "
                            "stops anyway after 10 such steps in a row")

    out = parser.add_argument_group("output and checkpoints")
    out.add_argument("--output-dir", type=non_empty, default=None, help=f"default: runs/finetune_{model_type}")
    out.add_argument("--save-every", type=count, default=100,
                     help="save a resumable checkpoint every N steps and at the last step (0: never)")
    out.add_argument("--keep-checkpoints", type=count, default=2,
                     help="how many recent checkpoints of this run to keep (0: all)")
    out.add_argument("--resume", nargs="?", const="latest", default=None, type=_non_empty("--resume"),
                     help="resume from the newest complete checkpoint in --output-dir, or from the given checkpoint "
                          "folder; restores model, optimizer, scheduler, RNG and data-loader position")
    out.add_argument("--allow-resume-mismatch", action="store_true",
                     help="resume even if the model, data, batch size, seed or LoRA settings differ from the "
                          "checkpoint's run (the run is then no longer a continuation of it)")
    out.add_argument("--overwrite-output-dir", action="store_true",
                     help="start a fresh run in an --output-dir that holds another run's checkpoints, deleting them")
    out.add_argument("--no-save-model", action="store_true", help="do not export the final model / adapter")
    out.add_argument("--log-every", type=positive, default=None,
                     help="print a log line every N steps (default: 10 on GPU, 2 on CPU)")
    return parser


# --------------------------------------------------------------------------- defaults and combinations


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def default_dtype() -> str:
    import torch

    if not torch.cuda.is_available():
        return "fp32"
    if torch.version.hip is not None:
        arch = str(getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")).split(":")[0]
        # MI100 (gfx908) has no fast bf16 path; its fp16 matrix cores are the fast ones.
        if arch == "gfx908":
            return "fp16"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def _looks_like_path(spec: str) -> bool:
    # Hub names are "name" or "owner/name"; these can only be meant as folders.
    return spec.startswith((os.sep, ".", "~")) or os.sep + os.sep in spec or spec.count("/") > 1


def check_model_path(model: str | None, prog: str) -> None:
    if model is not None and _looks_like_path(model) and not Path(model).expanduser().exists():
        fail(prog, f"--model {model}: no such folder (give a local model folder, or a hub name like "
                   f"owner/name where the hub is reachable)")


def check_options_early(model_type: str, argv=None) -> None:
    """Parse the command line (argparse's range checks, --help) and check --model's path, importing nothing heavy."""
    args = build_parser(model_type).parse_args(argv)
    check_model_path(args.model, f"finetune_{model_type}.py")


def _non_empty(option: str):
    """An argparse type: the string as given, refusing an empty one (a quoted variable that was empty)."""
    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{option} needs a checkpoint folder (or no value: the newest one)")
        return value

    return parse


def fail(parser_prog: str, message: str):
    """Stop like argparse does: one line on stderr, exit status 2."""
    sys.stderr.write(f"{parser_prog}: error: {message}\n")
    raise SystemExit(2)


def check_model_shape(args, prog: str, uses_fa_amd: bool):
    """The random-init model's shape options fit together (one-line errors, exit 2)."""
    if args.hidden_size % args.num_heads:
        fail(prog, f"--hidden-size {args.hidden_size} is not a multiple of --num-heads {args.num_heads}")
    head_dim = args.hidden_size // args.num_heads
    if args.num_heads % args.num_kv_heads:
        fail(prog, f"--num-heads {args.num_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
    if head_dim % 2:
        fail(prog, f"head dim --hidden-size / --num-heads = {head_dim} must be even (rotary embeddings)")
    if uses_fa_amd and head_dim > MAX_HEAD_DIM:
        fail(prog, f"head dim --hidden-size / --num-heads = {head_dim} is above fa_amd's {MAX_HEAD_DIM}")


def resolve_args(args: argparse.Namespace, prog: str | None = None) -> argparse.Namespace:
    """Fill the per-device defaults and check combinations that cannot work (one-line errors, exit 2)."""
    prog = prog or f"finetune_{args.model_type}.py"
    gpu = has_gpu()
    args.device_kind = "gpu" if gpu else "cpu"
    for name, (gpu_value, cpu_value) in DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu_value if gpu else cpu_value)
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    for name, value in (("hidden_size", shape.hidden_size), ("intermediate_size", shape.intermediate_size),
                        ("num_layers", shape.num_layers), ("num_heads", shape.num_heads),
                        ("num_kv_heads", shape.num_kv_heads)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model is None:
        check_model_shape(args, prog, uses_fa_amd=args.attn == "fa_amd")
    else:
        check_model_path(args.model, prog)
    if args.dtype == "auto":
        args.dtype = default_dtype()
    if not gpu and args.dtype != "fp32":
        if args.dtype == "fp16":
            fail(prog, "--dtype fp16 needs a GPU (the GradScaler path is GPU-only); use fp32 on CPU")
    if args.dropout is None and args.model is None:
        args.dropout = 0.1
    if args.lr is None:
        if args.lora:
            args.lr = 2e-4
        elif args.model is not None:
            args.lr = 2e-5
        else:
            args.lr = RANDOM_INIT_LR[0] if gpu else RANDOM_INIT_LR[1]
    if args.warmup_steps is None:
        if not gpu and args.model is None:
            args.warmup_steps = min(CPU_WARMUP_STEPS, args.max_steps - 1)
        else:
            args.warmup_steps = min(100, max(1, args.max_steps // 10))
    if args.output_dir is None:
        args.output_dir = f"runs/finetune_{args.model_type}"
    if args.batch_tokens < args.seq_len:
        fail(prog, f"--batch-tokens ({args.batch_tokens}) must be at least --seq-len ({args.seq_len})")
    if args.sliding_window is not None and args.model_type != "mistral" and args.model is None:
        fail(prog, "--sliding-window applies to Mistral models (finetune_mistral.py or --model-type mistral)")
    args.packing = not args.no_packing
    return args
