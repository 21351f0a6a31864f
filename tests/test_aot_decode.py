"""The decode kernels in the AOT compile check (issue 14 point 7, issue 13 point 1): the split-KV decode
kernel, the merge of its key splits and the KV-cache append, recorded from their launchers in every
route the public API takes into them (fa_amd.aot_launches.DECODE_LAUNCHES), at the tiles the decode
tables choose under the installed triton.  CPU-cheap: nothing is compiled here (tests/test_aot_amd.py's
`fa-amd compile` builds the CI subset, which includes them; figures in docs/AOT.md)."""
import pytest
import torch

from fa_amd import aot, aot_launches, tuning
from fa_amd.tuning import decode_entry_config, get_decode_config, tables
from fa_amd.tuning.tables import (DECODE_FP8, DECODE_FUSED_MERGE_FAMILIES, DECODE_TABLES, DECODE_WIDE_ROWS,
                                  TRITON_OVERRIDES)


def _args(target, kernel, variant, d=128, dtype="bf16"):
    call = aot.launch_call(aot.CompileJob(target, kernel, d, dtype, variant))
    return aot.bound_arguments(aot._kernel(aot.LAUNCHES[kernel]), call.args, call.kwargs), call


def test_decode_jobs_cover_every_target_and_route():
    targets = [t for t in aot.DEFAULT_TARGETS if aot.target_supported(t) is None]
    ci = aot.ci_jobs(targets, aot.DEFAULT_KERNELS)
    for t in targets:  # the CI subset: the paged all-features decode, the merge (where launched), the append
        got = {(j.kernel, j.variant) for j in ci if j.target == t and j.kernel in aot.DECODE_KERNELS}
        fused = tuning.family_of(aot._arch_of(t)) in DECODE_FUSED_MERGE_FAMILIES
        assert got == {("decode", "all"), ("append", "all")} | (set() if fused else {("merge", "all")}), (t, got)
    full = aot.full_jobs(["gfx942"], aot.KERNELS)
    for kernel in aot.DECODE_KERNELS:
        jobs = [j for j in full if j.kernel == kernel]
        assert {j.variant for j in jobs} == set(aot_launches.DECODE_VARIANTS[kernel])
        assert {j.dtype for j in jobs} == {"fp16", "bf16", "fp32"} and {j.head_dim for j in jobs} == set(aot.HEAD_DIMS)
    # the decode routes' variants are built for the decode kernels only; the FP8 ones keep theirs
    assert not {j.kernel for j in full if j.variant in aot_launches.DECODE_ONLY_VARIANTS} - set(aot.DECODE_KERNELS)
    assert {j.variant for j in full if j.kernel == "decode_fp8"} == {"plain", "causal", "all"}
    assert {j.dtype for j in full if j.kernel == "fwd"} == set(aot.DTYPES)


def test_decode_launches_carry_the_tables_and_features():
    a, call = _args("gfx942", "decode", "all", d=80)
    assert a["PAGED"] and a["SPLIT"] and a["ROTARY"] and a["ROTARY_INTERLEAVED"] and a["HAS_SINKS"]
    assert a["HAS_LEFTPAD"] and a["HAS_ALIBI"] and a["IS_SOFTCAP"] and a["HAS_LEFT"] and a["GROUP"] == 2
    assert a["Q"].dtype == a["K"].dtype == torch.bfloat16 and a["OutPart"].dtype == a["Lse"].dtype == torch.float32
    assert a["HEAD_DIM"] == 80 and a["D_PAD"] == 128 and a["BlockTable"].dtype == torch.int32
    cfg = get_decode_config(aot._arch_of("gfx942"), 128)["decode"]
    assert aot.launch_config(aot.LAUNCHES["decode"], call) == cfg == aot.decode_config("gfx942", "decode", 128)
    # more than DECODE_WIDE_ROWS rows per KV head (17 tokens of chunked prefill): the "wide" tile
    a, call = _args("gfx942", "decode", "causal")
    assert a["HAS_RIGHT"] and not a["SPLIT"] and 17 > DECODE_WIDE_ROWS
    assert call.kwargs["BLOCK_M"] == aot.decode_config("gfx942", "decode", 128, wide=True)["BLOCK_M"] > 16
    a, call = _args("gfx942", "decode", "plain", dtype="fp32")
    assert call.kwargs["BLOCK_N"] == get_decode_config(aot._arch_of("gfx942"), 128, True)["decode"]["BLOCK_N"]
    a, _ = _args("gfx942", "decode", "dense")
    assert a["HAS_BATCH_IDX"] and a["ROTARY"] and not a["ROTARY_INTERLEAVED"] and a["HAS_RIGHT"] and not a["SPLIT"]
    a, _ = _args("gfx942", "decode", "varlen")
    assert a["Q_VARLEN"] and a["K_LENS"] == 2 and a["HAS_SEQUSED"] and a["PAGED"] and a["HAS_RIGHT"]
    a, _ = _args("gfx942", "decode", "masked")
    assert a["HAS_KEY_MASK"] and a["KeyMask"].dtype == torch.uint8 and a["HAS_SINKS"] and a["SPLIT"]
    # RDNA: the reloading kernel streams q, so the launcher rotates q first (the rotary kernel, recorded)
    a, call = _args("gfx1100", "decode", "all")
    assert call.kwargs["RELOAD_CHUNK"] == 32 and not a["ROTARY"] and "waves_per_eu" in call.kwargs
    a, _ = _args("sm90", "decode", "all")
    assert a["ROTARY"] and a["RELOAD_CHUNK"] == 0
    # the split decode merges its splits in the kernel where the tables say so (no merge launch), else not
    fused = "sm90" in DECODE_FUSED_MERGE_FAMILIES
    assert a["FUSED_MERGE"] == fused and (a["SplitCounters"] is not None) == fused
    assert aot.builds("sm90", "merge", 256, variant="all") != fused
    a, _ = _args("gfx942", "decode", "all")
    assert not a["FUSED_MERGE"] and a["SplitCounters"] is None
    a, call = _args("gfx942", "merge", "all", d=256)
    assert a["HAS_SINKS"] and a["BLOCK_R"] == get_decode_config(aot._arch_of("gfx942"), 256)["merge"]["BLOCK_M"]
    assert a["Out"].dtype == torch.bfloat16 and a["OutPart"].dtype == torch.float32
    a, _ = _args("gfx942", "merge", "plain")
    assert not a["HAS_SINKS"]
    a, _ = _args("gfx942", "append", "all", dtype="fp16")
    assert a["PAGED"] and a["ROTARY"] and a["ROTARY_INTERLEAVED"] and a["KCache"].dtype == torch.float16
    a, _ = _args("gfx942", "append", "dense")
    assert a["HAS_BATCH_IDX"] and a["ROTARY"] and not a["ROTARY_INTERLEAVED"] and a["SEQLENS_TENSOR"]


