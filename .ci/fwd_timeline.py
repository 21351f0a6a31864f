"""GPU probe: where a forward program's time goes -- each program's clock at four points, and the SMs' timeline.

    PYTHONPATH=. python .ci/fwd_timeline.py          # on an NVIDIA GPU (~1-2 min with compiles)
    TREES=head=/tmp/head,tree=. PYTHONPATH=. python .ci/fwd_timeline.py   # several trees' kernels, interleaved

Each tree's fa_amd/ (TREES: name=path pairs; default this tree) is copied and imported as `fa_amd_tl_<name>`,
its attn_fwd_kernel patched to write, per program,
%globaltimer (ns) and %clock64 (SM cycles) at entry (T0), before the key loops (T1), after them (T2) and after the
epilogue's stores (T3), with %smid and its key-block count (the stores are issued, not completed, at T3).  One call
per row after an L2 flush (the bench's timing); its records give:
  - cycles per program in the prologue (T1 - T0), the key loops (T2 - T1) and the epilogue (T3 - T2), and a
    least-squares fit of the loops' cycles against key blocks (slope: one block; intercept: the loops' fill);
  - the SMs' timeline: programs resident per SM over time, the gap between a program's end and the start of the one
    that takes its slot (CTA launch), the time before the first program starts and after each SM's last ends.
Rows: ROWS (names of ROW_SPECS, comma-separated; default all); ROUNDS (default 5) interleaved rounds of one call per
tree, each figure the median round.  A span is also given in SM cycles (its length times the clock the programs'
own counters show): steadier than microseconds while the clock moves between power-cap levels.  JSON to $OUT/fwd_timeline.json when OUT is set.
"""
import importlib
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fa_amd import bench  # noqa: E402
from tree_copy import copy_fa_amd, paired_change_pct  # noqa: E402

FIELDS = 8  # per program: gt0, clk0, clk1, clk2, clk3, gt3, smid, key blocks

PATCHES = [  # (anchor in fa_amd/kernels/forward.py, text put after it)
    ("    EVEN_QK: tl.constexpr = False, FWD_MERGED_EDGES: tl.constexpr = 0,", " Timeline=None,"),
    ("    pid_m = tl.num_programs(0) - 1 - pid_0\n",
     "    if Timeline is not None:\n"
     "        _row = Timeline + ((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0)\n"
     "                           + tl.program_id(0)).to(tl.int64) * 8\n"
     "        tl.store(_row + 0, _tl_gt())\n"
     "        tl.store(_row + 1, _tl_clk())\n"
     "        tl.store(_row + 6, _tl_sm().to(tl.int64))\n"),
    ("    lo, full_lo, full_hi, hi = key_ranges(m0, q_len, k_len, diag, win_left, win_right,\n"
     "                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)\n",
     "    if Timeline is not None:\n"
     "        tl.store(_row + 2, _tl_clk())\n"
     "        tl.store(_row + 7, ((hi - lo) // BLOCK_N).to(tl.int64))\n"),
    ("    empty_row = l_i == 0.0\n", None),  # (T2 goes before this line)
    ("        tl.store(lse_head + offs_m, lse, mask=offs_m < q_len)\n",
     "    if Timeline is not None:\n"
     "        tl.store(_row + 4, _tl_clk())\n"
     "        tl.store(_row + 5, _tl_gt())\n"),
]
T2 = ("    if Timeline is not None:\n"
      "        tl.store(_row + 3, _tl_clk())\n")
HELPERS = '''

@triton.jit
def _tl_gt():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _tl_clk():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _tl_sm():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


_TIMELINE = [None]
'''


