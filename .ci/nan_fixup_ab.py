"""GPU experiment (issue 17, the short causal rows): the V NaN rule of masked forwards through relaxed marks
and a fix-up launch after the forward ("fixup": tables.FWD_NAN_FIXUP_FAMILIES lists the arch), or through the
pass over V before the forward ("pass": the arch left out of it); FlexAttention in the same interleaved rounds
(.ci/family_ab.py).  ROUNDS (env) sets the rounds.

    python .ci/nan_fixup_ab.py      # on the GPU machine
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import family_ab  # noqa: E402
from fa_amd.bench import Shape  # noqa: E402

SHAPES = [(b, s, d, direction) for direction in ("fwd", "fwd+bwd") for d in (64, 128) for b, s in ((32, 512), (16, 1024))] \
    + [(b, s, d, direction) for direction in ("fwd", "fwd+bwd") for d in (64, 128, 256) for b, s in ((4, 4096), (1, 16384))] \
    + [(16, 1024, d, "fwd") for d in (96, 192, 256)]
if family_ab.SMOKE:
    SHAPES = [(1, 37, 64, "fwd"), (1, 37, 64, "fwd+bwd")]
ROWS = [(Shape(b, s, 2048 // d if not family_ab.SMOKE else 2, 2048 // d if not family_ab.SMOKE else 1, d, True),
         direction) for b, s, d, direction in SHAPES]

if __name__ == "__main__":
    family_ab.run("FWD_NAN_FIXUP_FAMILIES", "fixup", "pass", ROWS)
