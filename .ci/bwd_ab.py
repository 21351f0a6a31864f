"""GPU experiment: forward+backward A/B on the rows where FlexAttention's backward was closest in the
2026-11-23 interleaved benches (docs/TUNING_NOTES.md v8): HEAD_DIM=128 (default), the d128 non-causal
rows: dK/dV tile and stage variants of the fused backward and the two-launch backward; HEAD_DIM=64:
the d64 backward fused with w8 dQ tiles against the table's two launches; FlexAttention in the same
alternating rounds (fwd+bwd timed as
`fa-amd bench` times it: CUDA events after an L2 flush, median call per round).  Prints the median
round per (row, variant).  ROUNDS (env) sets the rounds."""
import json
import os
import statistics
import sys

import torch

from fa_amd import bench, tuning
from fa_amd.kernels import backward as A
from fa_amd.tuning import tables

ROUNDS = int(os.environ.get("ROUNDS", 5))
HEAD_DIM = int(os.environ.get("HEAD_DIM", 128))
if HEAD_DIM == 128:
    ROWS = [bench.Shape(1, 16384, 16, 16, 128, False), bench.Shape(2, 8192, 16, 16, 128, False),
            bench.Shape(16, 1024, 16, 16, 128, False)]
    # name -> (dq mode, dkdv changes, dq changes)
    VARIANTS = {
        "table": (None, {}, {}),
        "s2": (None, {"num_stages": 2}, {"num_stages": 2}),
        "dkdv32x128": (None, {"BLOCK_M": 32}, {}),
        "dq64x64": (None, {}, {"BLOCK_M": 64}),
        "separate": ("separate", {}, {}),
    }
else:  # d64: the table's dQ entry runs 4 warps, so its backward is two launches; fused with w8 dQ tiles?
    ROWS = [bench.Shape(16, 1024, 32, 32, 64, True), bench.Shape(16, 1024, 32, 32, 64, False),
            bench.Shape(4, 4096, 32, 32, 64, True), bench.Shape(1, 16384, 32, 32, 64, False)]
    VARIANTS = {
        "table": (None, {}, {}),
        "fused-dq128x64w8": (None, {}, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}),
        "fused-dq128x32w8": (None, {}, {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8}),
        "fused-dq64x64w8": (None, {}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8}),
    }
ROW = next(r for r in tables.TABLES["sm90"] if r["head_dim"] == HEAD_DIM)
PRISTINE = {k: dict(ROW[k]) for k in ("dkdv", "dq")}


def apply(mode, dkdv, dq):
    for k, extra in (("dkdv", dkdv), ("dq", dq)):
        ROW[k].clear()
        ROW[k].update(PRISTINE[k], **extra)
    A.BWD_DQ_MODE = mode
    tuning._RESOLVED.clear()


def timer(shape, method, setting):
    """Rounds of the bench's own forward+backward call of `method` under `setting`."""
    fwd_bwd = bench._prepare(method, shape, torch.bfloat16, "cuda")[1]
    apply(*setting)
    fwd_bwd.call()
    torch.cuda.synchronize()

    def once():
        apply(*setting)
        return bench.gpu_round_ms(fwd_bwd.call, fwd_bwd.grads, 8)
    return once


def main():
    rows = []
    for shape in ROWS:
        timers = {name: timer(shape, "fa_amd", s) for name, s in VARIANTS.items()}
        timers["flex"] = timer(shape, "flex", VARIANTS["table"])
        times = {name: [] for name in timers}
        for r in range(ROUNDS):
            names = list(timers)
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timers[name]())
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = dict(shape=shape.label, variant=name, ms=round(ms, 4),
                       tflops=round(3.5 * shape.fwd_flops() / (ms * 1e-3) / 1e12, 1), rounds=[round(t, 4) for t in ts])
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    apply(*VARIANTS["table"])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bwd_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
