"""GPU timing (issue 18): what the quantising functions' straight-through backward costs -- forward+backward
of flash_attn_fp8_func against flash_attn_func (bf16), and the backward's three FP8 round trips alone
(fa_amd.fp8.fp8_round_trip of q, k, v).  Interleaved rounds, CUDA events, median of ROUNDS (env, 5) rounds
of 10 calls each, L2 flushed before each call.

    PYTHONPATH=.:.ci python .ci/fp8_backward_cost.py
"""
import os
import statistics
import time

import torch

import fa_amd
from fa_amd import bench, fp8

ROUNDS = int(os.environ.get("ROUNDS", 5))
ROWS = [bench.Shape(4, 4096, 16, 16, 128, True), bench.Shape(2, 8192, 16, 4, 128, True),
        bench.Shape(16, 1024, 16, 16, 128, True)]


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {ROUNDS} rounds of 10 calls")
    print("| row | bf16 fwd+bwd ms | fp8_func fwd+bwd ms | ratio | round trips (q, k, v) ms |\n|---|---|---|---|---|")
    for shape in ROWS:
        q, k, v, dout = bench.make_inputs(shape, "bshd", torch.bfloat16, "cuda")
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        grads = [q, k, v]
        fp8_dtype = fp8.fp8_dtypes(q)[0]

        def bf16():
            fa_amd.flash_attn_func(q, k, v, causal=shape.causal).backward(dout)

        def fp8_func():
            fa_amd.flash_attn_fp8_func(q, k, v, causal=shape.causal).backward(dout)

        def trips():
            for x in (q, k, v):
                fp8.fp8_round_trip(x, fp8_dtype)

        fns = {"bf16": bf16, "fp8_func": fp8_func, "trips": trips}
        times = {n: [] for n in fns}
        for r in range(ROUNDS):
            for n in list(fns)[r % 3:] + list(fns)[:r % 3]:
                times[n].append(bench.gpu_round_ms(fns[n], grads, 10))
        ms = {n: statistics.median(t) for n, t in times.items()}
        print(f"| {shape.label} | {ms['bf16']:.3f} | {ms['fp8_func']:.3f} | {ms['fp8_func'] / ms['bf16']:.2f} | "
              f"{ms['trips']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
