"""Where HF generate()'s host time goes with a dynamic cache (issue 14: fa_amd 818 vs sdpa 1069 new
tokens/s on the H100): the `fa-amd bench --generate` model (8 layers, hidden 2048, 16/4 heads, bf16),
batch 8, prompt 1024, NEW new tokens, per implementation: wall time per new token, then a cProfile of
one generate() sorted by own time (the attention functions and what they call).

    python .ci/generate_host.py            # on the GPU machine
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench_decode  # noqa: E402

NEW = int(os.environ.get("NEW", 32))


def main():
    model = bench_decode._generate_model("cuda", torch.bfloat16, smoke=False)
    ids = torch.randint(3, 32000, (8, 1024), device="cuda")
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    for impl in ("fa_amd", "sdpa"):
        model.set_attn_implementation(impl)
        run()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        print(f"{impl}: {1e3 * sorted(times)[1] / NEW:.2f} ms per new token (batch 8, median of 3)")
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        print(buf.getvalue())
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats("fa_amd|integrations|sdpa_attention", 25)
        print(buf.getvalue())
        # GPU side: the kernels' own time per generate(), by kernel
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as gpu_prof:
            run()
        print(gpu_prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
