"""GPU experiment (issue 17, the d96 / d192 rows): a head dim that is not a power of two run as two
power-of-two chunks (tables.HEAD_DIM_SPLIT_FAMILIES, tuning.head_dim_chunks: 192 = 128 + 64, 96 = 64 + 32)
or padded to the next power of two, with SDPA's flash backend (FA2) in the same interleaved rounds, timed as
`fa-amd bench` times (L2 flush before each call, CUDA events, median call per round, median round);
forward and forward+backward TFLOP/s (FLOPs counted at the true head dim).  ROUNDS (env) sets the rounds,
ROWS (env, e.g. "16x1024x21x96") limits the rows, CAUSAL (env: "0", "1", default both) the masks.

    python .ci/head_split_ab.py           # split vs padded vs FA2, on the GPU machine
    python .ci/head_split_ab.py --tiles   # tile candidates of the split launches (TILES below) vs FA2
"""
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd import bench, tuning  # noqa: E402
from fa_amd.arch import device_arch  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
# (batch, seqlen, heads, head dim): the bench's d96 / d192 rows (heads x head dim ~ 2048)
ROWS = [(16, 1024, 21, 96), (4, 4096, 21, 96), (1, 16384, 21, 96),
        (16, 1024, 10, 192), (4, 4096, 10, 192), (1, 16384, 10, 192)]
if os.environ.get("ROWS"):
    ROWS = [tuple(int(x) for x in r.split("x")) for r in os.environ["ROWS"].split(",")]
FAMILY = tuning.family_of(device_arch())
SPLIT = {"split": tuple(tables.HEAD_DIM_SPLIT_FAMILIES) + (FAMILY,),
         "padded": tuple(f for f in tables.HEAD_DIM_SPLIT_FAMILIES if f != FAMILY)}
METHODS = ("split", "padded", "fa2")
# --tiles: name -> {kernel: launch-dict changes} of the table row the split head dim resolves to, per TILESET (env)
TILESETS = {
    "d192": {
        "fwd 128x64/w8/s4": {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4)},
        "fwd 128x64/w8/s2": {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)},
        "fwd 128x128/w8/s2": {"fwd": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)},
        "dkdv 32x128/w8/s2": {"dkdv": dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2)},
        "dkdv 64x64/w8/s2": {"dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)},
        "dq 128x32/w8/s2": {"dq": dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)},
        "dq 64x64/w8/s2": {"dq": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)},
    },
    "d96": {
        "fwd 128x64/w8/s3": {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)},
        "fwd 128x64/w4/s3": {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)},
        "fwd 64x64/w4/s4": {"fwd": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)},
        "fwd 64x128/w4/s3": {"fwd": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)},
        "fwd 128x128/w8/s3": {"fwd": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)},
        "dkdv 64x64/w4/s3": {"dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)},
        "dq 64x64/w8/s3": {"dq": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)},
    },
}
TILES = TILESETS[os.environ.get("TILESET", "d192")]
PRISTINE = tables.TABLES[FAMILY]


def tiled_rows(d, changes):
    """The family's table with `changes` applied to the entries of head dim d's row (the "causal" / "short"
    overrides dropped, so the tile runs on every row of the bench); a new list: plans are memoized per rows
    object (tuning.memo_get)."""
    lo, hi = tuning.head_dim_chunks(device_arch(), d, 1 << (d - 1).bit_length())
    rows = []
    for row in PRISTINE:
        row = dict(row)
        if row["head_dim"] == next(r["head_dim"] for r in PRISTINE if r["head_dim"] >= lo + hi):
            for kernel, change in changes.items():
                entry = {k: v for k, v in row[kernel].items() if k not in ("causal", "short")}
                row[kernel] = dict(entry, **change)
        rows.append(row)
    return rows


def calls(row, causal, method):
    b, s, h, d = row
    rows = tiled_rows(d, TILES[method]) if method in TILES else PRISTINE
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    if method == "fa2":
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        doutt = dout.transpose(1, 2)

        def run(backward):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            if backward:
                out.backward(doutt)
        leaves = (qt, kt, vt)
    else:
        def run(backward):
            tables.HEAD_DIM_SPLIT_FAMILIES = SPLIT["padded" if method == "padded" else "split"]
            tables.TABLES[FAMILY] = rows
            if backward:
                fa_amd.flash_attn_func(q, k, v, causal=causal).backward(dout)
            else:
                with torch.no_grad():
                    fa_amd.flash_attn_func(q, k, v, causal=causal)
        leaves = (q, k, v)
    return (lambda: run(False)), (lambda: run(True)), leaves


def flops(row, causal, backward):
    b, s, h, d = row
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def main():
    methods = ("split",) + tuple(TILES) + ("fa2",) if "--tiles" in sys.argv else METHODS
    masks = {"0": (False,), "1": (True,)}.get(os.environ.get("CAUSAL", ""), (False, True))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "| TFLOP/s, median of", ROUNDS, "rounds")
    print("| row (b, s, h, d) | pass | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for row in ROWS:
        for causal in masks:
            made = {m: calls(row, causal, m) for m in methods}
            times = bench.interleaved_rounds_ms({(m, i): (made[m][i], made[m][2] if i else ())
                                                 for i in (0, 1) for m in methods}, ROUNDS)
            name = f"{row} {'causal' if causal else 'full'}"
            for i in (0, 1):
                cells = [flops(row, causal, i) / statistics.median(times[(m, i)]) / 1e9 for m in methods]
                print(f"| {name} | {'fwd+bwd' if i else 'fwd'} | " + " | ".join(f"{c:.0f}" for c in cells) + " |",
                      flush=True)
            torch.cuda.empty_cache()
    tables.TABLES[FAMILY] = PRISTINE


if __name__ == "__main__":
    main()
