"""Checkpoints and the output folder of the fine-tuning recipes: nothing is lost, nothing poisoned.

* A checkpoint is written into ``checkpoints/.tmp-step_N-<run>``, every file
  fsynced, a completeness marker (:data:`MARKER`, with the run's id, step,
  configuration and every file's size) written last, then the folder is
  renamed to ``checkpoints/step_N``.  A kill at any moment leaves either the
  old set of checkpoints or the new one, plus at worst a ``.tmp-*`` folder
  that is never read and is cleaned up by the next run.
* Resume picks the newest checkpoint whose marker is there and whose files
  match it, says which, and warns about and skips damaged ones (no marker,
  missing or truncated files, unreadable files, NaN/inf weights).
* Rotation deletes only checkpoints that carry this run's id.  A fresh run
  refuses an output folder that holds another run's checkpoints.
* Resume compares the checkpoint's run configuration with this one.
* The output folder is checked (a file? writable? enough space?) before
  training starts.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

CHECKPOINT_DIR_NAME = "checkpoints"
CHECKPOINT_PREFIX = "step_"
MARKER = "checkpoint_complete.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".deleting-"
MARKER_FORMAT = 1
# Written per process by accelerate's save_state; resuming without one is possible but not exact.
RNG_STATE_PATTERN = re.compile(r"random_states_\d+\.pkl")
# What must match for a resumed run to be a continuation of the checkpoint's run
# (--allow-resume-mismatch overrides); everything else may change on resume.
MUST_MATCH = {
    "model": "--model", "model_type": "--model-type", "hidden_size": "hidden size", "num_layers": "layers",
    "num_heads": "heads", "num_kv_heads": "KV heads", "intermediate_size": "intermediate size",
    "vocab_size": "vocabulary size", "sliding_window": "--sliding-window",
    "lora": "--lora", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha", "lora_dropout": "--lora-dropout",
    "dataset": "--dataset", "dataset_config": "--dataset-config", "dataset_split": "--dataset-split",
    "text_column": "--text-column", "data_sha256": "the data (tokenized samples)", "seq_len": "--seq-len",
    "packing": "--no-packing", "batch_tokens": "--batch-tokens", "grad_accum": "--grad-accum", "seed": "--seed",
    "num_processes": "the number of processes",
}
# Worth a note when they change on resume (they are allowed to).
MAY_CHANGE = ("max_steps", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "dropout", "attn", "dtype")
# Unwritable-output errors that get a one-line message instead of a traceback.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENOTDIR,
                errno.EEXIST, errno.EISDIR}


class RecipeError(RuntimeError):
    """A problem the user has to fix; reported as one line and a non-zero exit status."""


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def describe_os_error(err: OSError, what: str) -> str:
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        reason += " (the disk is full: free space, lower --keep-checkpoints, or pick another --output-dir)"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        reason += " (pick a writable --output-dir)"
    return f"{what}: {reason}"


# --------------------------------------------------------------------------- atomic files


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so readers see the old or the new content, never half of it."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def replace_folder(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; an older one at ``final`` goes away only after the new one is there."""
    for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
        fsync_path(file)
    old = None
    if final.exists():
        old = final.with_name(f"{TRASH_PREFIX}{final.name}.{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- listing and validating


def checkpoint_root(output_dir) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR_NAME


def checkpoint_step(path: Path) -> int | None:
    match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir) -> list[Path]:
    """Every ``step_N`` folder under ``output_dir/checkpoints`` (complete or not), oldest step first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def read_marker(checkpoint: Path) -> dict | None:
    try:
        marker = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("complete") is True else None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (None when its files are all there, as its marker lists them).

    RNG-state files may be missing: resuming without them works, only not bit-exactly.
    """
    if not checkpoint.is_dir():
        return "no such folder"
    marker = read_marker(checkpoint)
    if marker is None:
        if (checkpoint / MARKER).exists():
            return f"its completeness marker {MARKER} is unreadable"
        return f"no completeness marker {MARKER} (a half-written save, or not written by these recipes)"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return f"its marker {MARKER} lists no files"
    for name, size in sorted(files.items()):
        path = checkpoint / name
        if not path.is_file():
            if RNG_STATE_PATTERN.fullmatch(Path(name).name):
                continue
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the marker says {size} (truncated or overwritten)"
    return None


