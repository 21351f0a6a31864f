"""GPU experiment (issue 17, docs/TUNING_NOTES.md v9): the head-dim-256 backward candidates against the
current table and SDPA's FA2 (flash) and cuDNN backends, forward+backward, in interleaved rounds.

Rows: d256 full 1k / full 16k / causal 4k / causal 16k / causal 512 / causal 1k (b*s = 16k tokens, 8
heads), d192 (10 heads, padded to the d256 row) and d96 (21 heads, padded to the d128 row) full 1k /
causal 4k.  ROWS_AT=512,1024 keeps the rows of those sequence lengths.  Variants
change only the sm90 d256 table row (so d96 rows run the table alone):

  table          the current row (split32 since 2026-11-23)
  old-table      the row before: dK/dV 32x64/w8/s2 (255 regs, 384 B ptxas stack on sm90), dQ
                 64x32/w8/s1 in a second launch
  split32-dq64   split32 with dQ 64x32/w8/s2 (fused); split32-sep: its dQ in a second launch
  table-dq128    the same dK/dV with dQ 128x32/w8/s2 (230 regs, no stack), fused into its launch
  split16        DKDV_SPLIT=1: dK and dV in separate programs, 16x128/w8/s2 (252 regs, no stack,
                 with the fused dQ 128x32/w8/s2 programs), one launch
  split32        DKDV_SPLIT=1 at 32x128/w8/s2 (255 regs, 88 B stack), dQ 128x32/w8/s2 fused
  split16-dq16   split16 with dQ 128x16/w8/s2 (245 regs, no stack)
  split16-sep    split16 with the dQ 128x32/w8/s2 programs in a second launch
  fwd-c*         the table's backward, with a "causal" forward override (64x64/w4/s2, 64x64/w8/s2,
                 128x32/w8/s2; fwd-c64+split16 with split16's backward); causal rows only

Every variant is first compiled in parallel worker processes (one per variant x head dim x causal,
at the real head count on a short sequence, so the main process finds every kernel in Triton's
cache), which also check the variant's gradients against a float64 reference (max error beside
SDPA flash's on the same inputs).  Timing: `fa-amd bench`'s method (CUDA events after an L2 flush,
the median call of a round), ROUNDS (env, default 3) rounds, each starting with another method.
Prints one compact table (TFLOP/s, fwd+bwd = 3.5x forward FLOPs) and writes $OUT/d256_ab.json.
Budget: ~4-5 minutes on an H100 from a cold Triton cache.

    python .ci/d256_ab.py                 # everything
    VARIANTS=table,split16 ROUNDS=5 python .ci/d256_ab.py
    TRITON_INTERPRET=1 python .ci/d256_ab.py   # no GPU: a tiny smoke run of every path (fp16)
"""
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from fa_amd import bench, tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward as A
from fa_amd.tuning import tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = DEVICE == "cpu"  # the interpreter (TRITON_INTERPRET=1): tiny rows, fp16, wall-clock rounds
DTYPE = torch.float16 if SMOKE else torch.bfloat16
FAMILY = tuning.family_of(arch_for(torch.empty(0, device=DEVICE)))

ROUNDS = int(os.environ.get("ROUNDS", 3))
CALLS = int(os.environ.get("CALLS", 8))
W8S2 = {"num_warps": 8, "num_stages": 2}
# name -> (dQ mode override or None, "dkdv" entry changes, "dq" entry changes) of the sm90 d256 row
ALL_VARIANTS = {
    "table": (None, {}, {}),
    # the row before 2026-11-23's switch to split32 (dK/dV 32x64 unsplit, dQ 64x32/w8/s1 in a second launch)
    "old-table": (None, dict(BLOCK_M=32, BLOCK_N=64, DKDV_SPLIT=0, **W8S2), dict(BLOCK_M=64, BLOCK_N=32, num_warps=8,
                                                                            num_stages=1)),
    "split32-dq64": (None, dict(BLOCK_M=32, BLOCK_N=128, DKDV_SPLIT=1, **W8S2), dict(BLOCK_M=64, BLOCK_N=32, **W8S2)),
    "split32-sep": ("separate", dict(BLOCK_M=32, BLOCK_N=128, DKDV_SPLIT=1, **W8S2),
                    dict(BLOCK_M=128, BLOCK_N=32, **W8S2)),
    "table-dq128": (None, {}, dict(BLOCK_M=128, BLOCK_N=32, **W8S2)),
    "split16": (None, dict(BLOCK_M=16, BLOCK_N=128, DKDV_SPLIT=1, **W8S2), dict(BLOCK_M=128, BLOCK_N=32, **W8S2)),
    "split32": (None, dict(BLOCK_M=32, BLOCK_N=128, DKDV_SPLIT=1, **W8S2), dict(BLOCK_M=128, BLOCK_N=32, **W8S2)),
    "split16-dq16": (None, dict(BLOCK_M=16, BLOCK_N=128, DKDV_SPLIT=1, **W8S2), dict(BLOCK_M=128, BLOCK_N=16, **W8S2)),
    "split16-sep": ("separate", dict(BLOCK_M=16, BLOCK_N=128, DKDV_SPLIT=1, **W8S2),
                    dict(BLOCK_M=128, BLOCK_N=32, **W8S2)),
}
# variants that also give the sm90 d256 forward a "causal" override (short causal rows: 1k, 512 keys)
FWD_CAUSAL = {
    "fwd-c64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "fwd-c64w8": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
    "fwd-c128x32": dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2),
    "fwd-c64+split16": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
}
ALL_VARIANTS.update({name: (None, {}, {}) for name in FWD_CAUSAL})
ALL_VARIANTS["fwd-c64+split16"] = ALL_VARIANTS["split16"]
VARIANTS = {k: v for k, v in ALL_VARIANTS.items()
            if not os.environ.get("VARIANTS") or k in os.environ["VARIANTS"].split(",")}
