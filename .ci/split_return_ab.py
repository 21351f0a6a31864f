"""GPU experiment (issue 17, the d256 / d192 backward): split dK/dV programs (DKDV_SPLIT) past their sequence
return early (tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES lists the arch) or run with empty query ranges (the form
that keeps AMD's split builds free of scratch under triton 3.4 / 3.5).  Dense rows never have such a block, so
any difference is code generation.  Timed as `fa-amd bench` times forward+backward (L2 flush before each call,
CUDA events, median call per round, median round); ROUNDS (env) sets the rounds.

    python .ci/split_return_ab.py      # on the GPU machine
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
ROWS = [bench.Shape(16, 1024, 8, 8, 256, False), bench.Shape(4, 4096, 8, 8, 256, False),
        bench.Shape(1, 16384, 8, 8, 256, False), bench.Shape(4, 4096, 8, 8, 256, True),
        bench.Shape(4, 4096, 10, 10, 192, False), bench.Shape(1, 16384, 10, 10, 192, False)]
FAMILY = tuning.family_of(device_arch())
OTHERS = tuple(f for f in tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES if f != FAMILY)
MODES = {"early return": OTHERS + (FAMILY,), "empty ranges": OTHERS}


def fwd_bwd(shape, mode):
    fn, layout = bench.make_fa_amd(shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def call():
        tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES = MODES[mode]
        fn(q, k, v).backward(dout)
    return call, (q, k, v)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "| fwd+bwd TFLOP/s, median of", ROUNDS, "rounds")
    print("| row | " + " | ".join(MODES) + " | early / empty |")
    print("|---|" + "---|" * (len(MODES) + 1))
    for shape in ROWS:
        times = bench.interleaved_rounds_ms({m: fwd_bwd(shape, m) for m in MODES}, ROUNDS)
        med = {m: statistics.median(times[m]) for m in MODES}
        print(f"| {shape.label} | " + " | ".join(f"{3.5 * shape.fwd_flops() / med[m] / 1e9:.0f}" for m in MODES)
              + f" | {med['empty ranges'] / med['early return']:.3f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
