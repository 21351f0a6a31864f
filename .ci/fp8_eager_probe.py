"""GPU probe (issue 18): why `fa-amd bench --fp8` reads the FP8 forward slower than CUDA-graph A/B runs do.

    PYTHONPATH=. python .ci/fp8_eager_probe.py      # on the GPU, ~3 min

For each row, fa_amd's bf16 forward and its FA3-style FP8 forward (bench.fp8_inputs) are timed as the bench
times them (eager calls, each after the bench's L2 flush: bench.gpu_round_ms) and as CUDA-graph replays after
the same flush, in ROUNDS interleaved rounds; then the host microseconds to issue one call, the SM clock and
board power over back-to-back calls (nvidia-smi), and one profiled eager call (GPU timeline after the flush).
"""
import os
import statistics
import subprocess
import time

import torch

from fa_amd import bench

ROUNDS = int(os.environ.get("ROUNDS", 7))
ROWS = [bench.Shape(4, 4096, 16, 16, 128, True), bench.Shape(4, 4096, 16, 4, 128, True),
        bench.Shape(2, 8192, 16, 16, 128, False), bench.Shape(4, 4096, 16, 16, 128, False)]


def calls_for(shape):
    q, k, v, _ = bench.make_inputs(shape, "bshd", torch.bfloat16, "cuda")
    q, k, v = (x.detach() for x in (q, k, v))
    q8, k8, v8, descales = bench.fp8_inputs(q, k, v)
    import fa_amd
    return {"bf16": lambda: fa_amd.flash_attn_func(q, k, v, causal=shape.causal),
            "fp8": lambda: fa_amd.flash_attn_func(q8, k8, v8, causal=shape.causal, **descales)}


def clocks_under(fn, seconds=1.5):
    """Median SM clock (MHz) and board power (W) while fn runs back to back."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    lines = [l.split(",") for l in smi.communicate()[0].splitlines() if "," in l]
    clocks = [float(a) for a, _ in lines[2:]] or [0.0]
    power = [float(b) for _, b in lines[2:]] or [0.0]
    return statistics.median(clocks), statistics.median(power)


def timeline(fn):
    """GPU kernels of one eager call after the flush: (name, start offset from the flush's end, duration) in us."""
    flush = bench.l2_flush("zero")
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            flush()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    out, flush_end = [], None
    for e in kernels:
        name = e.name
        if "fill" in name.lower() and e.time_range.elapsed_us() > 30:
            flush_end = e.time_range.end
            out.append(("--flush", 0.0, e.time_range.elapsed_us()))
            continue
        if flush_end is not None:
            out.append((name[:60], e.time_range.start - flush_end, e.time_range.elapsed_us()))
    return out[-6:]


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    import triton
    print("triton", triton.__version__, time.strftime("%H:%M:%S UTC", time.gmtime()), flush=True)
    for shape in ROWS:
        fns = calls_for(shape)
        with torch.no_grad():
            timed = {}
            for name, fn in fns.items():
                timed[f"{name} eager"] = (fn, ())
                timed[f"{name} graph"] = (bench.cuda_graph(fn, warmup=2).replay, ())
            times = bench.interleaved_rounds_ms(timed, ROUNDS)
            ms = {k: statistics.median(v) for k, v in times.items()}
            host = {name: bench.best_host_us(fn, 20) for name, fn in fns.items()}
            clocks = {name: clocks_under(fn) for name, fn in fns.items()}
            print(f"\n### {shape.label}", flush=True)
            for k, v in ms.items():
                print(f"  {k:12s} {v * 1e3:8.1f} us   rounds {[round(t * 1e3, 1) for t in times[k]]}")
            for mode in ("eager", "graph"):
                print(f"  ratio bf16/fp8 {mode}: {ms['bf16 ' + mode] / ms['fp8 ' + mode]:.3f}x")
            for name in fns:
                print(f"  {name}: host {host[name]:.1f} us/call; SM clock {clocks[name][0]:.0f} MHz, "
                      f"power {clocks[name][1]:.0f} W")
            for name, fn in fns.items():
                print(f"  {name} timeline (start after flush end, duration; us):")
                for kname, start, dur in timeline(fn):
                    print(f"     {start:8.1f} {dur:8.1f}  {kname}")
        del fns, timed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