PEERS = ("sdpa_flash", "sdpa_cudnn")


def heads(d):
    return bench.HIDDEN // d


def dense(d, seqlen, causal):
    if SMOKE:
        return bench.Shape(1, 48, 2, 2, d, causal)
    return bench.Shape(bench.TOKENS // seqlen, seqlen, heads(d), heads(d), d, causal)


ROWS = [dense(256, 1024, False), dense(256, 16384, False), dense(256, 4096, True), dense(256, 16384, True),
        dense(192, 1024, False), dense(192, 4096, True), dense(96, 1024, False), dense(96, 4096, True),
        dense(256, 512, True), dense(256, 1024, True)]
ROWS = list({r.label: r for r in ROWS
             if (not os.environ.get("HEAD_DIMS") or str(r.head_dim) in os.environ["HEAD_DIMS"].split(","))
             and (not os.environ.get("ROWS_AT") or str(r.seqlen) in os.environ["ROWS_AT"].split(","))}.values())
# d192 runs on the d256 row too, but only the front-runners (fewer kernels to compile)
D192_VARIANTS = ("table", "old-table", "split32", "split32-dq64", "split32-sep")


def variants_for(shape):
    """The d256-row variants where the row runs on the d256 table entry, else the table alone."""
    if shape.head_dim <= 128:
        return ["table"]
    return [v for v in VARIANTS if (shape.head_dim == 256 or v in D192_VARIANTS)
            and (shape.causal or v not in FWD_CAUSAL)]


def _row256():
    return next(r for r in tables.TABLES[FAMILY] if r["head_dim"] >= 256)


PRISTINE = {k: dict(_row256()[k]) for k in ("dkdv", "dq", "fwd")}


def apply(name):
    mode, dkdv, dq = ALL_VARIANTS[name]
    row = _row256()
    for key, extra in (("dkdv", dkdv), ("dq", dq)):
        row[key].clear()
        row[key].update(PRISTINE[key], **extra)
    row["fwd"].clear()
    row["fwd"].update(PRISTINE["fwd"], **({"causal": FWD_CAUSAL[name]} if name in FWD_CAUSAL else {}))
    A.BWD_DQ_MODE = mode
    tuning._RESOLVED.clear()


# --------------------------------------------------------------------------- compile + check workers

def _grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), dout)


def warm_and_check(name, head_dim, causal):
    """(worker) Compile the variant at this head dim / mask on a short sequence with the bench's head
    count, and return its largest gradient error vs float64, beside SDPA flash's (same inputs)."""
    import fa_amd
    from fa_amd.reference import attention_ref
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    apply(name)
    torch.manual_seed(0)
    # the timed rows' specializations: seqlens divisible by 16, and > tables.SHORT_SEQLEN_K where a
    # causal row is (the "short" overrides are for <= 1024 keys)
    shape = (1, 40, 2, head_dim) if SMOKE else (1, 2048 if causal else 1024, heads(head_dim), head_dim)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    start = time.perf_counter()
    got = _grads(lambda *x: fa_amd.flash_attn_func(*x, causal=causal), q, k, v, dout)
    if not SMOKE:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref = _grads(lambda *x: attention_ref(*x, causal=causal)[0], *(x.detach().double().requires_grad_() for x in
                                                                  (q, k, v)), dout.double())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = _grads(lambda *x: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in x), is_causal=causal
                                                                 ).transpose(1, 2), q, k, v, dout)
    err = max((a.double() - r).abs().max().item() / r.abs().max().item() for a, r in zip(got, ref))
    err_flash = max((a.double() - r).abs().max().item() / r.abs().max().item() for a, r in zip(flash, ref))
    return dict(variant=name, head_dim=head_dim, causal=causal, compile_s=round(seconds, 1),
                rel_err=float(f"{err:.3g}"), flash_rel_err=float(f"{err_flash:.3g}"), ok=err <= 2 * err_flash + 1e-3)


