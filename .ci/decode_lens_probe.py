"""GPU probe (issue 14): the decode kernel's time by how the call gives the key counts -- none (every key of
the cache), an int cache_seqlens, an int32 cache_seqlens tensor -- as CUDA-graph replays after the decode
bench's L2 flush (median of ROUNDS interleaved rounds), SDPA in the same rounds; then the kernels one
tensor-lens call launches (torch profiler).  Rows: ROWS (env, "BxCACHE,..."; default b1 2k, b8 2k, b64 2k, b64 8k),
bf16, GQA 32/8, d128, one query token.

    python .ci/decode_lens_probe.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.argv += ["--stages", "kernel"]

import fa_amd  # noqa: E402
from fa_amd import bench_decode  # noqa: E402
import decode_ab  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
ROWS = os.environ.get("ROWS", "1x2048,8x2048,64x2048,64x8192")


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, ROUNDS={ROUNDS}", flush=True)
    for item in ROWS.split(","):
        b, s = (int(x) for x in item.split("x"))
        row = bench_decode.DecodeRow(b, s)
        q, k, v = bench_decode._decode_inputs(row, torch.bfloat16, "cuda")
        q_f, k_f, v_f = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        calls = {"none": lambda: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f),
                 "int": lambda: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f, cache_seqlens=s),
                 "tensor": lambda: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f, cache_seqlens=lens),
                 "sdpa": bench_decode._decode_call("sdpa", row, q, k, v, "cuda")}
        graphs, keep = {}, []
        for name, fn in calls.items():
            replay, held = decode_ab.capture(fn)
            graphs[name] = replay
            keep.append(held)
        gbs = decode_ab.time_flushed(row, graphs, (decode_ab.FLUSH,), "lens", rounds=ROUNDS)
        cells = [f"{n} {row.kv_bytes() / (g * 1e3):8.2f} us ({g:6.0f} GB/s)" for n, g in gbs.items()]
        print(f"# {row.label:14s} " + " | ".join(cells), flush=True)
        for name in ("none", "tensor"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    calls[name]()
                torch.cuda.synchronize()
            for ev in prof.key_averages():
                if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
                    per_call = ev.device_time_total / ev.count
                    print(f"#     {name:7s} {ev.key[:60]:60s} x{ev.count // 3} {per_call:8.2f} us")
        del graphs, keep, q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
