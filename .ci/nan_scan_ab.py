"""GPU experiment (issue 17, the short causal rows): a masked forward finds V's NaNs inside the kernel
(tables.FWD_NAN_SCAN_FAMILIES, forward._v_nan_find) or by the pass over V before it
(forward.v_nan_flags_kernel).  Both modes of each row in the same interleaved rounds, timed as
`fa-amd bench` times (L2 flush before each call, CUDA events, median call per round, median round);
forward and forward+backward TFLOP/s.  ROUNDS (env) sets the rounds.

    python .ci/nan_scan_ab.py      # on the GPU machine
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd import bench, tuning  # noqa: E402
from fa_amd.arch import device_arch  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
# (batch, seqlen, query heads, KV heads, head dim, window): window None = causal
ROWS = [(32, 512, 16, 16, 128, None), (16, 1024, 16, 16, 128, None), (32, 512, 32, 32, 64, None),
        (32, 512, 8, 8, 256, None), (4, 4096, 16, 16, 128, None), (1, 16384, 16, 16, 128, None),
        (8, 2048, 16, 4, 128, None), (4, 4096, 16, 16, 128, (1024, 0))]
FAMILY = tuning.family_of(device_arch())
MODES = {"scan": tuple(tables.FWD_NAN_SCAN_FAMILIES) + (FAMILY,),
         "pass": tuple(f for f in tables.FWD_NAN_SCAN_FAMILIES if f != FAMILY)}


def calls(row, mode):
    b, s, hq, hk, d, window = row
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    kw = dict(causal=True) if window is None else dict(window_size=window, causal=True)
    dout = torch.randn_like(q)

    def fwd():
        tables.FWD_NAN_SCAN_FAMILIES = MODES[mode]
        with torch.no_grad():
            fa_amd.flash_attn_func(q, k, v, **kw)

    def fwd_bwd():
        tables.FWD_NAN_SCAN_FAMILIES = MODES[mode]
        fa_amd.flash_attn_func(q, k, v, **kw).backward(dout)
    return fwd, fwd_bwd, (q, k, v)


def flops(row, backward):
    b, s, hq, _, d, window = row
    keys = s / 2 if window is None else min(window[0] + 1, s)  # causal: half the keys on average
    f = 4 * b * hq * s * keys * d
    return f * (3.5 if backward else 1.0)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "| TFLOP/s, median of", ROUNDS, "rounds")
    print("| row (b, s, hq, hk, d, window) | fwd scan | fwd pass | fwd+bwd scan | fwd+bwd pass |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        made = {m: calls(row, m) for m in MODES}
        times = bench.interleaved_rounds_ms({(m, i): (made[m][i], made[m][2] if i else ())
                                             for m in MODES for i in (0, 1)}, ROUNDS)
        cells = [flops(row, i) / statistics.median(times[(m, i)]) / 1e9 for i in (0, 1) for m in MODES]
        print(f"| {row} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
