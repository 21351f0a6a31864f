"""GPU experiment (issue 18, point 6): what the FP8 forward's per-call descale preparation costs inside a timed
call, as `fa-amd bench --fp8` times it (CUDA events around each call, L2 flush before it).

    PYTHONPATH=. python .ci/fp8_descale_ab.py            # on an H100 / H200: ~2-3 min
    SMOKE=1 PYTHONPATH=. python .ci/fp8_descale_ab.py    # CPU check of the script (interpreter, tiny rows)

Variants, every one in the same interleaved rounds (fa_amd.bench.interleaved_rounds_ms, ROUNDS default 7):
  bf16        fa_amd.flash_attn_func on bf16 inputs (the ratio's baseline)
  fp8         FA3-style FP8 inputs + descales (per (batch, KV head)), V token-major: the code as it is (since
              the twenty-fifth session the kernels read the three descales in place: no launch before the forward)
  fp8 packed  the same call after the one stacking launch that built the (batch, nheads, 3) descale operand
              before that change (fp8.pack_descales, as the decode path still does): what reading in place saves
  fp8 graph   fp8 replayed from a CUDA graph (no host work, no launch gaps): the kernels' own time
Output: one line per (row, variant): ms, TFLOP/s, ratio to bf16; JSON lines in $OUT/fp8_descale_ab.json if OUT is set.
"""
import json
import os
import statistics
import sys

SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd import bench, fp8  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 7))
DEVICE = "cpu" if SMOKE else "cuda"
S = bench.Shape
ROWS = [S(4, 4096, 16, 16, 128, False), S(4, 4096, 16, 16, 128, True), S(2, 8192, 16, 16, 128, False),
        S(2, 8192, 16, 16, 128, True), S(4, 4096, 16, 4, 128, False), S(4, 4096, 16, 4, 128, True),
        S(1, 16384, 16, 16, 128, True)]
if SMOKE:
    ROWS = [S(2, 40, 4, 2, 32, True)]

def fp8_inputs(shape):
    q, k, v, _ = bench.make_inputs(shape, "bshd", torch.bfloat16, DEVICE)
    q, k, v = (x.detach() for x in (q, k, v))
    return (q, k, v), bench.fp8_inputs(q, k, v)


def graphed(fn):
    return fn if SMOKE else bench.cuda_graph(fn).replay


def main():
    out_path = os.path.join(os.environ["OUT"], "fp8_descale_ab.json") if os.environ.get("OUT") else None
    print(f"# {torch.cuda.get_device_name() if not SMOKE else 'cpu'}, torch {torch.__version__}, "
          f"ROUNDS={ROUNDS}", flush=True)
    for shape in ROWS:
        (q, k, v), (q8, k8, v8, descales) = fp8_inputs(shape)
        causal = shape.causal

        def bf16():
            return fa_amd.flash_attn_func(q, k, v, causal=causal)

        def fp8_new():
            return fa_amd.flash_attn_func(q8, k8, v8, causal=causal, **descales)

        def fp8_packed():
            fp8.pack_descales(descales["q_descale"], descales["k_descale"], descales["v_descale"], shape.heads_q)
            return fp8_new()

        timed = {"bf16": (bf16, []), "fp8": (fp8_new, []), "fp8 packed": (fp8_packed, []),
                 "fp8 graph": (graphed(fp8_new), [])}
        if SMOKE:
            ms = {key: [1.0] for key in timed}
            for fn, _ in timed.values():
                fn()
        else:
            with torch.no_grad():
                ms = bench.interleaved_rounds_ms(timed, ROUNDS)
        base = statistics.median(ms["bf16"])
        for key, rounds in ms.items():
            med = statistics.median(rounds)
            tflops = shape.fwd_flops() / (med * 1e-3) / 1e12
            line = dict(row=shape.label, variant=key, ms=round(med, 4), tflops=round(tflops, 1),
                        vs_bf16=round(base / med, 3), rounds=[round(r, 4) for r in rounds])
            print(json.dumps(line), flush=True)
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
