"""The one training code path behind finetune_llama.py and finetune_mistral.py.

Run through ``accelerate launch``, or plain ``python`` for one process.  With
no arguments it trains a random-init model on the built-in corpus:

* on a GPU: an 8-layer, hidden-2048, 16-head / 4-KV-head model in bf16 (fp16
  on MI100) with fa_amd attention and fused rotary, for 300 steps;
* without a GPU: a tiny model for a few steps through the Triton interpreter
  in fp32, a smoke run that proves the path works end to end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import finetune_data as data

MODEL_TYPES = ("llama", "mistral")
ATTN_IMPLEMENTATIONS = ("fa_amd", "sdpa", "eager")
DTYPES = ("auto", "bf16", "fp16", "fp32")
CHECKPOINT_DIR_NAME = "checkpoints"
CHECKPOINT_PREFIX = "step_"
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
# Small enough that the Triton interpreter runs a step in seconds.
CPU_SHAPE = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)

# Defaults that depend on whether a GPU is there: (gpu, cpu).
DEVICE_DEFAULTS = {
    "seq_len": (2048, 64),
    "batch_tokens": (16384, 128),
    "max_steps": (300, 4),
    "log_every": (10, 1),
}
BUILTIN_VOCAB_SIZE = 8192


def build_parser(model_type: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(
            f"Fine-tune (or train from scratch) a {model_type.capitalize()}-style causal LM with fa_amd attention, "
            "through Hugging Face Accelerate. With no arguments: a random-init model on a built-in corpus "
            "(Python's own reference docs), no download needed."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="local path or hub name of a pretrained causal LM (loaded with from_pretrained); "
                            "default: a random-init model with the built-in tokenizer")
    model.add_argument("--model-type", choices=MODEL_TYPES, default=model_type,
                       help="architecture of the random-init model and which fused-rotary patch to apply")
    model.add_argument("--attn", choices=ATTN_IMPLEMENTATIONS, default="fa_amd", help="attention implementation")
    model.add_argument("--no-fused-rope", action="store_true",
                       help="with --attn fa_amd, keep the stock rotary embedding instead of fa_amd's fused one")
    model.add_argument("--dropout", type=float, default=None,
                       help="attention dropout (default: 0.1 for a random-init model, the checkpoint's value otherwise)")
    model.add_argument("--sliding-window", type=int, default=None,
                       help="Mistral sliding window (default for a random-init model: seq-len // 2, so it bites)")
    model.add_argument("--hidden-size", type=int, default=None, help="random-init model width (default: per device)")
    model.add_argument("--num-layers", type=int, default=None)
    model.add_argument("--num-heads", type=int, default=None)
    model.add_argument("--num-kv-heads", type=int, default=None)
    model.add_argument("--intermediate-size", type=int, default=None)
    model.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) instead of every weight")
    model.add_argument("--lora-r", type=int, default=16)
    model.add_argument("--lora-alpha", type=int, default=32)
    model.add_argument("--lora-dropout", type=float, default=0.05)
    model.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")

    dataset = parser.add_argument_group("data")
    dataset.add_argument("--dataset", default=None,
                         help="local .txt/.md/.json/.jsonl file or folder (read directly; in .txt, blank lines separate "
                              "documents), local .parquet/.csv, or a `datasets` hub name (both need `datasets`); "
                              "default: the built-in corpus")
    dataset.add_argument("--dataset-config", default=None, help="`datasets` config name for a hub dataset")
    dataset.add_argument("--dataset-split", default="train")
    dataset.add_argument("--text-column", default="text", help="column holding the text")
    dataset.add_argument("--seq-len", type=int, default=None,
                         help="longest sample in tokens; LONGER DOCUMENTS ARE SPLIT INTO CHUNKS of this length "
                              "(default: 2048 on GPU, 64 on CPU)")
    dataset.add_argument("--batch-tokens", type=int, default=None,
                         help="token budget per micro-batch per process: packed, the sum of sample lengths; "
                              "padded, rows x longest row (default: 16384 on GPU, 128 on CPU)")
    dataset.add_argument("--no-packing", action="store_true",
                         help="pad samples to the batch's longest (with attention_mask) instead of packing them "
                              "into one row with DataCollatorWithFlattening")

    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: 300 on GPU, 4 on CPU)")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate (default: 3e-4 random init, 2e-5 full fine-tune, 2e-4 LoRA; "
                            "1e-3 for the tiny CPU model)")
    train.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default: 10%% of max-steps, <= 100)")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--max-grad-norm", type=float, default=1.0)
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="compute precision (fp32 master weights + autocast; fp16 adds a GradScaler). "
                            "auto: bf16 on GPUs with bf16 (MI200/MI300, NVIDIA Ampere+), fp16 on MI100, fp32 on CPU")
    train.add_argument("--seed", type=int, default=0)

    out = parser.add_argument_group("output and checkpoints")
    out.add_argument("--output-dir", default=None, help=f"default: runs/finetune_{model_type}")
    out.add_argument("--save-every", type=int, default=100,
                     help="save a resumable checkpoint every N steps and at the last step (0: never)")
    out.add_argument("--keep-checkpoints", type=int, default=2, help="how many recent checkpoints to keep (0: all)")
    out.add_argument("--resume", nargs="?", const="latest", default=None,
                     help="resume from the latest checkpoint in --output-dir, or from the given checkpoint folder; "
                          "restores model, optimizer, scheduler, RNG and data-loader position")
    out.add_argument("--no-save-model", action="store_true", help="do not export the final model / adapter")
    out.add_argument("--log-every", type=int, default=None, help="print a log line every N steps")
    return parser


# --------------------------------------------------------------------------- environment


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def prepare_triton_interpreter() -> bool:
    """Switch Triton's interpreter on when there is no GPU; must run before fa_amd is imported."""
    if has_gpu():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def import_fa_amd():
    try:
        import fa_amd  # noqa: F401  (importing registers attn_implementation="fa_amd" with transformers)
        import fa_amd.integrations as integrations
    except ImportError as err:
        raise SystemExit(
            f"--attn fa_amd needs the fa_amd package importable ({err}). Install it with `pip install -e .` "
            f"from the repo root, or pick --attn sdpa / eager."
        ) from err
    return integrations


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


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the per-device defaults and check combinations that cannot work."""
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
    if args.dtype == "auto":
        args.dtype = default_dtype()
    if not gpu and args.dtype != "fp32":
        if args.dtype == "fp16":
            raise SystemExit("--dtype fp16 needs a GPU (the GradScaler path is GPU-only); use fp32 on CPU")
        if args.attn == "fa_amd":
            # The interpreter's bf16 tl.dot gives wrong results; fp32 is the one that is right on CPU.
            print("[recipe] no GPU: the Triton interpreter needs fp32, switching --dtype bf16 -> fp32", flush=True)
            args.dtype = "fp32"
    if args.dropout is None and args.model is None:
        args.dropout = 0.1
    if args.lr is None:
        if args.lora:
            args.lr = 2e-4
        elif args.model is not None:
            args.lr = 2e-5
        else:
            args.lr = 3e-4 if gpu else 1e-3
    if args.warmup_steps is None:
        args.warmup_steps = min(100, max(1, args.max_steps // 10))
    if args.output_dir is None:
        args.output_dir = f"runs/finetune_{args.model_type}"
    if args.seq_len < 2:
        raise SystemExit("--seq-len must be at least 2")
    if args.batch_tokens < args.seq_len:
        raise SystemExit(f"--batch-tokens ({args.batch_tokens}) must be at least --seq-len ({args.seq_len})")
    if args.max_steps < 1 or args.grad_accum < 1:
        raise SystemExit("--max-steps and --grad-accum must be positive")
    args.packing = not args.no_packing
    return args


# --------------------------------------------------------------------------- model


def build_model(args, tokenizer):
    """Random-init or pretrained causal LM with the chosen attention (and fused rotary for fa_amd)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    integrations = import_fa_amd() if args.attn == "fa_amd" else None
    # LoRA keeps the frozen base in the compute dtype (it gets no gradients);
    # trained weights stay fp32 and autocast runs the math in bf16/fp16.
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    weight_dtype = compute_dtype if args.lora else torch.float32

    if args.model is not None:
        config = AutoConfig.from_pretrained(args.model)
        overrides = {}
        if args.dropout is not None:
            overrides["attention_dropout"] = args.dropout
        if args.sliding_window is not None:
            overrides["sliding_window"] = args.sliding_window
        model = AutoModelForCausalLM.from_pretrained(
            args.model, attn_implementation=args.attn, dtype=weight_dtype, **overrides
        )
        args.model_type = model.config.model_type if model.config.model_type in MODEL_TYPES else args.model_type
    else:
        common = dict(
            vocab_size=len(tokenizer),
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_layers,
            num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_kv_heads,
            max_position_embeddings=max(4096, args.seq_len),
            attention_dropout=args.dropout,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            use_cache=False,
        )
        if args.model_type == "mistral":
            window = args.sliding_window or max(1, args.seq_len // 2)
            args.sliding_window = window
            config = AutoConfig.for_model("mistral", sliding_window=window, **common)
        else:
            config = AutoConfig.for_model("llama", **common)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn, dtype=weight_dtype)

    model.config.use_cache = False
    args.fused_rope = False
    if integrations is not None and not args.no_fused_rope:
        patch = {"llama": integrations.apply_fa_amd_to_llama, "mistral": integrations.apply_fa_amd_to_mistral}
        if model.config.model_type in patch:
            patch[model.config.model_type](model, rope=True, attention=True)
            args.fused_rope = True
        else:
            print(f"[recipe] no fused-rotary patch for model_type {model.config.model_type!r}; "
                  f"using fa_amd attention with the stock rotary", flush=True)

    if args.dropout is None:
        args.dropout = getattr(model.config, "attention_dropout", None)
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen (LoRA) bases and varlen kwargs.
        # Newer Transformers 5.x renamed the method; older ones only have the first name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=LORA_TARGET_MODULES, task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora_config)
    return model


