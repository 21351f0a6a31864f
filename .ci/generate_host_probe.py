"""Where fa_amd's HF generate() (dynamic cache) spends host time against sdpa's (issue 14), on the `fa-amd bench
--generate` model (batch 8, prompt 1024, NEW new tokens), per implementation:
  - the prefill forward alone (ms, synced, median of 5);
  - the host<->device synchronisations of one generate() (torch.cuda sync debug mode, counted by the innermost
    callers outside torch);
  - one generate() under cProfile (NEW_PROFILED new tokens): the TOP functions by own and by cumulative time, so
    the host time fa_amd adds inside and outside its attention call shows.

    python .ci/generate_host_probe.py            # on the GPU machine
"""
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench_decode  # noqa: E402

NEW = int(os.environ.get("NEW", 8))
NEW_PROFILED = int(os.environ.get("NEW_PROFILED", 16))
IMPLS = os.environ.get("IMPLS", "fa_amd sdpa").split()
TOP = int(os.environ.get("TOP", 30))


def main():
    model = bench_decode._generate_model("cuda", torch.bfloat16, smoke=False)
    ids = torch.randint(3, model.config.vocab_size, (8, 1024), device="cuda")
    mask = torch.ones_like(ids)

    def generate(new=NEW):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True)

    for impl in IMPLS:
        model.set_attn_implementation(impl)
        generate()
        prefill()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prefill()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        where = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            # (torch's own frames out; a venv may itself live under a directory named torch)
            frames = [f for f in traceback.extract_stack()[:-1] if "site-packages/torch/" not in f.filename
                      and "warnings" not in f.filename and "generate_host_probe" not in f.filename]
            where[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-3:][::-1])] += 1

        old = warnings.showwarning
        warnings.showwarning = show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                generate()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = old
        print(f"{impl}: prefill {statistics.median(times):.2f} ms (rounds {' '.join(f'{t:.2f}' for t in times)}); "
              f"{sum(where.values())} syncs in one generate() of {NEW} new tokens")
        for site, n in where.most_common(12):
            print(f"   {n:5d}  {site}")
        generate(NEW_PROFILED)
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        generate(NEW_PROFILED)
        torch.cuda.synchronize()  # (the profile ends when the GPU has caught up)
        profile.disable()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).strip_dirs().sort_stats(key).print_stats(TOP)
            print(f"===== {impl}: one generate() of {NEW_PROFILED} new tokens under cProfile, by {key}")
            print(out.getvalue())


if __name__ == "__main__":
    main()
