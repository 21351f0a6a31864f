#!/usr/bin/env python
"""Counts for issue 16's closing note, from the reliability suites themselves.

Runs the three hostile-input suites with FA_AMD_RELIABILITY_LOG set, so every check that passes
records its case (tests/reliability_log.py: "error" = a clear error, "right" = the right result,
"safe" = unchecked invalid values (FA_AMD_CHECK_VARLEN=0) ran without a crash or an out-of-bounds
access), and reads pytest's outcomes from a JUnit XML report:

* crashes: failed tests whose report says a process died (the crash cases run in subprocesses);
* silent wrong results: other failed tests, plus the strict xfails (known open cases, each naming
  the code that must change; they turn into failures once fixed, and the marker goes);
* inputs tried: every recorded case, plus one per failed or xfailed test.

    python .ci/reliability_counts.py            # print the tables (CPU: ~3 min with -n 2)
    python .ci/reliability_counts.py --write    # and put them into docs/RELIABILITY.md

Exit status 1 when a test failed.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITES = ("tests/test_hostile_inputs.py", "tests/kernels/test_bad_input.py", "tests/test_recipes_reliability.py")
DOC = REPO / "docs" / "RELIABILITY.md"
BEGIN, END = "<!-- reliability_counts: begin -->", "<!-- reliability_counts: end -->"
CRASH_WORDS = re.compile(r"died|Segmentation|core dumped|scenario driver exited|exit code -\d", re.I)


def run_suites(workers: int, log: Path, junit: Path) -> int:
    env = dict(os.environ, FA_AMD_RELIABILITY_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", *SUITES, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit2"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def outcomes(junit: Path) -> dict:
    """{test node id: (outcome, message)}, outcome one of passed, failed, skipped, xfailed."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        node = f"{path}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "") + (child.text or "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), child.get("message") or ""
        result[node] = (outcome, message)
    return result


def suite_of(node: str) -> str:
    return node.split("::")[0]


def function_of(node: str) -> str:
    return node.split("::")[-1].split("[")[0]


def tally(records: list, results: dict) -> tuple[list, list]:
    """(rows per suite + total, rows per test function)."""
    per_suite = collections.defaultdict(collections.Counter)
    per_function = collections.defaultdict(collections.Counter)
    for row in records:
        node = row["test"]
        for key in (row["kind"], "tried") + (("isolated",) if row["isolated"] else ()):
            per_suite[suite_of(node)][key] += 1
            per_function[(suite_of(node), function_of(node))][key] += 1
    for node, (outcome, message) in results.items():
        c = per_suite[suite_of(node)]
        c[outcome] += 1
        if outcome == "failed":  # (an input whose check failed records nothing: counted here)
            c["crash" if CRASH_WORDS.search(message) else "wrong"] += 1
            c["tried"] += 1
        if outcome == "xfailed":
            c["wrong"] += 1
            c["tried"] += 1
    suites = [(s, per_suite[s]) for s in SUITES]
    total = collections.Counter()
    for _, c in suites:
        total.update(c)
    return suites + [("total", total)], sorted(per_function.items())


def markdown(suites: list, functions: list, results: dict) -> str:
    lines = ["| suite | tests passed | inputs tried | clear error | right result | memory-safe, checks off | "
             "run in a subprocess | crashes | silent wrong results | failed / xfailed / skipped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, c in suites:
        label = f"`{name}`" if name != "total" else "**total**"
        lines.append(f"| {label} | {c['passed']} | {c['tried']} | {c['error']} | {c['right']} | {c['safe']} | "
                     f"{c['isolated']} | {c['crash']} | {c['wrong']} | {c['failed']} / {c['xfailed']} / "
                     f"{c['skipped']} |")
    known = [node for node, (outcome, _) in results.items() if outcome == "xfailed"]
    if known:
        lines += ["", "Silent wrong results still open (strict xfails, each naming the code to change):", ""]
        lines += [f"- `{node}`" for node in sorted(known)]
    skipped = [f"`{node}`: {msg}" for node, (outcome, msg) in sorted(results.items()) if outcome == "skipped"]
    if skipped:
        lines += ["", "Skipped here:", ""] + [f"- {s}" for s in skipped]
    lines += ["", "<details><summary>Cases per test function</summary>", "",
              "| suite | test | clear error | right result | memory-safe | in a subprocess |",
              "|---|---|---:|---:|---:|---:|"]
    for (suite, function), c in functions:
        lines.append(f"| `{Path(suite).name}` | `{function}` | {c['error']} | {c['right']} | {c['safe']} | "
                     f"{c['isolated']} |")
    lines += ["", "</details>"]
    return "\n".join(lines)


def write_doc(table: str) -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table + "\n" + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    parser.add_argument("--write", action="store_true", help=f"update the table in {DOC.relative_to(REPO)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log, junit = Path(tmp) / "cases.jsonl", Path(tmp) / "junit.xml"
        log.touch()
        code = run_suites(args.workers, log, junit)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        results = outcomes(junit)
    suites, functions = tally(records, results)
    table = markdown(suites, functions, results)
    print(table)
    if args.write:
        write_doc(table)
    return 1 if code not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
