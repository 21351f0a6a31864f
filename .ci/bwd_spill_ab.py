"""GPU experiment (issue 17): dK/dV kernel switches and launch options (kernels/backward.py, tables.KERNEL_SWITCHES)
against the table's kernel on the rows where the fused backward trails FlexAttention.  By default DKDV_COL_BOUNDS (on
sm90 under triton 3.6 it takes the fused 64x128/w8/s3 dK/dV + dQ launch from 104 / 144 B of ptxas stack, plain /
causal, to 32 / 0 B at the same tiles); SWITCHES (env) names others, e.g. "one:DKDV_ONE_MASKED_LOOP=1" or
"s2:num_stages=2,dq.num_stages=2" (TUNING_NOTES v34), each set in every case of the entries.  Forward+backward timed
as `fa-amd bench` times it (CUDA events after an L2 flush, median call per round), variants and FlexAttention in the
same interleaved rounds; BWD=1 (env) also times the backward alone (autograd backward of a kept forward graph).
Prints one JSON line per (row, variant, mode); ROUNDS (env) sets the rounds, ROWS and HEAD_DIM the rows, OUT (env) a
folder for bwd_spill_ab.json.

  python .ci/bwd_spill_ab.py             # on the GPU (torch 2.11 / triton 3.6)
  python .ci/bwd_spill_ab.py --dry-run   # CPU: the interpreter on tiny shapes, variants' grads compared"""
import json
import os
import statistics
import sys

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from fa_amd import bench, tuning  # noqa: E402
from fa_amd.arch import arch_for  # noqa: E402
from fa_amd.tuning import tables  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 5))
TIME_BWD = os.environ.get("BWD", "1") == "1"
ROWS = [bench.Shape(32, 512, 16, 16, 128, True), bench.Shape(16, 1024, 16, 16, 128, True),
        bench.Shape(32, 512, 16, 16, 128, False), bench.Shape(4, 4096, 16, 16, 128, True),
        bench.Shape(2, 4096, 16, 4, 128, True), bench.Shape(1, 16384, 16, 16, 128, False)]
# name -> dK/dV entry changes ("dkdv" and "dkdv_atomic" take the switch; the dQ entry is left alone);
# SWITCHES (env) "name:KEY=V,KEY=V;name:..." replaces the variants after "table" (KEY: a switch or launch
# option of the dK/dV entries, "dq.KEY" one of the dQ entry)
VARIANTS = {
    "table": {},
    "col_bounds": {"DKDV_COL_BOUNDS": 1},
}
if os.environ.get("SWITCHES"):
    VARIANTS = {"table": {}}
    for item in os.environ["SWITCHES"].split(";"):
        name, _, sets = item.partition(":")
        VARIANTS[name] = {k: int(v) for k, v in (kv.split("=") for kv in sets.split(","))}
HEAD_DIM = int(os.environ.get("HEAD_DIM", 128))
FAMILY = "cpu" if DRY else "sm90"
if os.environ.get("ROWS"):  # "b,s,hq,hk,c;..." (c: 1 causal, 0 full), HEAD_DIM
    ROWS = [bench.Shape(*(int(x) for x in item.split(",")[:4]), HEAD_DIM, item.split(",")[4] == "1")
            for item in os.environ["ROWS"].split(";")]
if DRY:  # tiny rows, every case the masks distinguish: causal / full, ragged, GQA
    ROWS = [bench.Shape(1, 40, 2, 2, HEAD_DIM, True), bench.Shape(1, 33, 2, 2, HEAD_DIM, False),
            bench.Shape(1, 48, 4, 2, HEAD_DIM, True)]
ROW = tuning.row_for(tables.TABLES[FAMILY], HEAD_DIM)
PRISTINE = {k: dict(ROW[k]) for k in ("dkdv", "dkdv_atomic", "dq") if k in ROW}


def _forced(entry, changes):
    """`entry` with `changes` at its top level and dropped from every override dict in it (so a table override
    such as "short": {"causal": {...}} cannot set them back)."""
    out = {k: (_forced(v, {n: None for n in changes}) if isinstance(v, dict) else v) for k, v in entry.items()}
    for n, v in changes.items():
        out.pop(n, None)
        if v is not None:
            out[n] = v
    return out


