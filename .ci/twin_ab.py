"""GPU experiment: this tree's kernels against another tree's, in the same process and the same interleaved rounds.

    git archive HEAD fa_amd | tar -x -C /tmp/twin        # (here: the tree to compare against)
    TWIN=/tmp/twin PYTHONPATH=. python .ci/twin_ab.py      # on the GPU: ~4-6 min with compiles
    TWIN=/tmp/twin DRY_RUN=1 TRITON_INTERPRET=1 PYTHONPATH=. python .ci/twin_ab.py   # the plumbing, on the CPU

For kernel changes that no table entry switches (e.g. a prologue's arithmetic): TWIN's fa_amd/ is copied and
imported as `fa_amd_twin` (its custom ops renamed into their own namespace), so both versions run side by side.
Every call is captured once in a CUDA graph and replayed (GPU time alone, the small launches included), each
replay after bench.l2_flush, timed with CUDA events; the two versions of a row alternate in ROUNDS (default 7)
interleaved rounds, and a figure is the median over rounds.  Rows (ROWS=fwd,fp8,bwd,decode picks groups):
  fwd / fp8: d128 forward, bf16 and FA3-style FP8 (bench.fp8_inputs), b4 s4k h16 causal and full, h16/kv4 causal,
             b2 s8k causal;
  prefix:    d128 causal forward of queries after a cached prefix (fewer queries than keys), bf16 and FP8: b1 512
             queries / 16k keys and 128 / 8k at h32/kv8, b4 1k / 4k at h16;
  bwd:       d128 and d64 forward+backward, b32 s512 and b16 s1k causal, h16/kv4 b4 s4k causal;
  decode:    flash_attn_with_kvcache, one query token, GQA 32/8, d128, bf16: b1 / b8 / b64 at 2k, b1 / b8 at 8k.
Prints one line per row (twin ms, this tree's ms, ratio, and the median and range of the per-round paired change of
this tree's time: the steadier figure) and JSON lines to $OUT/twin_ab.json when OUT is set.
"""
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tree_copy import copy_fa_amd, paired_change_pct  # noqa: E402

DRY_RUN = os.environ.get("DRY_RUN") == "1"
ROUNDS = int(os.environ.get("ROUNDS", 7))
GROUPS = os.environ.get("ROWS", "fwd,fp8,bwd,decode").split(",")
DEVICE = "cpu" if DRY_RUN else "cuda"


def load_twin(path: str):
    """TWIN's fa_amd package imported as fa_amd_twin (its torch.library ops in the fa_amd_twin namespace)."""
    copy_fa_amd(path, "fa_amd_twin")
    return importlib.import_module("fa_amd_twin")


import fa_amd  # noqa: E402
from fa_amd import bench  # noqa: E402

twin = load_twin(os.environ["TWIN"])
VERSIONS = {"twin": twin, "tree": fa_amd}


def replay(fn):
    """fn captured in a CUDA graph: its replay (fn itself on the CPU dry run)."""
    if DRY_RUN:
        return fn
    graph = bench.cuda_graph(fn)
    return graph.replay


def rnd(*shape, dtype=torch.bfloat16, grad=False):
    t = torch.randn(shape, device=DEVICE, dtype=torch.float32).to(torch.float16 if DRY_RUN else dtype)
    return t.requires_grad_(grad)


def forward_rows(kind, label, q, k, v, causal, dtypes):
    """`kind` rows of one shape's forward, in `dtypes`: "bf16" and / or "fp8" (FA3-style inputs, bench.fp8_inputs)."""
    rows = []
    if "bf16" in dtypes:
        rows.append((f"{kind} bf16 {label}", {
            name: (lambda m=m, q=q, k=k, v=v, c=causal: m.flash_attn_func(q, k, v, causal=c))
            for name, m in VERSIONS.items()}))
    if "fp8" in dtypes:
        q8, k8, v8, descales = bench.fp8_inputs(q, k, v)
        rows.append((f"{kind} fp8 {label}", {  # (every input bound now: the loop rebinds the names)
            name: (lambda m=m, c=causal, q8=q8, k8=k8, v8=v8, ds=descales: m.flash_attn_func(q8, k8, v8, causal=c,
                                                                                             **ds))
            for name, m in VERSIONS.items()}))
    return rows


def fwd_rows():
    rows = []
    for (b, s, hq, hk, causal) in [(4, 4096, 16, 16, True), (4, 4096, 16, 16, False), (4, 4096, 16, 4, True),
                                   (2, 8192, 16, 16, True)]:
        if DRY_RUN:
            b, s = 1, 40
        q, k, v = rnd(b, s, hq, 128), rnd(b, s, hk, 128), rnd(b, s, hk, 128)
        label = f"b{b} s{s} h{hq}/kv{hk} d128 {'causal' if causal else 'full'}"
        dtypes = [dtype for dtype, group in (("bf16", "fwd"), ("fp8", "fp8")) if group in GROUPS]
        rows += forward_rows("fwd", label, q, k, v, causal, dtypes)
    return rows


