"""Host time of one forward+backward, at a shape whose GPU time is ~1 ms on an H100 (16, 1024, 16, 128,
causal). Prints CPU microseconds per call (issued back to back, no sync) for: an empty Triton launch, the
raw launchers (attention_forward + attention_backward), the same launchers called from a second Python
thread, a bare autograd.Function around them, and the public API (docs/TUNING_NOTES.md v6: ~0.5 ms
appeared between the launchers and the Function).

    python .ci/host_breakdown.py          # on the GPU machine (`.ci/gpu host`)
    python .ci/host_breakdown.py --profile  # also: cProfile of the public API's calls (top functions by own
                                            # time) and the launches / CUDA API calls per call (torch.profiler)
    python .ci/host_breakdown.py --pieces   # also: host us of single pieces of the planned launchers
    python .ci/host_breakdown.py --cpu    # here: kernels stubbed out (no launch at all), the sm90 tables,
                                          # small CPU tensors: the Python/autograd glue alone (v9)
"""
import os
import sys
import threading

CPU = "--cpu" in sys.argv
if CPU:
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors pass the interface's device check

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fa_amd  # noqa: E402
from fa_amd.arch import Arch  # noqa: E402
from fa_amd.bench import host_ms_per_call  # noqa: E402
from fa_amd.kernels import backward as A, forward as F  # noqa: E402
from fa_amd.ops import EagerAttention  # noqa: E402

DEVICE = "cpu" if CPU else "cuda"
# CPU: small tensors (allocation is not what is measured); the launchers still resolve sm90 configs
B, S, H, D = (2, 128, 4, 128) if CPU else (16, 1024, 16, 128)
CAUSAL = "--full" not in sys.argv
if "--shape" in sys.argv:  # --shape B S H D: another shape (the bench's b32 s512 rows: 32 512 16 128)
    B, S, H, D = (int(x) for x in sys.argv[sys.argv.index("--shape") + 1:][:4])
SCALE = D ** -0.5


def _stub_kernels():
    """Every launch becomes a no-op that still evaluates its grid; configs come from the sm90 tables."""
    sm90 = Arch("cuda", "sm90", 32)

    def launch(kernel, cfg, grid0, grid_tail, args, kwargs, per_cfg=None):
        grid0(cfg)
        return cfg

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for module in (F, A):
        module.arch_for = lambda x: sm90
        module.launch = launch
        module.jit_launch = lambda kernel, grid, args, kwargs: None  # (the V NaN flags, the delta pass)
    A.num_sms = lambda x: 132
    A.bwd_preprocess_kernel = NoLaunch()


if CPU:
    _stub_kernels()
q = torch.randn(B, S, H, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn_like(q).requires_grad_()
v = torch.randn_like(q).requires_grad_()
dout = torch.randn_like(q)
WINDOW_RIGHT = 0 if CAUSAL else -1
out, lse, _ = F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1, WINDOW_RIGHT, 0.0, None, None, False)


@triton.jit
def _nop(x):
    pass


def empty_launch():
    _nop[(1,)](q)


def launchers():
    F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1, WINDOW_RIGHT, 0.0, None, None, False)
    A.attention_backward(dout, q, k, v, out, lse, None, None, S, S, 0.0, SCALE, -1, WINDOW_RIGHT, 0.0, None, None,
                         False)


def bare_function():
    # the public API's autograd.Function, without the interface's checks
    EagerAttention.apply(q, k, v, None, (None, None, S, S, 0.0, SCALE, -1, WINDOW_RIGHT, 0.0, None, None, False, False)
                         )[0].backward(dout)


def public_api():
    fa_amd.flash_attn_func(q, k, v, causal=CAUSAL).backward(dout)


def host_us(fn, calls=100):
    for _ in range(9):  # warm-up (host_ms_per_call adds one more)
        fn()
    return 1e3 * host_ms_per_call(fn, (q, k, v), calls)  # clears q/k/v grads before each call


def in_thread(fn):
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("us", host_us(fn)))
    worker.start()
    worker.join()
    return result["us"]


