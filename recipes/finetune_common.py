"""The one training code path behind finetune_llama.py and finetune_mistral.py.

Run through ``accelerate launch``, or plain ``python`` for one process.  With
no arguments it trains a random-init model on the built-in corpus:

* on a GPU: an 8-layer, hidden-2048, 16-head / 4-KV-head model in bf16 (fp16
  on MI100) with fa_amd attention and fused rotary, for 300 steps;
* without a GPU: a tiny model (2 layers, hidden 64, 2 heads / 1 KV head) for
  20 steps through the Triton interpreter in fp32, about a minute on two
  cores, in which the loss falls from 9.0 to about 7.

Options are in finetune_options.py, checkpoint and output-folder safety in
finetune_checkpoints.py, data in finetune_data.py.  A run never ends with a
model poisoned by NaN: a non-finite loss or gradient stops it (exit status 1)
unless --skip-nonfinite-steps drops such steps, and NaN weights are never
saved.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import finetune_data as data
from finetune_checkpoints import (  # noqa: F401  (re-exported: the tests and bench_train use these names)
    CHECKPOINT_DIR_NAME, CHECKPOINT_PREFIX, MARKER, WRITE_ERRNOS, RecipeError, any_process, atomic_write_text,
    check_free_space, check_output_dir, check_resume_config, checkpoint_problem, checkpoint_root, describe_os_error,
    find_resume_checkpoint, human_size, list_checkpoints, missing_rng_states, new_run_id, read_marker,
    replace_folder, resume_candidates, rotate_checkpoints, write_checkpoint,
)
from finetune_options import (  # noqa: F401  (re-exported)
    ATTN_IMPLEMENTATIONS, CPU_SHAPE, DEVICE_DEFAULTS, DTYPES, GPU_SHAPE, MODEL_TYPES, ModelShape, build_parser,
    check_model_shape, default_dtype, has_gpu, resolve_args,
)

LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUILTIN_VOCAB_SIZE = 8192
# --skip-nonfinite-steps gives up after this many bad steps in a row: the run is diverging.
MAX_CONSECUTIVE_SKIPS = 10


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# --------------------------------------------------------------------------- environment


def prepare_triton_interpreter(tile: int | None = None) -> bool:
    """Switch Triton's interpreter on when there is no GPU; must run before fa_amd is imported.

    ``tile``: run the attention kernels with ``tile x tile`` blocks.  fa_amd's
    own CPU table uses small 32x16 tiles so its tests reach the masked paths on
    short sequences; the interpreter runs each program in Python, so a recipe
    whose samples fit one tile runs ~2-3x faster with it.  The tiles go in
    through fa_amd's documented tuned-table mechanism (a table under
    FA_AMD_CACHE_DIR), and only when the user has not set FA_AMD_CACHE_DIR.
    """
    if has_gpu():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    if tile and "FA_AMD_CACHE_DIR" not in os.environ:
        os.environ["FA_AMD_CACHE_DIR"] = str(data.interpreter_tile_table(tile))
    return True


def interpreter_tile(seq_len: int) -> int:
    """The attention tile for the interpreter: one tile covers a sample (16..128)."""
    return min(128, max(16, 1 << (seq_len - 1).bit_length()))


def import_fa_amd():
    try:
        import fa_amd  # noqa: F401  (importing registers attn_implementation="fa_amd" with transformers)
        import fa_amd.integrations as integrations
    except ImportError as err:
        raise RecipeError(
            f"--attn fa_amd needs the fa_amd package importable ({err}). Install it with `pip install -e .` "
            f"from the repo root, or pick --attn sdpa / eager."
        ) from err
    return integrations


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
        overrides = {}
        if args.dropout is not None:
            overrides["attention_dropout"] = args.dropout
        if args.sliding_window is not None:
            overrides["sliding_window"] = args.sliding_window
        try:
            model = AutoModelForCausalLM.from_pretrained(
                args.model, attn_implementation=args.attn, dtype=weight_dtype, **overrides
            )
        except (OSError, ValueError) as err:  # not found, offline, not a causal LM, broken files
            raise RecipeError(f"--model {args.model}: could not load it: {first_line(err)}") from None
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


def follow_this_runs_schedule(scheduler, optimizer, args) -> None:
    """After a resume: the learning rate of the step the run is at under this run's schedule (--lr, --max-steps,
    --warmup-steps), not the one the checkpoint's optimizer stopped at.  A run trained further with a larger
    --max-steps had ended its cosine at lr 0 and trained its first resumed step at 0; an exact continuation gets
    the value it restored."""
    inner = getattr(scheduler, "scheduler", scheduler)  # (accelerate's wrapper)
    inner.base_lrs = [args.lr] * len(optimizer.param_groups)
    for group, rule in zip(optimizer.param_groups, inner.lr_lambdas):
        group["initial_lr"] = args.lr
        group["lr"] = args.lr * rule(inner.last_epoch)
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]


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
    skipped_steps: int = 0
    history: list = field(default_factory=list)

    def state_dict(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


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
    atomic_write_text(path, json.dumps({"config": config, "summary": summary, "steps": progress.history}, indent=2))
    return path


def smoothed(values: list, window: int) -> list:
    """Trailing mean over ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_figure(history: list, title: str):
    """The loss (each step, and a running mean) and tokens/s against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    fig, (loss_axis, speed_axis) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                                gridspec_kw={"height_ratios": [2, 1]})
    loss_axis.plot(steps, losses, marker="o" if len(steps) <= 60 else None, markersize=3, linewidth=1,
                   label="train loss (each step)")
    window = max(3, len(steps) // 10)
    if len(steps) >= 2 * window:
        loss_axis.plot(steps, smoothed(losses, window), linewidth=2, label=f"mean of the last {window} steps")
    if losses:
        # The axis spans the whole fall, from the start (ln(vocab) for a random init) down.
        low, high = min(losses), max(losses)
        pad = max(0.05 * (high - low), 0.05)
        loss_axis.set_ylim(low - pad, high + pad)
        if losses[0]:
            loss_axis.annotate(f"step {steps[0]}: {losses[0]:.3f}, step {steps[-1]}: {losses[-1]:.3f} "
                               f"({(losses[-1] - losses[0]) / losses[0]:+.1%})",
                               xy=(0.99, 0.97), xycoords="axes fraction", ha="right", va="top")
    loss_axis.set_ylabel("loss")
    loss_axis.set_title(title)
    loss_axis.grid(alpha=0.3)
    loss_axis.legend(loc="lower left")
    loss_axis.ticklabel_format(axis="y", useOffset=False)
    speed_axis.plot(steps, [h["tokens_per_s"] for h in history], color="tab:orange")
    speed_axis.set_ylabel("tokens/s")
    speed_axis.set_xlabel("optimizer step")
    speed_axis.grid(alpha=0.3)
    speed_axis.ticklabel_format(axis="y", useOffset=False, style="plain")
    speed_axis.set_ylim(bottom=0)
    # Steps are whole numbers: no ticks at 1.5.
    speed_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps:
        speed_axis.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    fig.tight_layout()
    return fig


def plot_loss_curve(output_dir: Path, history: list, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig = loss_figure(history, title)
    path = output_dir / "loss_curve.png"
    tmp = output_dir / ".tmp-loss_curve.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- main


def log(accelerator, message: str) -> None:
    if accelerator is None or accelerator.is_main_process:
        from tqdm.auto import tqdm

        tqdm.write(f"[recipe] {message}")
        sys.stdout.flush()


def warn(accelerator, message: str) -> None:
    log(accelerator, f"warning: {message}")


def describe_run(args) -> str:
    model = args.model or (
        f"random-init {args.model_type} ({args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_heads} heads / {args.num_kv_heads} KV head{'s' if args.num_kv_heads != 1 else ''})"
    )
    return (f"{model}, attn={args.attn}{' + fused rotary' if args.fused_rope else ''}, dtype={args.dtype}, "
            f"{'packed' if args.packing else 'padded'} batches of <= {args.batch_tokens} tokens, seq-len {args.seq_len}, "
            f"dropout={args.dropout}, {'LoRA' if args.lora else 'full fine-tune'}, {args.max_steps} steps, "
            f"lr {args.lr:g} (warmup {args.warmup_steps})")


def main(model_type: str = "llama", argv=None) -> dict:
    """Train; a problem the user must fix ends the process with one line and exit status 1 (2 for bad options)."""
    prog = f"finetune_{model_type}.py"
    try:
        return train(model_type, argv)
    except data.DataError as err:
        # A problem with the user's data: say what it is, no traceback.
        raise SystemExit(f"data error: {err}") from None
    except RecipeError as err:
        raise SystemExit(f"{prog}: error: {err}") from None
    except OSError as err:
        if err.errno in WRITE_ERRNOS:
            raise SystemExit(f"{prog}: error: {describe_os_error(err, str(err.filename or 'writing output'))}") from None
        raise


def on_main_then_all(accelerator, fn):
    """Run ``fn`` on the main process; a RecipeError there stops every process (none is left waiting)."""
    error = None
    if accelerator.is_main_process:
        try:
            fn()
        except RecipeError as err:
            error = err
    if any_process(accelerator, error is not None):
        raise error or RecipeError("stopped: the main process found a problem (see its message)")


def data_fingerprint(samples) -> str:
    """sha256 of the tokenized samples: a resumed run must see the same batches."""
    import numpy as np

    digest = hashlib.sha256()
    digest.update(np.asarray([len(s) for s in samples], dtype=np.int64).tobytes())
    digest.update(np.fromiter((t for s in samples for t in s), dtype=np.int64).tobytes())
    return digest.hexdigest()


def run_signature(args, model, data_sha: str, num_processes: int) -> dict:
    """What a checkpoint records about its run, for the resume check (finetune_checkpoints.MUST_MATCH)."""
    config = model.config
    if hasattr(model, "get_base_model"):  # PEFT: the base model's shape
        config = model.get_base_model().config
    return {
        "model": args.model, "model_type": config.model_type, "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers, "num_heads": config.num_attention_heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "intermediate_size": getattr(config, "intermediate_size", None), "vocab_size": config.vocab_size,
        "sliding_window": getattr(config, "sliding_window", None),
        "lora": args.lora, "lora_r": args.lora_r if args.lora else None,
        "lora_alpha": args.lora_alpha if args.lora else None, "lora_dropout": args.lora_dropout if args.lora else None,
        "dataset": args.dataset, "dataset_config": args.dataset_config, "dataset_split": args.dataset_split,
        "text_column": args.text_column, "data_sha256": data_sha, "seq_len": args.seq_len, "packing": args.packing,
        "batch_tokens": args.batch_tokens, "grad_accum": args.grad_accum, "seed": args.seed,
        "num_processes": num_processes, "dtype": args.dtype,
        "max_steps": args.max_steps, "lr": args.lr, "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm, "dropout": args.dropout,
        "attn": args.attn,
    }


def nonfinite_tensors(accelerator, tensors) -> int:
    """How many of ``tensors`` (or shards) hold NaN/inf, summed over the processes; 0 means all finite. One sync."""
    import torch

    # FSDP2 parameters and their optimizer states are DTensors: check each process's own shard.
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    flags = [torch.isfinite(t.detach()).all().to(accelerator.device) for t in local if t.numel()]
    bad = (~torch.stack(flags)).sum().float() if flags else torch.zeros((), device=accelerator.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad.reshape(1), reduction="sum")
    return int(bad.sum().item())


def optimizer_tensors(optimizer):
    """The floating-point state tensors (AdamW moments) of a (possibly accelerate-wrapped) optimizer."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return [v for state in inner.state.values() for v in state.values()
            if hasattr(v, "dtype") and v.dtype.is_floating_point]


