"""GPU experiment: forward-kernel A/B on the rows where FlexAttention's forward is closest
(docs/TUNING_NOTES.md v7 "Open": d128 non-causal at 1k-4k): forward tiles / warps / stages (and, in v7,
the raw-score row max of tables.FWD_RAW_MAX_FAMILIES on/off), each timed as `fa-amd bench` times the
forward (no grad, CUDA events after an L2 flush, median call per round), in interleaved rounds; FlexAttention's
and SDPA flash's (FA2) forwards in the same rounds (PEERS).  Prints the median over rounds per (row, variant).
ROUNDS (env) sets the rounds, ROWS the rows (e.g. the short causal d256 / d96 rows: issue 17's forward)."""
import json
import os
import statistics
import sys

import torch

from fa_amd import bench, tuning
from fa_amd.tuning import tables

ROUNDS = int(os.environ.get("ROUNDS", 5))
CALLS = 10
# v8: the short d128 non-causal rows (Flex runs 128x64/w8/s3 there); ROWS (env) "b,s,hq,hk,d,c;..." (c: 1 causal)
ROWS = [bench.Shape(16, 1024, 16, 16, 128, False), bench.Shape(8, 2048, 16, 16, 128, False),
        bench.Shape(4, 4096, 16, 16, 128, False)]
if os.environ.get("ROWS"):
    ROWS = [bench.Shape(*(int(x) for x in item.split(",")[:5]), item.split(",")[5] == "1")
            for item in os.environ["ROWS"].split(";")]
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim; None: the table's entry as it resolves
TILES = {128: [None, (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
               (64, 128, 4, 2)],
         256: [None, (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2),
               (128, 64, 8, 3)],
         # d96 runs as 64 + 32 chunks on sm90 (tables.HEAD_DIM_SPLIT_FAMILIES), from its own table row
         96: [None, (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
              (64, 32, 4, 3)]}
# peers in the same rounds (bench.MAKERS names)
PEERS = os.environ.get("PEERS", "flex sdpa_flash").split()


def variants(shape):
    """(name, tile): the table's forward entry and the tiles above."""
    return [("table" if tile is None else "%dx%d/w%d/s%d" % tile, tile) for tile in TILES[shape.head_dim]]


PRISTINE = {row["head_dim"]: dict(row["fwd"]) for row in tables.TABLES["sm90"]}


def apply(head_dim, tile):
    """The variant's settings (tile None: the table's own forward entry, overrides and all; else the tile in
    every case but fp32 / fp8: the causal and short overrides dropped)."""
    for row in tables.TABLES["sm90"]:
        row["fwd"].clear()
        row["fwd"].update(PRISTINE[row["head_dim"]])
    if tile is not None:
        row = next(r for r in tables.TABLES["sm90"] if r["head_dim"] >= head_dim)  # (d96: its own row)
        for case in ("causal", "short"):
            row["fwd"].pop(case, None)
        row["fwd"].update(BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3])
    tuning._RESOLVED.clear()


def forward_fn(shape, tile, method="fa_amd"):
    fn, layout = bench.MAKERS[method](shape, "cuda")
    q, k, v, _ = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def run():
        with torch.no_grad():
            fn(q, k, v)

    def call():  # settings applied at every timing, since variants alternate
        apply(shape.head_dim, tile)
        return bench.gpu_round_ms(run, (), CALLS)
    call()  # compile
    return call


def main():
    rows = []
    for shape in ROWS:
        timers = {name: forward_fn(shape, tile) for name, tile in variants(shape)}
        for peer in PEERS:
            timers[peer] = forward_fn(shape, None, peer)
        times = {name: [] for name in timers}
        names = list(timers)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timers[name]())
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = dict(shape=shape.label, variant=name, ms=round(ms, 4),
                       tflops=round(shape.fwd_flops() / (ms * 1e-3) / 1e12, 1), rounds=[round(t, 4) for t in ts])
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    apply(128, None)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fwd_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
