"""AOT compile check of the decode kernels (fa_amd/kernels/decode.py) at their table configs, no GPU
needed: VGPRs / scratch / occupancy for AMD targets, registers / stack for sm80/sm90.

    python .ci/decode_aot.py                         # every target, d64/80/128/256, plain / all / wide
    python .ci/decode_aot.py --targets gfx942 sm90 --json out.json

Exits non-zero on a compile error or on scratch (spills) for an AMD target.  Until fa_amd/aot.py
builds the decode kernels itself (it owns KERNELS / _KERNEL_FN / _POINTER_DTYPE), this is their check.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)  # real compiles (the kernels must be @triton.jit functions)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = {"gfx908": ("hip", "gfx908", 64), "gfx90a": ("hip", "gfx90a", 64), "gfx942": ("hip", "gfx942", 64),
           "gfx950": ("hip", "gfx950", 64), "gfx1100": ("hip", "gfx1100", 32), "sm80": ("cuda", 80, 32),
           "sm90": ("cuda", 90, 32)}
HEAD_DIMS = (64, 80, 128, 256)
KERNELS = {"decode": "decode_kernel", "append": "kv_append_kernel", "merge": "split_merge_kernel"}
_I32_POINTERS = ("CuSeqlensQ", "CacheSeqlens", "CuSeqlensK", "SeqUsedK", "LeftPad", "BatchIdx", "BlockTable")
_FP32_POINTERS = ("Lse", "OutPart", "LsePart", "Alibi", "Sinks")
_IO_POINTERS = ("Q", "K", "V", "Out", "KNew", "VNew", "KCache", "VCache", "Cos", "Sin")
_FLOATS = ("qk_scale_log2", "softcap_div", "softcap_log2")
_NOT_DIVISIBLE = ("stride_ab", "stride_kmb", "stride_btb", "win_left", "win_right", "GROUP", "rot_half",
                  "seqlen_ro", "cache_seqlens_int", "seqlen_new", "page_size", "n_splits")
_BASE = dict(Q_VARLEN=False, K_LENS=1, K_PACKED=False, HAS_SEQUSED=False, HAS_LEFTPAD=False, HAS_BATCH_IDX=False,
             PAGED=False, HAS_KEY_MASK=False, ROTARY=False, ROTARY_INTERLEAVED=False, ROTARY_PER_TOKEN=False,
             SPLIT=True, IS_SOFTCAP=False, HAS_ALIBI=False, HAS_LEFT=False, HAS_RIGHT=False,
             INPUT_PRECISION="ieee", SEQLENS_TENSOR=True, HAS_SINKS=False)
VARIANTS = {
    "plain": dict(_BASE),
    # every feature the paged decode path can meet at once (cache_batch_idx excludes paging)
    "all": dict(_BASE, PAGED=True, HAS_LEFTPAD=True, HAS_KEY_MASK=True, ROTARY=True, ROTARY_PER_TOKEN=True,
                IS_SOFTCAP=True, HAS_ALIBI=True, HAS_LEFT=True, HAS_RIGHT=True, HAS_SINKS=True),
    # ... and the unsplit epilogue with sinks
    "dense_all": dict(_BASE, HAS_BATCH_IDX=True, HAS_LEFTPAD=True, ROTARY=True, ROTARY_INTERLEAVED=True,
                      IS_SOFTCAP=True, HAS_ALIBI=True, HAS_LEFT=True, HAS_RIGHT=True, Q_VARLEN=True, SPLIT=False,
                      HAS_SINKS=True),
    # chunked / paged prefill on a cache: the "wide" tile
    "wide": dict(_BASE, PAGED=True, HAS_RIGHT=True, K_LENS=2),
}


def _config(target: str, kernel: str, d_pad: int, wide: bool):
    from fa_amd.arch import Arch
    from fa_amd.tuning import get_decode_config

    backend = TARGETS[target][0]
    arch = Arch(backend, target if backend == "hip" else target, TARGETS[target][2])
    return dict(get_decode_config(arch, d_pad, False, wide)[kernel])


def compile_one(job):
    target, kernel, head_dim, dtype, variant = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fa_amd.kernels import decode
    from fa_amd.kernels.launch import head_dim_padded

    fn = getattr(decode, KERNELS[kernel])
    d_pad = head_dim_padded(head_dim)
    cfg = _config(target, kernel, d_pad, variant == "wide")
    values = dict(VARIANTS[variant], HEAD_DIM=head_dim, D_PAD=d_pad)
    if kernel == "decode":
        values.update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], RELOAD_CHUNK=cfg["RELOAD_CHUNK"])
        if cfg["RELOAD_CHUNK"]:
            values["ROTARY"] = False  # the launcher pre-rotates q for the reloading kernel
    elif kernel == "append":
        values.update(BLOCK_T=cfg["BLOCK_M"])
    else:
        values.update(BLOCK_R=cfg["BLOCK_M"])
    constexprs = {n: values[n] for n in fn.arg_names if n in values and n.isupper() and n != "GROUP"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in _I32_POINTERS:
            sig[name] = "*i32"
        elif name in _FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in _IO_POINTERS:
            sig[name] = "*" + dtype
        elif name == "KeyMask":
            sig[name] = "*u8"
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or (sig[name] == "i32" and name not in _NOT_DIVISIBLE
                                         and name.startswith("stride_")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in cfg.items() if k not in ("BLOCK_M", "BLOCK_N", "RELOAD_CHUNK")}
    backend, arch, warp = TARGETS[target]
    out = dict(target=target, kernel=kernel, head_dim=head_dim, dtype=dtype, variant=variant, config=cfg)
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        return out
    out["lds"] = int(getattr(compiled.metadata, "shared", 0) or 0)
    if backend == "hip":
        text = compiled.asm["amdgcn"]
        for key, name in (("NumVgprs", "vgprs"), ("NumAgprs", "agprs"), ("ScratchSize", "scratch"),
                          ("Occupancy", "occupancy")):
            m = re.search(rf";\s*{key}:\s*(\d+)", text)
            out[name] = int(m.group(1)) if m else None
    else:
        from fa_amd.aot import _cuda_usage

        out["regs"], out["stack"] = _cuda_usage(compiled)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    jobs = []
    for t in args.targets:
        dtype = "fp16" if t == "gfx908" else "bf16"
        for d in args.head_dims:
            for v in VARIANTS:
                jobs.append((t, "decode", d, dtype, v))
            jobs.append((t, "append", d, dtype, "all"))
            jobs.append((t, "merge", d, dtype, "plain"))
            jobs.append((t, "merge", d, dtype, "all"))
    bad = 0
    results = []
    with ProcessPoolExecutor(args.workers) as pool:
        for r in pool.map(compile_one, jobs):
            results.append(r)
            c = r["config"]
            tiles = f"{c.get('BLOCK_M')}x{c.get('BLOCK_N', '-')} w{c.get('num_warps')} s{c.get('num_stages', '-')}"
            if "error" in r:
                status, bad = "ERROR " + r["error"], bad + 1
            elif r.get("scratch"):
                status, bad = f"SPILLS {r['scratch']} B", bad + 1
            else:
                status = "ok"
            usage = (f"vgprs {r.get('vgprs')} agprs {r.get('agprs')} scratch {r.get('scratch')} occ {r.get('occupancy')}"
                     if TARGETS[r["target"]][0] == "hip" else f"regs {r.get('regs')} stack {r.get('stack')}")
            print(f"{r['target']:8s} {r['kernel']:7s} d{r['head_dim']:<4d} {r['variant']:10s} {tiles:18s} "
                  f"lds {r.get('lds')} {usage}  {status}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{len(results)} builds, {bad} failing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
