"""The hostile-input tally of the reliability suites (issue 16), read by .ci/reliability_counts.py.

Each check of a hostile input calls ``record(kind, case)`` once it has passed:

* ``"error"``: a bad input got a clear error (a ValueError/TypeError/RuntimeError naming the user's
  argument, or a recipe's one-line message and non-zero exit);
* ``"right"``: a legal edge case (or a once-crashing input) gave the right result;
* ``"safe"``: invalid values the user asked not to check (FA_AMD_CHECK_VARLEN=0) ran without a crash
  and without touching memory outside the tensors.

``isolated=True`` marks a case run in a subprocess (one that once crashed, or a recipe run).  Without
FA_AMD_RELIABILITY_LOG set (a normal test run) ``record`` does nothing.
"""
from __future__ import annotations

import json
import os

LOG_ENV = "FA_AMD_RELIABILITY_LOG"
KINDS = ("error", "right", "safe")


def record(kind: str, case: str, isolated: bool = False) -> None:
    assert kind in KINDS, kind
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    line = json.dumps({"test": test, "kind": kind, "case": case, "isolated": isolated})
    with open(path, "a", encoding="utf-8") as f:  # one short append per line: xdist workers do not interleave
        f.write(line + "\n")
