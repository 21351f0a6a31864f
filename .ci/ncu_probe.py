"""GPU profiling aid: one call of a chosen row between torch.cuda.profiler.start() / stop(), for Nsight
Compute's `--profile-from-start off` (the warm-up calls, compiles and launch-plan building stay outside).

    bash .ci/gpu ncu                                 # the rows below, one process each (NCU_ROWS picks)
    ncu --profile-from-start off --section SpeedOfLight python .ci/ncu_probe.py fp8-causal
    python .ci/ncu_probe.py --list

Rows (d128 bf16 unless named): decode-b1-2k / decode-b1-2k-sdpa (GQA 32/8, one query token, a 2k cache),
decode-b64-2k / -sdpa, fp8-causal / bf16-causal / fp8-full / bf16-full (b4 s4k h16), fp8-gqa-causal /
bf16-gqa-causal (h16/kv4), bwd-b32-s512-causal / -flex (the backward alone, b32 s512 h16 causal).
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd import bench  # noqa: E402


def decode(batch, cache, method):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 1, 128, generator=gen, device="cuda").bfloat16()
    k = torch.randn(batch, 8, cache, 128, generator=gen, device="cuda").bfloat16()
    v = torch.randn(batch, 8, cache, 128, generator=gen, device="cuda").bfloat16()
    if method == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    q_f, k_f, v_f = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return lambda: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f)


def prefill(hk, causal, fp8):
    shape = bench.Shape(4, 4096, 16, hk, 128, causal)
    q, k, v, _ = bench.make_inputs(shape, "bshd", torch.bfloat16, "cuda")
    q, k, v = (x.detach() for x in (q, k, v))
    if not fp8:
        return lambda: fa_amd.flash_attn_func(q, k, v, causal=causal)
    q8, k8, v8, descales = bench.fp8_inputs(q, k, v)
    return lambda: fa_amd.flash_attn_func(q8, k8, v8, causal=causal, **descales)


def backward(method, batch=32, seqlen=512, heads=16, causal=True):
    """(forward, backward): the backward of `method` (bench.MAKERS) on the bench's d128 row, its forward untimed."""
    shape = bench.Shape(batch, seqlen, heads, heads, 128, causal)
    fn, layout = bench.MAKERS[method](shape, "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cuda")
    kept = []

    def forward():
        with torch.enable_grad():
            out = fn(q, k, v)
        kept.append(out[0] if isinstance(out, tuple) else out)

    def run():
        kept.pop().backward(dout)
    return forward, run


ROWS = {
    "decode-b1-2k": lambda: decode(1, 2048, "fa_amd"),
    "decode-b1-2k-sdpa": lambda: decode(1, 2048, "sdpa"),
    "decode-b64-2k": lambda: decode(64, 2048, "fa_amd"),
    "decode-b64-2k-sdpa": lambda: decode(64, 2048, "sdpa"),
    "fp8-causal": lambda: prefill(16, True, True),
    "bf16-causal": lambda: prefill(16, True, False),
    "fp8-full": lambda: prefill(16, False, True),
    "bf16-full": lambda: prefill(16, False, False),
    "fp8-gqa-causal": lambda: prefill(4, True, True),
    "bf16-gqa-causal": lambda: prefill(4, True, False),
    # issue 17's b32 s512 d128 causal row: the backward alone (the delta preprocess and the fused dK/dV + dQ
    # launch; Flex's own kernels)
    "bwd-b32-s512-causal": lambda: backward("fa_amd"),
    "bwd-b32-s512-causal-flex": lambda: backward("flex"),
}


def main():
    if sys.argv[1:] == ["--list"]:
        print("\n".join(ROWS))
        return
    fn = ROWS[sys.argv[1]]()
    before, fn = fn if isinstance(fn, tuple) else (lambda: None, fn)  # (a backward row: its forward untimed)
    with torch.no_grad():
        for _ in range(3):
            before()
            fn()
        before()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
