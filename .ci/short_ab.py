"""GPU experiment (issue 17, the small rows): tiles of the short launches (at most tables.SHORT_SEQLEN_K keys
per row), FlexAttention in the same interleaved rounds, timed as `fa-amd bench` times them (L2 flush before
each call, CUDA events, median call per round, median round).

    PART=fwd python .ci/short_ab.py     # forward tiles on the causal short rows: fwd and fwd+bwd
    PART=bwd python .ci/short_ab.py     # dK/dV and dQ tiles on the d64 / d128 short rows: fwd+bwd
    PART=bwd2 / PART=fwd2               # the d64 dK/dV winners at every length; d96 / d192 / d256 forwards
    PART=bwd3                           # the d128 backward on the short rows

A variant replaces the sm90 table row's "fwd" (every override dropped) or "dkdv" / "dq" entries for the
rows it is timed on.  ROUNDS (env) sets the rounds; HEAD_DIMS (env, e.g. "64") limits the rows; $OUT gets
short_ab_<part>.json.
"""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench, tuning  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
PART = os.environ.get("PART", "fwd")
HEAD_DIMS = [int(d) for d in os.environ.get("HEAD_DIMS", "64 128").split()]
BUDGET_S = float(os.environ.get("BUDGET_S", 270))


def tile(m, n, w, s):
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}


def _name(cfg):
    return "%dx%d/w%d/s%d" % (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])


