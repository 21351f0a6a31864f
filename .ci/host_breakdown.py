"""GPU experiment for `.ci/gpu host`: where the host time of one forward+backward goes, at a shape whose
GPU time is ~1 ms on an H100 (16, 1024, 16, 128, causal). Prints CPU microseconds per call (issued back
to back, no sync) for: an empty Triton launch, the raw launchers (attention_forward + attention_backward),
the same launchers called from a second Python thread, a bare autograd.Function around them, and the
public API (docs/TUNING_NOTES.md v6: ~0.5 ms appeared between the launchers and the Function)."""
import threading
import time

import torch
import triton
import triton.language as tl

import fa_amd
from fa_amd.bench import host_ms_per_call
from fa_amd.kernels import backward as A, forward as F
from fa_amd.ops import EagerAttention

B, S, H, D = 16, 1024, 16, 128
SCALE = D ** -0.5
q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn_like(q).requires_grad_()
v = torch.randn_like(q).requires_grad_()
dout = torch.randn_like(q)
out, lse, _ = F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1, 0, 0.0, None, None, False)


@triton.jit
def _nop(x):
    pass


def empty_launch():
    _nop[(1,)](q)


def launchers():
    F.attention_forward(q, k, v, None, None, S, S, 0.0, SCALE, -1, 0, 0.0, None, None, False)
    A.attention_backward(dout, q, k, v, out, lse, None, None, S, S, 0.0, SCALE, -1, 0, 0.0, None, None, False)


def bare_function():
    # the public API's autograd.Function, without the interface's checks
    EagerAttention.apply(q, k, v, None, None, S, S, 0.0, SCALE, -1, 0, 0.0, None, None, False, False
                         )[0].backward(dout)


def public_api():
    fa_amd.flash_attn_func(q, k, v, causal=True).backward(dout)


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


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for name, fn in (("empty Triton launch", empty_launch), ("raw launchers (fwd+bwd)", launchers),
                     ("bare autograd.Function", bare_function), ("public API", public_api)):
        print(f"{name:32s} {min(host_us(fn) for _ in range(3)):8.0f} us/call (host, best of 3)", flush=True)
    print(f"{'raw launchers, second thread':32s} {in_thread(launchers):8.0f} us/call (host)")
