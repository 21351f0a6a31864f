"""The FP8 kernels in the AOT compile check (issue 18 point 7): which targets build them, that the
recorded launches are FP8 launches with the target's FP8 type and table entries, and that they are
exactly what the public FP8 API launches.  (The compiles themselves run in tests/test_aot_amd.py's
`fa-amd compile`, whose default kernels include the FP8 ones; figures in docs/AOT.md.)"""
import pytest
import torch

from fa_amd import aot, aot_launches
from fa_amd.tuning import fp8_min_triton

from .test_aot_decode import public_decode_launch, recorded_public_calls


def _call(target, kernel, variant="all", d=128, dtype="bf16"):
    job = aot.CompileJob(target, kernel, d, dtype, variant)
    call = aot.launch_call(job)
    return aot.bound_arguments(aot._kernel(aot.LAUNCHES[kernel]), call.args, call.kwargs), call


def test_fp8_jobs_only_where_the_arch_has_fp8():
    targets = [t for t in aot.DEFAULT_TARGETS if aot.target_supported(t) is None]
    ci = aot.ci_jobs(targets, aot.DEFAULT_KERNELS)
    pairs = {(j.target, j.kernel) for j in ci if j.kernel in aot.FP8_KERNELS}
    gfx950 = aot.triton_version() >= fp8_min_triton(aot._arch_of("gfx950"))
    # (no nan_flags_fp8: these families mark FP8 V's NaNs inside the forward, tables.FWD_NAN_FIXUP_FAMILIES)
    want = {(t, k) for t in ("gfx942", "sm90") + (("gfx950",) if gfx950 else ()) for k in aot.FP8_KERNELS
            if k != "nan_flags_fp8"}
    assert pairs == want
    assert not any(aot.builds(t, "fwd_fp8", 128) for t in ("gfx908", "gfx90a", "gfx1100", "sm80"))
    full = aot.full_jobs(["gfx942"], aot.FP8_KERNELS)
    assert {j.variant for j in full} == {"plain", "causal", "all"} and {j.head_dim for j in full} == set(aot.HEAD_DIMS)


def test_fp8_launches_carry_fp8_types_and_tables():
    a, call = _call("gfx942", "fwd_fp8")
    assert a["Q"].dtype == a["K"].dtype == a["V"].dtype == torch.float8_e4m3fnuz
    assert a["Out"].dtype == torch.bfloat16
    assert all(a[n].dtype == torch.float32 for n in ("QDescale", "KDescale", "VDescale"))
    assert a["Q_DESCALE_PER_KV_HEAD"]  # FA3's q_descale, (batch, nheads_k)
    assert a["IS_VARLEN"] and a["HAS_DROPOUT"] and a["GROUP"] == 2  # every feature ("all")
    a, _ = _call("gfx942", "fwd_fp8", "causal")
    assert a["stride_vn"] == 1 and a["stride_vd"] > 1  # dense V token-major on gfx942 (tables.FP8_V_TOKEN_MAJOR)
    a, call = _call("gfx950", "fwd_fp8", "causal")
    assert a["Q"].dtype == torch.float8_e4m3fn and a["stride_vd"] == 1
    assert call.kwargs["matrix_instr_nonkdim"] == 32  # the entry's "fp8" override
    a, call = _call("gfx942", "decode_fp8", d=256)
    assert a["Q"].dtype == a["K"].dtype == torch.float8_e4m3fnuz and a["Out"].dtype == torch.bfloat16
    assert all(a[n].shape == (2, 2) and a[n].dtype == torch.float32 for n in ("QDescale", "KDescale", "VDescale"))
    assert (a["stride_qdb"], a["stride_kdh"]) == (2, 1) and a["FP8_MAX"] == 240.0  # read in place, at their strides
    assert a["PAGED"] and a["SPLIT"] and a["ROTARY"] and a["HAS_SINKS"] and a["HAS_LEFTPAD"]
    a, _ = _call("sm90", "decode_fp8kv", "plain", d=64)
    assert a["Q"].dtype == torch.bfloat16 and a["K"].dtype == torch.float8_e4m3fn and a["FP8_MAX"] == 448.0
    # FP8 dots are at least 32 deep (sm90 rejects 16): a d16 FP8 launch pads the head dim to 32
    for kernel in ("fwd_fp8", "decode_fp8"):
        a, _ = _call("sm90", kernel, "causal", d=16)
        assert a["HEAD_DIM"] == 16 and a["D_PAD"] == 32
    a, _ = _call("gfx950", "append_fp8", dtype="fp16")
    assert a["KNew"].dtype == torch.float16 and a["KCache"].dtype == torch.float8_e4m3fn and a["ROTARY"]


