"""GPU diagnostic (issue 17): why fa_amd's forward+backward rounds swing on small rows while its peers' do
not (e.g. b16 s1024 d96 causal rounds 1.78 / 1.23 / 1.08 ms, Flex 1.17-1.18).  Runs the bench's interleaved
rounds for a few rows and prints, per method and round, the GPU ms per call (CUDA events, median, as
`fa-amd bench`) next to the host ms to issue one call (wall time of the round's loop / calls), and for fa_amd
how many launch-plan replays fell back to the long way.  GC=freeze (env) calls gc.freeze() after warm-up.

    python .ci/round_stalls.py          # on the GPU machine
"""
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench  # noqa: E402
from fa_amd.kernels import launch as L  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 6))
CALLS = int(os.environ.get("CALLS", 12))
ROWS = [bench.Shape(32, 512, 8, 8, 256, True), bench.Shape(16, 1024, 21, 21, 96, True),
        bench.Shape(16, 1024, 16, 16, 128, True), bench.Shape(32, 512, 16, 16, 128, True)]
METHODS = ("fa_amd", "sdpa_flash", "flex")
MISSES = [0, 0]  # plan replays that fell back / that ran
_run = L.LaunchPlan.run


def _counted_run(self, env):
    ok = _run(self, env)
    MISSES[0 if not ok else 1] += 1
    return ok


L.LaunchPlan.run = _counted_run
FLUSH = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")


def one_round(fn, grads):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]
    bench._clear_grads(grads)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start, end in events:
        bench._clear_grads(grads)
        FLUSH.zero_()
        start.record()
        fn()
        end.record()
    host = (time.perf_counter() - t0) * 1e3 / CALLS
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), host


def make(shape, method):
    fn, layout = bench.MAKERS[method](shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def call():
        out = fn(q, k, v)
        (out[0] if isinstance(out, tuple) else out).backward(dout)
    return call, (q, k, v)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "GC", os.environ.get("GC", "default"),
          f"| fwd+bwd, {CALLS} calls per round: GPU ms (median call) / host ms per call")
    for shape in ROWS:
        timed = {m: make(shape, m) for m in METHODS}
        for fn, _ in timed.values():
            fn()
        if os.environ.get("GC") == "freeze":
            gc.collect()
            gc.freeze()
        rows = {m: [] for m in METHODS}
        MISSES[:] = [0, 0]
        for r in range(ROUNDS):
            for m in METHODS[r % 3:] + METHODS[:r % 3]:
                rows[m].append(one_round(*timed[m]))
        print(shape.label, f"(plan fallbacks {MISSES[0]} of {sum(MISSES)})")
        for m in METHODS:
            print(f"  {m:10s}", "  ".join(f"{g:.3f}/{h:.3f}" for g, h in rows[m]))
        if os.environ.get("GC") == "freeze":
            gc.unfreeze()
        del timed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
