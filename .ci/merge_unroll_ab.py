"""GPU experiment (issue 14, the batch-1 decode rows): how many split partials the fused merge of the decode kernel
loads per step (kernels/decode.MERGE_UNROLL, a module constexpr), timed as CUDA graph replays of the tabled launch
(.ci/decode_ab.py stage "kernel": read flush, interleaved rounds, SDPA in the same rounds).  Each value runs in its
own process (the constexpr is read when the kernel first compiles), so compare each row's fa_amd figure against the
SDPA figure of the same process.

    ROWS=1x2048,1x8192,1x32768 ROUNDS=5 UNROLLS="2 8" python .ci/merge_unroll_ab.py
"""
import importlib.util
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(unroll: int):
    import triton.language as tl

    from fa_amd.kernels import decode
    decode.MERGE_UNROLL = tl.constexpr(unroll)
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a == "--dry-run"]
    spec = importlib.util.spec_from_file_location("decode_ab", os.path.join(HERE, "decode_ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    ab.KERNEL_TILES = [None]
    ab.KERNEL_SPLITS = {b: [0] for b in (1, 8, 64)}
    for row in ab.rows():
        ab.kernel_row(row)


def main():
    if os.environ.get("MERGE_UNROLL_CHILD"):
        child(int(os.environ["MERGE_UNROLL_CHILD"]))
        return
    for unroll in os.environ.get("UNROLLS", "2 8 4 16").split():
        print(f"# MERGE_UNROLL={unroll}", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env=dict(os.environ, MERGE_UNROLL_CHILD=unroll,
                       PYTHONPATH=os.path.dirname(HERE)), check=False)


if __name__ == "__main__":
    main()