def load_patched(name, tree):
    pkg = f"fa_amd_tl_{name}"
    dst = copy_fa_amd(tree, pkg)
    fwd = os.path.join(dst, "kernels", "forward.py")
    with open(fwd) as f:
        text = f.read()
    for anchor, after in PATCHES:
        if text.count(anchor) != 1:
            raise SystemExit(f"anchor not found once in forward.py: {anchor!r}")
        text = text.replace(anchor, T2 + anchor if after is None else anchor + after)
    text = text.replace("\n\n@triton.jit\ndef _masked_block", HELPERS + "\n\n@triton.jit\ndef _masked_block", 1)
    # the launch takes the buffer; launch plans off (a plan would replay without it)
    text = text.replace("POSITIVE_SCALE=0 < softmax_scale <= tables.FWD_RAW_MAX_SCALE and raw_max, **order,",
                        "POSITIVE_SCALE=0 < softmax_scale <= tables.FWD_RAW_MAX_SCALE and raw_max, **order, "
                        "Timeline=_TIMELINE[0],", 1)
    text = text.replace('if not return_probs and sinks is None and q.device.type != "cpu":', "if False:", 1)
    with open(fwd, "w") as f:
        f.write(text)
    return importlib.import_module(pkg), importlib.import_module(f"{pkg}.kernels.forward")


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def analyse(rec, event_us):
    rec = rec[rec[:, 0] != 0].double()  # programs that returned early write nothing past T0... (none here)
    rec = rec[rec[:, 5] != 0]
    gt0, clk0, clk1, clk2, clk3, gt3, sm, nblk = (rec[:, i] for i in range(FIELDS))
    t_start = gt0.min()
    ns_per_cycle = float(((gt3 - gt0).sum() / (clk3 - clk0).sum()))
    pro, loop, epi = clk1 - clk0, clk2 - clk1, clk3 - clk2
    slope, icept = fit(nblk.tolist(), loop.tolist())
    total_slope, total_icept = fit(nblk.tolist(), (clk3 - clk0).tolist())
    out = dict(programs=int(rec.shape[0]), sms=int(sm.unique().numel()), event_us=event_us,
               span_us=float(gt3.max() - t_start) / 1e3, ghz=1 / ns_per_cycle,
               mean_blocks=float(nblk.mean()),
               prologue_cyc=float(pro.mean()), loops_cyc=float(loop.mean()), epilogue_cyc=float(epi.mean()),
               loop_cyc_per_block=slope, loop_fill_cyc=icept, program_cyc_per_block=total_slope,
               program_fixed_cyc=total_icept)
    # per SM: resident programs over time, slot hand-over gaps, idle tail
    gaps, tails, firsts, busy2, busy1 = [], [], [], 0.0, 0.0
    t_end = gt3.max()
    for s in sm.unique():
        sel = sm == s
        starts, ends = gt0[sel], gt3[sel]
        order = torch.argsort(starts)
        starts, ends = starts[order], ends[order]
        firsts.append(float(starts[0] - t_start))
        tails.append(float(t_end - ends.max()))
        events = sorted([(float(t), 1) for t in starts] + [(float(t), -1) for t in ends])
        live, last = 0, float(starts[0])
        for t, d in events:
            if live >= 1:
                busy1 += t - last
            if live >= 2:
                busy2 += t - last
            live, last = live + d, t
        # a start that is not in the SM's first wave takes the slot of the latest end before it
        ends_sorted = sorted(float(e) for e in ends)
        resident0 = int((starts <= starts[0] + 2000).sum())  # first wave: starts within 2 us of the first
        for t in starts[resident0:]:
            before = [e for e in ends_sorted if e <= float(t)]
            if before:
                gaps.append(float(t) - before[-1])
    span = float(t_end - t_start) * out["sms"]
    out.update(first_start_us=statistics.median(firsts) / 1e3, slot_gap_us=statistics.median(gaps) / 1e3 if gaps else 0,
               slot_gap_mean_us=(sum(gaps) / len(gaps) / 1e3) if gaps else 0,
               tail_idle_us_mean=sum(tails) / len(tails) / 1e3, tail_idle_us_max=max(tails) / 1e3,
               sm_busy_ge1=busy1 / span, sm_busy_ge2=busy2 / span)
    return out