def shape(d, b, s, causal):
    return bench.Shape(b, 16384 // b, 2048 // d, 2048 // d, d, causal)


if PART == "fwd":  # (shape, mode) groups in the order they are timed (BUDGET_S may cut the tail)
    GROUPS = [(shape(d, 32, 512, True), "fwd") for d in (64, 128)] \
        + [(shape(d, 32, 512, True), "fwd+bwd") for d in (64, 128)] \
        + [(shape(d, 16, 1024, True), "fwd") for d in (64, 128)]
    CANDIDATES = [tile(128, 64, 8, 3), tile(128, 64, 4, 3), tile(128, 32, 4, 3), tile(64, 32, 4, 3),
                  tile(64, 64, 4, 2), tile(64, 64, 8, 3), tile(64, 128, 4, 3), tile(128, 128, 8, 3)]
    VARIANTS = {"table": {}} | {_name(c): {"fwd": c} for c in CANDIDATES}
elif PART == "fwd2":  # the other head dims' causal short forwards (d96 / d192 / d256 trail FA2 there)
    GROUPS = [(shape(96, 16, 1024, True), "fwd"), (shape(256, 32, 512, True), "fwd"),
              (shape(256, 16, 1024, True), "fwd"), (shape(192, 16, 1024, True), "fwd"),
              (shape(96, 16, 1024, True), "fwd+bwd"), (shape(256, 32, 512, True), "fwd+bwd")]
    CANDIDATES = [tile(64, 32, 4, 3), tile(64, 64, 4, 3), tile(128, 32, 4, 3), tile(64, 32, 4, 2),
                  tile(64, 64, 4, 2), tile(128, 32, 8, 2), tile(64, 32, 8, 2)]
    VARIANTS = {"table": {}} | {_name(c): {"fwd": c} for c in CANDIDATES}
elif PART == "bwd2":  # the d64 dK/dV tiles that won at s512 / s1k (PART=bwd), at every length
    GROUPS = [(shape(64, 32, 512, False), "fwd+bwd"), (shape(64, 16, 1024, True), "fwd+bwd"),
              (shape(64, 8, 2048, False), "fwd+bwd"), (shape(64, 4, 4096, True), "fwd+bwd"),
              (shape(64, 1, 16384, False), "fwd+bwd"), (shape(64, 1, 16384, True), "fwd+bwd"),
              (shape(64, 32, 512, True), "fwd+bwd")]
    VARIANTS = {
        "table": {},
        "dkdv 64x64/w4": {"dkdv": tile(64, 64, 4, 3)},
        "dkdv 64x64/w4 dq 64x32/w4": {"dkdv": tile(64, 64, 4, 3), "dq": tile(64, 32, 4, 3)},
        "dkdv 64x64/w4 dq 64x64/w4": {"dkdv": tile(64, 64, 4, 3), "dq": tile(64, 64, 4, 3)},
        "dkdv 32x128/w4 dq 64x32/w4": {"dkdv": tile(32, 128, 4, 3), "dq": tile(64, 32, 4, 3)},
        "dkdv 64x64/w4/s4": {"dkdv": tile(64, 64, 4, 4), "dq": tile(128, 32, 4, 4)},
        "dkdv 128x64/w4": {"dkdv": tile(128, 64, 4, 3)},
    }
elif PART == "bwd3":  # the d128 backward on the short rows (its fused launch keeps the delta preprocess)
    GROUPS = [(shape(128, 32, 512, True), "fwd+bwd"), (shape(128, 16, 1024, True), "fwd+bwd"),
              (shape(128, 32, 512, False), "fwd+bwd"), (shape(128, 16, 1024, False), "fwd+bwd")]
    VARIANTS = {
        "table": {},
        "dq 64x64/w8": {"dq": tile(64, 64, 8, 3)},
        "dkdv 64x64/w8 dq 64x64/w8": {"dkdv": tile(64, 64, 8, 3), "dq": tile(64, 64, 8, 3)},
        "dkdv 32x128/w8": {"dkdv": tile(32, 128, 8, 3)},
        "dkdv 64x64/w4 dq 64x64/w4": {"dkdv": tile(64, 64, 4, 3), "dq": tile(64, 64, 4, 3)},
        "separate dq 128x64/w4": {"dq": tile(128, 64, 4, 3)},
        "separate dq 64x64/w4": {"dq": tile(64, 64, 4, 3)},
        "separate dq 128x32/w4": {"dq": tile(128, 32, 4, 3)},
    }
else:
    GROUPS = [(shape(64, 32, 512, False), "fwd+bwd"), (shape(64, 32, 512, True), "fwd+bwd"),
              (shape(64, 16, 1024, False), "fwd+bwd"), (shape(128, 32, 512, True), "fwd+bwd"),
              (shape(128, 32, 512, False), "fwd+bwd")]
    VARIANTS = {
        "table": {},
        "dkdv 64x64/w4": {"dkdv": tile(64, 64, 4, 3)},
        "dkdv 64x128/w4": {"dkdv": tile(64, 128, 4, 3)},
        "dkdv 32x128/w4": {"dkdv": tile(32, 128, 4, 3)},
        "dkdv 128x64/w8": {"dkdv": tile(128, 64, 8, 3)},
        "dq 64x32/w4": {"dq": tile(64, 32, 4, 3)},
        "dq 64x64/w4": {"dq": tile(64, 64, 4, 3)},
        "dq 128x64/w8": {"dq": tile(128, 64, 8, 3)},
        "s2": {"dkdv": {"num_stages": 2}, "dq": {"num_stages": 2}},
    }
ROW_OF = {r["head_dim"]: r for r in tables.TABLES["sm90"]}
PRISTINE = {d: {k: dict(ROW_OF[d][k]) for k in ("fwd", "dkdv", "dq")} for d in ROW_OF}


def apply(head_dim, variant):
    row = ROW_OF[head_dim]
    for key in ("fwd", "dkdv", "dq"):
        row[key].clear()
        row[key].update(PRISTINE[head_dim][key])
    for key, patch in variant.items():
        if key == "fwd":  # the candidate for every case: no overrides left
            row[key].clear()
        row[key].update(patch)  # dK/dV, dQ: the tiles / options replaced, the fp32 override kept
    tuning._RESOLVED.clear()


def timed(shape, method, mode, variant):
    fn_timed = bench._prepare(method, shape, torch.bfloat16, "cuda")[0 if mode == "fwd" else 1]
    apply(shape.head_dim, variant)
    fn_timed.call()
    torch.cuda.synchronize()

    def once():
        apply(shape.head_dim, variant)
        return bench.gpu_round_ms(fn_timed.call, fn_timed.grads, 10)
    return once


def main():
    rows = []
    start = time.time()
    for shape, mode in GROUPS:
        if shape.head_dim not in HEAD_DIMS:
            continue
        if time.time() - start > BUDGET_S:
            print("budget spent; stopping", flush=True)
            break
        timers = {}
        for name, variant in VARIANTS.items():
            try:
                timers[name] = timed(shape, "fa_amd", mode, variant)
            except Exception as exc:  # a tile that does not build / fit
                print(json.dumps(dict(shape=shape.label, mode=mode, variant=name, error=str(exc)[:200])))
        timers["flex"] = timed(shape, "flex", mode, {})
        times = {name: [] for name in timers}
        names = list(timers)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timers[name]())
        flops = shape.fwd_flops() * (3.5 if mode == "fwd+bwd" else 1.0)
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = dict(shape=shape.label, mode=mode, variant=name, ms=round(ms, 4),
                       tflops=round(flops / (ms * 1e-3) / 1e12, 1), rounds=[round(t, 4) for t in ts])
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    for d in ROW_OF:
        apply(d, {})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"short_ab_{PART}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
