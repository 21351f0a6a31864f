"""Where a left-padded batch's generate() with a static cache under torch.compile spends its time, fa_amd
against sdpa (issue 14: `fa-amd bench --generate --generate-padded` put fa_amd at 0.89x sdpa there, 1.40x with
a dynamic cache).  The `fa-amd bench --generate` model, batch 8, prompt 1024, NEW new tokens; per
(implementation, padded or not): wall ms per new token, the GPU kernels' summed time per new token (torch
profiler), the top kernels by time, and inductor's cudagraph skips and dynamo's graph breaks.

    python .ci/generate_padded_probe.py            # on the GPU machine (~3 min with compiles)
"""
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench_decode  # noqa: E402

NEW = int(os.environ.get("NEW", 64))
IMPLS = os.environ.get("IMPLS", "fa_amd sdpa").split()
PADDED = [p == "1" for p in os.environ.get("PADDED", "0 1").split()]
CACHE = os.environ.get("CACHE", "static")
TOP = int(os.environ.get("TOP", 10))


def main():
    from torch._dynamo.utils import counters

    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    model = bench_decode._generate_model("cuda", torch.bfloat16, smoke=False)
    batch, prompt = 8, 1024
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=gen).cuda()
    masks = {False: torch.ones_like(ids), True: bench_decode.left_padded_mask(batch, prompt).cuda()}
    kwargs = dict(cache_implementation="static") if CACHE == "static" else {}

    def run(impl, padded):
        model.set_attn_implementation(impl)
        mask = masks[padded]
        with torch.no_grad():
            return model.generate(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, max_new_tokens=NEW,
                                  min_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)

    for impl in IMPLS:
        for padded in PADDED:
            counters.clear()
            run(impl, padded)  # compile
            torch.cuda.synchronize()
            skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
            breaks = sum(counters["graph_break"].values())
            t0 = time.perf_counter()
            run(impl, padded)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run(impl, padded)
                torch.cuda.synchronize()
            per_kernel = defaultdict(lambda: [0.0, 0])
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    entry = per_kernel[ev.name]
                    entry[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                    entry[1] += 1
            gpu_us = sum(t for t, _ in per_kernel.values())
            print(f"\n== {impl} {CACHE} {'left-padded' if padded else 'unpadded'}: wall {wall / NEW:.3f} ms per new "
                  f"token, GPU kernels {gpu_us / 1e3 / NEW:.3f} ms per new token (prefill included), cudagraph skips "
                  f"{skips}, graph breaks {breaks} {dict(counters['graph_break']) if breaks else ''}", flush=True)
            for name, (t, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP]:
                print(f"  {t / 1e3:9.2f} ms  {n:6d} x  {name[:110]}", flush=True)


if __name__ == "__main__":
    main()
