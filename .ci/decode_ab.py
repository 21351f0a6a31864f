"""GPU experiment: decode-kernel launch candidates on the `fa-amd bench --decode` rows, so the table
values (tables.DECODE_TABLES / DECODE_SPLITS for this GPU's family) can be picked from one run.

  1. tiles: BLOCK_N x warps x stages candidates for the d128 "decode" entry, split rule as tabled;
  2. split rule: programs per SM / min key blocks per split / max splits / no split, on the tile that
     won stage 1 (geometric mean of KV GB/s over the rows);
  3. paging: the winner on a paged cache (page 16 / 64 / 256) against the dense cache;
  4. merge: the split merge inside the decode kernel ("fused": its last split program of each tile
     merges, tables.DECODE_FUSED_MERGE_FAMILIES) against the split_merge_kernel launch after it
     ("launch"), tabled tile and split rule, on every row (host time included: each call is a whole
     flash_attn_with_kvcache call, as in `fa-amd bench --decode`; rows that do not split run the
     same code in both);
  5. kernel: the kernels alone -- each candidate call captured once in a CUDA graph and replayed --
     over tiles x explicit split counts (num_splits) per row, SDPA's graph in the same rounds: what
     the kernels can do where whole calls are bound by host time (batch 1, 2k rows);
  6. flush: the tabled launch and SDPA, whole calls and graph replays, after each of three L2
     flushes: "zero" (a 256 MB buffer zeroed, triton.testing.do_bench's and `fa-amd bench`'s
     method, which leaves up to an L2 of dirty lines for the timed call to write back), "read" (the
     same buffer summed: L2 left holding clean lines) and "none".

Each (row, candidate) is timed like `fa-amd bench --decode` (L2 flush before each call, CUDA events,
median call per round), candidates of a row in interleaved rounds with torch SDPA in the same rounds;
median round (the decode bench's flush, bench_decode.DECODE_L2_FLUSH; FLUSH picks stage 5's).  Prints one
JSON line per (stage, row, candidate) and a summary; writes
$OUT/decode_ab.json when OUT is set.  ROUNDS (env, default 3) sets the rounds; ROWS (env, e.g.
"1x8192,64x2048") limits the rows; --stages picks stages (default: the first four); HEAD_DIM (env) runs
the rows at another head dim; TABLE_TILE_ONLY=1 gives stage 5 the table's tile only (split counts vary).

    python .ci/decode_ab.py
    ROUNDS=7 python .ci/decode_ab.py --stages merge       # fused vs launched merge, SDPA in the rounds
    python .ci/decode_ab.py --dry-run --stages merge      # the plumbing, on the CPU (interpreter)
"""
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd import bench, bench_decode, tuning  # noqa: E402
from fa_amd.arch import device_arch  # noqa: E402
from fa_amd.kernels import decode  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 3))
# a CPU dry run (TRITON_INTERPRET=1, tiny rows) checks the plumbing: `python .ci/decode_ab.py --dry-run`
DRY_RUN = "--dry-run" in sys.argv
ALL_STAGES = ("tiles", "splits", "paging", "merge", "kernel", "flush")
STAGES = ALL_STAGES[:4]
if "--stages" in sys.argv:
    STAGES = tuple(sys.argv[sys.argv.index("--stages") + 1].split(","))
    assert set(STAGES) <= set(ALL_STAGES), f"--stages: pick from {','.join(ALL_STAGES)}"
