"""GPU experiment (issues 17 and 18): the causal kernels' program order (kernels/blocks.grouped_program_ids,
tables.PROGRAM_GROUPS) on an H100 / H200.

    PYTHONPATH=. python .ci/order_ab.py              # on a GPU: ~4-6 min with compiles
    SMOKE=1 PYTHONPATH=. python .ci/order_ab.py      # CPU check of the script (interpreter, tiny rows)
    bash .ci/gpu order                               # the GPU tests, then grid order vs the table, fwd and bwd

Prediction (a list-scheduling model of 264 program slots, 2 per SM: .ci/order_ab.py --model): causal launches
lose 5-7 % to their tail at 2k-8k tokens when each (batch, head) pair's query blocks run in turn, heaviest first
(group size 1, the grid order), and get within 0.5 % of the ideal when groups of 4-16 (batch, head) pairs run
their heavy blocks first.  Full (non-causal) rows should not move.

Variants: the group size in $ORDER_GROUPS (default "0 4 8 16"; 0 and 1: the grid order; "table" =
tuning.program_group's rule over tables.PROGRAM_GROUPS), forced on every launch of the varied kernel (MODE=fwd:
the forward, for bf16 inputs and FA3-style FP8 inputs with per-(batch, KV head) descales and V token-major as the
sm90 kernel reads it; MODE=bwd: the dK/dV launch of a bf16 forward+backward, the forward at the table's rule).
Each variant is captured in a CUDA graph (its launch plan holds its program order) and replayed after an L2
flush; every variant of a row runs in the same ROUNDS (default 5) interleaved rounds
(fa_amd.bench.interleaved_rounds_ms).  Output: per row, ms / TFLOP/s per variant and the FP8 / bf16 ratio at
each order; JSON lines in $OUT/order_ab.json.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("FA_AMD_CACHE_DIR", tempfile.mkdtemp(prefix="order_ab_"))

import torch  # noqa: E402

from fa_amd import bench, fp8, tuning  # noqa: E402
from fa_amd.kernels import backward, forward  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
# group sizes ("table": tuning.program_group's rule; 0 and 1: the grid order)
GROUPS = [g if g == "table" else int(g) for g in os.environ.get("ORDER_GROUPS", "0 4 8 16").split()]
WORKERS = int(os.environ.get("WORKERS", 8))
START = time.time()
DEVICE = "cpu" if SMOKE else "cuda"
# MODE=bwd: forward+backward of bf16 inputs, the forward at the table's rule and the backward's group size varied
MODE = os.environ.get("MODE", "fwd")
FAMILY = "cpu" if SMOKE else "sm90"
S = bench.Shape
ROWS = [S(8, 2048, 16, 16, 128, True), S(4, 4096, 16, 16, 128, True), S(2, 8192, 16, 16, 128, True),
        S(1, 16384, 16, 16, 128, True), S(4, 4096, 16, 4, 128, True), S(4, 4096, 16, 16, 128, False),
        S(4, 4096, 32, 32, 64, True), S(4, 4096, 8, 8, 256, True), S(16, 1024, 16, 16, 128, True)]
# SET=2: the confirmation run (rows where the first run moved; GQA rows at 4k-16k)
if os.environ.get("SET") == "2":
    ROWS = [S(4, 4096, 16, 4, 128, True), S(2, 8192, 16, 4, 128, True), S(1, 16384, 32, 8, 128, True),
            S(1, 16384, 16, 16, 128, True), S(2, 8192, 16, 16, 128, True), S(4, 4096, 16, 16, 128, True),
            S(4, 4096, 8, 8, 256, True), S(1, 16384, 8, 8, 256, True), S(4, 4096, 8, 8, 256, False),
            S(2, 8192, 16, 16, 128, False), S(4, 4096, 32, 32, 64, False)]
# SET=3: the table's rule against the grid order over the bench's d128 / d256 rows
if os.environ.get("SET") == "3":
    ROWS = [S(16, 1024, 16, 16, 128, True), S(8, 2048, 16, 16, 128, True), S(4, 4096, 16, 16, 128, True),
            S(2, 8192, 16, 16, 128, True), S(1, 16384, 16, 16, 128, True), S(4, 4096, 16, 4, 128, True),
            S(2, 8192, 16, 4, 128, True), S(16, 1024, 16, 16, 128, False), S(4, 4096, 16, 16, 128, False),
            S(1, 16384, 16, 16, 128, False), S(32, 512, 8, 8, 256, True), S(4, 4096, 8, 8, 256, True),
            S(1, 16384, 8, 8, 256, True)]
# MODE=bwd rows (SET is ignored): causal forward+backward, the bench's and the end-to-end anchor's shapes
if MODE == "bwd":
    ROWS = [S(16, 1024, 16, 16, 128, True), S(8, 2048, 16, 16, 128, True), S(4, 4096, 16, 16, 128, True),
            S(2, 8192, 16, 16, 128, True), S(1, 16384, 16, 16, 128, True), S(2, 4096, 16, 4, 128, True),
            S(2, 8192, 16, 4, 128, True), S(4, 4096, 8, 8, 256, True), S(1, 16384, 8, 8, 256, True),
            S(4, 4096, 32, 32, 64, True)]
if os.environ.get("ROWS"):
    ROWS = [ROWS[int(i)] for i in os.environ["ROWS"].split(",")]
if SMOKE:
    ROWS = [S(2, 48, 4, 2, 32, True), S(2, 40, 2, 2, 32, False)]
DTYPES = os.environ.get("DTYPES", "bf16 fp8").split()
if MODE == "bwd":
    DTYPES = ["bf16"]
TABLE_RULE = tuning.program_group
RULE_SEEN = {}  # (row label, dtype) -> the group size the table's rule gave
CURRENT = [None]


def _table_rule(*args):
    group = TABLE_RULE(*args)
    RULE_SEEN[CURRENT[0]] = group
    return group


def apply(group):
    """Forces the varied kernel's program group size (or the table's rule) for the launches made after it."""
    rule = _table_rule if group == "table" else (lambda *args: max(1, group))
    forward.program_group = rule if MODE == "fwd" else TABLE_RULE
    backward.program_group = rule if MODE == "bwd" else TABLE_RULE
    tuning._RESOLVED.clear()  # (configs and launch plans)


def make_call(shape, dtype):
    import fa_amd

    q, k, v, dout = bench.make_inputs(shape, "bshd", torch.bfloat16, DEVICE)
    if MODE == "bwd":
        def fwd_bwd():
            out = fa_amd.flash_attn_func(q, k, v, causal=shape.causal)
            return torch.autograd.grad(out, (q, k, v), dout)
        return fwd_bwd
    q, k, v = (x.detach() for x in (q, k, v))
    if dtype == "bf16":
        return lambda: fa_amd.flash_attn_func(q, k, v, causal=shape.causal)
    fp8_dtype = fp8.fp8_dtypes(q)[0]
    b, s, hq, d = q.shape
    hk = k.shape[2]
    q8, qd = fp8.quantize_fp8(q.reshape(b, s, hk, (hq // hk) * d), fp8_dtype)
    q8 = q8.reshape(q.shape)
    k8, kd = fp8.quantize_fp8(k, fp8_dtype)
    v8, vd = fp8.quantize_fp8(v, fp8_dtype)
    if fp8.fp8_v_token_major(fp8.arch_for(v8)):
        v8 = fp8.token_major_copy(v8)
    return lambda: fa_amd.flash_attn_func(q8, k8, v8, causal=shape.causal, q_descale=qd, k_descale=kd, v_descale=vd)


_KEEP = []


def captured(fn):
    """fn's launches replayed from a CUDA graph (its launch plan, so its program order, fixed at capture)."""
    if SMOKE:
        return fn
    with torch.set_grad_enabled(MODE == "bwd"):
        graph = bench.cuda_graph(fn)
    _KEEP.append(fn)  # (its closure holds the graph's input tensors)
    return graph.replay


