"""Host time of one HF generate() (dynamic cache) per implementation under cProfile (issue 14): the `fa-amd bench
--generate` model, batch 8, prompt 1024, NEW new tokens; prints each implementation's functions by own time and the
cumulative time of the model's layers, so the host time fa_amd adds outside its attention call shows.

    python .ci/generate_profile.py          # on the GPU machine
"""
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench_decode  # noqa: E402

NEW = int(os.environ.get("NEW", 16))
IMPLS = os.environ.get("IMPLS", "fa_amd sdpa").split()
TOP = int(os.environ.get("TOP", 30))


def main():
    model = bench_decode._generate_model("cuda", torch.bfloat16, smoke=False)
    ids = torch.randint(3, model.config.vocab_size, (8, 1024), device="cuda")
    mask = torch.ones_like(ids)

    def generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    for impl in IMPLS:
        model.set_attn_implementation(impl)
        generate()
        generate()
        profile = cProfile.Profile()
        profile.enable()
        generate()
        profile.disable()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out).strip_dirs().sort_stats(key)
            stats.print_stats(TOP)
            print(f"===== {impl} by {key}")
            print(out.getvalue())


if __name__ == "__main__":
    main()
