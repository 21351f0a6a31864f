"""GPU experiment for `.ci/gpu profile`: where the forward+backward time goes, per kernel, for fa_amd's
backward variants and FlexAttention on the rows where Flex leads (docs/TUNING_NOTES.md "Open").
For each (row, variant): the do_bench median of one forward+backward (as `fa-amd bench` times it),
and the GPU microseconds per call of every kernel (torch.profiler, 5 calls), so the auxiliary
kernels (delta, dQ accumulator zero/convert, partial sums) show next to the main ones.
Variants (all deterministic=False, the bench's call): the dQ strategy forced to "atomic" (fp32
atomics from the dK/dV programs), "separate" (a second dQ kernel), the default (the tables' choice),
GQA rows also with every group split to one head per program, d64 rows also fused with other
dQ tiles; flex.  Then a CPU profile (by op) of one fa_amd forward+backward."""
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import fa_amd
from fa_amd import bench
from fa_amd import tuning
from fa_amd.kernels import backward as A
from fa_amd.tuning import tables

ROWS = [bench.Shape(16, 1024, 16, 16, 128, False), bench.Shape(4, 4096, 16, 16, 128, False),
        bench.Shape(1, 16384, 16, 16, 128, False), bench.Shape(16, 1024, 16, 16, 128, True),
        bench.Shape(4, 4096, 16, 16, 128, True), bench.Shape(16, 1024, 32, 32, 64, False),
        bench.Shape(8, 2048, 16, 4, 128, True), bench.Shape(8, 2048, 16, 4, 128, False)]
ROWS = [r for r in ROWS if not os.environ.get("ROWS") or r.label in os.environ["ROWS"].split(";")]


def fa_amd_maker(deterministic=False):
    def make(shape, device):
        return (lambda q, k, v: fa_amd.flash_attn_func(q, k, v, causal=shape.causal,
                                                       deterministic=deterministic)), "bshd"
    return make


def setting(dq_mode=None, heads_per_program=None, dq_entry=None):
    """A variant's module settings: the backward's dQ strategy, the GQA split, the d64 "dq" entry."""
    def apply():
        A.BWD_DQ_MODE, A.DKDV_HEADS_PER_PROGRAM = dq_mode, heads_per_program
        tables.TABLES["sm90"][0]["dq"] = dict(dq_entry or D64_DQ)
        tuning._RESOLVED.clear()
    return apply


D64_DQ = dict(tables.TABLES["sm90"][0]["dq"])


def kernel_us(fn, grads, calls=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            bench._clear_grads(grads)
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:60]] += ev.device_time / calls
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def cell(shape, variant, maker):
    fn, layout = maker(shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")

    def fwd_bwd():
        out = fn(q, k, v)
        (out[0] if isinstance(out, tuple) else out).backward(dout)

    ms = bench.time_ms(fwd_bwd, grad_to_none=[q, k, v])
    kernels = kernel_us(fwd_bwd, (q, k, v))
    host = bench.host_ms_per_call(fwd_bwd, (q, k, v))
    row = dict(shape=shape.label, variant=variant, ms=round(ms, 4),
               tflops=round(3.5 * shape.fwd_flops() / (ms * 1e-3) / 1e12, 1), host_ms=round(host, 3),
               kernel_sum_us=round(sum(kernels.values()), 1), kernels={n: round(t, 1) for n, t in kernels.items()})
    print(json.dumps(row), flush=True)
    return row


def host_profile(shape=bench.Shape(16, 1024, 16, 16, 128, True), calls=20):
    """CPU time by op of fa_amd forward+backward (the autograd engine's share included)."""
    fn, layout = fa_amd_maker()(shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")
    for _ in range(5):
        bench._clear_grads((q, k, v))
        fn(q, k, v).backward(dout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            bench._clear_grads((q, k, v))
            fn(q, k, v).backward(dout)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def main():
    rows = []
    for shape in ROWS:
        variants = [("atomic", setting("atomic")), ("separate", setting("separate")), ("default", setting())]
        if shape.heads_q != shape.heads_kv:
            variants.append(("default+split1", setting(heads_per_program=1)))
        if shape.head_dim == 64:
            variants += [(f"fused+dq{m}x{n}w8", setting("fused", dq_entry=dict(BLOCK_M=m, BLOCK_N=n, num_warps=8,
                                                                                num_stages=3)))
                         for m, n in ((128, 64), (128, 32), (64, 64))]
        variants.append(("flex", None))
        for name, apply in variants:
            setting()() if apply is None else apply()
            try:
                rows.append(cell(shape, name, bench.make_flex if apply is None else fa_amd_maker()))
            except Exception as exc:
                print(json.dumps(dict(shape=shape.label, variant=name, error=repr(exc)[:300])), flush=True)
            torch.cuda.empty_cache()
    setting()()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kernel_profile.json"), "w") as f:
            json.dump(rows, f, indent=1)
    host_profile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