def test_decode_version_overrides_are_table_data():
    """A decode entry (and its "wide" / "fp32" / FP8 override dicts) may carry "triton<X.Y" overrides,
    applied below X.Y only; every one used is a tables.TRITON_OVERRIDES key."""
    entry = {"BLOCK_M": 16, "BLOCK_N": 64, "waves_per_eu": 2, "triton<3.7": {"BLOCK_N": 32},
             "triton<3.3": {"waves_per_eu": 1}, "wide": {"BLOCK_M": 64}}
    assert decode_entry_config(entry, triton_version=(3, 9)) == {"BLOCK_M": 16, "BLOCK_N": 64, "waves_per_eu": 2}
    assert decode_entry_config(entry, triton_version=(3, 6))["BLOCK_N"] == 32
    assert decode_entry_config(entry, triton_version=(3, 2)) == {"BLOCK_M": 16, "BLOCK_N": 32, "waves_per_eu": 1}

    def keys(d):
        for k, v in d.items():
            if isinstance(v, dict):
                yield k
                yield from keys(v)

    used = {k for rows in DECODE_TABLES.values() for row in rows for k in keys(row) if k.startswith("triton")}
    used |= {k for rows in DECODE_FP8.values() for e in rows.values() for k in keys(e) if k.startswith("triton")}
    assert used <= set(TRITON_OVERRIDES), used


# --------------------------------------------------------------------------- the public API's launches

def public_decode_launch(variant, kw, new_dtype, **fp8_kwargs):
    """Call the public route of a decode variant (fa_amd.aot_launches' decode block) with the problem
    `kw` (aot_launches._decode_inputs) describes: flash_attn_with_kvcache (appending kw's new keys),
    flash_attn_varlen_func with block_table / seqused_k, or the Transformers route's decode_attention."""
    import fa_amd
    from fa_amd.kvcache import decode_attention

    common = dict(softmax_scale=kw["softmax_scale"], softcap=kw["softcap"], alibi_slopes=kw["alibi_slopes"])
    causal = kw["window_right"] == 0
    window = (kw["window_left"], -1)
    if variant == "varlen":
        kc = kw["k_cache"]
        return fa_amd.flash_attn_varlen_func(kw["q"], kc, kw["v_cache"], kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                             kw["max_seqlen_q"], int(kw["seqused_k"].max()), causal=causal,
                                             window_size=window, block_table=kw["block_table"],
                                             seqused_k=kw["seqused_k"], **common, **fp8_kwargs)
    if variant == "masked":
        return decode_attention(kw["q"], kw["k_cache"], kw["v_cache"], kw["softmax_scale"], kw["window_left"],
                                kw["window_right"], kw["softcap"], cache_seqlens=kw["cache_seqlens"],
                                cache_leftpad=kw["cache_leftpad"], key_mask=kw["key_mask"], sinks=kw["sinks"])
    batch, hk, d = kw["q"].shape[0], kw["k_cache"].shape[2], kw["q"].shape[-1]
    new = torch.zeros(batch, kw["seqlen_new"], hk, d, dtype=new_dtype) if kw["seqlen_new"] else None
    seqlens = kw["cache_seqlens_int"] if "cache_seqlens_int" in kw else kw["cache_seqlens"]
    return fa_amd.flash_attn_with_kvcache(
        kw["q"], kw["k_cache"], kw["v_cache"], new, new, kw.get("rotary_cos"), kw.get("rotary_sin"),
        cache_seqlens=seqlens, cache_batch_idx=kw.get("cache_batch_idx"), cache_leftpad=kw.get("cache_leftpad"),
        block_table=kw.get("block_table"), causal=causal, window_size=window,
        rotary_interleaved=kw.get("rotary_interleaved", True), num_splits=kw["num_splits"], sinks=kw.get("sinks"),
        **common, **fp8_kwargs)


