"""Where a decode call's host time goes, on the GPU machine (GQA 32/8, d128, bf16, one query token):
per row, CPU microseconds to issue one call back to back with no sync for the public
flash_attn_with_kvcache, for decode_forward (no argument checks), for an empty Triton launch and for
an empty launch with the decode kernel's argument count; the GPU microseconds of one call replayed in
a CUDA graph (the kernels alone, no launch gaps) next to SDPA's; then a cProfile of the public call.

    python .ci/decode_host.py            # on the GPU machine
"""
import cProfile
import io
import os
import pstats
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd.bench import graph_replay_ms, host_ms_per_call  # noqa: E402
from fa_amd.kernels import decode as D  # noqa: E402
from fa_amd.tuning import resolve_entry, tables  # noqa: E402

ROWS = [(1, 2048), (1, 32768), (8, 8192), (64, 2048)]


@triton.jit
def _nop(x):
    pass


@triton.jit
def _nop_many(x, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
              c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9,
              e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, f0, f1, f2, f3, f4, f5, f6, f7, f8, f9,
              K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, K4: tl.constexpr,
              K5: tl.constexpr, K6: tl.constexpr, K7: tl.constexpr, K8: tl.constexpr, K9: tl.constexpr):
    pass


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    x = torch.empty(16, device="cuda")
    ints = [17 * i + 3 for i in range(60)]
    consts = dict(K0=1, K1=2, K2=True, K3=False, K4=64, K5=128, K6=4, K7=0, K8=1, K9=3)
    print(f"empty launch, 1 arg:          {1e3 * host_ms_per_call(lambda: _nop[(1,)](x), (), 200):7.1f} us")
    print(f"empty launch, 61 args + 10 K: "
          f"{1e3 * host_ms_per_call(lambda: _nop_many[(1, 1, 1)](x, *ints, **consts), (), 200):7.1f} us")
    compiled = _nop_many[(1, 1, 1)](x, *ints, **consts)  # the CompiledKernel of that launch
    runner = compiled[(1, 1, 1)]
    print(f"the same, through the CompiledKernel's runner (no binder / cache key): "
          f"{1e3 * host_ms_per_call(lambda: runner(x, *ints, *consts.values()), (), 200):7.1f} us")
    # the launcher itself, as CompiledLaunch.launch calls it (addresses, no hooks): its cost per argument
    stream = torch.cuda.current_stream().cuda_stream
    for name, kernel, args, kw in (("1 arg", _nop, [], {}), ("61 args + 10 K", _nop_many, ints, consts)):
        c = kernel[(1, 1, 1)](x, *args, **kw)
        c[(1, 1, 1)]  # (initialises the kernel's handles)
        direct = [x.data_ptr()] + list(args)
        if resolve_entry(tables.COMPILED_LAUNCH)["args"] == "all":  # (constexprs too, as CompiledLaunch passes them)
            direct += list(kw.values())
        run = lambda: c.run(1, 1, 1, stream, c.function, c.packed_metadata, None, None, None, *direct)  # noqa: E731
        print(f"empty launch, {name}, the launcher called directly: {1e3 * host_ms_per_call(run, (), 500):7.1f} us")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for batch, cache in ROWS:
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, cache, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        public = lambda: fa_amd.flash_attn_with_kvcache(q, k, v)  # noqa: E731
        direct = lambda: D.decode_forward(q, k, v, 128 ** -0.5, -1, -1, 0.0, None)  # noqa: E731
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        torch_sdpa = lambda: sdpa(qt, kt, vt, enable_gqa=True)  # noqa: E731
        cells = []
        for name, fn in (("public", public), ("decode_forward", direct), ("sdpa", torch_sdpa)):
            host = 1e3 * host_ms_per_call(fn, (), 200)
            gpu = graph_replay_ms(fn, ())
            cells.append(f"{name} host {host:6.1f} us, graph {1e3 * gpu:6.1f} us" if gpu else f"{name} host {host:6.1f}")
        print(f"b{batch} cache {cache}: " + " | ".join(cells))
        if (batch, cache) == ROWS[0]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                public()
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            profile_text = buf.getvalue()
    print(profile_text)


if __name__ == "__main__":
    main()