FLUSH = os.environ.get("FLUSH", bench_decode.DECODE_L2_FLUSH)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (BLOCK_N, num_warps, num_stages) for BLOCK_M = 16 (one KV group's 4 heads per tile at GQA 32/8)
TILES = [None, (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (64, 8, 3), (128, 8, 3),
         (256, 8, 2)]
SPLIT_RULES = [None, dict(programs_per_sm=1), dict(programs_per_sm=4), dict(programs_per_sm=8),
               dict(min_blocks_per_split=1), dict(min_blocks_per_split=4), dict(min_blocks_per_split=8),
               dict(max_splits=32), dict(efficiency=0.95), "no-split"]
PAGES = [None, 16, 64, 256]
MERGES = ["fused", "launch"]
# stage 5: tiles (None: the table's) x explicit key splits (0: the tabled rule) by batch
KERNEL_TILES = [None, (64, 4, 2), (64, 8, 3), (64, 2, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2), (32, 4, 4)]
KERNEL_SPLITS = {1: [0, 4, 8, 12, 16, 32], 8: [0, 1, 2, 4], 64: [0]}
if os.environ.get("SPLITS_B1"):  # e.g. SPLITS_B1="0 2 4 6 8": stage 5's split counts at batch 1
    KERNEL_SPLITS[1] = [int(x) for x in os.environ["SPLITS_B1"].split()]
if os.environ.get("TABLE_TILE_ONLY") == "1":  # stage 5 over split counts only (e.g. another head dim's row)
    KERNEL_TILES = [None]
FLUSHES = bench.L2_FLUSHES


def rows():
    wanted = os.environ.get("ROWS")
    out = bench_decode.decode_rows(smoke=DRY_RUN)
    if os.environ.get("HEAD_DIM") and not DRY_RUN:  # the same rows at another head dim
        out = [bench_decode.DecodeRow(r.batch, r.cache, head_dim=int(os.environ["HEAD_DIM"])) for r in out]
    if wanted:
        keep = {tuple(int(x) for x in item.split("x")) for item in wanted.split(",")}
        out = [r for r in out if (r.batch, r.cache) in keep]
    return out


FAMILY = tuning.family_of(device_arch())
PRISTINE_ROWS = [dict(r, decode=dict(r["decode"])) for r in tables.DECODE_TABLES[FAMILY]]
PRISTINE_SPLITS = dict(tables.DECODE_SPLITS.get(FAMILY, tables.DECODE_SPLITS["default"]))
PRISTINE_FUSED_MERGE = tables.DECODE_FUSED_MERGE_FAMILIES


_INSTALLED = [None]


def apply(tile=None, split_rule=None, merge=None):
    """Install a candidate in the tables (tile None / rule None / merge None: the tabled values); a
    no-op when it is installed already (a round's calls of one candidate pay no table rebuild)."""
    state = (tile, repr(split_rule), merge)
    if _INSTALLED[0] == state:
        return
    _INSTALLED[0] = state
    decode.forget_plans()  # (a memoized launch plan keeps the tile it was made with)
    others = tuple(f for f in PRISTINE_FUSED_MERGE if f != FAMILY)
    tables.DECODE_FUSED_MERGE_FAMILIES = {None: PRISTINE_FUSED_MERGE, "fused": others + (FAMILY,),
                                          "launch": others}[merge]
    for row, pristine in zip(tables.DECODE_TABLES[FAMILY], PRISTINE_ROWS):
        row["decode"] = dict(pristine["decode"])
    if tile is not None:
        row = next(r for r in tables.DECODE_TABLES[FAMILY] if r["head_dim"] >= 128)
        row["decode"].update(BLOCK_M=16, BLOCK_N=tile[0], num_warps=tile[1], num_stages=tile[2])
    policy = dict(PRISTINE_SPLITS)
    if isinstance(split_rule, dict):  # (a candidate rule replaces the table's head-dim overrides too)
        policy.pop("head_dims", None)
        policy.update(split_rule)
    tables.DECODE_SPLITS[FAMILY] = policy
    tuning._DECODE_RESOLVED.clear()


def name_of(tile, rule, page, merge=None):
    parts = ["table" if tile is None else "16x%d/w%d/s%d" % tile]
    if rule is not None:
        parts.append(rule if isinstance(rule, str) else ",".join(f"{k}={v}" for k, v in rule.items()))
    if page:
        parts.append(f"page{page}")
    if merge:
        parts.append(f"merge={merge}")
    return " ".join(parts)


def make_call(row, q, k, v, tile, rule, page, merge=None):
    """fn() for one candidate: the settings are installed at each call (candidates alternate)."""
    q_f = q.transpose(1, 2)
    if page:
        # the same keys, paged: (b, cache) slots -> pages of `page` slots, table in shuffled order
        b, hk, s, d = k.shape
        per_seq = math.ceil(s / page)
        k_pages = torch.empty(b * per_seq, page, hk, d, dtype=k.dtype, device=k.device)
        v_pages = torch.empty_like(k_pages)
        order = torch.randperm(b * per_seq, device=k.device)
        for i in range(b):
            for src, dst_pages in ((k, k_pages), (v, v_pages)):
                flat = src[i].transpose(0, 1)  # (s, hk, d)
                padded = torch.nn.functional.pad(flat, (0, 0, 0, 0, 0, per_seq * page - s))
                dst_pages[order[i * per_seq:(i + 1) * per_seq]] = padded.view(per_seq, page, hk, d)
        table = order.view(b, per_seq).to(torch.int32)
        lens = torch.full((b,), s, dtype=torch.int32, device=k.device)
        splits = 1 if rule == "no-split" else 0

        def call():
            apply(tile, rule, merge)
            return fa_amd.flash_attn_with_kvcache(q_f, k_pages, v_pages, cache_seqlens=lens, block_table=table,
                                                  num_splits=splits)
        return call
    k_f, v_f = k.transpose(1, 2), v.transpose(1, 2)
    splits = 1 if rule == "no-split" else 0

    def call():
        apply(tile, rule, merge)
        return fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f, num_splits=splits)
    return call


def round_ms(fn, calls, flush=bench_decode.DECODE_L2_FLUSH):
    if DEVICE == "cpu":
        return bench.time_ms(fn, smoke=True)
    return bench.gpu_round_ms(fn, (), calls, flush)


def time_row(row, candidates, label, with_sdpa=True):
    """{candidate name: median-round GB/s} of one row, candidates (and SDPA) in interleaved rounds."""
    q, k, v = bench_decode._decode_inputs(row, torch.bfloat16 if DEVICE == "cuda" else torch.float32, DEVICE)
    calls = {name_of(*c): make_call(row, q, k, v, *c) for c in candidates}
    if with_sdpa:
        calls["sdpa"] = bench_decode._decode_call("sdpa", row, q, k, v, DEVICE)
    out = time_flushed(row, calls, (bench_decode.DECODE_L2_FLUSH,), label)
    apply()
    del q, k, v, calls
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def capture(fn):
    """(replay, keep) of fn captured in a CUDA graph, warmed on the capture stream (so the decode
    split counters of that stream exist before capture and no memset joins the graph); None on the CPU."""
    if DEVICE == "cpu":
        return fn, None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        kept = fn()
    torch.cuda.synchronize()
    return graph.replay, (graph, kept)


def time_flushed(row, calls, flush_modes, label, rounds=None):
    """{name: median-round GB/s} for named fns `calls` ({name: fn}), each after each flush mode, all
    (name, flush) pairs in `rounds` (default ROUNDS) interleaved rounds; one JSON line per (name, flush)."""
    cases = {f"{name} flush={mode}" if len(flush_modes) > 1 else name: (fn, mode)
             for name, fn in calls.items() for mode in flush_modes}
    per_round = {name: bench._calls_per_round(round_ms(fn, 3, flush)) for name, (fn, flush) in cases.items()}
    times = {name: [] for name in cases}
    names = list(cases)
    for r in range(ROUNDS if rounds is None else rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, flush = cases[name]
            times[name].append(round_ms(fn, per_round[name], flush))
    out = {}
    for name, ts in times.items():
        ms = statistics.median(ts)
        gbs = row.kv_bytes() / (ms * 1e-3) / 1e9
        out[name] = gbs
        print(json.dumps(dict(stage=label, row=row.label, candidate=name, us=round(ms * 1e3, 2), gbs=round(gbs, 1),
                              rounds_us=[round(t * 1e3, 2) for t in ts])), flush=True)
    return out


def kernel_row(row):
    """Stage 5 for one row: graph replays of tile x split candidates and of SDPA."""
    q, k, v = bench_decode._decode_inputs(row, torch.bfloat16 if DEVICE == "cuda" else torch.float32, DEVICE)
    q_f, k_f, v_f = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    splits = KERNEL_SPLITS.get(row.batch, [0]) if not DRY_RUN else [0, 2]
    graphs, keep = {}, []
    for tile in (KERNEL_TILES if not DRY_RUN else [None, (16, 4, 1)]):
        apply(tile)
        for n in splits:
            fn = (lambda n=n: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f, num_splits=n))
            replay, held = capture(fn)
            graphs[f"{name_of(tile, None, None)} splits={n or 'rule'}"] = replay
            keep.append(held)
    apply()
    replay, held = capture(bench_decode._decode_call("sdpa", row, q, k, v, DEVICE))
    graphs["sdpa"], _ = replay, keep.append(held)
    result = time_flushed(row, graphs, (FLUSH,), "kernel")
    del q, k, v, graphs, keep
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def flush_row(row):
    """Stage 6 for one row: the tabled launch and SDPA, whole calls and graph replays, per flush."""
    q, k, v = bench_decode._decode_inputs(row, torch.bfloat16 if DEVICE == "cuda" else torch.float32, DEVICE)
    calls = {m: bench_decode._decode_call(m, row, q, k, v, DEVICE) for m in ("fa_amd", "sdpa")}
    keep = []
    for m in ("fa_amd", "sdpa"):
        replay, held = capture(calls[m])
        calls[f"{m} graph"] = replay
        keep.append(held)
    result = time_flushed(row, calls, FLUSHES, "flush")
    del q, k, v, calls, keep
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def main():
    results = {"family": FAMILY, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "stages": {}}
    if DRY_RUN:
        global TILES, SPLIT_RULES, PAGES
        TILES, SPLIT_RULES, PAGES = [None, (16, 4, 1)], [None, "no-split", dict(programs_per_sm=4)], [None, 16]
    the_rows = rows()
    best_tile = None  # the tabled tile unless stage 1 runs
    if "tiles" in STAGES:  # 1. tiles
        stage = {}
        for row in the_rows:
            stage[row.label] = time_row(row, [(t, None, None) for t in TILES], "tiles")
        results["stages"]["tiles"] = stage
        scores = {name: geomean([stage[r][name] for r in stage]) for name in next(iter(stage.values()))
                  if name != "sdpa"}
        best_tile_name = max(scores, key=scores.get)
        best_tile = next(t for t in TILES if name_of(t, None, None) == best_tile_name)
        print("# tiles by geometric-mean GB/s: " + ", ".join(f"{n} {s:.0f}" for n, s in
                                                          sorted(scores.items(), key=lambda x: -x[1])), flush=True)
    if "splits" in STAGES:  # 2. split rule on the winning tile (the rows where splits matter: batch 1 and 8)
        stage = {}
        for row in [r for r in the_rows if r.batch <= 8]:
            stage[row.label] = time_row(row, [(best_tile, rule, None) for rule in SPLIT_RULES], "splits",
                                        with_sdpa=False)
        results["stages"]["splits"] = stage
        if stage:
            scores = {name: geomean([stage[r][name] for r in stage]) for name in next(iter(stage.values()))}
            print("# split rules by geometric-mean GB/s: " + ", ".join(
                f"{n} {s:.0f}" for n, s in sorted(scores.items(), key=lambda x: -x[1])), flush=True)
    if "paging" in STAGES:  # 3. paging cost
        stage = {}
        paging_rows = ((1, 32768), (8, 8192), (8, 32768), (64, 2048), (64, 8192)) if not DRY_RUN else ((2, 70),)
        for row in [r for r in the_rows if (r.batch, r.cache) in paging_rows]:
            stage[row.label] = time_row(row, [(best_tile, None, page) for page in PAGES], "paging", with_sdpa=False)
        results["stages"]["paging"] = stage
    if "merge" in STAGES:  # 4. the split merge in the decode kernel vs its own launch, SDPA in the same rounds
        stage = {}
        # (the interpreter has one SM, where the tabled rule never splits: the dry run splits by this rule)
        rule = dict(programs_per_sm=64, min_blocks_per_split=1) if DRY_RUN else None
        splits = {}
        for row in the_rows:
            decode.forget_plans()
            stage[row.label] = time_row(row, [(best_tile, rule, None, m) for m in MERGES], "merge")
            splits[row.label] = sorted({plan.grid[1] for plan in decode._PLANS.values()})  # (grid: tiles, splits, b)
        results["stages"]["merge"] = stage
        results["merge_splits"] = splits
        fused, launched = name_of(best_tile, rule, None, "fused"), name_of(best_tile, rule, None, "launch")
        print("# merge (stage 4): row, key splits, fused / launch GB/s, fused vs launch, fused vs SDPA")
        for label, c in stage.items():
            print(f"#   {label:16s} {str(splits[label]):8s} {c[fused]:7.0f} / {c[launched]:7.0f}  "
                  f"{c[fused] / c[launched]:5.3f}x  {c[fused] / c['sdpa']:5.3f}x sdpa", flush=True)
        print(f"# merge geometric mean: fused {geomean([c[fused] for c in stage.values()]):.0f} GB/s, launch "
              f"{geomean([c[launched] for c in stage.values()]):.0f} GB/s, sdpa "
              f"{geomean([c['sdpa'] for c in stage.values()]):.0f} GB/s", flush=True)
    if "kernel" in STAGES:  # 5. the kernels alone (graph replays), tiles x split counts
        stage = {row.label: kernel_row(row) for row in the_rows}
        results["stages"]["kernel"] = stage
        print(f"# kernel (stage 5, graph replays, flush={FLUSH}): row, best candidate GB/s, table GB/s, sdpa GB/s")
        for label, c in stage.items():
            best = max((n for n in c if n != "sdpa"), key=c.get)
            table = c.get("table splits=rule", 0)
            print(f"#   {label:16s} {best:28s} {c[best]:7.0f}  table {table:7.0f}  sdpa {c['sdpa']:7.0f}", flush=True)
    if "flush" in STAGES:  # 6. what each L2 flush does to the timed call
        stage = {row.label: flush_row(row) for row in the_rows}
        results["stages"]["flush"] = stage
        print("# flush (stage 6): GB/s per flush zero / read / none")
        for label, c in stage.items():
            cells = "  ".join(f"{m}: " + "/".join(f"{c[f'{m} flush={f}']:.0f}" for f in FLUSHES)
                              for m in ("fa_amd", "sdpa", "fa_amd graph", "sdpa graph"))
            print(f"#   {label:16s} {cells}", flush=True)
    if "tiles" in STAGES:  # per row: best candidate of stage 1 and its share of SDPA
        print("# per row (stage 1): best tile, its GB/s, SDPA GB/s")
        for label, cands in results["stages"]["tiles"].items():
            best = max((n for n in cands if n != "sdpa"), key=cands.get)
            print(f"#   {label:16s} {best:16s} {cands[best]:7.0f}  sdpa {cands.get('sdpa', 0):7.0f}  table "
                  f"{cands.get('table', 0):7.0f}", flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "decode_ab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