def recorded_public_calls(kernel, variant, run, monkeypatch):
    """(the AOT job's call, the public API's calls of the same @triton.jit function) on the interpreter's
    table family, kernels recorded rather than run.  Routes without a num_splits argument get the
    job's split count from the heuristic (patched: on a GPU it depends on the CU count)."""
    from fa_amd.kernels import decode, launch, rotary

    job = aot.CompileJob("cpu", kernel, 40, "bf16", variant)
    spec = aot.LAUNCHES[kernel]
    expected = aot.launch_call(job)
    splits = aot_launches._DECODE_SPLITS.get(variant, 1)
    monkeypatch.setattr(decode, "decode_num_splits", lambda programs, blocks, sms, policy, requested=0:
                        requested or splits)
    calls = []
    with aot_launches._as_on("cpu", [launch, decode, rotary], {}, calls):
        run(aot_launches.Problem.of(job))
    fn = aot._kernel(spec)

    def arguments(call):
        bound = aot.bound_arguments(fn, call.args, call.kwargs)
        return {n: (x.dtype, tuple(x.shape), x.stride()) if isinstance(x, torch.Tensor) else x
                for n, x in bound.items()}

    want = arguments(expected)
    got = [arguments(c) for c in calls if c.kernel == spec.kernel_fn]
    assert len(got) == 1, [c.kernel for c in calls]
    assert got[0].keys() == want.keys() == set(fn.arg_names) | set(aot.launch_config(spec, expected))
    return got[0], want


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel,variant", [(k, v) for k, vs in aot_launches.DECODE_VARIANTS.items() for v in vs])
def test_decode_aot_signatures_are_the_public_api_launches(kernel, variant, monkeypatch):
    """What the AOT check builds for a decode job == what the public route of its variant launches for
    the same problem: every argument's dtype, shape and strides, every int, float, constexpr and
    launch option."""
    def run(p):
        public_decode_launch(variant, aot_launches._decode_inputs(p), torch.bfloat16)

    if kernel == "merge":  # (the interpreter's family merges in the decode kernel: the merge launch's route)
        monkeypatch.setattr(tables, "DECODE_FUSED_MERGE_FAMILIES", ())
    got, want = recorded_public_calls(kernel, variant, run, monkeypatch)
    assert got == want


def test_known_decode_spill_covers_its_dtype_only():
    """The one known spill (fp32 decode at d256 on RDNA3) exempts fp32 builds of that row only, on every
    RDNA part sharing it, and is reported stale once none of them spills."""
    def res(target, variant, scratch, triton="3.9.0"):
        return aot.CompileResult(target, "decode", variant, scratch_bytes=scratch, triton=triton)

    fp32, bf16 = res("gfx1100", "d256-fp32-all", 880), res("gfx1100", "d256-bf16-all", 16)
    assert aot.known_scratch(fp32) and not fp32.failed
    assert not aot.known_scratch(bf16) and bf16.failed
    assert aot.known_scratch(res("gfx1201", "d256-fp32-causal", 40))
    assert not aot.known_scratch(res("gfx1100", "d128-fp32-all", 40))
    # under triton < 3.6 every gfx1100 decode row is a known (documented) spill
    assert aot.known_scratch(res("gfx1100", "d128-bf16-all", 40, triton="3.5.1"))
    assert not aot.known_scratch(res("gfx942", "d256-fp32-all", 8, triton="3.2.0"))
    assert aot.stale_known_scratch([fp32, res("gfx1100", "d256-fp32-plain", 0)]) == []
    assert aot.stale_known_scratch([res("gfx1100", "d256-fp32-plain", 0)]) == ["gfx1100 decode d256 fp32"]


def test_full_sweep_head_dims_option():
    """`fa-amd compile --full --head-dims` (and .ci/aot_matrix.py's) narrows the sweep to those head dims."""
    jobs = aot.full_jobs(["gfx942"], ["decode", "merge", "append"], ["bf16"], head_dims=(64, 256))
    assert {j.head_dim for j in jobs} == {64, 256}
    per_dim = sum(len(vs) for vs in aot_launches.DECODE_VARIANTS.values())
    assert len(jobs) == 2 * per_dim
