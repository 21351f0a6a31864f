"""GPU experiment (issue 17, the d256 / d192 backward): split dK/dV programs (DKDV_SPLIT) past their sequence
return early ("early return": tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES lists the arch) or run with empty query
ranges ("empty ranges": the form that keeps AMD's split builds free of scratch under triton 3.4 / 3.5).  Dense
rows never have such a block, so any difference is code generation.  No peers (.ci/family_ab.py); ROUNDS (env)
sets the rounds.

    python .ci/split_return_ab.py      # on the GPU machine
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import family_ab  # noqa: E402
from fa_amd.bench import Shape  # noqa: E402

ROWS = [(Shape(b, s, 2048 // d, 2048 // d, d, causal), "fwd+bwd") for b, s, d, causal in (
    (16, 1024, 256, False), (4, 4096, 256, False), (1, 16384, 256, False), (4, 4096, 256, True),
    (4, 4096, 192, False), (1, 16384, 192, False))]
if family_ab.SMOKE:
    ROWS = [(Shape(1, 37, 2, 1, 192, False), "fwd+bwd")]

if __name__ == "__main__":
    family_ab.run("DKDV_SPLIT_EARLY_RETURN_FAMILIES", "early return", "empty ranges", ROWS, peers=())