def make_optimizer(model, args):
    import torch

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Norm gains and biases are not weights to shrink.
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = has_gpu()
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def make_scheduler(optimizer, args):
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)


# --------------------------------------------------------------------------- progress state


@dataclass
class TrainingProgress:
    """Everything about where training is that accelerate's save_state does not already hold.

    ``micro_batches_in_epoch`` counts the batches this process took from the
    current epoch's loader; on resume exactly that many are skipped.
    """

    step: int = 0
    epoch: int = 0
    micro_batches_in_epoch: int = 0
    micro_batches_total: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    history: list = field(default_factory=list)

    def state_dict(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_root(output_dir) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR_NAME


def list_checkpoints(output_dir) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_resume_checkpoint(resume: str, output_dir) -> Path:
    if resume == "latest":
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            raise SystemExit(f"--resume: no checkpoint under {checkpoint_root(output_dir)}")
        return checkpoints[-1]
    path = Path(resume)
    if not path.is_dir():
        raise SystemExit(f"--resume {resume}: no such checkpoint folder")
    # An output dir was given: take its latest checkpoint.
    if not (path / "custom_checkpoint_0.pkl").exists() and list_checkpoints(path):
        return list_checkpoints(path)[-1]
    return path


# --------------------------------------------------------------------------- metrics


def peak_memory_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_metrics(output_dir: Path, config: dict, progress: TrainingProgress, summary: dict) -> Path:
    path = output_dir / "metrics.json"
    path.write_text(json.dumps({"config": config, "summary": summary, "steps": progress.history}, indent=2))
    return path


def plot_loss_curve(output_dir: Path, history: list, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (loss_axis, speed_axis) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    loss_axis.plot(steps, [h["loss"] for h in history], label="train loss")
    loss_axis.set_ylabel("loss")
    loss_axis.set_title(title)
    loss_axis.grid(alpha=0.3)
    speed_axis.plot(steps, [h["tokens_per_s"] for h in history], color="tab:orange")
    speed_axis.set_ylabel("tokens/s")
    speed_axis.set_xlabel("step")
    speed_axis.grid(alpha=0.3)
    fig.tight_layout()
    path = output_dir / "loss_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def log(accelerator, message: str) -> None:
    if accelerator.is_main_process:
        from tqdm.auto import tqdm

        tqdm.write(f"[recipe] {message}")
        sys.stdout.flush()


def describe_run(args) -> str:
    model = args.model or (
        f"random-init {args.model_type} ({args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_heads} heads / {args.num_kv_heads} KV heads)"
    )
    return (f"{model}, attn={args.attn}{' + fused rotary' if args.fused_rope else ''}, dtype={args.dtype}, "
            f"{'packed' if args.packing else 'padded'} batches of <= {args.batch_tokens} tokens, seq-len {args.seq_len}, "
            f"dropout={args.dropout}, {'LoRA' if args.lora else 'full fine-tune'}, {args.max_steps} steps")


def main(model_type: str = "llama", argv=None) -> dict:
    try:
        return train(model_type, argv)
    except data.DataError as err:
        # A problem with the user's data: say what it is, no traceback.
        raise SystemExit(f"data error: {err}") from None


def train(model_type: str, argv=None) -> dict:
    args = build_parser(model_type).parse_args(argv)
    interpreting = prepare_triton_interpreter()
    args = resolve_args(args)

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    mixed_precision = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[args.dtype]
    # The scheduler is stepped by hand once per optimizer step; accelerate's
    # default would step it once per process per step.
    accelerator = Accelerator(mixed_precision=mixed_precision, step_scheduler_with_optimizer=False)
    output_dir = Path(args.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)

    if interpreting:
        log(accelerator,
            "no GPU found: this is a CPU smoke run - a tiny model for a few steps through the Triton interpreter "
            "in fp32. It shows the pipeline works; it is not the real recipe. On a ROCm or CUDA GPU the same "
            "command trains an 8-layer / hidden-2048 / 16-head (4 KV heads) model in bf16 for 300 steps.")

    # --- data (the local main process builds the corpus/tokenizer caches first, the others read them)
    with accelerator.local_main_process_first():
        if args.model is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            texts = data.load_texts(args.dataset, args.text_column, args.dataset_split, args.dataset_config)
        else:
            texts = data.load_texts(args.dataset, args.text_column, args.dataset_split, args.dataset_config)
            corpus_for_tokenizer = texts if args.dataset is None else data.load_builtin_corpus()
            tokenizer = data.builtin_tokenizer(corpus_for_tokenizer, BUILTIN_VOCAB_SIZE)
    samples, data_stats = data.tokenize_and_chunk(texts, tokenizer, args.seq_len)
    log(accelerator,
        f"data: {data_stats['documents']} documents -> {data_stats['samples']} samples, {data_stats['tokens']} tokens; "
        f"{data_stats['documents_split']} documents longer than --seq-len {args.seq_len} were split into "
        f"{args.seq_len}-token chunks")
    sampler = data.TokenBudgetBatchSampler(
        [len(s) for s in samples], args.batch_tokens, packed=args.packing, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(
        data.TokenSamples(samples), batch_sampler=sampler,
        collate_fn=data.make_collator(args.packing, tokenizer.pad_token_id), num_workers=0,
        # Its own generator: a DataLoader iterator otherwise draws its base seed
        # from the global RNG, and a resumed run (which starts a fresh iterator
        # mid-epoch) would shift the dropout stream by that draw.
        generator=torch.Generator().manual_seed(args.seed),
    )

    # --- model and optimizer (same init on every rank; dropout streams differ per rank)
    set_seed(args.seed)
    model = build_model(args, tokenizer)
    set_seed(args.seed + accelerator.process_index)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log(accelerator, f"run: {describe_run(args)}; {accelerator.num_processes} process(es) on {accelerator.device}")
    log(accelerator, f"parameters: {total / 1e6:.2f}M total, {trainable / 1e6:.2f}M trained")

    if args.resume is not None:
        checkpoint = find_resume_checkpoint(args.resume, output_dir)
        accelerator.load_state(str(checkpoint))
        optimizer_states = len(optimizer.state_dict()["state"])
        log(accelerator,
            f"resumed from {checkpoint}: step {progress.step}, epoch {progress.epoch}, skipping "
            f"{progress.micro_batches_in_epoch} micro-batches already seen this epoch; optimizer state for "
            f"{optimizer_states} parameter tensors restored, lr {scheduler.get_last_lr()[0]:.3e}")
        if progress.step >= args.max_steps:
            log(accelerator, f"checkpoint is already at step {progress.step} >= --max-steps {args.max_steps}")

    device = accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def save_checkpoint():
        path = checkpoint_root(output_dir) / f"{CHECKPOINT_PREFIX}{progress.step:07d}"
        accelerator.save_state(str(path))
        if accelerator.is_main_process and args.keep_checkpoints > 0:
            for old in list_checkpoints(output_dir)[: -args.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        log(accelerator, f"saved checkpoint {path}")

    model.train()
    bar = tqdm(total=args.max_steps, initial=progress.step, disable=not accelerator.is_main_process,
               desc=f"{args.model_type}/{args.attn}", dynamic_ncols=True)
    step_loss = torch.zeros((), device=device)
    step_tokens = 0
    step_slots = 0  # tokens computed, padding included
    step_checksum = 0
    step_started = time.perf_counter()
    while progress.step < args.max_steps:
        sampler.set_epoch(progress.epoch)
        loader.set_epoch(progress.epoch)
        epoch_loader = (accelerator.skip_first_batches(loader, progress.micro_batches_in_epoch)
                        if progress.micro_batches_in_epoch else loader)
        for batch in epoch_loader:
            step_tokens += data.real_token_count(batch)
            step_slots += batch["input_ids"].numel()
            step_checksum += int(batch["input_ids"].sum())
            last_micro_batch = (progress.micro_batches_total + 1) % args.grad_accum == 0
            # Gradients are all-reduced on the last micro-batch of a step only.
            sync_context = accelerator.no_sync(model) if not last_micro_batch else contextlib.nullcontext()
            with sync_context:
                loss = model(**batch).loss / args.grad_accum
                accelerator.backward(loss)
            step_loss += loss.detach()
            progress.micro_batches_in_epoch += 1
            progress.micro_batches_total += 1
            if not last_micro_batch:
                continue

            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1

            # One all-reduce for loss / tokens / checksum: it also times the step honestly on GPU.
            totals = accelerator.reduce(
                torch.tensor([step_loss.item(), step_tokens, step_checksum, step_slots], device=device,
                             dtype=torch.float64),
                reduction="sum",
            ).tolist()
            elapsed = time.perf_counter() - step_started
            mean_loss = totals[0] / accelerator.num_processes
            tokens = int(totals[1])
            progress.tokens_seen += tokens
            progress.train_seconds += elapsed
            record = {
                "step": progress.step,
                "loss": mean_loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": tokens,
                "tokens_per_s": tokens / elapsed,
                "padding_fraction": 1 - tokens / totals[3],
                "peak_mem_gb": peak_memory_gb(device),
                "step_seconds": elapsed,
                "epoch": progress.epoch,
                "data_checksum": int(totals[2]),
            }
            progress.history.append(record)
            if not math.isfinite(mean_loss):
                raise SystemExit(f"loss became {mean_loss} at step {progress.step}; lower --lr or check the data")
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            peak_gb=f"{record['peak_mem_gb']:.2f}")
            if progress.step % args.log_every == 0 or progress.step == args.max_steps:
                log(accelerator,
                    f"step {progress.step}/{args.max_steps} loss {mean_loss:.4f} lr {record['lr']:.2e} "
                    f"tokens/s {record['tokens_per_s']:,.0f} peak mem {record['peak_mem_gb']:.2f} GB")
            if args.save_every > 0 and (progress.step % args.save_every == 0 or progress.step == args.max_steps):
                save_checkpoint()
            step_loss.zero_()
            step_tokens = 0
            step_slots = 0
            step_checksum = 0
            step_started = time.perf_counter()
            if progress.step >= args.max_steps:
                break
        else:
            # The epoch ran out: the next one reshuffles with its own seed.
            progress.epoch += 1
            progress.micro_batches_in_epoch = 0
    bar.close()

    summary = summarize(progress, accelerator)
    config = run_config(args, accelerator, data_stats, model, trainable, total)
    if accelerator.is_main_process:
        metrics_path = write_metrics(output_dir, config, progress, summary)
        plot_path = plot_loss_curve(output_dir, progress.history, f"{args.model_type} / {args.attn} / "
                                    f"{'packed' if args.packing else 'padded'} / {args.dtype}")
        log(accelerator, f"metrics: {metrics_path}, loss curve: {plot_path}")
    if not args.no_save_model:
        save_final_model(accelerator, model, tokenizer, output_dir / "final_model")
    log(accelerator,
        f"done: {progress.step} steps, final loss {summary.get('final_loss', float('nan')):.4f}, "
        f"{summary.get('median_tokens_per_s', 0):,.0f} tokens/s (median step), "
        f"peak memory {summary.get('peak_mem_gb', 0):.2f} GB")
    if interpreting:
        log(accelerator, "that was the CPU smoke run. For the real thing run the same command on a machine with a "
                         f"ROCm or CUDA GPU: `accelerate launch recipes/finetune_{args.model_type}.py` "
                         "(multi-GPU: --config_file recipes/configs/multi_gpu_ddp.yaml; docs/RECIPES.md)")
    accelerator.end_training()
    return {"summary": summary, "output_dir": str(output_dir)}


def summarize(progress: TrainingProgress, accelerator) -> dict:
    history = progress.history
    if not history:
        return {"steps": progress.step}
    # The first steps include kernel compilation / autotuning; leave them out of the speed.
    timed = history[min(len(history) - 1, max(1, len(history) // 10)):]
    seconds = sum(h["step_seconds"] for h in timed)
    return {
        "steps": progress.step,
        "final_loss": history[-1]["loss"],
        "first_loss": history[0]["loss"],
        "min_loss": min(h["loss"] for h in history),
        "tokens_seen": progress.tokens_seen,
        "mean_tokens_per_s": sum(h["tokens"] for h in timed) / seconds if seconds > 0 else 0.0,
        # Robust to the odd step that recompiles a kernel for a new shape.
        "median_tokens_per_s": statistics.median(h["tokens_per_s"] for h in timed),
        "peak_mem_gb": max(h["peak_mem_gb"] for h in history),
        "train_seconds": progress.train_seconds,
        "num_processes": accelerator.num_processes,
    }


def run_config(args, accelerator, data_stats, model, trainable, total) -> dict:
    import platform

    import torch
    import transformers

    device = accelerator.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    config.update({
        "data": data_stats,
        "parameters_total": total,
        "parameters_trained": trainable,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hip": torch.version.hip,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    })
    return config


def save_final_model(accelerator, model, tokenizer, path: Path) -> None:
    # get_state_dict gathers FSDP shards; every rank must call it.
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(str(path), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(path))
        log(accelerator, f"final {'adapter' if hasattr(unwrapped, 'peft_config') else 'model'} saved to {path}")
    accelerator.wait_for_everyone()