def missing_rng_states(checkpoint: Path, process_index: int) -> bool:
    return not (checkpoint / f"random_states_{process_index}.pkl").is_file()


def stale_temporaries(output_dir) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)))


def resume_candidates(resume: str, output_dir) -> tuple[list[Path], bool]:
    """Checkpoints to try, newest first, and whether the user named one explicitly.

    ``resume`` is "latest" (the newest in ``output_dir``), a checkpoint folder,
    or an output folder (its newest).
    """
    if resume == "latest":
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            raise RecipeError(f"--resume: no checkpoint under {checkpoint_root(output_dir)}")
        return checkpoints[::-1], False
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise RecipeError(f"--resume {resume}: no such checkpoint folder")
    if checkpoint_step(path) is None and list_checkpoints(path):
        # An output folder was given: its checkpoints, newest first.
        return list_checkpoints(path)[::-1], False
    return [path], True


def find_resume_checkpoint(resume: str, output_dir, warn=print) -> Path:
    """The newest checkpoint whose files are complete (damaged ones are reported through ``warn`` and skipped)."""
    candidates, explicit = resume_candidates(resume, output_dir)
    for checkpoint in candidates:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        if explicit:
            raise RecipeError(f"--resume {checkpoint}: cannot resume from it: {problem}")
        warn(f"skipping damaged checkpoint {checkpoint}: {problem}")
    raise RecipeError(f"--resume: no complete checkpoint under {checkpoint_root(output_dir)} "
                      f"(every one of {len(candidates)} is damaged, see above)")


# --------------------------------------------------------------------------- run configuration


