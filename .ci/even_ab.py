"""GPU experiment (issues 17, 18): EVEN_QK on ("whole blocks": tables.EVEN_QK_FAMILIES lists the arch) or off
("bounded": every load keeps its row / key bounds).  With it a dense launch whose lengths are whole multiples of its
tiles loads its masked blocks (the causal diagonal, window edges) without bounds.  The forward and forward+backward
of the short causal rows issue 17 names, with FlexAttention and SDPA flash (FA2) in the same rounds
(.ci/family_ab.py); FP8=1 (env) adds fa_amd's FP8 forward (FA3-style inputs, issue 18's rows) on and off, and
the bf16 forward of the same rows.  ROUNDS (env) sets the rounds.

    python .ci/even_ab.py      # on the GPU machine
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import family_ab  # noqa: E402
from fa_amd.bench import Shape  # noqa: E402

ON, OFF = "whole blocks", "bounded"
ROWS = [(Shape(b, s, h, kv, d, causal), direction) for b, s, h, kv, d, causal in (
    (32, 512, 16, 16, 128, True), (16, 1024, 16, 16, 128, True), (32, 512, 16, 16, 128, False),
    (4, 4096, 16, 16, 128, True), (2, 4096, 16, 4, 128, True), (32, 512, 32, 32, 64, True),
    (16, 1024, 32, 32, 64, True), (32, 512, 8, 8, 256, True), (16, 1024, 21, 21, 96, True))
    for direction in ("fwd", "fwd+bwd")]
FP8_ROWS = [(Shape(b, s, h, kv, 128, causal), "fwd") for b, s, h, kv, causal in (
    (4, 4096, 16, 16, True), (4, 4096, 16, 4, True), (2, 8192, 16, 4, True), (4, 4096, 16, 4, False))]
if os.environ.get("ROWS"):  # "b,s,hq,hk,d,c,direction;..." (c: 1 causal; direction: fwd or fwd+bwd)
    ROWS = [(Shape(*(int(x) for x in item.split(",")[:5]), item.split(",")[5] == "1"), item.split(",")[6])
            for item in os.environ["ROWS"].split(";")]
if family_ab.SMOKE:
    ROWS = [(Shape(1, 128, 2, 2, 64, True), "fwd+bwd"), (Shape(1, 64, 4, 2, 64, False), "fwd")]
    FP8_ROWS = []

if __name__ == "__main__":
    if os.environ.get("ONLY_FP8") != "1":
        family_ab.run("EVEN_QK_FAMILIES", ON, OFF, ROWS, peers=("flex", "sdpa_flash"))
    if os.environ.get("FP8") == "1" or os.environ.get("ONLY_FP8") == "1":
        family_ab.run("EVEN_QK_FAMILIES", ON, OFF, FP8_ROWS, peers=(), maker="fa_amd_fp8")
        family_ab.run("EVEN_QK_FAMILIES", ON, OFF, FP8_ROWS, peers=())