def apply(changes):
    """The dK/dV entries with `changes` set in every case; a key "dq.NAME" sets NAME in the dQ entry instead (the
    fused launch needs both entries' launch options equal)."""
    for k, entry in PRISTINE.items():
        ROW[k].clear()
        if k == "dq":
            ROW[k].update(_forced(entry, {n[3:]: v for n, v in changes.items() if n.startswith("dq.")}))
        else:
            ROW[k].update(_forced(entry, {n: v for n, v in changes.items() if not n.startswith("dq.")}))
    tuning._RESOLVED.clear()


def prepared(shape, method):
    """(fwd+bwd call, grads, bwd-only call) of the bench's own inputs for `method`."""
    fn, layout = bench.MAKERS[method](shape, "cpu" if DRY else "cuda")
    q, k, v, dout = bench.make_inputs(shape, layout, torch.bfloat16, "cpu" if DRY else "cuda")

    def fwd_bwd():
        out = fn(q, k, v)
        (out[0] if isinstance(out, tuple) else out).backward(dout)

    kept = []

    def bwd():  # the backward of a forward run outside the timed region (one graph per call)
        out = kept.pop()
        out.backward(dout)

    def arm():
        out = fn(q, k, v)
        kept.append(out[0] if isinstance(out, tuple) else out)
    return fwd_bwd, (q, k, v), bwd, arm


def dry_run():
    """Each variant's fwd+bwd through the interpreter: the table kernel's gradients."""
    for shape in ROWS:
        grads = {}
        for name, changes in VARIANTS.items():
            fwd_bwd, inputs, _, _ = prepared(shape, "fa_amd")
            apply(changes)
            cfg = tuning.get_config(arch_for(inputs[0]), "dkdv", HEAD_DIM)
            assert all(cfg.get(k, 0) == v for k, v in changes.items() if not k.startswith("dq.")), cfg
            fwd_bwd()
            grads[name] = [t.grad.clone() for t in inputs]
            for t in inputs:
                t.grad = None
        apply({})
        # (a variant may sum dK / dV in another order, DKDV_ONE_MASKED_LOOP: close, maybe not bit for bit)
        same = {n: all(torch.equal(a, b) for a, b in zip(grads["table"], g)) for n, g in grads.items()}
        close = {n: all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in zip(grads["table"], g))
                 for n, g in grads.items()}
        print(json.dumps(dict(shape=shape.label, bitwise_equal=same, close=close)), flush=True)
        if not all(close.values()):
            return 1
    print("dry run ok: variants' gradients match the table kernel's", flush=True)
    return 0


def main():
    if DRY:
        return dry_run()
    rows = []
    for shape in ROWS:
        timers = {}
        for name, changes in VARIANTS.items():
            timers[name] = (prepared(shape, "fa_amd"), changes)
        timers["flex"] = (prepared(shape, "flex"), {})
        for (fwd_bwd, grads, _, _), changes in timers.values():
            apply(changes)
            fwd_bwd()
        torch.cuda.synchronize()
        modes = ("fwd+bwd", "bwd") if TIME_BWD else ("fwd+bwd",)
        times = {(name, mode): [] for name in timers for mode in modes}
        names = list(timers)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                (fwd_bwd, grads, bwd, arm), changes = timers[name]
                apply(changes)
                times[(name, "fwd+bwd")].append(bench.gpu_round_ms(fwd_bwd, grads, 8))
                if TIME_BWD:
                    times[(name, "bwd")].append(bench.gpu_round_ms(bwd, grads, 8, before=arm))
        for (name, mode), ts in times.items():
            ms = statistics.median(ts)
            flops = (2.5 if mode == "bwd" else 3.5) * shape.fwd_flops()
            row = dict(shape=shape.label, variant=name, mode=mode, ms=round(ms, 4),
                       tflops=round(flops / (ms * 1e-3) / 1e12, 1), rounds=[round(t, 4) for t in ts])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del timers
        torch.cuda.empty_cache()
    apply({})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bwd_spill_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