def config_mismatches(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(differences that break the continuation, allowed differences worth a note)."""
    def show(value):
        return "(none)" if value is None else (value[:12] if isinstance(value, str) and len(value) == 64 else value)

    blocking = [f"{label}: checkpoint {show(saved.get(key))}, now {show(current.get(key))}"
                for key, label in MUST_MATCH.items() if key in saved and saved.get(key) != current.get(key)]
    changed = [f"{key} {saved.get(key)} -> {current.get(key)}"
               for key in MAY_CHANGE if key in saved and saved.get(key) != current.get(key)]
    return blocking, changed


def check_resume_config(checkpoint: Path, current: dict, allow_mismatch: bool, warn=print) -> dict:
    """Refuse to resume a run whose configuration differs where it matters; returns the checkpoint's marker."""
    marker = read_marker(checkpoint) or {}
    saved = marker.get("config") or {}
    blocking, changed = config_mismatches(saved, current)
    if blocking and not allow_mismatch:
        raise RecipeError(
            f"--resume {checkpoint}: this run differs from the checkpoint's run in {'; '.join(blocking)}. "
            f"Pass the checkpoint's options, or --allow-resume-mismatch to resume anyway (no longer an exact "
            f"continuation)")
    if blocking:
        warn(f"resuming despite differences (--allow-resume-mismatch): {'; '.join(blocking)}")
    if changed:
        warn(f"changed since the checkpoint (allowed): {', '.join(changed)}")
    return marker


# --------------------------------------------------------------------------- writing and rotating


def write_checkpoint(accelerator, output_dir, step: int, run_id: str, config: dict, settings: dict,
                     weights_finite: bool) -> Path:
    """Save accelerate's full training state atomically as ``checkpoints/step_N`` (every process calls it)."""
    if not weights_finite:
        raise RecipeError(f"refusing to save checkpoint step {step}: the model weights hold NaN/inf")
    root = checkpoint_root(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = root / f"{TMP_PREFIX}{final.name}-{run_id}"
    error = None
    try:
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
    except OSError as err:
        error = err
    # Every process must get past the barrier, even one whose write failed.
    failed = any_process(accelerator, error is not None)
    if not failed and accelerator.is_main_process:
        try:
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            marker = {"format": MARKER_FORMAT, "complete": True, "run_id": run_id, "step": step,
                      "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "num_processes": accelerator.num_processes,
                      "config": config, "settings": settings, "files": files}
            with open(tmp / MARKER, "w", encoding="utf-8") as f:
                json.dump(marker, f, indent=1)
            replace_folder(tmp, final)
        except OSError as err:
            error = err
    failed = any_process(accelerator, error is not None)
    if failed:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise RecipeError(describe_os_error(error, f"could not write checkpoint {final}")) from None
        raise RecipeError(f"could not write checkpoint {final}: another process failed to write its part")
    return final


def any_process(accelerator, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (each process must call it)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() > 0)


def rotate_checkpoints(output_dir, run_id: str, keep: int) -> list[Path]:
    """Keep this run's newest ``keep`` usable checkpoints (0: keep all) and delete its other ones.

    Only folders whose marker carries ``run_id`` are touched: never another
    run's checkpoint, nor a folder without a marker.  A damaged checkpoint of
    this run older than the newest usable one is deleted too.
    """
    if keep <= 0:
        return []
    ours = [p for p in list_checkpoints(output_dir) if (read_marker(p) or {}).get("run_id") == run_id]
    usable = [p for p in ours if checkpoint_problem(p) is None]
    kept = set(usable[-keep:])
    newest_kept = max((checkpoint_step(p) for p in kept), default=None)
    deleted = []
    for old in ours:
        if old in kept or newest_kept is None or checkpoint_step(old) > newest_kept:
            continue
        # Renamed first, so a kill mid-delete leaves no half-deleted folder under a checkpoint's name.
        trash = old.with_name(f"{TRASH_PREFIX}{old.name}.{os.getpid()}")
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(old)
    return deleted


# --------------------------------------------------------------------------- the output folder


def check_output_dir(output_dir, fresh_run: bool, overwrite: bool, log=print) -> None:
    """Before anything trains: the output folder can be created and written, and a fresh run loses nothing.

    Runs on the main process.  Raises RecipeError with a one-line message.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise RecipeError(f"--output-dir {path} is a file, not a folder; pick another --output-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RecipeError(describe_os_error(err, f"cannot create --output-dir {path}")) from None
    probe = path / f"{TMP_PREFIX}write-test.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise RecipeError(describe_os_error(err, f"cannot write to --output-dir {path}")) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    for stale in stale_temporaries(path):
        log(f"removing {stale} (left by an interrupted save or delete)")
        shutil.rmtree(stale, ignore_errors=True)
    existing = list_checkpoints(path)
    if fresh_run and existing:
        names = ", ".join(p.name for p in existing[-3:])
        if not overwrite:
            raise RecipeError(
                f"--output-dir {path} already holds checkpoints of an earlier run ({names}); a fresh run there "
                f"would mix them up. Pass --resume to continue that run, --overwrite-output-dir to delete them and "
                f"start over, or a new --output-dir")
        log(f"--overwrite-output-dir: deleting the earlier run's checkpoints ({names})")
        for old in existing:
            shutil.rmtree(old)


def human_size(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def check_free_space(output_dir, needed_bytes: int, what: str) -> None:
    """Stop before training when the output folder's disk cannot hold what the run will write."""
    free = shutil.disk_usage(output_dir).free
    if free < needed_bytes:
        raise RecipeError(
            f"--output-dir {output_dir}: not enough disk space: {what} need about {human_size(needed_bytes)}, "
            f"{human_size(free)} are free. Free space, lower --keep-checkpoints, save less often "
            f"(--save-every, 0: never), or pick another --output-dir")
