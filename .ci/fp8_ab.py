"""GPU experiment (issue 18, point 6): FP8 forward candidates vs fa_amd's own bf16 forward on an H100 (sm90), d128.

    PYTHONPATH=. python .ci/fp8_ab.py        # on an H100: ~3-5 min with compiles (rows stop after BUDGET_S)
    SMOKE=1 PYTHONPATH=. python .ci/fp8_ab.py  # CPU check of the script itself (interpreter, tiny rows, ~8 min)
    TILES="64,128,4,2,168;64,64,4,3" ...         # these tiles (M, N, warps, stages[, maxnreg]) beside the table's
    KINDS=causal (or full) ...                   # those rows only; GQA_TILES=1: the GQA rows time the tiles too

Rows: b4 s4096 h16 d128 and b2 s8192 h16 d128, full and causal (GQA=1 adds b4 s4096 h16/kv4 with the table tile).
Every variant of a row is timed in the same interleaved rounds (ROUNDS, default 7): each round takes the
median of `calls` calls timed with CUDA events, each after an L2 flush (fa_amd.bench.gpu_round_ms, as
`fa-amd bench` times), after ~WARM_MS (default bench.ROUND_WARM_MS; 0: none) of the variant's own untimed calls,
and a variant's figure is the median over rounds.  A variant is a set of
overrides applied in-process before each of its timings (no code edits between candidates):

  bf16                 fa_amd.flash_attn_func on bf16 q, k, v (the table's tile): the baseline
  fp8 <tile>           FA3-style FP8 q, k, v + descales, V already token-major (no copy per call), the sm90
                       d128 forward with that tile as its "fp8" override (tables.TABLES); "table" = as shipped
  fp8 v-copy           table tile, V in the usual (batch, seqlen, heads, d) layout: token-major copy per call
                       (fa_amd.fp8.token_major_copy, the quantiser's cast kernel run unscaled)
  fp8 v-copy-torch     the same with the old torch copy (token_major_empty(..).copy_(v)); OLD=1 only
  fp8 v-hdm            table tile, V read head-dim-major by the kernel (tables.FP8_V_TOKEN_MAJOR = ()): no
                       copy; Triton transposes V tiles in shared memory
  fp8_func             fa_amd.flash_attn_fp8_func end to end (bf16 in, quantised inside by the Triton passes of
                       kernels/quantize.py, V written token-major, FP8 forward with the table tile)
  fp8_func old-quant   the same with the old torch quantiser (the chain of torch ops it replaced); OLD=1 only
  quant / quant-old    the quantisation of q, k, v alone (new Triton passes / old torch ops, OLD=1 only)
  [graph] ...          bf16, fp8 table and fp8_func replayed from a CUDA graph: no host time (their ratios are
                       against [graph] bf16); if eager is much slower than graph, the call's host time limits it
After the rounds, "fp8_func best" repeats fp8_func with the fastest fp8 tile of that row.

Output: one table per row as it finishes (ms, TFLOP/s, ratio vs bf16), then the sm90 "fp8" override that the
fastest tiles would make (paste into fa_amd/tuning/tables.py), and JSON lines in $OUT/fp8_ab.json if OUT is set.
Compiles run first in parallel worker processes (WORKERS, default 8) on a small problem with the same kernel
specialisations, so the timed process finds them in Triton's cache.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# SMOKE=1: a CPU run of the whole script through Triton's interpreter on tiny rows (checks the script,
# not speed); the interpreter must be chosen before triton is imported
SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
# a tuned table on this machine would replace the sm90 rows this script edits
os.environ.setdefault("FA_AMD_CACHE_DIR", tempfile.mkdtemp(prefix="fp8_ab_"))

import torch  # noqa: E402

from fa_amd import bench, fp8, tuning  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 7))
WARM_MS = float(os.environ.get("WARM_MS", bench.ROUND_WARM_MS))  # 0: the cold rounds of before v44
BUDGET_S = float(os.environ.get("BUDGET_S", 330))
WORKERS = int(os.environ.get("WORKERS", 8))
START = time.time()

DEVICE = "cpu" if SMOKE else "cuda"
ROWS = [bench.Shape(4, 4096, 16, 16, 128, False), bench.Shape(4, 4096, 16, 16, 128, True),
        bench.Shape(2, 8192, 16, 16, 128, False), bench.Shape(2, 8192, 16, 16, 128, True)]
GQA_ROWS = [bench.Shape(4, 4096, 16, 4, 128, False), bench.Shape(4, 4096, 16, 4, 128, True)]
WARM_SHAPE = (2, 4096)  # (batch, seqlen) of the compile warm-up: the timed rows' kernel specialisations
if SMOKE:
    ROWS = [bench.Shape(2, 40, 2, 2, 32, False), bench.Shape(2, 48, 2, 2, 32, True)]
    GQA_ROWS = [bench.Shape(2, 48, 4, 2, 32, True)]
    WARM_SHAPE = (2, 32)
# FP8 tile candidates (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]).  Why these (sm90, AOT under
# triton 3.6, d128): the shipped tiles are bf16's, where 128x128/w8/s3 (237 regs, 112 KB smem) runs one
# CTA of two warpgroups per SM that meet at a barrier every key block, so one's softmax cannot hide the
# other's wgmma.  FP8 halves the tiles' shared memory: 64x128/w4/s3 (241 regs, 104 KB) fits two
# independent CTAs per SM, 64x128/w4/s2 (72 KB) too; 64x64/w4 (157-202 regs, 56 KB) fits two, or three
# with maxnreg 168 (161 regs, no spill).  128-key tiles halve the per-block overhead against 64.
# (128-row tiles in one warpgroup, 128x64/w4/s3 and 128x128/w4/s2, compile spill-free at 255 regs and
# ran 0-8 % slower, 2026-11-24: docs/TUNING_NOTES.md v19.)
FULL_TILES = [None, (64, 128, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]
CAUSAL_TILES = [None, (64, 64, 4, 3), (64, 64, 4, 3, 168), (128, 64, 4, 3), (64, 128, 4, 2)]
# TILES="64,128,4,2,168;64,64,4,3": these candidates (beside the table's) on every row instead of the lists above
if os.environ.get("TILES"):
    FULL_TILES = CAUSAL_TILES = [None] + [tuple(int(x) for x in t.split(",")) for t in os.environ["TILES"].split(";")]

FAMILY = "cpu" if SMOKE else "sm90"
SM90 = tables.TABLES[FAMILY]
PRISTINE_FWD = {row["head_dim"]: json.loads(json.dumps(row["fwd"])) for row in SM90}
PRISTINE_TOKEN_MAJOR = tables.FP8_V_TOKEN_MAJOR + (("cpu",) if SMOKE else ())
ROW_D = next(r["head_dim"] for r in SM90 if r["head_dim"] >= 128)  # the table row the d128 rows use
NEW_QUANTIZE, NEW_COPY = fp8.quantize_fp8, fp8.token_major_copy


# --------------------------------------------------------------------------- the replaced code (baselines)

def torch_quantize_fp8(x, fp8_dtype, cu_seqlens=None, token_major=False, max_seqlen=None):
    """fa_amd.fp8.quantize_fp8 before kernels/quantize.py (dense path): torch ops."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax = x.detach().abs().amax(dim=(1, 3)).float()
    nonzero = amax > 0
    scale = torch.where(nonzero, fp8_max / amax, torch.ones_like(amax))
    descale = torch.where(nonzero, amax / fp8_max, torch.ones_like(amax))
    scaled = (x.detach().float() * scale[:, None, :, None]).clamp_(-fp8_max, fp8_max)
    if token_major:
        x8 = fp8.token_major_empty(x.shape, fp8_dtype, x.device)
        x8.copy_(scaled)
    else:
        x8 = scaled.to(fp8_dtype)
    return x8, descale


