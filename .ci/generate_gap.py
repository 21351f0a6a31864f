"""Where fa_amd's HF generate() (dynamic cache) loses host time to sdpa's (issue 14): the `fa-amd bench
--generate` model, batch 8, prompt 1024, NEW new tokens, fa_amd and sdpa in interleaved rounds.  Per
implementation and round: ms per new token, the host ms per new token spent inside the attention
function and inside the mask function (timing wrappers around Transformers' registered functions), us
per call inside fa_amd's decode call and inside the replayed launches' Triton runner,
and the Python garbage collector's collections and ms (gc.callbacks).  GC=freeze runs gc.freeze()
after the model is built (long-lived objects leave the collector's generations).

    python .ci/generate_gap.py            # on the GPU machine
"""
import gc
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import bench_decode  # noqa: E402

NEW = int(os.environ.get("NEW", 32))
ROUNDS = int(os.environ.get("ROUNDS", 3))
DEVICE = os.environ.get("DEVICE", "cuda")
IMPLS = os.environ.get("IMPLS", "fa_amd sdpa").split()

spent = defaultdict(float)
calls = defaultdict(int)


def timed(tag, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[tag] += time.perf_counter() - t0
            calls[tag] += 1
    return wrapper


_gc_t0 = [0.0]


def _gc_callback(phase, info):
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        spent[f"gc{info['generation']}"] += time.perf_counter() - _gc_t0[0]
        calls[f"gc{info['generation']}"] += 1


def main():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = bench_decode._generate_model(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32, smoke=DEVICE != "cuda")
    import fa_amd.kvcache
    from fa_amd.integrations import hf_attention
    from fa_amd.kernels import launch
    # inside the attention function: the decode call (a filed step's hf_attention.run_filed_plan, else
    # fa_amd.kvcache.decode_attention) and the replayed launches in it (CompiledLaunch.launch: Triton's runner)
    fa_amd.kvcache.decode_attention = timed("decode", fa_amd.kvcache.decode_attention)
    hf_attention.run_filed_plan = timed("decode", hf_attention.run_filed_plan)
    launch.CompiledLaunch.launch = timed("runner", launch.CompiledLaunch.launch)
    for impl in IMPLS:
        ALL_ATTENTION_FUNCTIONS[impl] = timed("attn", ALL_ATTENTION_FUNCTIONS[impl])
        ALL_MASK_ATTENTION_FUNCTIONS[impl] = timed("mask", ALL_MASK_ATTENTION_FUNCTIONS[impl])
    ids = torch.randint(3, model.config.vocab_size, (8, 1024 if DEVICE == "cuda" else 17), device=DEVICE)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    for impl in IMPLS:  # warm-up (compiles, plans)
        model.set_attn_implementation(impl)
        run()
    if os.environ.get("GC") == "freeze":
        gc.collect()
        gc.freeze()
    gc.callbacks.append(_gc_callback)
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch", torch.__version__, "GC", os.environ.get("GC", "default"),
          "gc thresholds", gc.get_threshold(), "objects tracked", len(gc.get_objects()))
    rows = defaultdict(list)
    for r in range(ROUNDS):
        order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
        for impl in order:
            model.set_attn_implementation(impl)
            spent.clear()
            calls.clear()
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
            per = lambda tag: 1e3 * spent[tag] / NEW  # noqa: E731
            us = lambda tag: f"{1e6 * spent[tag] / max(calls[tag], 1):5.1f} us x {calls[tag]}"  # noqa: E731
            rows[impl].append(1e3 * wall / NEW)
            print(f"round {r} {impl:7s} {1e3 * wall / NEW:6.2f} ms/token | attn {per('attn'):5.2f} ms/token "
                  f"({calls['attn']} calls, {1e6 * spent['attn'] / max(calls['attn'], 1):5.1f} us each) | mask "
                  f"{per('mask'):5.2f} ({calls['mask']} calls) | decode {us('decode')} | runner {us('runner')} | gc " +
                  " ".join(f"g{g}: {calls[f'gc{g}']} x, {1e3 * spent[f'gc{g}']:.1f} ms" for g in range(3)),
                  flush=True)
    for impl in IMPLS:
        print(f"{impl}: median {statistics.median(rows[impl]):.2f} ms per new token")


if __name__ == "__main__":
    main()
