"""GPU experiment for `.ci/gpu gqa`: how the GQA backward splits query-head groups over dK/dV
programs (the rule of tables.DKDV_MAX_PROGRAM_SHARE vs a forced 1, 2 or 4 heads per program) and
how split slices are summed (tables.GQA_SPLIT_SUM "partials" vs "atomic"), on the GQA bench rows
and the training anchor's shape, with the MHA rows of equal FLOPs for reference.  Prints one line
per cell: forward+backward ms (do_bench median, as fa-amd bench) and the GPU-only ms of a CUDA-graph
replay.  docs/TUNING_NOTES.md v7 holds the prediction."""
import json
import os
import sys

import torch

from fa_amd import bench
from fa_amd.kernels import backward as A
from fa_amd.tuning import tables

SHAPES = [bench.Shape(8, 2048, 16, 4, 128, True), bench.Shape(8, 2048, 16, 4, 128, False),
          bench.Shape(2, 8192, 16, 4, 128, True), bench.Shape(2, 8192, 16, 4, 128, False),
          bench.Shape(2, 4096, 16, 4, 128, True)]
MHA = [bench.Shape(8, 2048, 16, 16, 128, True), bench.Shape(8, 2048, 16, 16, 128, False)]


def cell(shape, split_sum, heads_per_program):
    tables.GQA_SPLIT_SUM["sm90"], A.DKDV_HEADS_PER_PROGRAM = split_sum, heads_per_program
    fb = next(r for r in bench.bench_method("fa_amd", shape, torch.bfloat16, "cuda", False, host_time=True)
              if r.mode == "fwd+bwd")
    row = dict(shape=shape.label, split_sum=split_sum, heads_per_program=heads_per_program or "rule", ms=fb.ms,
               tflops=fb.tflops, graph_ms=fb.graph_ms, host_ms=fb.host_ms)
    print(json.dumps(row), flush=True)
    return row


def main():
    rows = [cell(s, "partials", None) for s in MHA]
    for shape in SHAPES:
        rows.append(cell(shape, "partials", None))
        for heads_per_program in (1, 2, 4):
            for split_sum in ("partials", "atomic") if heads_per_program < 4 else ("partials",):
                rows.append(cell(shape, split_sum, heads_per_program))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gqa_split.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
