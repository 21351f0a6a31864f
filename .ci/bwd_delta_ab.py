"""GPU experiment (issue 17, the short d64 rows): a backward whose dQ has its own launch (sm90 d64) runs it
first and computes delta = rowsum(dO * O) in the dQ programs (tables.BWD_DELTA_IN_DQ_FAMILIES), or runs the
delta preprocess launch before the dK/dV and dQ launches; FlexAttention in the same interleaved rounds, timed
as `fa-amd bench` times forward+backward (L2 flush before each call, CUDA events, median call per round,
median round).  ROUNDS (env) sets the rounds.

    python .ci/bwd_delta_ab.py      # on the GPU machine
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench, tuning  # noqa: E402
from fa_amd.arch import device_arch  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
ROWS = [bench.Shape(32, 512, 32, 32, 64, False), bench.Shape(32, 512, 32, 32, 64, True),
        bench.Shape(16, 1024, 32, 32, 64, False), bench.Shape(16, 1024, 32, 32, 64, True),
        bench.Shape(4, 4096, 32, 32, 64, True), bench.Shape(1, 16384, 32, 32, 64, False)]
FAMILY = tuning.family_of(device_arch())
MODES = {"dq first": tuple(tables.BWD_DELTA_IN_DQ_FAMILIES) + (FAMILY,),
         "preprocess": tuple(f for f in tables.BWD_DELTA_IN_DQ_FAMILIES if f != FAMILY)}


def fwd_bwd(shape, mode):
    make = bench.make_flex if mode == "flex" else bench.make_fa_amd
    fn, layout = make(shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def call():
        if mode != "flex":
            tables.BWD_DELTA_IN_DQ_FAMILIES = MODES[mode]
        out = fn(q, k, v)
        (out[0] if isinstance(out, tuple) else out).backward(dout)
    return call, (q, k, v)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "| fwd+bwd TFLOP/s, median of", ROUNDS, "rounds")
    methods = tuple(MODES) + ("flex",)
    print("| row | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for shape in ROWS:
        times = bench.interleaved_rounds_ms({m: fwd_bwd(shape, m) for m in methods}, ROUNDS)
        cells = [3.5 * shape.fwd_flops() / statistics.median(times[m]) / 1e9 for m in methods]
        print(f"| {shape.label} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