def segments(calls=200):
    """Median host microseconds of the parts of one public-API forward+backward (no sync): the forward
    call, backward() up to the autograd node's entry, the node's own Python, its return to the caller."""
    import statistics
    import time

    stamps = {}
    real_forward, real_backward = EagerAttention.forward, EagerAttention.backward

    def forward(ctx, *args):
        stamps["fwd_in"] = time.perf_counter_ns()
        out = real_forward(ctx, *args)
        stamps["fwd_out"] = time.perf_counter_ns()
        return out

    def backward(ctx, *grads):
        stamps["bwd_in"] = time.perf_counter_ns()
        out = real_backward(ctx, *grads)
        stamps["bwd_out"] = time.perf_counter_ns()
        return out

    EagerAttention.forward, EagerAttention.backward = staticmethod(forward), staticmethod(backward)
    rows = []
    try:
        for i in range(calls + 10):
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter_ns()
            out = fa_amd.flash_attn_func(q, k, v, causal=CAUSAL)
            t1 = time.perf_counter_ns()
            out.backward(dout)
            t2 = time.perf_counter_ns()
            if i >= 10:
                rows.append((stamps["fwd_in"] - t0, stamps["fwd_out"] - stamps["fwd_in"], t1 - stamps["fwd_out"],
                             stamps["bwd_in"] - t1, stamps["bwd_out"] - stamps["bwd_in"], t2 - stamps["bwd_out"],
                             t2 - t0))
    finally:
        EagerAttention.forward, EagerAttention.backward = staticmethod(real_forward), staticmethod(real_backward)
    names = ("api->node fwd", "node fwd", "fwd return", "backward()->node", "node bwd", "node->caller", "total")
    print("segments (median us over", calls, "calls):",
          "  ".join(f"{n} {statistics.median(r[i] for r in rows) / 1e3:.0f}" for i, n in enumerate(names)))


def pieces():
    """Host us of single pieces of the planned forward / backward (best of 5 runs of 500 calls back to back)."""
    from fa_amd.bench import best_host_us
    from fa_amd.kernels.launch import current_stream

    rows = [
        ("attention_forward (planned)", lambda: F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1,
                                                                    WINDOW_RIGHT, 0.0, None, None, False)),
        ("attention_backward (planned)", lambda: A.attention_backward(dout, q, k, v, out, lse, None, None, S, S, 0.0,
                                                                      SCALE, -1, WINDOW_RIGHT, 0.0, None, None,
                                                                      False)),
        ("q.new_empty(q.shape)", lambda: q.new_empty(q.shape)),
        ("torch.zeros(1024, int32)", lambda: torch.zeros(1024, device=q.device, dtype=torch.int32)),
        ("q.new_empty((0,))", lambda: q.new_empty((0,))),
        ("current_stream()", current_stream),
        ("torch.is_grad_enabled()", torch.is_grad_enabled),
    ]
    for name, fn in rows:
        print(f"  {name:36s} {best_host_us(fn, 500):7.2f} us", flush=True)


def profile(fn, calls=200):
    """Where the host time of `fn` goes: Python functions by own time, then the CUDA runtime calls."""
    import cProfile
    import pstats

    for _ in range(10):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        q.grad = k.grad = v.grad = None
        fn()
    prof.disable()
    print(f"cProfile, {calls} calls of {fn.__name__} (per-call us = tottime / {calls} * 1e6):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if CPU:
        return
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(20):
            q.grad = k.grad = v.grad = None
            fn()
        torch.cuda.synchronize()
    print("torch.profiler, 20 calls (counts are totals):")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    print(torch.cuda.get_device_name() if not CPU else "CPU, kernels stubbed", torch.__version__, triton.__version__,
          f"shape (b, s, h, d) = {(B, S, H, D)}, {'causal' if CAUSAL else 'full'}")
    cases = [("raw launchers (fwd+bwd)", launchers), ("bare autograd.Function", bare_function),
             ("public API", public_api)]
    if not CPU:
        cases.insert(0, ("empty Triton launch", empty_launch))
    for name, fn in cases:
        print(f"{name:32s} {min(host_us(fn) for _ in range(5 if CPU else 3)):8.0f} us/call (host, best of runs)",
              flush=True)
    if not CPU:
        print(f"{'raw launchers, second thread':32s} {in_thread(launchers):8.0f} us/call (host)")
    segments()
    if "--pieces" in sys.argv and not CPU:
        pieces()
    if "--profile" in sys.argv:
        profile(public_api)

