#!/usr/bin/env python
"""Write Accelerate's default config for this machine, once, so that

    accelerate launch recipes/finetune_llama.py

runs without Accelerate's "The following values were not passed to
`accelerate launch`" warning block.  The README's set-up command runs this.

What it writes is what `accelerate launch` picks by itself when it has no
config (one process per GPU, data parallel when there are several; one
process without a GPU), spelled out.  Unlike `accelerate config default`
it leaves `use_cpu` off on a machine without a GPU: with it on, `accelerate
launch` prints a warning block of its own (about CPU threads) every time.

An existing default config is kept (pass --force to replace it).  The file is
Accelerate's usual one: $HF_HOME/accelerate/default_config.yaml, else
~/.cache/huggingface/accelerate/default_config.yaml.
"""
from __future__ import annotations

import argparse
import os
import sys


def machine_config() -> dict:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        # The recipes pass their --dtype to Accelerator(mixed_precision=...) themselves.
        "mixed_precision": "no",
        "num_machines": 1,
        "num_processes": max(1, gpus),
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }
    if gpus:
        config["gpu_ids"] = "all"
    return config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="replace an existing default config")
    parser.add_argument("--config-file", default=None, help="where to write (default: Accelerate's default config)")
    args = parser.parse_args(argv)

    import yaml
    from accelerate.commands.config.config_args import default_config_file

    path = args.config_file or default_config_file
    if os.path.exists(path) and not args.force:
        print(f"[setup] keeping the existing Accelerate config {path} (--force replaces it)")
        try:
            with open(path, encoding="utf-8") as f:
                existing = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            existing = {}
        if existing.get("use_cpu") and not os.environ.get("OMP_NUM_THREADS"):
            print("[setup] note: it has use_cpu: true, with which `accelerate launch` prints a warning block about "
                  "CPU threads on every launch; --force replaces it with one that does not")
        return 0
    config = machine_config()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:  # an unwritable or impossible path: one line, not a traceback
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err)
        print(f"error: cannot write the Accelerate config {path} ({reason})", file=sys.stderr)
        return 2
    print(f"[setup] wrote the Accelerate config {path}: {config['num_processes']} process(es), "
          f"{config['distributed_type']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
