"""GPU experiment (issue 17, the short causal rows): the V NaN rule of masked forwards through relaxed marks
and a fix-up launch after the forward ("fixup": tables.FWD_NAN_FIXUP_FAMILIES lists the arch), or through the
pass over V before the forward ("pass": the arch left out of it); FlexAttention in the same interleaved rounds,
timed as `fa-amd bench` times them.  ROUNDS (env) sets the rounds.

    python .ci/nan_fixup_ab.py      # on the GPU machine
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
FAMILY = tuning.family_of(device_arch())
OTHERS = tuple(f for f in tables.FWD_NAN_FIXUP_FAMILIES if f != FAMILY)
MODES = {"fixup": OTHERS + (FAMILY,), "pass": OTHERS}
TABLE = tables.FWD_NAN_FIXUP_FAMILIES  # (put back after the rounds)
GROUPS = [(b, s, d, mode) for mode in ("fwd", "fwd+bwd") for d in (64, 128) for b, s in ((32, 512), (16, 1024))] \
    + [(b, s, d, mode) for mode in ("fwd", "fwd+bwd") for d in (64, 128, 256) for b, s in ((4, 4096), (1, 16384))] \
    + [(16, 1024, d, "fwd") for d in (96, 192, 256)]


def make(shape, method, mode):
    fn, layout = (bench.make_flex if method == "flex" else bench.make_fa_amd)(shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def call():
        if method != "flex":
            tables.FWD_NAN_FIXUP_FAMILIES = MODES[method]
        if mode == "fwd":
            with torch.no_grad():
                fn(q, k, v)
        else:
            out = fn(q, k, v)
            (out[0] if isinstance(out, tuple) else out).backward(dout)
    return call, (q, k, v)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "| causal, TFLOP/s, median of", ROUNDS, "rounds")
    methods = tuple(MODES) + ("flex",)
    print("| row | mode | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for b, s, d, mode in GROUPS:
        shape = bench.Shape(b, s, 2048 // d, 2048 // d, d, True)
        times = bench.interleaved_rounds_ms({m: make(shape, m, mode) for m in methods}, ROUNDS)
        mult = 1.0 if mode == "fwd" else 3.5
        print(f"| {shape.label} | {mode} | " + " | ".join(
            f"{mult * shape.fwd_flops() / statistics.median(times[m]) / 1e9:.0f}" for m in methods) + " |", flush=True)
        torch.cuda.empty_cache()
    tables.FWD_NAN_FIXUP_FAMILIES = TABLE


if __name__ == "__main__":
    main()