def warm_all():
    jobs = sorted({(name, r.head_dim, r.causal) for r in ROWS for name in variants_for(r)})
    workers = max(1, min(len(jobs), os.cpu_count() or 4, 16))
    start = time.perf_counter()
    if SMOKE:  # the interpreter compiles nothing: check in this process
        workers, checks = 1, [warm_and_check(*job) for job in jobs]
    else:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            checks = list(pool.map(warm_and_check, *zip(*jobs)))
    print(f"compiled + checked {len(jobs)} (variant, head dim, mask) in {time.perf_counter() - start:.0f} s "
          f"({workers} processes)", flush=True)
    for c in checks:
        print(json.dumps(c), flush=True)
    bad = [f"{c['variant']} d{c['head_dim']}{' causal' if c['causal'] else ''}" for c in checks if not c["ok"]]
    print(f"gradient checks: {len(checks) - len(bad)}/{len(checks)} within 2x SDPA flash's error + 1e-3"
          + (f"; FAILED: {', '.join(bad)}" if bad else ""), flush=True)
    return checks


# --------------------------------------------------------------------------- timing

def timer(shape, method, name):
    """A function timing one round of the bench's forward+backward call of `method` under variant `name`."""
    fwd_bwd = next(t for t in bench._prepare(method, shape, DTYPE, DEVICE) if t.mode == "fwd+bwd")
    if fwd_bwd.call is None:
        print(f"{shape.label} {method}: {fwd_bwd.note}", flush=True)
        return None
    apply(name)
    try:
        fwd_bwd.call()
        if not SMOKE:
            torch.cuda.synchronize()
    except Exception as exc:  # a peer that cannot run this row (e.g. cuDNN on a head dim it lacks)
        print(f"{shape.label} {method}: {bench._failure_note(exc)}", flush=True)
        return None

    def once():
        apply(name)
        if SMOKE:
            return bench.time_ms(fwd_bwd.call, list(fwd_bwd.grads), smoke=True)
        return bench.gpu_round_ms(fwd_bwd.call, fwd_bwd.grads, CALLS)
    return once


def main():
    gpu = torch.cuda.get_device_name() if not SMOKE else "CPU (Triton interpreter, smoke run: no numbers)"
    print(gpu, "torch", torch.__version__, "triton", __import__("triton").__version__,
          time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), flush=True)
    start = time.perf_counter()
    checks = warm_all()
    results = []
    for shape in ROWS:
        timers = {name: timer(shape, "fa_amd", name) for name in variants_for(shape)}
        for peer in PEERS:
            t = timer(shape, peer, "table")
            if t is not None:
                timers[peer] = t
        times = {name: [] for name in timers}
        names = list(timers)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timers[name]())
        for name, ts in times.items():
            ms = statistics.median(ts)
            results.append(dict(shape=shape.label, head_dim=shape.head_dim, causal=shape.causal, variant=name,
                                ms=round(ms, 4), tflops=round(3.5 * shape.fwd_flops() / (ms * 1e-3) / 1e12, 1),
                                rounds=[round(t, 4) for t in ts]))
        print(f"{shape.label}: " + ", ".join(f"{r['variant']} {r['tflops']:.0f}" for r in results
                                             if r["shape"] == shape.label), flush=True)
        del timers
        if not SMOKE:
            torch.cuda.empty_cache()
    apply("table")
    print_table(results)
    print(f"total {time.perf_counter() - start:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "d256_ab.json"), "w") as f:
            json.dump({"checks": checks, "results": results}, f, indent=1)
    return 0 if all(c["ok"] for c in checks) else 1


def print_table(results):
    """Rows x methods, TFLOP/s (median round); the best fa_amd variant and its ratio to FA2 / cuDNN."""
    cols = list(dict.fromkeys(r["variant"] for r in results))
    idx = {(r["shape"], r["variant"]): r["tflops"] for r in results}
    print("\n| fwd+bwd TFLOP/s | " + " | ".join(cols) + " | best fa_amd | vs FA2 | vs cuDNN |")
    print("|---" * (len(cols) + 4) + "|")
    for label in dict.fromkeys(r["shape"] for r in results):
        ours = {c: idx[(label, c)] for c in cols if (label, c) in idx and c not in PEERS}
        best = max(ours, key=ours.get)
        fa2, cudnn = idx.get((label, "sdpa_flash")), idx.get((label, "sdpa_cudnn"))
        ratio = (lambda x: f"{ours[best] / x:.2f}x" if x else "n/a")
        print(f"| {label} | " + " | ".join(f"{idx[(label, c)]:.0f}" if (label, c) in idx else "" for c in cols)
              + f" | {best} | {ratio(fa2)} | {ratio(cudnn)} |")


if __name__ == "__main__":
    sys.exit(main())