def prefix_rows():
    rows = []
    for (b, sq, sk, hq, hk) in [(1, 512, 16384, 32, 8), (1, 128, 8192, 32, 8), (4, 1024, 4096, 16, 16)]:
        if DRY_RUN:
            b, sq, sk = 1, 24, 40
        q, k, v = rnd(b, sq, hq, 128), rnd(b, sk, hk, 128), rnd(b, sk, hk, 128)
        rows += forward_rows("prefix", f"b{b} q{sq} k{sk} h{hq}/kv{hk} d128 causal", q, k, v, True, ("bf16", "fp8"))
    return rows


def bwd_rows():
    rows = []
    for (b, s, hq, hk, d) in [(32, 512, 16, 16, 128), (16, 1024, 16, 16, 128), (4, 4096, 16, 4, 128),
                              (32, 512, 16, 16, 64), (16, 1024, 16, 16, 64)]:
        if DRY_RUN:
            b, s = 1, 40
        q, k, v = rnd(b, s, hq, d, grad=True), rnd(b, s, hk, d, grad=True), rnd(b, s, hk, d, grad=True)
        dout = rnd(b, s, hq, d)

        def step(m, q=q, k=k, v=v, dout=dout):
            q.grad = k.grad = v.grad = None
            m.flash_attn_func(q, k, v, causal=True).backward(dout)

        rows.append((f"fwd+bwd b{b} s{s} h{hq}/kv{hk} d{d} causal",
                     {name: (lambda m=m, step=step: step(m)) for name, m in VERSIONS.items()}))
    return rows


def decode_rows():
    rows = []
    for (b, cache) in [(1, 2048), (8, 2048), (64, 2048), (1, 8192), (8, 8192)]:
        if DRY_RUN:
            b, cache = min(b, 2), 48
        q = rnd(b, 1, 32, 128)
        k_cache, v_cache = rnd(b, cache, 8, 128), rnd(b, cache, 8, 128)
        seqlens = torch.full((b,), cache, dtype=torch.int32, device=DEVICE)
        rows.append((f"decode b{b} cache {cache} h32/kv8 d128", {
            name: (lambda m=m, q=q, kc=k_cache, vc=v_cache, sl=seqlens: m.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=sl)) for name, m in VERSIONS.items()}))
    return rows


def main():
    rows = (fwd_rows() if {"fwd", "fp8"} & set(GROUPS) else []) + (prefix_rows() if "prefix" in GROUPS else []) \
        + (bwd_rows() if "bwd" in GROUPS else []) + (decode_rows() if "decode" in GROUPS else [])
    out = []
    env = bench.environment(torch.device(DEVICE))
    print(json.dumps(env))
    for label, calls in rows:
        with torch.no_grad() if not label.startswith("fwd+bwd") else torch.enable_grad():
            results = [fn() for fn in calls.values()]  # compile, and check the versions agree
            outs = [r[0] if isinstance(r, tuple) else r for r in results]
            same = all(o is None for o in outs) or torch.equal(outs[0], outs[1])
            timed = {name: (replay(fn), ()) for name, fn in calls.items()}
        if DRY_RUN:
            for fn, _ in timed.values():
                fn()
            print(label, "ran, outputs", "equal" if same else "DIFFER")
            continue
        times = bench.interleaved_rounds_ms(timed, ROUNDS, calls=10)
        med = {name: statistics.median(t) for name, t in times.items()}
        # the two versions' rounds in pairs (tree_copy.paired_change_pct)
        p_med, p_min, p_max = paired_change_pct(times["tree"], times["twin"])
        line = dict(row=label, outputs_equal=same, twin_ms=med["twin"], tree_ms=med["tree"], tree_vs_twin=med["twin"] / med["tree"],
                    paired_pct=dict(median=p_med, min=p_min, max=p_max), rounds=times)
        out.append(line)
        print(f"{label:48s} twin {med['twin'] * 1e3:9.1f} us  tree {med['tree'] * 1e3:9.1f} us  "
              f"tree speed x{line['tree_vs_twin']:.4f}  paired tree time {p_med:+.2f} % "
              f"({p_min:+.2f}..{p_max:+.2f}){'' if same else '  OUTPUTS DIFFER'}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "twin_ab.json"), "w") as f:
            for line in [env] + out:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
