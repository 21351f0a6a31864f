"""Host time inside the autograd nodes of one public-API forward+backward (GPU machine): the forward
launcher alone in a loop, then inside EagerAttention.forward (launcher vs _setup_context), and the
backward launcher alone vs inside EagerAttention.backward.  Median microseconds over 200 calls, no sync.

    python .ci/host_nodes.py [B S H D] [--full]
"""
import statistics
import sys
import time

import torch

import fa_amd
from fa_amd import ops
from fa_amd.kernels import backward as A, forward as F

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, S, H, D = (int(x) for x in args[:4]) if args else (32, 512, 16, 128)
CAUSAL = "--full" not in sys.argv
q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn_like(q).requires_grad_()
v = torch.randn_like(q).requires_grad_()
dout = torch.randn_like(q)
SCALE, WR = D ** -0.5, (0 if CAUSAL else -1)
stamps = {}


def timed(name, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter_ns()
        r = fn(*a, **kw)
        stamps.setdefault(name, []).append(time.perf_counter_ns() - t)
        return r
    return wrapper


def median_us(xs):
    return statistics.median(xs[20:]) / 1e3


def loop(fn, n=220):
    out = []
    for _ in range(n):
        q.grad = k.grad = v.grad = None
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    torch.cuda.synchronize()
    return median_us(out)


out, lse, _ = F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1, WR, 0.0, None, None, False)
print(torch.cuda.get_device_name(), torch.__version__, (B, S, H, D), "causal" if CAUSAL else "full")
print("fwd launcher alone", f"{loop(lambda: F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1, WR, 0.0, None, None, False)):.0f}")
print("bwd launcher alone", f"{loop(lambda: A.attention_backward(dout, q, k, v, out, lse, None, None, S, S, 0.0, SCALE, -1, WR, 0.0, None, None, False)):.0f}")
print("empty alloc", f"{loop(lambda: q.new_empty((0,))):.1f}", "alloc like q", f"{loop(lambda: q.new_empty(q.shape)):.1f}",
      "zeros small", f"{loop(lambda: torch.zeros((B, H, D + 1), device='cuda', dtype=torch.int32)):.1f}")
ops.attention_forward = timed("node: attention_forward", ops.attention_forward)
ops._setup_context = timed("node: _setup_context", ops._setup_context)
ops.attention_backward = timed("node: attention_backward", ops.attention_backward)
ops._backward_with = timed("node: _backward_with", ops._backward_with)
ops.EagerAttention.forward = staticmethod(timed("node fwd (all)", ops.EagerAttention.forward))
ops.EagerAttention.backward = staticmethod(timed("node bwd (all)", ops.EagerAttention.backward))
total = loop(lambda: fa_amd.flash_attn_func(q, k, v, causal=CAUSAL).backward(dout))
fwd_only = loop(lambda: fa_amd.flash_attn_func(q, k, v, causal=CAUSAL))
print("public fwd+bwd", f"{total:.0f}", "| public fwd only (graph built, no backward)", f"{fwd_only:.0f}")
for name, xs in stamps.items():
    print(f"  {name:28s} {median_us(xs):.0f}")
