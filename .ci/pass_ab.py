"""GPU experiment (issue 17, the b32 s512 / b16 s1k rows): the two memory-bound passes around the
attention kernels -- the forward's V NaN-flag pass (masked calls) and the backward's delta preprocess
(rowsum(dO * O)) -- timed alone, per launch setting, as CUDA-graph replays after an L2 flush (so the
launcher's host time is not in the figure), in interleaved rounds; GB/s counts the bytes each pass
must read.  Prints a table per pass; the tables' rows (tables.V_NAN_FLAGS, tables.BWD_PREPROCESS) are
the "table" variant.

    python .ci/pass_ab.py          # on the GPU machine; ROUNDS (env) sets the rounds
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd.kernels import backward, forward  # noqa: E402
from fa_amd.kernels.launch import cdiv, head_dim_padded, row_strides  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
CALLS = 20
DEV = os.environ.get("DEV", "cuda")  # (DEV=cpu: a smoke run of the calls under the interpreter, untimed)
# (batch, seqlen, query heads, KV heads, head dim)
SHAPES = [(32, 512, 16, 16, 128), (16, 1024, 16, 16, 128), (32, 512, 32, 32, 64), (16, 1024, 32, 32, 64),
          (32, 512, 8, 8, 256), (4, 4096, 16, 16, 128), (1, 16384, 16, 16, 128), (8, 2048, 16, 4, 128)]
# V NaN flags: (BLOCK_ELEMENTS, MAX_SPLITS, PROGRAMS or 0 for no such key, num_warps); the first is the
# code before tables.V_NAN_FLAGS (32 rows at d128, 8 programs per (sequence, KV head))
FLAG_VARIANTS = [(4096, 8, 0, 4), (4096, 32, 2048, 4), (4096, 32, 4096, 4), (8192, 32, 2048, 4),
                 (16384, 32, 2048, 8), (8192, 32, 0, 4)]
# delta preprocess: (BLOCK_ELEMENTS, num_warps); 8192 / 4 is the code before this change (64 rows at d128)
PRE_VARIANTS = [(8192, 4), (8192, 8), (16384, 4), (16384, 8), (4096, 4), (32768, 8)]

_FLUSH = []


def graph_ms(fn) -> float:
    """Median ms of CALLS replays of fn captured in a CUDA graph, each after an L2 flush."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 * 2**20, dtype=torch.int8, device=DEV))
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]
    for start, end in events:
        _FLUSH[0].zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[CALLS // 2]


def flag_call(shape, variant):
    batch, seqlen, _, hk, d = shape
    v = torch.randn(batch, seqlen, hk, d, device=DEV, dtype=torch.bfloat16)
    d_pad = head_dim_padded(d)
    cfg = dict(BLOCK_ELEMENTS=variant[0], MAX_SPLITS=variant[1], num_warps=variant[3],
               **({"PROGRAMS": variant[2]} if variant[2] else {}))

    def run():
        tables.V_NAN_FLAGS["sm90"] = cfg
        try:
            forward.v_nan_flags(v, v, False, batch, hk, d, d_pad, seqlen, seqlen)
        finally:
            tables.V_NAN_FLAGS.pop("sm90", None)
    return run, v.numel() * 2


def pre_call(shape, variant):
    batch, seqlen, hq, _, d = shape
    out, dout = (torch.randn(batch, seqlen, hq, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    delta = torch.empty(batch, hq, seqlen, device=DEV, dtype=torch.float32)
    d_pad = head_dim_padded(d)
    block_m = max(16, variant[0] // d_pad)

    def run():
        backward.bwd_preprocess_kernel[(cdiv(seqlen, block_m), hq, batch)](
            out, dout, delta, out, seqlen, *row_strides(out, False), *row_strides(dout, False),
            delta.stride(0), delta.stride(1), out.shape[0], HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=block_m,
            IS_VARLEN=False, num_warps=variant[1])
    return run, out.numel() * 4


def table(name, make, variants, fmt):
    print(f"\n# {name}: us (GB/s), median of {ROUNDS} interleaved rounds of {CALLS} graph replays")
    print("| shape (b, s, hq, hk, d) | " + " | ".join(fmt(v) for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for shape in SHAPES:
        calls = [make(shape, v) for v in variants]
        times = [[] for _ in variants]
        for r in range(ROUNDS):
            order = list(range(len(variants)))
            order = order[r % len(order):] + order[:r % len(order)]
            for i in order:
                times[i].append(graph_ms(calls[i][0]))
        cells = []
        for (fn, nbytes), ts in zip(calls, times):
            ms = statistics.median(ts)
            cells.append(f"{1e3 * ms:.1f} ({nbytes / ms / 1e6:.0f})")
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    table("V NaN flags (BLOCK_ELEMENTS/MAX_SPLITS/PROGRAMS/warps)", flag_call, FLAG_VARIANTS,
          lambda v: "%d/%d/%d/w%d" % v)
    table("delta preprocess (BLOCK_ELEMENTS/warps)", pre_call, PRE_VARIANTS, lambda v: "%d/w%d" % v)


if __name__ == "__main__":
    main()