ROW_SPECS = {  # name: (batch, seqlen, heads, KV heads, causal, dtype), d128
    "bf16-causal": (4, 4096, 16, 16, True, "bf16"), "fp8-causal": (4, 4096, 16, 16, True, "fp8"),
    "bf16-full": (4, 4096, 16, 16, False, "bf16"), "fp8-full": (4, 4096, 16, 16, False, "fp8"),
    "fp8-full-s1k": (16, 1024, 16, 16, False, "fp8"), "bf16-gqa-causal": (4, 4096, 16, 4, True, "bf16"),
    "fp8-gqa-causal": (4, 4096, 16, 4, True, "fp8"), "bf16-s8k-causal": (2, 8192, 16, 16, True, "bf16"),
    "fp8-s8k-causal": (2, 8192, 16, 16, True, "fp8"),
}


def main():
    trees = [pair.split("=", 1) for pair in os.environ.get("TREES", "tree=.").split(",")]
    versions = {name: load_patched(name, path) for name, path in trees}
    rounds = int(os.environ.get("ROUNDS", 5))
    env = bench.environment("cuda")
    print(json.dumps(env))
    flush = bench.l2_flush()
    results = []
    for row in os.environ.get("ROWS", ",".join(ROW_SPECS)).split(","):
        b, s, hq, hk, causal, dtype = ROW_SPECS[row]
        q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
        args, kwargs = (q, k, v), dict(causal=causal)
        if dtype == "fp8":
            q8, k8, v8, ds = bench.fp8_inputs(q, k, v)
            args, kwargs = (q8, k8, v8), dict(causal=causal, **ds)
        buf = torch.zeros(b * hq * triton.cdiv(s, 16), FIELDS, dtype=torch.int64, device="cuda")  # (>= the grid)
        runs = {name: [] for name in versions}
        with torch.no_grad():
            for name, (mod, fwd) in versions.items():  # compile, warm, check
                fwd._TIMELINE[0] = buf
                outs = [mod.flash_attn_func(*args, **kwargs) for _ in range(2)]
                fwd._TIMELINE[0] = None
            for r in range(rounds):
                for name, (mod, fwd) in versions.items():
                    fwd._TIMELINE[0] = buf
                    buf.zero_()
                    flush()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    mod.flash_attn_func(*args, **kwargs)
                    end.record()
                    torch.cuda.synchronize()
                    fwd._TIMELINE[0] = None
                    runs[name].append(analyse(buf.cpu(), start.elapsed_time(end) * 1e3))
        del outs
        for name in versions:
            rs = runs[name]
            med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            med.update(row=row, tree=name, span_kcyc_rounds=[r["span_us"] * r["ghz"] for r in rs])
            med["span_kcyc"] = statistics.median(med["span_kcyc_rounds"])
            results.append(med)
            print(f"{row:16s} {name:8s} span {med['span_us']:7.1f} us = {med['span_kcyc']:7.1f} kcycles at "
                  f"{med['ghz']:.2f} GHz; {med['programs']:.0f} programs, {med['mean_blocks']:.1f} blocks each")
            print(f"    cycles: prologue {med['prologue_cyc']:.0f}  loops {med['loops_cyc']:.0f} "
                  f"(fit {med['loop_cyc_per_block']:.0f}/block + {med['loop_fill_cyc']:.0f})  epilogue "
                  f"{med['epilogue_cyc']:.0f};  program fit {med['program_cyc_per_block']:.0f}/block + "
                  f"{med['program_fixed_cyc']:.0f}")
            print(f"    timeline: slot gap median {med['slot_gap_us']:.2f} mean {med['slot_gap_mean_us']:.2f} us, tail "
                  f"idle mean {med['tail_idle_us_mean']:.1f} max {med['tail_idle_us_max']:.1f} us, SM busy >=1 "
                  f"{med['sm_busy_ge1']:.3f} >=2 {med['sm_busy_ge2']:.3f}", flush=True)
        if len(versions) > 1:
            base = list(versions)[0]
            for name in list(versions)[1:]:
                spans = {m["tree"]: m["span_kcyc_rounds"] for m in results if m["row"] == row}
                p_med, p_min, p_max = paired_change_pct(spans[name], spans[base])
                print(f"    {name} vs {base}: span in cycles {p_med:+.2f} % per round ({p_min:+.2f}..{p_max:+.2f})")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fwd_timeline.json"), "w") as f:
            for line in [env] + results:
                f.write(json.dumps(line) + "\n")



if __name__ == "__main__":
    main()
