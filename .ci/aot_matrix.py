#!/usr/bin/env python
"""The AOT compile check (`fa-amd compile`, fa_amd/aot.py) under every Triton fa_amd supports.

Each version runs in its own virtual environment (`--system-site-packages`, so torch and this
checkout come from the running interpreter; `pip install --no-deps triton==X` shadows the
system triton), one version after the other, and the version x target table is printed
(docs/AOT.md shows it).  No GPU, no ROCm, no linker needed.

    python .ci/aot_matrix.py                           # every version, full sweep, AMD targets
    python .ci/aot_matrix.py --versions 3.2.0 --ci     # what .ci/run runs: the CI subset under 3.2
    python .ci/aot_matrix.py --from-json DIR           # the tables of earlier runs

Exit status: non-zero when any version has a compile error or AMD scratch outside
fa_amd.aot.KNOWN_SCRATCH.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The Tritons of ROCm PyTorch 2.6 .. 2.11 (3.2 .. 3.6); "installed" is the running interpreter's.
VERSIONS = ("3.2.0", "3.3.1", "3.4.0", "3.5.1", "3.6.0", "installed")
AMD_TARGETS = ("gfx908", "gfx90a", "gfx942", "gfx950", "gfx1100")


def venv_python(version: str, venv_dir: Path) -> str:
    """The interpreter of a venv whose triton is `version` (created on first use; pip's cache is reused)."""
    if version == "installed":
        return sys.executable
    venv = venv_dir / f"triton-{version}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import triton; print(triton.__version__)"]
    if python.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == version:
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    f"triton=={version}"], check=True)
    got = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    if got != version:
        raise SystemExit(f"venv {venv} imports triton {got}, not {version}")
    return str(python)


def run_version(version: str, args) -> Path:
    python = venv_python(version, Path(args.venv_dir))
    if version == "installed":
        version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    out = Path(args.out) / f"aot-triton-{version}.json"
    cmd = [python, "-m", "fa_amd.aot", "--arch", *args.arch, "-j", str(args.jobs), "--json", str(out)]
    cmd += ["--full"] if not args.ci else []
    cmd += ["--kernels", *args.kernels] if args.kernels else []
    cmd += ["--dtypes", *args.dtypes] if args.dtypes else []
    cmd += ["--variants", *args.variants] if args.variants else []
    cmd += ["--head-dims", *map(str, args.head_dims)] if args.head_dims else []
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    print(f"== triton {version}: {' '.join(cmd[1:])}", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith(("note:", "FAIL", "triton"))
            or "variants compiled" in line]
    print("\n".join(tail[-40:]), flush=True)
    print(f"== triton {version}: exit {res.returncode}, {time.perf_counter() - start:.0f} s", flush=True)
    if not out.exists():
        raise SystemExit(f"triton {version}: no results ({res.stdout[-2000:]}{res.stderr[-2000:]})")
    return out


def matrix_table(paths, targets) -> tuple:
    """(markdown table, whether everything passed): one line per (triton, target), worst case over its variants."""
    sys.path.insert(0, str(ROOT))
    from fa_amd.aot import CompileResult, known_scratch

    lines = ["| triton | target | variants built | errors | max VGPRs | max scratch B | spilling variants "
             "| min occupancy | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for path in paths:
        payload = json.loads(Path(path).read_text())
        results = [CompileResult(**r) for r in payload["results"]]
        for target in targets:
            rows = [r for r in results if r.target == target]
            if target not in payload["targets"]:
                lines.append(f"| {payload['triton']} | {target} | not supported by this triton | | | | | | |")
                continue
            built = [r for r in rows if r.error is None]
            spills = [r for r in built if r.scratch_bytes]
            ok &= not any(r.failed for r in rows)
            vgprs = max((r.vgprs for r in built if r.vgprs is not None), default=None)
            occ = min((r.occupancy for r in built if r.occupancy is not None), default=None)
            known = sum(1 for r in spills if known_scratch(r))
            lines.append(f"| {payload['triton']} | {target} | {len(built)} / {len(rows)} | {len(rows) - len(built)} "
                         f"| {vgprs} | {max((r.scratch_bytes for r in spills), default=0)} "
                         f"| {len(spills)}{f' ({known} known)' if known else ''} | {occ} "
                         f"| {payload['wall_seconds']:.0f} |")
    return "\n".join(lines), ok


def kernel_table(paths, targets, kernels) -> str:
    """One line per (triton, target): per kernel, the variants built, max VGPRs, max scratch B and min
    occupancy (docs/AOT.md's decode table)."""
    sys.path.insert(0, str(ROOT))
    from fa_amd.aot import CompileResult

    head = " | ".join(f"{k}: built, VGPRs, scratch B, occupancy" for k in kernels)
    lines = [f"| triton | target | {head} |", "|---|---|" + "---|" * len(kernels)]
    for path in paths:
        payload = json.loads(Path(path).read_text())
        results = [CompileResult(**r) for r in payload["results"]]
        for target in targets:
            if target not in payload["targets"]:
                continue
            cells = []
            for kernel in kernels:
                rows = [r for r in results if (r.target, r.kernel) == (target, kernel)]
                built = [r for r in rows if r.error is None]
                if not rows:
                    cells.append("-")
                    continue
                vgprs = max((r.vgprs for r in built if r.vgprs is not None), default=None)
                occ = min((r.occupancy for r in built if r.occupancy is not None), default=None)
                scratch = max((r.scratch_bytes or 0 for r in built), default=0)
                cells.append(f"{len(built)}/{len(rows)}, {vgprs}, {scratch}, {occ}")
            lines.append(f"| {payload['triton']} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), help="triton versions ('installed': this one)")
    parser.add_argument("--arch", nargs="+", default=list(AMD_TARGETS), help="targets (default: the AMD ones)")
    parser.add_argument("--kernels", nargs="+", help="kernels (default: fa-amd compile's)")
    parser.add_argument("--ci", action="store_true", help="the CI subset (heaviest variant per kernel), not --full")
    parser.add_argument("--dtypes", nargs="+", help="with the full sweep: only these dtypes (default: all)")
    parser.add_argument("--variants", nargs="+", help="with the full sweep: only these feature variants (default: all)")
    parser.add_argument("--head-dims", nargs="+", type=int, help="with the full sweep: only these head dims")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "fa_amd_aot_matrix"),
                        help="folder for the per-version JSON files")
    parser.add_argument("--venv-dir", default=os.environ.get("FA_AMD_VENV_DIR", str(Path.home() / ".cache" / "fa_amd"
                                                                                     / "venvs")))
    parser.add_argument("--from-json", metavar="DIR", help="print the table of earlier runs' JSON files in DIR")
    args = parser.parse_args(argv)
    if args.from_json:
        paths = sorted(Path(args.from_json).glob("aot-triton-*.json"),
                       key=lambda p: [int(x) if x.isdigit() else 0 for x in p.stem.split("-")[-1].split(".")])
    else:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        paths = [run_version(v, args) for v in args.versions]
    table, ok = matrix_table(paths, args.arch)
    print("\n" + table)
    from fa_amd.aot import DECODE_KERNELS

    print("\nThe decode kernels:\n")
    print(kernel_table(paths, args.arch, DECODE_KERNELS))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