def torch_token_major_copy(v):
    return fp8.token_major_empty(v.shape, v.dtype, v.device).copy_(v)


# --------------------------------------------------------------------------- variants

def tile_name(tile):
    if tile is None:
        return "table"
    return "%dx%d/w%d/s%d" % tile[:4] + (f"/r{tile[4]}" if len(tile) > 4 else "")


def tile_dict(tile, interpreter=False):
    cfg = dict(BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3])
    if len(tile) > 4 and not interpreter:  # (the interpreter takes no maxnreg)
        cfg["maxnreg"] = tile[4]
    return cfg


def apply(tile=None, token_major=True, old_quant=False, torch_copy=False):
    """Pristine tables and fa_amd.fp8, then this variant's overrides."""
    for row in SM90:
        row["fwd"].clear()
        row["fwd"].update(json.loads(json.dumps(PRISTINE_FWD[row["head_dim"]])))
    if tile is not None:
        next(r for r in SM90 if r["head_dim"] == ROW_D)["fwd"]["fp8"] = tile_dict(tile, SMOKE)
    tables.FP8_V_TOKEN_MAJOR = PRISTINE_TOKEN_MAJOR if token_major else ()
    fp8.quantize_fp8 = torch_quantize_fp8 if old_quant else NEW_QUANTIZE
    fp8.token_major_copy = torch_copy and torch_token_major_copy or NEW_COPY
    tuning._RESOLVED.clear()


