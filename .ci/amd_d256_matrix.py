#!/usr/bin/env python
"""The head-dim-256 backward on AMD under every supported Triton (AOT, CPU; issue 17): VGPRs, AGPRs,
scratch, occupancy and LDS of

  * "table": the d256 backward launches each target's table rows make (dkdv, dq, dkdv_atomic,
    preprocess), as `fa-amd compile --full --head-dims 256` builds them;
  * "split": the dK/dV kernel with dK and dV in separate programs (DKDV_SPLIT=1) at the tiles
    `fa-amd tune` tries for d256 (fa_amd.tuning.candidates), on the table row's options, by route:
    "separate" (dQ in its own launch, the table's dq row), "fused" (the dQ programs, at the table's
    dq tile, in the dK/dV launch: the sm90 route; AMD does not fuse today) and "atomic" (dQ summed
    with fp32 atomics, deterministic=False on AMD).

Each Triton runs in its venv (.ci/aot_matrix.py makes them); results are merged into
OUT/d256-triton-X.json (jobs already there are skipped, so a run can be resumed or widened).

    python .ci/amd_d256_matrix.py --venv-dir /work/venvs --out /tmp/d256 -j 1
    python .ci/amd_d256_matrix.py --sets split --tiles 16x64 --routes fused --variants all --out /tmp/d256
    python .ci/amd_d256_matrix.py --from-json /tmp/d256      # the markdown tables
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.2.0", "3.3.1", "3.4.0", "3.5.1", "3.6.0")
TARGETS = ("gfx942", "gfx950", "gfx90a")
TABLE_KERNELS = ("dkdv", "dq", "dkdv_atomic", "preprocess")
# DKDV_SPLIT tiles of fa_amd.tuning.candidates at d256 (16x32: the table rows' own tile)
SPLIT_TILES = ("16x32", "16x64", "16x128", "32x64")
ROUTES = {"separate": "dkdv", "fused": "dkdv_fused", "atomic": "dkdv_atomic"}
HEAD_DIM = 256


def _aot_matrix():
    spec = importlib.util.spec_from_file_location("aot_matrix", ROOT / ".ci" / "aot_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- inside one venv

def _jobs(args):
    """[(tag, CompileJob)]: tag = "table" or "split <route> <tile>"."""
    from fa_amd.aot import CompileJob, _is_causal, builds, default_config
    from fa_amd.aot_launches import _arch_of
    from fa_amd.tuning.candidates import _strip_for

    out = []
    for target in args.arch:
        for dtype in args.dtypes:
            for variant in args.variants:
                if "table" in args.sets:
                    for kernel in TABLE_KERNELS:
                        if kernel == "preprocess" and variant != "plain":
                            continue
                        if builds(target, kernel, HEAD_DIM, _is_causal(variant), variant):
                            out.append(("table", CompileJob(target, kernel, HEAD_DIM, dtype, variant)))
                if "split" in args.sets:
                    for route in args.routes:
                        kernel = ROUTES[route]
                        table_kernel = "dkdv_atomic" if route == "atomic" else "dkdv"
                        for tile in args.tiles:
                            bm, bn = map(int, tile.split("x"))
                            base = default_config(target, table_kernel, HEAD_DIM, _is_causal(variant))
                            cfg = _strip_for(_arch_of(target), dict(base, BLOCK_M=bm, BLOCK_N=bn, DKDV_SPLIT=1))
                            out.append((f"split {route} {tile}",
                                        CompileJob(target, kernel, HEAD_DIM, dtype, variant, config=cfg)))
    return out


def _key(tag, job) -> str:
    return json.dumps([tag, job.target, job.kernel, job.dtype, job.variant, job.config], sort_keys=True)


def inner(args) -> int:
    import triton

    from fa_amd.aot import probe_targets, run_jobs

    path = Path(args.out) / f"d256-triton-{triton.__version__}.json"
    payload = json.loads(path.read_text()) if path.exists() else {"triton": triton.__version__, "entries": []}
    done = {e["key"] for e in payload["entries"]}
    unsupported = probe_targets(args.arch)
    payload["unsupported"] = dict(payload.get("unsupported", {}), **unsupported)
    args.arch = [t for t in args.arch if t not in unsupported]
    todo = [(tag, job) for tag, job in _jobs(args) if _key(tag, job) not in done]
    print(f"triton {triton.__version__}: {len(todo)} jobs ({len(done)} already in {path}); "
          f"unsupported: {unsupported or 'none'}", flush=True)
    start = time.perf_counter()
    for i in range(0, len(todo), 8):  # saved every 8 jobs: a cut-off run keeps what it built
        batch = todo[i:i + 8]
        results = run_jobs([job for _, job in batch], args.jobs)
        for (tag, job), r in zip(batch, results):
            payload["entries"].append({"key": _key(tag, job), "tag": tag, "dtype": job.dtype, "result": asdict(r)})
            bad = r.error or (f"scratch {r.scratch_bytes} B" if r.scratch_bytes else None)
            if bad:
                print(f"  {tag} {r.target} {r.kernel} {r.variant}: {bad}", flush=True)
        path.write_text(json.dumps(payload, indent=1))
    print(f"triton {triton.__version__}: {len(todo)} jobs in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


# --------------------------------------------------------------------------- the parent

def run_versions(args) -> int:
    matrix = _aot_matrix()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    passed = ["--arch", *args.arch, "--sets", *args.sets, "--dtypes", *args.dtypes, "--variants", *args.variants,
              "--tiles", *args.tiles, "--routes", *args.routes, "-j", str(args.jobs),
              "--out", str(Path(args.out).resolve())]
    for version in args.versions:
        python = matrix.venv_python(version, Path(args.venv_dir))
        print(f"== triton {version}", flush=True)
        subprocess.run([python, str(Path(__file__).resolve()), "--_inner", *passed], cwd=ROOT, env=env, check=True)
    return 0


def _load(folder):
    paths = sorted(Path(folder).glob("d256-triton-*.json"),
                   key=lambda p: [int(x) for x in p.stem.split("-")[-1].split(".") if x.isdigit()])
    return [json.loads(p.read_text()) for p in paths]


def _cell(r) -> str:
    if r["error"]:
        return "ERROR"
    lds = r["lds_bytes"] // 1024 if r["lds_bytes"] is not None else "-"
    return f"{r['vgprs']}+{r['agprs']} / {r['scratch_bytes']} / {r['occupancy']} / {lds}"


def report(folder) -> str:
    """Markdown: per target, one table of triton version x launch; cells per dtype and variant."""
    payloads = _load(folder)
    lines = []
    for target in TARGETS:
        entries = [(p["triton"], e) for p in payloads for e in p["entries"] if e["result"]["target"] == target]
        if not entries:
            continue
        lines += [f"\n### {target}\n", "VGPRs+AGPRs / scratch B / occupancy / LDS KB; "
                  "variants plain, causal, all\n",
                  "| triton | launch | tiles | dtype | plain | causal | all |", "|---|---|---|---|---|---|---|"]
        rows = {}
        for version, e in entries:
            r = e["result"]
            c = r["config"]
            what = ("table " + r["kernel"]) if e["tag"] == "table" else e["tag"]
            tiles = (f"{c.get('BLOCK_M', '-')}x{c.get('BLOCK_N', '-')}/w{c.get('num_warps', 4)}"
                     f"{'/split' if c.get('DKDV_SPLIT') else ''}")
            if r["kernel"] == "dkdv_fused":
                tiles += f" + dQ {r['constexprs'].get('DQ_BLOCK_M')}x{r['constexprs'].get('DQ_BLOCK_N')}"
            rows.setdefault((version, what, tiles, e["dtype"]), {})[r["variant"].split("-")[-1]] = _cell(r)
        for (version, what, tiles, dtype), cells in rows.items():
            lines.append(f"| {version} | {what} | {tiles} | {dtype} | {cells.get('plain', '')} "
                         f"| {cells.get('causal', '')} | {cells.get('all', '')} |")
    findings = []
    for p in payloads:
        for target, why in p.get("unsupported", {}).items():
            findings.append(f"- triton {p['triton']}: {target} not built: {why[:200]}")
        for e in p["entries"]:
            r = e["result"]
            if r["error"] or r["scratch_bytes"]:
                what = r["error"] or f"scratch {r['scratch_bytes']} B"
                findings.append(f"- triton {p['triton']} {r['target']} {e['tag']} {r['kernel']} {r['variant']} "
                                f"{r['config'].get('BLOCK_M')}x{r['config'].get('BLOCK_N')}: {what}")
    total = sum(len(p["entries"]) for p in payloads)
    lines += [f"\n{total} builds; findings (errors, scratch):\n"] + (findings or ["- none"])
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    parser.add_argument("--arch", nargs="+", default=list(TARGETS))
    parser.add_argument("--sets", nargs="+", choices=("table", "split"), default=["table", "split"])
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"), default=["bf16", "fp16"])
    parser.add_argument("--variants", nargs="+", choices=("plain", "causal", "all"), default=["plain", "causal", "all"])
    parser.add_argument("--tiles", nargs="+", default=list(SPLIT_TILES), help="DKDV_SPLIT tiles, BLOCK_MxBLOCK_N")
    parser.add_argument("--routes", nargs="+", choices=tuple(ROUTES), default=list(ROUTES))
    parser.add_argument("-j", "--jobs", type=int, default=1)
    parser.add_argument("--out", default="/tmp/fa_amd_d256")
    parser.add_argument("--venv-dir", default=os.environ.get("FA_AMD_VENV_DIR", str(Path.home() / ".cache" / "fa_amd"
                                                                                     / "venvs")))
    parser.add_argument("--from-json", metavar="DIR", help="print the tables of earlier runs in DIR")
    parser.add_argument("--_inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.from_json:
        print(report(args.from_json))
        return 0
    if args._inner:
        return inner(args)
    return run_versions(args)


if __name__ == "__main__":
    sys.exit(main())
