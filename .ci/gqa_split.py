"""GPU experiment for `.ci/gpu gqa`: how split GQA groups sum their dK/dV (tables.GQA_SPLIT_SUM
"partials" vs "atomic") and when groups split (tables.DKDV_MIN_PROGRAMS_PER_SM), on the GQA bench
rows and the training anchor's shape, with the MHA row of equal FLOPs for reference. Prints one
line per cell: forward+backward ms (do_bench median, as fa-amd bench) and the GPU-only ms of a
CUDA-graph replay. docs/TUNING_NOTES.md ("Open", step 1) holds the prediction."""
import json
import os
import sys

import torch

from fa_amd import bench
from fa_amd.tuning import tables

SHAPES = [bench.Shape(8, 2048, 16, 4, 128, True), bench.Shape(8, 2048, 16, 4, 128, False),
          bench.Shape(2, 8192, 16, 4, 128, True), bench.Shape(2, 8192, 16, 4, 128, False),
          bench.Shape(2, 4096, 16, 4, 128, True)]
MHA = [bench.Shape(8, 2048, 16, 16, 128, True), bench.Shape(8, 2048, 16, 16, 128, False)]


def cell(shape, split_sum, min_programs):
    tables.GQA_SPLIT_SUM, tables.DKDV_MIN_PROGRAMS_PER_SM = split_sum, min_programs
    fb = next(r for r in bench.bench_method("fa_amd", shape, torch.bfloat16, "cuda", False, host_time=True)
              if r.mode == "fwd+bwd")
    row = dict(shape=shape.label, split_sum=split_sum, min_programs=min_programs, ms=fb.ms, tflops=fb.tflops,
               graph_ms=fb.graph_ms, host_ms=fb.host_ms)
    print(json.dumps(row), flush=True)
    return row


def main():
    rows = [cell(s, "partials", 4) for s in MHA]
    for shape in SHAPES:
        for split_sum in ("partials", "atomic"):
            for min_programs in (2, 4, 8):
                rows.append(cell(shape, split_sum, min_programs))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gqa_split.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
