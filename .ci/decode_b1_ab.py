"""GPU experiment (issue 14): the split decode kernel's per-program fixed cost at batch 1 --
tables.DECODE_MASKED_STAGES (the masked front / tail key loops unpipelined) -- and the many-program tile's register
cap (tables.DECODE_MANY "maxnreg"), against the same kernel without them, and torch SDPA.  (The first run, TUNING_NOTES
v29, also timed a "few blocks per split" tile with fewer pipeline stages: it lost and was removed.)

Rows: bf16, GQA 32/8, d128, one query token, cache_seqlens an int32 tensor (every key of the cache; LENS=none
passes no cache_seqlens), batch 1 at 2k / 8k / 32k / 128k keys, batch 8 and 64 at 2k.  Each (row, variant) is one
flash_attn_with_kvcache call captured in a CUDA graph and replayed (decode_ab.py's "kernel" stage: L2 flush before
each replay as bench_decode does, CUDA events, median call per round), SDPA's graph in the same interleaved rounds;
median round.  Variants are table patches installed before capture (decode plans forgotten between), so one
process times them all.  Prints one JSON line per (row, variant) and a table of us / KV GB/s; writes
$OUT/decode_b1_ab.json when OUT is set.  ROUNDS (env, default 5), ROWS (env, e.g. "1x2048,64x2048"), VARIANTS
(env, comma-separated names).

    python .ci/decode_b1_ab.py
    python .ci/decode_b1_ab.py --dry-run      # the plumbing on the CPU (interpreter, tiny rows)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.argv += [] if "--stages" in sys.argv else ["--stages", "kernel"]  # (decode_ab parses argv at import)

import fa_amd  # noqa: E402
from fa_amd import bench_decode, tuning  # noqa: E402
from fa_amd.kernels import decode  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_ab  # noqa: E402  (capture, time_flushed, FAMILY, DEVICE, DRY_RUN)

ROUNDS = int(os.environ.get("ROUNDS", 5))
DRY_RUN = decode_ab.DRY_RUN
DEVICE = decode_ab.DEVICE
FAMILY = decode_ab.FAMILY
FLUSH = decode_ab.FLUSH
ROW_KEYS = ((1, 2048), (1, 8192), (1, 32768), (1, 131072), (8, 2048), (64, 2048))
PRISTINE = {name: dict(getattr(tables, name)) for name in ("DECODE_MASKED_STAGES", "DECODE_MANY", "DECODE_SPLITS")}
_ROW_D = 128 if not DRY_RUN else 256  # the table row the variants patch (the interpreter's only row: 256)
LENS = os.environ.get("LENS", "tensor")


def _many_uncapped():
    rule = dict(PRISTINE["DECODE_MANY"].get(FAMILY) or {})
    if rule:
        rule["head_dims"] = {d: {k: v for k, v in tile.items() if k != "maxnreg"}
                             for d, tile in rule["head_dims"].items()}
    return rule or None


# name -> {table name: this family's entry (None: removed)}; "table" is the tables as they are
VARIANTS = {
    "table": {},
    "masked-pipelined": {"DECODE_MASKED_STAGES": None},  # masked loops pipelined like the main loop
    "many-uncapped": {"DECODE_MANY": _many_uncapped()},  # the many-program tile without its register cap
}
if DRY_RUN:  # the interpreter family has no entry: the variant installs one, and splits on one "SM"
    VARIANTS = {"table": {}, "masked": {"DECODE_MASKED_STAGES": {_ROW_D: 1}}}
if os.environ.get("VARIANTS"):
    VARIANTS = {n: VARIANTS[n] for n in os.environ["VARIANTS"].split(",")}


def install(name=None):
    """The tables as they are, with variant `name`'s entries patched in (None: as they are); plans forgotten."""
    for table, pristine in PRISTINE.items():
        getattr(tables, table).clear()
        getattr(tables, table).update(pristine)
    for table, entry in (VARIANTS[name] if name else {}).items():
        if entry is None:
            getattr(tables, table).pop(FAMILY, None)
        else:
            getattr(tables, table)[FAMILY] = entry
    if DRY_RUN:  # one interpreter "SM": split by a rule that splits these tiny rows
        tables.DECODE_SPLITS[FAMILY] = dict(tables.DECODE_SPLITS["default"], programs_per_sm=64,
                                            min_blocks_per_split=1)
    tuning._DECODE_RESOLVED.clear()
    decode.forget_plans()


def rows():
    if DRY_RUN:
        return [bench_decode.DecodeRow(1, 70, 8, 2, 32), bench_decode.DecodeRow(2, 40, 8, 2, 32)]
    wanted = os.environ.get("ROWS")
    keys = [tuple(int(x) for x in item.split("x")) for item in wanted.split(",")] if wanted else ROW_KEYS
    return [bench_decode.DecodeRow(b, s) for b, s in keys]


def run_row(row):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    q, k, v = bench_decode._decode_inputs(row, dtype, DEVICE)
    q_f, k_f, v_f = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    lens = torch.full((row.batch,), row.cache, dtype=torch.int32, device=DEVICE)
    graphs, keep, launches, outs = {}, [], {}, {}
    for name in VARIANTS:
        install(name)
        lens_kw = dict(cache_seqlens=lens) if LENS == "tensor" else {}
        fn = (lambda: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f, **lens_kw))
        outs[name] = fn().float()
        replay, held = decode_ab.capture(fn)
        graphs[name] = replay
        keep.append(held)
        plan = next(iter(decode._PLANS.values()), None)
        if plan is not None:
            kw = plan.kwargs
            launches[name] = (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}/w{kw['num_warps']}/s{kw['num_stages']} "
                              f"splits {plan.grid[1]} masked_stages {kw.get('MASKED_STAGES', 0)}")
    install()
    ref = outs["table"]
    for name, out in outs.items():  # every variant computes the same attention
        err = (out - ref).abs().max().item()
        assert err < 2e-2, (row.label, name, err)
    replay, held = decode_ab.capture(bench_decode._decode_call("sdpa", row, q, k, v, DEVICE))
    graphs["sdpa"], _ = replay, keep.append(held)
    gbs = decode_ab.time_flushed(row, graphs, (FLUSH,), "b1", rounds=ROUNDS)  # (prints a JSON line per variant)
    result = {n: dict(us=round(row.kv_bytes() / (g * 1e3), 2), gbs=round(g, 1), launch=launches.get(n, ""))
              for n, g in gbs.items()}
    del q, k, v, graphs, keep
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    results = {"family": FAMILY, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "flush": FLUSH, "rounds": ROUNDS, "rows": {}}
    for row in rows():
        results["rows"][row.label] = run_row(row)
    names = list(VARIANTS) + ["sdpa"]
    print(f"# graph replays, flush={FLUSH}, median of {ROUNDS} rounds: us (KV GB/s); launch of each variant")
    print("#   " + " " * 14 + "".join(f"{n:>20s}" for n in names))
    for label, res in results["rows"].items():
        print(f"#   {label:14s}" + "".join(f"{res[n]['us']:>9.2f} ({res[n]['gbs']:>7.0f})" for n in names))
        for n in VARIANTS:
            print(f"#       {n:18s} {res[n]['launch']}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "decode_b1_ab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