@pytest.mark.cpu_only  # (records the interpreter's launch: CPU tensors)
def test_fp8_forward_aot_signature_is_the_public_api_launch():
    """What the AOT check builds for the FP8 forward == what flash_attn_varlen_func (FP8 q, k, v)
    launches for the same problem: every argument's dtype, shape and strides, every constexpr and
    launch option (recorded on the interpreter's table family, not run)."""
    import fa_amd
    from fa_amd.kernels import decode, forward, launch

    job = aot.CompileJob("cpu", "fwd_fp8", 40, "bf16", "all")
    spec = aot.LAUNCHES["fwd_fp8"]
    expected = aot.launch_call(job)
    p = aot_launches.Problem.of(job)
    calls = []
    f8 = torch.float8_e4m3fn  # the interpreter's ("cpu") FP8 type
    with aot_launches._as_on("cpu", [launch, forward, decode], {}, calls):
        a = aot_launches._attention_inputs(p)
        q, k, v = (a[n].to(f8) for n in "qkv")
        ones = torch.ones(2, k.shape[1])
        fa_amd.flash_attn_varlen_func(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"],
                                      a["max_seqlen_k"], dropout_p=a["dropout_p"], causal=True,
                                      window_size=(a["window_left"], -1), softcap=a["softcap"],
                                      alibi_slopes=a["alibi_slopes"], q_descale=ones, k_descale=ones,
                                      v_descale=ones, out_dtype=torch.bfloat16)
    fn = aot._kernel(spec)

    def arguments(call):
        bound = aot.bound_arguments(fn, call.args, call.kwargs)
        return {n: (x.dtype, tuple(x.shape), x.stride()) if isinstance(x, torch.Tensor) else x
                for n, x in bound.items()}

    got = [arguments(c) for c in calls if c.kernel == spec.kernel_fn]
    assert len(got) == 1, [c.kernel for c in calls]
    want = arguments(expected)
    assert want["Q"][0] == f8 and "FP8" not in want
    assert got[0].keys() == want.keys() == set(fn.arg_names) | set(aot.launch_config(spec, expected))
    assert got[0] == want


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel,variant", [(k, v) for k in ("decode_fp8", "decode_fp8kv", "append_fp8")
                                            for v in ("plain", "causal", "all")])
def test_fp8_decode_aot_signatures_are_the_public_api_launches(kernel, variant, monkeypatch):
    """The same for the FP8 decode kernels: what flash_attn_with_kvcache launches over an FP8 cache
    (FP8 or bf16 q, bf16 new k/v quantised by the append) for each variant's problem."""
    def run(p):
        kw = aot_launches._decode_inputs(p, q_fp8=kernel == "decode_fp8", kv_fp8=True)
        ones = torch.ones(2, kw["k_cache"].shape[2])
        public_decode_launch(variant, kw, torch.bfloat16, k_descale=ones, v_descale=ones, out_dtype=torch.bfloat16,
                             **(dict(q_descale=ones) if kernel == "decode_fp8" else {}))

    got, want = recorded_public_calls(kernel, variant, run, monkeypatch)
    f8 = torch.float8_e4m3fn  # the interpreter's ("cpu") FP8 type
    assert want["K" if kernel != "append_fp8" else "KCache"][0] == f8 and want["FP8_MAX"] == 448.0
    assert got == want


def test_fp8_launches_record_without_running_a_kernel():
    """Recording runs no kernel (the compile workers have neither a GPU nor the interpreter): the FP8
    forward's token-major V relayout (the quantiser's cast kernel) and the quantiser's own passes are
    recorded too.  A subprocess without TRITON_INTERPRET, as the workers run."""
    import os
    import subprocess
    import sys

    code = ("from fa_amd import aot\n"
            "for t, k, v in [('gfx942', 'fwd_fp8', 'causal'), ('sm90', 'fwd_fp8', 'plain'), ('gfx942', 'cast_fp8', "
            "'plain'), ('gfx942', 'cast_fp8', 'all'), ('sm90', 'amax_fp8', 'causal')]:\n"
            "    call = aot.launch_call(aot.CompileJob(t, k, 128, 'bf16', v))\n"
            "    a = aot.bound_arguments(aot._kernel(aot.LAUNCHES[k]), call.args, call.kwargs)\n"
            "    print(t, k, v, a['V'].stride() if k == 'fwd_fp8' else a['stride_ot'] if k == 'cast_fp8' else '-')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    assert lines[0].endswith("(524288, 1, 262144, 2048)")  # gfx942: V token-major per head (2048 tokens)
    assert lines[2].endswith(" 1") and lines[3].endswith(" 1")  # the FA3 relayout and the quantiser write it so
