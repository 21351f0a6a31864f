"""GPU experiment (issue 17, the short d64 rows): a backward whose dQ has its own launch (sm90 d64) runs it
first and computes delta = rowsum(dO * O) in the dQ programs ("dq first": tables.BWD_DELTA_IN_DQ_FAMILIES lists
the arch), or runs the delta preprocess launch before the dK/dV and dQ launches ("preprocess"); FlexAttention
in the same interleaved rounds (.ci/family_ab.py).  ROUNDS (env) sets the rounds.

    python .ci/bwd_delta_ab.py      # on the GPU machine
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import family_ab  # noqa: E402
from fa_amd.bench import Shape  # noqa: E402

ROWS = [(Shape(b, s, 32, 32, 64, causal), "fwd+bwd") for b, s, causal in (
    (32, 512, False), (32, 512, True), (16, 1024, False), (16, 1024, True), (4, 4096, True), (1, 16384, False))]
if family_ab.SMOKE:
    ROWS = [(Shape(1, 37, 2, 1, 64, True), "fwd+bwd")]

if __name__ == "__main__":
    family_ab.run("BWD_DELTA_IN_DQ_FAMILIES", "dq first", "preprocess", ROWS)
