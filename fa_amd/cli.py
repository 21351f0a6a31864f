"""`fa-amd` command line: info | check | bench | tune | compile.

    fa-amd info        backend / arch / versions and the configs the tables pick
    fa-amd check       quick fwd+bwd correctness check against fa_amd.reference on this device
    fa-amd bench       TFLOP/s and memory vs SDPA / FlexAttention / flash_attn / eager (fa_amd.bench)
    fa-amd tune        benchmark candidate launch configs on this GPU, write the tuned table
    fa-amd compile     AOT compile check for AMD/NVIDIA targets, no GPU needed (fa_amd.aot)
"""
from __future__ import annotations

import argparse
import os
import sys


def _versions():
    import torch
    import triton

    return torch.__version__, triton.__version__


# --------------------------------------------------------------------------- info

def cmd_info(args) -> int:
    import torch

    from . import arch as arch_mod
    from .tuning import KERNELS, family_of, get_config, get_decode_config, get_decode_split_policy
    from .tuning.tuned_table import autotune_enabled, tuned_copy, tuned_table_path

    torch_v, triton_v = _versions()
    arch = arch_mod.detect_arch()
    runs_here = arch.backend != "interpreter" or arch_mod.INTERPRET
    print(f"fa_amd      {__import__('fa_amd').__version__}")
    print(f"torch       {torch_v}" + (f" (ROCm {torch.version.hip})" if torch.version.hip else
                                      f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""))
    print(f"triton      {triton_v}")
    if arch.backend != "interpreter":
        print(f"backend     {arch.backend}")
    elif arch_mod.INTERPRET:
        print("backend     interpreter (Triton's CPU interpreter: TRITON_INTERPRET=1)")
    else:
        print("backend     none: no GPU found and TRITON_INTERPRET is not set, so fa_amd's kernels cannot run "
              "here (set TRITON_INTERPRET=1 before importing fa_amd to use Triton's CPU interpreter)")
    if runs_here:
        print(f"arch        {arch.name} (table family {family_of(arch)})")
        print(f"warp size   {arch.warp_size}")
    if arch_mod.LATE_INTERPRET:
        print(f"interpreter BROKEN: {arch_mod._late_interpret_message()}")
    elif arch.backend == "interpreter" and arch_mod.INTERPRET:
        dot = ("exact (dot operands widened to fp32)" if arch_mod.INTERPRETER_BF16_DOT else
               "not supported by this triton's interpreter (use fp16 / fp32)")
        print(f"interpreter on (TRITON_INTERPRET=1; needs triton >= "
              f"{'.'.join(map(str, arch_mod.MIN_INTERPRETER_TRITON))}); bf16: {dot}")
    else:
        print("interpreter off")
    if arch.backend != "interpreter":
        need = ".".join(map(str, arch_mod.min_triton(arch.name)))
        try:
            arch_mod.check_triton_floor(arch)
            print(f"triton floor >= {need} for {arch.name}: ok")
        except RuntimeError as err:
            print(f"triton floor TOO OLD: {err}")
    if torch.cuda.is_available():
        print(f"device      {torch.cuda.get_device_name()}")
    if not runs_here:
        return 0
    path = tuned_table_path()
    tuned = tuned_copy().get(family_of(arch))
    print(f"tuned table {path} ({'has ' + family_of(arch) + ' rows' if tuned else 'no rows for this arch'}); "
          f"FA_AMD_AUTOTUNE={'1 (tune on first use)' if autotune_enabled() else 'off'}")
    print("configs the tables pick:")
    for d in (64, 128, 256):
        print(f"  d{d}:")
        for kernel in KERNELS:
            print(f"    {kernel:11s} {get_config(arch, kernel, d)}")
        for kernel, cfg in get_decode_config(arch, d).items():
            print(f"    {kernel:11s} {cfg}")
    print(f"decode key splits: {get_decode_split_policy(arch)}")
    return 0


# --------------------------------------------------------------------------- check

