"""Shared body of the GPU A/B scripts that time a tables.*_FAMILIES switch (.ci/nan_fixup_ab.py,
.ci/bwd_delta_ab.py, .ci/split_return_ab.py): the running arch's family listed in the table ("on") or
left out ("off"), peers (FlexAttention) in the same interleaved rounds, timed as `fa-amd bench` times
(an L2 flush before each call, CUDA events, the median call per round, the median round).  ROUNDS (env)
sets the rounds.  SMOKE=1 runs each call once on the CPU interpreter with made-up times (checks the
switching, not speed; tests/test_ci_scripts.py).
"""
import os
import statistics
import sys

if os.environ.get("SMOKE") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench, tuning  # noqa: E402
from fa_amd.arch import arch_for  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
SMOKE = os.environ.get("SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # (the interpreter's bf16 dot is not exact everywhere)


def family_modes(table: str, on: str, off: str) -> dict:
    """{on: the table with this arch's family, off: without it}."""
    family = tuning.family_of(arch_for(torch.empty(0, device=DEVICE)))
    others = tuple(f for f in getattr(tables, table) if f != family)
    return {on: others + (family,), off: others}


def _timed(shape, method, direction, table, modes, maker="fa_amd"):
    make = bench.MAKERS[method if method not in modes else maker]
    fn, layout = make(shape, DEVICE)
    q, k, v, dout = bench.make_inputs(shape, layout, DTYPE, DEVICE)

    def call():
        if method in modes:
            setattr(tables, table, modes[method])
        if direction == "fwd":
            with torch.no_grad():
                fn(q, k, v)
        else:
            out = fn(q, k, v)
            (out[0] if isinstance(out, tuple) else out).backward(dout)
    return call, (q, k, v)


def _rounds(timed):
    if not SMOKE:
        return bench.interleaved_rounds_ms(timed, ROUNDS)
    for fn, grads in timed.values():
        bench._clear_grads(grads)
        fn()
    return {key: [1.0] for key in timed}


def run(table: str, on: str, off: str, rows, peers=("flex",), maker="fa_amd") -> dict:
    """Print one markdown row per (shape, "fwd" | "fwd+bwd") in `rows`: TFLOP/s of on, off and the peers, and
    off / on (median ms); on and off run bench.MAKERS[maker] (e.g. "fa_amd_fp8": FP8 inputs).  The table is put
    back afterwards; returns {(label, direction): {method: ms}}."""
    modes = family_modes(table, on, off)
    saved = getattr(tables, table)
    methods = (on, off) + tuple(() if SMOKE else peers)
    name = torch.cuda.get_device_name() if not SMOKE else "CPU interpreter (smoke)"
    print(name, "torch", torch.__version__, f"| tables.{table}: {on} / {off} ({maker}), TFLOP/s, median of", ROUNDS,
          "rounds")
    print("| row | direction | " + " | ".join(methods) + f" | {off} / {on} (ms) |")
    print("|---|---|" + "---|" * (len(methods) + 1))
    medians = {}
    try:
        for shape, direction in rows:
            times = _rounds({m: _timed(shape, m, direction, table, modes, maker) for m in methods})
            med = {m: statistics.median(times[m]) for m in methods}
            mult = 1.0 if direction == "fwd" else 3.5
            print(f"| {shape.label} | {direction} | " + " | ".join(
                f"{mult * shape.fwd_flops() / med[m] / 1e9:.0f}" for m in methods) + f" | {med[off] / med[on]:.3f} |",
                flush=True)
            if os.environ.get("SHOW_ROUNDS") == "1":  # every round's ms, in the order the rounds ran
                print("  rounds (ms): " + "; ".join(f"{m} " + " ".join(f"{t:.3f}" for t in times[m]) for m in methods),
                      flush=True)
            medians[(shape.label, direction)] = med
            if not SMOKE:
                torch.cuda.empty_cache()
    finally:
        setattr(tables, table, saved)
    return medians