def variants(shape, table_only=False):
    """(name, settings, kind): kind is what is called (bf16 / fp8 with V pre-transposed / fp8 with V in
    the usual layout / fp8_func / quant)."""
    out = [("bf16", {}, "bf16")]
    tiles = [None] if table_only else (CAUSAL_TILES if shape.causal else FULL_TILES)
    out += [(f"fp8 {tile_name(t)}", dict(tile=t), "fp8") for t in tiles]
    if table_only:
        return out + [("fp8_func", {}, "fp8_func")]
    out += [("fp8 v-copy", {}, "fp8_vnat"), ("fp8 v-hdm", dict(token_major=False), "fp8_vnat"),
            ("fp8_func", {}, "fp8_func"), ("quant", {}, "quant")]
    if os.environ.get("OLD") == "1":  # the replaced torch code paths (history)
        out += [("fp8 v-copy-torch", dict(torch_copy=True), "fp8_vnat"),
                ("fp8_func old-quant", dict(old_quant=True), "fp8_func"), ("quant-old", dict(old_quant=True), "quant")]
    return out


class Inputs:
    """One row's tensors: bf16 q, k, v; FA3-style FP8 q, k, v (q's descale per KV head, as FA3 takes it)
    with V token-major and in the usual layout."""

    def __init__(self, shape):
        self.shape = shape
        q, k, v, _ = bench.make_inputs(shape, "bshd", torch.bfloat16, DEVICE)
        self.q, self.k, self.v = (x.detach() for x in (q, k, v))
        fp8_dtype = fp8.fp8_dtypes(self.q)[0]
        apply()
        b, s, hq, d = self.q.shape
        hk = self.k.shape[2]
        q8, qd = fp8.quantize_fp8(self.q.reshape(b, s, hk, (hq // hk) * d), fp8_dtype)
        self.q8 = q8.reshape(self.q.shape)
        self.k8, kd = fp8.quantize_fp8(self.k, fp8_dtype)
        self.v8, vd = fp8.quantize_fp8(self.v, fp8_dtype)
        self.v8_tm = fp8.token_major_copy(self.v8)
        self.descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)

    def call(self, kind):
        import fa_amd

        causal, fp8_dtype = self.shape.causal, self.q8.dtype
        if kind == "bf16":
            return lambda: fa_amd.flash_attn_func(self.q, self.k, self.v, causal=causal)
        if kind == "fp8":
            return lambda: fa_amd.flash_attn_func(self.q8, self.k8, self.v8_tm, causal=causal, **self.descales)
        if kind == "fp8_vnat":
            return lambda: fa_amd.flash_attn_func(self.q8, self.k8, self.v8, causal=causal, **self.descales)
        if kind == "fp8_func":
            return lambda: fa_amd.flash_attn_fp8_func(self.q, self.k, self.v, causal=causal)
        if kind == "quant":
            def quant():
                fp8.quantize_fp8(self.q, fp8_dtype)
                fp8.quantize_fp8(self.k, fp8_dtype)
                fp8.quantize_fp8(self.v, fp8_dtype, token_major=fp8.fp8_v_token_major(fp8.arch_for(self.v)))
            return quant
        raise ValueError(kind)


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def timer(inputs, settings, kind, graph=False):
    """A function timing one round of this variant (its settings applied first); None if it cannot run."""
    import warnings

    apply(**settings)
    fn = inputs.call(kind)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
        sync()
    shrunk = [str(w.message) for w in caught if "does not fit" in str(w.message)]
    if shrunk:
        raise RuntimeError("did not fit: " + shrunk[0][:160])
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    sync()
    call_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    calls = max(8, min(40, round(40 / call_ms)))
    # each round after ~WARM_MS of its own calls (the bench's ROUND_WARM_MS): the power state is the variant's own
    warm = 1 + max(0, min(bench.MAX_WARM_CALLS, round(WARM_MS / call_ms)))
    run = fn
    if graph and SMOKE:
        raise RuntimeError("no CUDA graphs on the CPU")
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            fn()
        run = g.replay

    def one_round():
        apply(**settings)
        with torch.no_grad():
            return bench.time_ms(run, smoke=True) if SMOKE else bench.gpu_round_ms(run, [], calls, warm=warm)
    return one_round


def elapsed():
    return time.time() - START


def time_row(shape, table_only=False):
    inputs = Inputs(shape)
    timers, notes = {}, {}
    todo = [(name, settings, kind, False) for name, settings, kind in variants(shape, table_only)]
    todo += [(f"[graph] {name}", settings, kind, True) for name, settings, kind in variants(shape, True)]
    for name, settings, kind, graph in todo:
        try:
            timers[name] = timer(inputs, settings, kind, graph)
        except Exception as exc:  # a candidate that cannot run here: reported, the others go on
            notes[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
    times = {name: [] for name in timers}
    for _ in range(ROUNDS):
        for name, one_round in timers.items():
            times[name].append(one_round())
    ms = {name: statistics.median(ts) for name, ts in times.items()}
    fp8_tiles = [(m, n) for n, m in ms.items() if n.startswith("fp8 ") and n[4:] in
                 {tile_name(t) for t in (CAUSAL_TILES if shape.causal else FULL_TILES)}]
    best = min(fp8_tiles)[1][4:] if fp8_tiles else "table"
    if not table_only and best != "table":
        tile = next(t for t in (CAUSAL_TILES if shape.causal else FULL_TILES) if tile_name(t) == best)
        name = f"fp8_func best ({best})"
        try:
            extra = {name: timer(inputs, dict(tile=tile), "fp8_func"), "bf16 (again)": timers["bf16"]}
            rounds = {n: [] for n in extra}
            for _ in range(ROUNDS):
                for n, one_round in extra.items():
                    rounds[n].append(one_round())
            for n, ts in rounds.items():  # ratios against the bf16 rounds of this second pass
                ms[n], times[n] = statistics.median(ts), ts
        except Exception as exc:
            notes[name] = f"{type(exc).__name__}: {exc}"[:200]
    apply()
    del inputs
    if not SMOKE:
        torch.cuda.empty_cache()
    return ms, times, notes, best


def print_row(shape, ms, times, notes, best, out_rows):
    flops = shape.fwd_flops()
    print(f"\n### {shape.label}  ({elapsed():.0f} s)   best fp8 tile: {best}")
    print("| variant | ms | TFLOP/s | vs bf16 |\n|---|---|---|---|")
    second_pass = "bf16 (again)" in ms
    for name, t in ms.items():
        # the second pass (fp8_func best) against the bf16 rounds timed beside it
        base = ms.get("bf16 (again)" if second_pass and (name.startswith("fp8_func best") or name == "bf16 (again)")
                      else "[graph] bf16" if name.startswith("[graph]") else "bf16")  # (graph rows: against graph bf16)
        quant = name.startswith("quant")
        tflops = "-" if quant else f"{flops / (t * 1e-3) / 1e12:.0f}"
        ratio = f"{base / t:.2f}x" if base and not quant else "-"
        print(f"| {name} | {t:.3f} | {tflops} | {ratio} |")
        out_rows.append(dict(shape=shape.label, variant=name, ms=round(t, 4),
                             ratio=round(base / t, 3) if base and not quant else None,
                             rounds=[round(x, 4) for x in times.get(name, [])]))
    for name, note in notes.items():
        print(f"| {name} | n/a: {note} | | |")
        out_rows.append(dict(shape=shape.label, variant=name, note=note))
    sys.stdout.flush()


def suggestion(best):
    """The sm90 d128 forward entry's "fp8" override that the fastest tiles make, where one tile won every
    dense row of its kind (full / causal); a causal winner that is the table's own tile is spelled out, as
    a full-row override would otherwise apply to causal rows too."""
    won = {c: tiles[0] for c, tiles in best.items() if len(set(tiles)) == 1}
    if not won:
        return "no tile won every row of its kind: keep the table, or read the rows"
    entry = {}
    if won.get(False, "table") != "table":
        entry.update(tile_dict(next(t for t in FULL_TILES if tile_name(t) == won[False])))
    if True in won and (won[True] != "table" or entry):
        if won[True] == "table":
            causal = tuning.resolve_entry(PRISTINE_FWD[ROW_D], causal=True)
            entry["causal"] = {k: causal[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
        else:
            entry["causal"] = tile_dict(next(t for t in CAUSAL_TILES if tile_name(t) == won[True]))
    if entry.get("causal") == {k: v for k, v in entry.items() if k != "causal"}:
        del entry["causal"]  # one tile for both
    return ('candidate: "fp8": ' + json.dumps(entry) + " in the sm90 head_dim 128 \"fwd\" entry (tables.py)"
            if entry else "the table's tiles won: no change")


# --------------------------------------------------------------------------- compile warm-up (workers)

def warm_shape(causal, gqa):
    row = ROWS[0]
    return bench.Shape(*WARM_SHAPE, row.heads_q, GQA_ROWS[0].heads_kv if gqa else row.heads_kv, row.head_dim, causal)


def warm_jobs():
    """(causal, GQA, variant name, settings, kind) of every variant timed: each compiles what it launches."""
    jobs = []
    for causal in (False, True):
        shape = warm_shape(causal, False)
        jobs += [(causal, False, name, s, k) for name, s, k in variants(shape)]
    if os.environ.get("GQA") == "1":
        for causal in (False, True):
            shape = warm_shape(causal, True)
            jobs += [(causal, True, name, s, k)
                     for name, s, k in variants(shape, table_only=os.environ.get("GQA_TILES") != "1")]
    return jobs


def warm_worker(indices):
    """Runs the given warm_jobs on b2 s4096 (same kernel specialisations as the timed rows: batch != 1,
    16-divisible lengths and strides, the same quantiser grid), so their compiles land in Triton's cache."""
    jobs = warm_jobs()
    inputs = {}
    for i in indices:
        causal, gqa, name, settings, kind = jobs[i]
        key = (causal, gqa)
        if key not in inputs:
            inputs[key] = Inputs(warm_shape(causal, gqa))
        try:
            apply(**settings)
            with torch.no_grad():
                inputs[key].call(kind)()
            sync()
        except Exception as exc:
            print(f"warm {name}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
    apply()


def warm_up():
    jobs = warm_jobs()
    n = max(1, min(WORKERS, len(jobs)))
    print(f"compiling the kernels of {len(jobs)} variants in {n} worker processes ...", flush=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", ",".join(str(i) for i in range(w, len(jobs), n))],
                              env=dict(os.environ)) for w in range(n)]
    deadline = START + 0.6 * BUDGET_S  # a stuck worker: the timed process compiles what is missing
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"warm-up worker {p.pid} stopped at the deadline", flush=True)
    print(f"compiled: {elapsed():.0f} s", flush=True)


# --------------------------------------------------------------------------- main

def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--warm":
        warm_worker([int(i) for i in sys.argv[2].split(",") if i])
        return 0
    print(f"device {'cpu (SMOKE)' if SMOKE else torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; {ROUNDS} rounds; budget {BUDGET_S:.0f} s", flush=True)
    warm_up()
    out_rows, best = [], {}
    rows = ROWS + (GQA_ROWS if os.environ.get("GQA") == "1" else [])
    for shape in rows:
        if elapsed() > BUDGET_S:
            print(f"\nbudget reached ({elapsed():.0f} s): skipped {shape.label}", flush=True)
            continue
        if os.environ.get("KINDS") in ("causal", "full") and shape.causal != (os.environ["KINDS"] == "causal"):
            continue
        gqa_table_only = shape.heads_kv != shape.heads_q and os.environ.get("GQA_TILES") != "1"
        ms, times, notes, best_tile = time_row(shape, table_only=gqa_table_only)
        print_row(shape, ms, times, notes, best_tile, out_rows)
        best.setdefault(shape.causal, []).append(best_tile)
    print("\n### fastest fp8 tile per row:", json.dumps({("causal" if c else "full"): v for c, v in best.items()}))
    print(suggestion(best))
    print(f"done in {elapsed():.0f} s", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_ab.json"), "w") as f:
            for row in out_rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