def cmd_check(args) -> int:
    import torch

    import fa_amd
    from .reference import attention_ref

    from . import arch

    if arch.LATE_INTERPRET:
        print(f"error: {arch._late_interpret_message()}", file=sys.stderr)
        return 2
    if arch.INTERPRET:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("error: no GPU found; set TRITON_INTERPRET=1 to check on CPU through Triton's interpreter",
              file=sys.stderr)
        return 2
    dtypes = {"fp16": [torch.float16], "bf16": [torch.bfloat16], "fp32": [torch.float32],
              "all": [torch.float16, torch.bfloat16, torch.float32]}[args.dtype]
    if device == "cpu" and torch.bfloat16 in dtypes and not arch.INTERPRETER_BF16_DOT:
        print("error: this triton's interpreter computes bf16 dots wrongly and fa_amd could not correct it; "
              "check --dtype fp16 or fp32 on CPU", file=sys.stderr)
        return 2
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal): odd lengths, GQA and padding included
    cases = [(2, 128, 128, 4, 4, 64, False), (1, 97, 131, 4, 2, 80, True), (1, 64, 64, 2, 1, 128, True),
             (1, 33, 65, 2, 2, 256, False)]
    if device == "cpu":
        cases = [(1, 33, 47, 2, 1, 32, True), (1, 40, 40, 2, 2, 80, False)]
    failed = 0
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"checking fa_amd against fa_amd.reference on {device} "
          f"({torch.cuda.get_device_name() if device == 'cuda' else 'Triton interpreter'})")
    for dtype in dtypes:
        for b, sq, sk, hq, hk, d, causal in cases:
            def rnd(*shape):
                return torch.randn(*shape, generator=gen, device=device).to(dtype).requires_grad_(True)

            q, k, v = rnd(b, sq, hq, d), rnd(b, sk, hk, d), rnd(b, sk, hk, d)
            dout = torch.randn(b, sq, hq, d, generator=gen, device=device).to(dtype)
            out = fa_amd.flash_attn_func(q, k, v, causal=causal)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            errors = []
            ok = True
            # tolerance: twice the error PyTorch itself makes in this dtype, plus a small epsilon
            ref64, ref_lp = (attention_ref(q, k, v, causal=causal, upcast=up)[0] for up in (True, False))
            ref_grads = torch.autograd.grad(ref64, (q, k, v), dout.double())
            lp_grads = torch.autograd.grad(ref_lp, (q, k, v), dout)
            eps = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 2e-5}[dtype]
            for name, got, r64, rlp in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref64, *ref_grads),
                                           (ref_lp, *lp_grads)):
                err = (got.double() - r64.double()).abs().max().item()
                bound = 2 * (rlp.double() - r64.double()).abs().max().item() + eps * max(1.0, r64.abs().max().item())
                errors.append(f"{name} {err:.1e}")
                ok &= bool(err <= bound) and not torch.isnan(got).any().item()
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {str(dtype)[6:]:8s} b{b} sq{sq} sk{sk} h{hq}/{hk} d{d} "
                  f"{'causal' if causal else 'full  '}  max err: {', '.join(errors)}")
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 1 if failed else 0


# --------------------------------------------------------------------------- tune

def cmd_tune(args) -> int:
    import torch

    from .arch import device_arch
    from .tuning import family_of
    from . import autotune

    if not torch.cuda.is_available():
        print("error: `fa-amd tune` needs a GPU (it times kernels on the current device)", file=sys.stderr)
        return 2
    if args.seqlen < 128 or args.seqlen > 65536:
        print(f"error: --seqlen must be in 128..65536, got {args.seqlen}", file=sys.stderr)
        return 2
    for d in args.head_dims:
        if d not in (64, 128, 256):
            print(f"error: --head-dims takes table classes 64, 128, 256 (got {d}); "
                  "other head dims use the class of their padded size", file=sys.stderr)
            return 2
    arch = device_arch()
    family = family_of(arch)
    path = args.out or str(autotune.tuned_table_path())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.dtype]
    print(f"tuning on {torch.cuda.get_device_name()} ({arch.name}, family {family}); table -> {path}")
    rows = []
    for d in args.head_dims:
        print(f"head_dim {d}, seqlen {args.seqlen}{' causal' if args.causal else ''}:")
        row = autotune.tune_head_dim(arch, d, seqlen=args.seqlen, causal=args.causal, dtype=dtype,
                                     log=print if args.verbose else (lambda m: None))
        for kernel in [k for k in autotune.ROW_KERNELS + autotune.OPTIONAL_KERNELS if k in row]:
            t = row["tuned"]["timings_ms"].get(kernel)
            speed = f"{t['best_ms']:.3f} ms (default {t['default_ms']:.3f} ms)" if t else "no candidate ran; default kept"
            print(f"  {kernel:5s} {row[kernel]}  {speed}")
        rows.append(row)
    out = autotune.save_tuned_rows(family, rows, path)
    print(f"wrote {out}")
    if args.out and os.path.abspath(args.out) != os.path.abspath(autotune.tuned_table_path()):
        print(f"note: fa_amd reads {autotune.tuned_table_path()} (set FA_AMD_CACHE_DIR to the folder of "
              f"{args.out}, or copy it there, to use it)")
    return 0


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    from . import aot, bench

    parser = argparse.ArgumentParser(prog="fa-amd", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench,tune,compile}")
    sub.required = True
    p = sub.add_parser("info", help="backend, arch, versions and table configs")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("check", help="quick correctness check vs the reference on this device")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32", "all"), default="all",
                   help="dtype(s) to check (all: fp16, bf16 and fp32)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="benchmark vs SDPA / FlexAttention / flash_attn / eager")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run_cli)
    p = sub.add_parser("tune", help="tune launch configs on this GPU and write the tuned table")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256], metavar="D")
    p.add_argument("--seqlen", type=int, default=4096, help="sequence length of the tuning problem "
                                                           "(batch*seqlen = 16k tokens, heads*dim = 2048)")
    p.add_argument("--causal", action="store_true", help="tune on causal attention")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None, help="default: bf16 (fp16 on gfx908)")
    p.add_argument("--out", metavar="PATH", help="tuned table to write (default: the one fa_amd reads)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every candidate's time")
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("compile", help="AOT compile check for AMD/NVIDIA targets (no GPU needed)")
    aot.add_arguments(p)
    p.set_defaults(func=aot.run_cli)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
