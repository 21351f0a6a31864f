"""GPU experiment: forward-kernel A/B on the rows where FlexAttention's forward is closest
(docs/TUNING_NOTES.md v7 "Open": d128 non-causal at 1k-4k): forward tiles / warps / stages (and, in v7,
the raw-score row max of tables.FWD_RAW_MAX_FAMILIES on/off), each timed as `fa-amd bench` times the
forward (no grad, do_bench median), in alternating rounds; FlexAttention's forward in the same rounds.
Prints the median over rounds per (row, variant).  ROUNDS (env) sets the rounds."""
import json
import os
import statistics
import sys

import torch

from fa_amd import bench, tuning
from fa_amd.tuning import tables

ROUNDS = int(os.environ.get("ROUNDS", 5))
# v8: the short d128 non-causal rows (Flex runs 128x64/w8/s3 there)
ROWS = [bench.Shape(16, 1024, 16, 16, 128, False), bench.Shape(8, 2048, 16, 16, 128, False),
        bench.Shape(4, 4096, 16, 16, 128, False)]
TILES = {128: [None, (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
               (64, 128, 4, 2)]}


def variants(shape):
    """(name, raw-score max, tile): the table's forward entry and the tiles above, raw max on."""
    return [("table" if tile is None else "%dx%d/w%d/s%d" % tile, True, tile) for tile in TILES[shape.head_dim]]


PRISTINE = {row["head_dim"]: dict(row["fwd"]) for row in tables.TABLES["sm90"]}


def apply(head_dim, raw_max, tile):
    """The variant's settings (tile None: the table's own forward entry)."""
    for row in tables.TABLES["sm90"]:
        row["fwd"].clear()
        row["fwd"].update(PRISTINE[row["head_dim"]])
    row = next(r for r in tables.TABLES["sm90"] if r["head_dim"] >= head_dim)
    if tile is not None:
        row["fwd"].update(BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3])
    tables.FWD_RAW_MAX_FAMILIES = ("sm90",) if raw_max else ()
    tuning._RESOLVED.clear()


def forward_fn(shape, raw_max, tile):
    fn, layout = bench.make_fa_amd(shape, "cuda")
    q, k, v, _ = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def run():
        with torch.no_grad():
            fn(q, k, v)

    def call():  # settings applied at every timing, since variants alternate
        apply(shape.head_dim, raw_max, tile)
        return bench.time_ms(run)
    call()  # compile
    return call


def main():
    rows = []
    for shape in ROWS:
        timers = {name: forward_fn(shape, raw, tile) for name, raw, tile in variants(shape)}
        fn, layout = bench.make_flex(shape, "cuda")
        q, k, v, _ = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

        def flex():
            with torch.no_grad():
                fn(q, k, v)
        timers["flex"] = lambda: bench.time_ms(flex)
        times = {name: [] for name in timers}
        for _ in range(ROUNDS):
            for name, timer in timers.items():
                times[name].append(timer())
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = dict(shape=shape.label, variant=name, ms=round(ms, 4),
                       tflops=round(shape.fwd_flops() / (ms * 1e-3) / 1e12, 1), rounds=[round(t, 4) for t in ts])
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    apply(128, True, None)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fwd_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
