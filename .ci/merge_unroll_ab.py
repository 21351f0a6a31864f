"""GPU experiment (issue 14, the batch-1 decode rows): how many split partials the fused merge of the decode kernel
loads per step (tables.DECODE_MERGE_STEP: SLOTS rows x splits per step, at most MAX_SPLITS splits; with one query
token of GQA 32/8, 4 rows), timed as CUDA graph replays of the tabled launch (.ci/decode_ab.py stage "kernel": read
flush, interleaved rounds, SDPA in the same rounds).  Each setting runs in its own process, so compare each row's
fa_amd figure against the SDPA figure of the same process.  (Until TUNING_NOTES v31 the knob was
kernels/decode.MERGE_UNROLL, the two-pass merge's splits per step over all 16 rows of the tile.)

    ROWS=1x2048,1x8192,1x32768 ROUNDS=5 STEPS="32/8 64/16 8/2" python .ci/merge_unroll_ab.py
"""
import importlib.util
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(step: str):
    from fa_amd.tuning import tables
    slots, max_splits = (int(x) for x in step.split("/"))
    tables.DECODE_MERGE_STEP["default"] = {"SLOTS": slots, "MAX_SPLITS": max_splits}
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a == "--dry-run"]
    spec = importlib.util.spec_from_file_location("decode_ab", os.path.join(HERE, "decode_ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    ab.KERNEL_TILES = [None]
    ab.KERNEL_SPLITS = {b: [0] for b in (1, 8, 64)}
    for row in ab.rows():
        ab.kernel_row(row)


def main():
    if os.environ.get("MERGE_STEP_CHILD"):
        child(os.environ["MERGE_STEP_CHILD"])
        return
    for step in os.environ.get("STEPS", "32/8 64/16 8/2").split():
        print(f"# DECODE_MERGE_STEP SLOTS/MAX_SPLITS={step}", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env=dict(os.environ, MERGE_STEP_CHILD=step,
                       PYTHONPATH=os.path.dirname(HERE)), check=False)


if __name__ == "__main__":
    main()