def shared_run_id(accelerator) -> str:
    """A new run id, the same on every process (rank 0's): each rank saves its part of a checkpoint into the
    folder the id names, and only rank 0 completes it (audit 2026-11-28: ids drawn per rank left rank 1's
    files in a stray folder, so multi-process checkpoints were incomplete)."""
    ids = [new_run_id()]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(ids, from_process=0)
    return ids[0]


def _rescale_data_position(accelerator, progress, marker: dict) -> None:
    """A checkpoint of another process count (--allow-resume-mismatch): micro_batches_in_epoch counts one
    process's batches, so the batches all of them took are spread over this run's processes (approximately:
    such a resume is not exact anyway)."""
    saved = (marker.get("config") or {}).get("num_processes")
    if isinstance(saved, int) and saved > 0 and saved != accelerator.num_processes:
        taken = progress.micro_batches_in_epoch * saved
        progress.micro_batches_in_epoch = -(-taken // accelerator.num_processes)


def resume_training(args, accelerator, model, optimizer, progress, signature, output_dir) -> tuple[str, Path]:
    """Load the newest usable checkpoint (damaged ones are skipped with a warning): (its run id, its folder)."""
    candidates, explicit = resume_candidates(args.resume, output_dir)
    for checkpoint in candidates:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            marker = check_resume_config(checkpoint, signature, args.allow_resume_mismatch,
                                         warn=lambda m: warn(accelerator, m))
            try:
                accelerator.load_state(str(checkpoint))
                failed = False
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # unreadable safetensors / torch files, a missing FSDP shard (torch's
                # CheckpointException is a BaseException): a damaged checkpoint
                failed, problem = True, f"cannot load it ({first_line(err)})"
            if not any_process(accelerator, failed):
                bad = nonfinite_tensors(accelerator, list(model.parameters()) + optimizer_tensors(optimizer))
                if bad == 0:
                    missing = [i for i in range(accelerator.num_processes) if missing_rng_states(checkpoint, i)]
                    if missing:
                        warn(accelerator, f"{checkpoint} has no RNG state for process(es) {missing}: model, optimizer, "
                                          f"schedule and data position are restored, but dropout draws differ, so the "
                                          f"resumed run is not an exact continuation")
                    _rescale_data_position(accelerator, progress, marker)
                    return marker.get("run_id") or shared_run_id(accelerator), checkpoint
                problem = "its weights or optimizer state hold NaN/inf"
            elif problem is None:
                problem = "another process could not load its part"
        if explicit or (args.allow_resume_mismatch and problem.startswith("cannot load")):
            raise RecipeError(f"--resume {checkpoint}: cannot resume from it: {problem}")
        warn(accelerator, f"skipping damaged checkpoint {checkpoint}: {problem}")
    raise RecipeError(f"--resume: no usable checkpoint under {checkpoint_root(output_dir)} "
                      f"(all {len(candidates)} are damaged, see the warnings above)")


def train(model_type: str, argv=None) -> dict:
    args = build_parser(model_type).parse_args(argv)
    args = resolve_args(args)
    interpreting = prepare_triton_interpreter(tile=interpreter_tile(args.seq_len))

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    mixed_precision = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[args.dtype]
    # The scheduler is stepped by hand once per optimizer step; accelerate's
    # default would step it once per process per step.
    # cpu: on a machine without a GPU, a multi-process launch (WORLD_SIZE > 1) runs gloo DDP; without it each
    # process ran a one-process job of its own into the same folder
    accelerator = Accelerator(mixed_precision=mixed_precision, step_scheduler_with_optimizer=False,
                              cpu=not has_gpu())
    output_dir = Path(args.output_dir)
    # Before any work: a file, an unwritable folder, or another run's checkpoints stop the run here.
    on_main_then_all(accelerator, lambda: check_output_dir(
        output_dir, fresh_run=args.resume is None, overwrite=args.overwrite_output_dir,
        log=lambda m: log(accelerator, m)))

    if interpreting:
        log(accelerator,
            f"no GPU found: a CPU run - a tiny model for {args.max_steps} steps through the Triton interpreter in "
            f"fp32 (about a minute on two cores), enough to see the loss fall. It shows the pipeline works and "
            f"learns; it is not the real recipe. On a ROCm or CUDA GPU the same command trains an 8-layer / "
            f"hidden-2048 / 16-head (4 KV heads) model in bf16 for 300 steps.")

    # --- data (the local main process builds the corpus/tokenizer caches first, the others read them)
    with accelerator.local_main_process_first():
        if args.model is not None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(args.model)
            except (OSError, ValueError) as err:
                raise RecipeError(f"--model {args.model}: could not load its tokenizer: {first_line(err)}") from None
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            texts = data.load_texts(args.dataset, args.text_column, args.dataset_split, args.dataset_config)
        else:
            texts = data.load_texts(args.dataset, args.text_column, args.dataset_split, args.dataset_config)
            corpus_for_tokenizer = texts if args.dataset is None else data.load_builtin_corpus()
            tokenizer = data.builtin_tokenizer(corpus_for_tokenizer, BUILTIN_VOCAB_SIZE)
    samples, data_stats = data.tokenize_and_chunk(texts, tokenizer, args.seq_len)
    data_sha = data_fingerprint(samples)
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
    signature = run_signature(args, model, data_sha, accelerator.num_processes)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kind = accelerator.distributed_type.value
    log(accelerator, f"run: {describe_run(args)}; {accelerator.num_processes} process(es) on {accelerator.device}"
                     + (f" ({kind})" if accelerator.num_processes > 1 else ""))
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and kind != "FSDP":
        warn(accelerator, f"the Accelerate config asks for FSDP, but Accelerate runs {kind} here (it uses FSDP on "
                          f"GPUs only): every process holds the whole model")
    log(accelerator, f"parameters: {total / 1e6:.2f}M total, {trainable / 1e6:.2f}M trained")

    if args.resume is not None:
        run_id, checkpoint = resume_training(args, accelerator, model, optimizer, progress, signature, output_dir)
        follow_this_runs_schedule(scheduler, optimizer, args)
        optimizer_states = len(optimizer.state_dict()["state"])
        log(accelerator,
            f"resumed from {checkpoint} (run {run_id}): step {progress.step}, "
            f"epoch {progress.epoch}, skipping {progress.micro_batches_in_epoch} micro-batches already seen this "
            f"epoch; optimizer state for {optimizer_states} parameter tensors restored, "
            f"lr {scheduler.get_last_lr()[0]:.3e}")
        if progress.step >= args.max_steps:
            log(accelerator, f"checkpoint is already at step {progress.step} >= --max-steps {args.max_steps}")
    else:
        run_id = shared_run_id(accelerator)
        log(accelerator, f"run id {run_id} (its checkpoints carry it; rotation deletes no other run's)")

    # --- the disk must hold what the run writes (checkpoints kept at once + the final model)
    weight_bytes = next(model.parameters()).element_size()
    checkpoint_bytes = total * weight_bytes + trainable * 8 + (1 << 20)
    saves = ([s for s in range(progress.step + 1, args.max_steps + 1)
              if s % args.save_every == 0 or s == args.max_steps] if args.save_every > 0 else [])
    held = len(saves) if args.keep_checkpoints == 0 else min(len(saves), args.keep_checkpoints + 1)
    final_bytes = 0 if args.no_save_model else (trainable if args.lora else total) * 4
    on_main_then_all(accelerator, lambda: check_free_space(
        output_dir, held * checkpoint_bytes + final_bytes,
        f"{held} checkpoint(s) of {human_size(checkpoint_bytes)} and a final model of {human_size(final_bytes)}"))

    device = accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def save_checkpoint():
        weights_ok = nonfinite_tensors(accelerator, list(model.parameters())) == 0
        path = write_checkpoint(accelerator, output_dir, progress.step, run_id, signature,
                                {"lr": args.lr, "max_steps": args.max_steps}, weights_ok)
        if accelerator.is_main_process:
            for old in rotate_checkpoints(output_dir, run_id, args.keep_checkpoints):
                log(accelerator, f"deleted older checkpoint {old.name} of this run (--keep-checkpoints "
                                 f"{args.keep_checkpoints})")
        accelerator.wait_for_everyone()
        log(accelerator, f"saved checkpoint {path}")

    def stop(reason: str, skippable: bool = True):
        """A non-finite step: keep the metrics so far, write no model, exit non-zero."""
        if accelerator.is_main_process:
            summary = dict(summarize(progress, accelerator), stopped=reason)
            write_metrics(output_dir, run_config(args, accelerator, data_stats, model, trainable, total, run_id),
                          progress, summary)
        hint = (", or pass --skip-nonfinite-steps to drop such steps"
                if skippable and not args.skip_nonfinite_steps else "")
        raise RecipeError(f"{reason}. Training stopped; no final model was written (the last checkpoint, if any, "
                          f"is intact). Lower --lr or check the data{hint}")

    trainable_params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    bar = tqdm(total=args.max_steps, initial=progress.step, disable=not accelerator.is_main_process,
               desc=f"{args.model_type}/{args.attn}", dynamic_ncols=True)
    step_loss = torch.zeros((), device=device)
    step_tokens = 0
    step_slots = 0  # tokens computed, padding included
    step_checksum = 0
    consecutive_skips = 0
    clip_to = args.max_grad_norm if args.max_grad_norm > 0 else math.inf
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

            # The norm before clipping (inf max norm: no clipping); the same on every process.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_to)
            # One all-reduce for loss / tokens / checksum, before the update: a NaN
            # on any process stops (or skips) the step on all of them.
            totals = accelerator.reduce(
                torch.tensor([step_loss.item(), step_tokens, step_checksum, step_slots], device=device,
                             dtype=torch.float64),
                reduction="sum",
            ).tolist()
            mean_loss = totals[0] / accelerator.num_processes
            norm = float(grad_norm) if grad_norm is not None else 0.0
            # fp16: an inf gradient norm is the GradScaler's business (it skips the update and lowers the scale).
            scaler_handles_it = args.dtype == "fp16" and math.isfinite(mean_loss)
            if not math.isfinite(mean_loss) or (not math.isfinite(norm) and not scaler_handles_it):
                what = f"non-finite {'loss' if not math.isfinite(mean_loss) else 'gradient'} at step " \
                       f"{progress.step + 1} (loss {mean_loss}, gradient norm {norm})"
                if not args.skip_nonfinite_steps:
                    bar.close()
                    stop(what)
                optimizer.zero_grad(set_to_none=True)
                progress.skipped_steps += 1
                consecutive_skips += 1
                warn(accelerator, f"{what}: step dropped (--skip-nonfinite-steps; {progress.skipped_steps} so far)")
                if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                    bar.close()
                    stop(f"{consecutive_skips} non-finite steps in a row (the run diverged)", skippable=False)
                step_loss.zero_()
                step_tokens = step_slots = step_checksum = 0
                step_started = time.perf_counter()
                if progress.step >= args.max_steps:
                    break
                continue
            consecutive_skips = 0
            step_lr = scheduler.get_last_lr()[0]  # (the rate this update uses; the scheduler then moves on)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            # A finite loss and gradient can still push weights to inf (a huge --lr): stop before they train on.
            if nonfinite_tensors(accelerator, trainable_params):
                bar.close()
                stop(f"the update of step {progress.step} made weights non-finite (loss {mean_loss:.4f}, "
                     f"gradient norm {norm:.3g}, lr {step_lr:.3g})", skippable=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's time includes its update
            elapsed = time.perf_counter() - step_started
            tokens = int(totals[1])
            progress.tokens_seen += tokens
            progress.train_seconds += elapsed
            record = {
                "step": progress.step,
                "loss": mean_loss,
                "lr": step_lr,
                "grad_norm": norm if grad_norm is not None else None,
                "tokens": tokens,
                "tokens_per_s": tokens / elapsed,
                "padding_fraction": 1 - tokens / totals[3],
                "peak_mem_gb": peak_memory_gb(device),
                "step_seconds": elapsed,
                "epoch": progress.epoch,
                "data_checksum": int(totals[2]),
            }
            progress.history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            peak_gb=f"{record['peak_mem_gb']:.2f}")
            if progress.step % args.log_every == 0 or progress.step == args.max_steps or progress.step == 1:
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
    config = run_config(args, accelerator, data_stats, model, trainable, total, run_id)
    if accelerator.is_main_process:
        metrics_path = write_metrics(output_dir, config, progress, summary)
        plot_path = plot_loss_curve(output_dir, progress.history, f"{args.model_type} / {args.attn} / "
                                    f"{'packed' if args.packing else 'padded'} / {args.dtype}")
        log(accelerator, f"metrics: {metrics_path}, loss curve: {plot_path}")
    if not args.no_save_model:
        if nonfinite_tensors(accelerator, list(model.parameters())):
            raise RecipeError("the trained weights hold NaN/inf; no final model was written")
        save_final_model(accelerator, model, tokenizer, output_dir / "final_model")
    first, final = summary.get("first_loss"), summary.get("final_loss")
    change = f" ({(final - first) / first:+.0%} from step 1's {first:.4f})" if first and final is not None else ""
    log(accelerator,
        f"done: {progress.step} steps, final loss {summary.get('final_loss', float('nan')):.4f}{change}, "
        f"{summary.get('median_tokens_per_s', 0):,.0f} tokens/s (median step), "
        f"peak memory {summary.get('peak_mem_gb', 0):.2f} GB")
    if progress.skipped_steps:
        warn(accelerator, f"{progress.skipped_steps} non-finite step(s) were dropped (--skip-nonfinite-steps)")
    if interpreting:
        log(accelerator, "that was the CPU run. For the real thing run the same command on a machine with a "
                         f"ROCm or CUDA GPU: `accelerate launch recipes/finetune_{args.model_type}.py` "
                         "(multi-GPU: --config_file recipes/configs/multi_gpu_ddp.yaml; docs/RECIPES.md)")
    accelerator.end_training()
    return {"summary": summary, "output_dir": str(output_dir), "run_id": run_id}


def summarize(progress: TrainingProgress, accelerator) -> dict:
    history = progress.history
    if not history:
        return {"steps": progress.step, "skipped_steps": progress.skipped_steps}
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
        "skipped_steps": progress.skipped_steps,
    }


def run_config(args, accelerator, data_stats, model, trainable, total, run_id=None) -> dict:
    import platform

    import torch
    import transformers

    device = accelerator.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    config.update({
        "run_id": run_id,
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
    """save_pretrained into a temporary folder, then renamed over ``path``: a kill never leaves half a model."""
    # get_state_dict gathers FSDP shards; every rank must call it.
    state_dict = accelerator.get_state_dict(model)
    error = None
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
        try:
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            replace_folder(tmp, path)
        except OSError as err:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            error = RecipeError(describe_os_error(err, f"could not write the final model to {path}"))
        else:
            log(accelerator, f"final {'adapter' if hasattr(unwrapped, 'peft_config') else 'model'} saved to {path}")
    if any_process(accelerator, error is not None):
        raise error or RecipeError(f"could not write the final model to {path} (see the main process)")
    accelerator.wait_for_everyone()