def time_row(shape):
    _KEEP.clear()  # (the previous row's graphs are done)
    timed = {}
    for dtype in DTYPES:
        if dtype == "fp8" and shape.head_dim > 256:
            continue
        for group in GROUPS:
            apply(group)
            CURRENT[0] = (shape.label, dtype)
            timed[(dtype, group)] = (captured(make_call(shape, dtype)), [])
    apply("table")
    if SMOKE:
        return {key: [bench.time_ms(fn, smoke=True)] for key, (fn, _) in timed.items()}
    return bench.interleaved_rounds_ms(timed, ROUNDS, calls=10)


def check():
    """Every order gives the same bits (dense / GQA / varlen with an empty segment, bf16 and FP8)."""
    import fa_amd

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(3, 301, 8, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(3, 333, 2, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(3, 333, 2, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    cu = torch.tensor([0, 100, 100, 700, 903], dtype=torch.int32, device=DEVICE)
    results = {}
    for group in GROUPS:
        apply(group)
        outs = [fa_amd.flash_attn_func(q, k, v, causal=c) for c in (False, True)]
        outs.append(fa_amd.flash_attn_varlen_func(q.reshape(-1, 8, 128), k[:, :301].reshape(-1, 2, 128),
                                                  v[:, :301].reshape(-1, 2, 128), cu, cu, 600, 600, causal=True))
        if "fp8" in DTYPES:
            f8 = fp8.fp8_dtypes(q)[0]
            outs.append(fa_amd.flash_attn_func(q.to(f8), k.to(f8), v.to(f8), causal=True))
        results[group] = outs
    apply("table")
    for group, outs in results.items():
        same = all(torch.equal(a, b) for a, b in zip(outs, results[GROUPS[0]]))
        print(f"order check, group {group} vs {GROUPS[0]}: {'same bits' if same else 'DIFFERENT'}", flush=True)


def warm_worker(indices):
    """Compiles (into Triton's cache) what the given (row, dtype, group) jobs launch, on a short problem with
    the same kernel specialisations."""
    jobs = [(r, dt, g) for r in range(len(ROWS)) for dt in DTYPES for g in GROUPS]
    for i in indices:
        r, dtype, group = jobs[i]
        row = ROWS[r]
        shape = S(2, 1024, row.heads_q, row.heads_kv, row.head_dim, row.causal)
        apply(group)
        try:
            make_call(shape, dtype)()
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"warm {row.label} {dtype} {group}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)


def warm_up():
    n_jobs = len(ROWS) * len(DTYPES) * len(GROUPS)
    n = max(1, min(WORKERS, n_jobs))
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", ",".join(str(i) for i in range(w, n_jobs, n))],
                              env=dict(os.environ)) for w in range(n)]
    for p in procs:
        p.wait()
    print(f"compiled {n_jobs} variants in {n} workers: {time.time() - START:.0f} s", flush=True)


def model():
    """The list-scheduling prediction: programs start in launch order on 264 slots; a causal query block
    of 64 rows costs its 128-key blocks plus one block of set-up."""
    import heapq

    def makespan(order, cost, slots=264):
        free = [0.0] * slots
        end = 0.0
        for p in order:
            t = heapq.heappop(free) + cost[p]
            end = max(end, t)
            heapq.heappush(free, t)
        return end

    for b, s in ((8, 2048), (4, 4096), (2, 8192), (1, 16384)):
        n_m, pairs = s // 64, [(bb, h) for bb in range(b) for h in range(16)]
        cost = {(p, m): math.ceil((m + 1) * 64 / 128) + 1 for p in pairs for m in range(n_m)}
        cells = [f"ideal {sum(cost.values()) / 264:.0f}"]
        for g in GROUPS:
            if g == "table":
                continue
            if g == 0:
                order = [(p, m) for p in pairs for m in reversed(range(n_m))]
            else:
                order = [(p, m) for i in range(0, len(pairs), g) for m in reversed(range(n_m)) for p in pairs[i:i + g]]
            cells.append(f"group {g}: {makespan(order, cost):.0f}")
        print(f"b{b} s{s} causal:", ", ".join(cells))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--model":
        model()
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--warm":
        warm_worker([int(i) for i in sys.argv[2].split(",") if i])
        return 0
    print(f"device {'cpu (SMOKE)' if SMOKE else torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; groups {GROUPS}; {ROUNDS} rounds", flush=True)
    model()
    check()
    if not SMOKE:
        warm_up()
    out = []
    for shape in ROWS:
        times = time_row(shape)
        ms = {key: statistics.median(ts) for key, ts in times.items()}
        flops = shape.fwd_flops() * (3.5 if MODE == "bwd" else 1.0)
        print(f"\n### {shape.label} ({time.time() - START:.0f} s)\n| group | " +
              " | ".join(f"{dt} ms (TFLOP/s)" for dt in DTYPES) + " | fp8 / bf16 |\n|---|" + "---|" * (len(DTYPES) + 1))
        for group in GROUPS:
            cells = [f"{ms[(dt, group)]:.3f} ({flops / ms[(dt, group)] / 1e9:.0f})" if (dt, group) in ms else "-"
                     for dt in DTYPES]
            ratio = ms.get(("bf16", group), 0) / ms[("fp8", group)] if ("fp8", group) in ms else 0
            if group == "table":  # the group sizes the rule gave this row
                group = "table (%s)" % ", ".join(f"{dt} {RULE_SEEN.get((shape.label, dt), '?')}" for dt in DTYPES)
            print(f"| {group} | " + " | ".join(cells) + (f" | {ratio:.2f}x |" if ratio else " | - |"))
        for (dt, group), ts in times.items():
            out.append(dict(shape=shape.label, dtype=dt, group=group, ms=ms[(dt, group)], rounds=ts))
        sys.stdout.flush()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "order_ab.json"), "w") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")
    print(f"done in {time.time() - START:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
