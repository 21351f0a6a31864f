"""FP8 KV cache in flash_attn_with_kvcache (issue 18 point 5) and FP8 pages in paged
flash_attn_varlen_func: the split-KV decode kernel's FP8 path (fa_amd/kernels/decode.py,
rules in fa_amd.fp8.kvcache_fp8_args).

Accuracy bound (as tests/kernels/test_fp8.py): the kernel's max error against float64 attention
of the ORIGINAL (unquantised) q, cache and new k/v must be at most 3x the max error of a plain
PyTorch emulation of the same quantisation -- the cache and the appended keys/values rounded with
the given descales (reference.fp8_scale_ref: fp8(clamp(x / descale)), as vLLM writes FP8 caches),
an FP8 q rounded per (sequence, KV head) -- then float64 attention of the dequantised values
(reference.attention_kvcache_ref), plus the rounding of the output dtype.  Why 3x: beyond the
emulation the kernel rounds P once more before the P.V dot -- to V's FP8 type under an FP8 q
(as FA3; relative error ~2^-4 per element, the size of V's own rounding that the emulation
already pays, so the error about doubles in variance: ~1.4x), to q's dtype under an fp16/bf16 q
(negligible) -- and sums S and P.V in fp32 tiles, split over key ranges merged by their
log-sum-exp (a small part).  Measured here: 0.9-1.5x.  A wrong descale, a lost key block or a
wrongly quantised append gives 5-50x.
"""
import math

import pytest
import torch

import fa_amd
from fa_amd import fp8 as fp8_mod
from fa_amd.kernels import launch
from fa_amd.reference import (attention_kvcache_ref, attention_paged_varlen_ref, fp8_dequantize_ref,
                              fp8_quantize_ref, fp8_scale_ref, rotary_ref)
from fa_amd.tuning import tables

from .helpers import cu_seqlens, strided_descales

OUT_EPS = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _fp8(device):
    return fp8_mod.fp8_dtypes(torch.empty(0, device=device))[0]  # e4m3fn on CPU and sm89+/gfx950, fnuz on gfx942


def _rnd(gen, *shape, device):
    return torch.randn(*shape, generator=gen).to(device)


def _descale(x_list, fp8_dtype):
    """Per (sequence, KV head) descale that covers every value in x_list (each (b, s, hk, d)):
    amax / fp8 max, as a calibrated KV-cache scale."""
    amax = torch.stack([x.abs().amax(dim=(1, 3)) for x in x_list]).amax(0).float()
    return (amax / torch.finfo(fp8_dtype).max).clamp_min(1e-6)


def _deq(x8, descale):
    return x8.double() * descale.double()[:, None, :, None]


def _fp8_q(q, hk, fp8_dtype):
    """FP8 q with its descale (batch, nheads_k): one amax scale per query-head group (FA3 convention)."""
    b, s, hq, d = q.shape
    q8g, qd = fp8_quantize_ref(q.reshape(b, s, hk, (hq // hk) * d), fp8_dtype)
    q8 = q8g.reshape(q.shape)
    return q8, qd, fp8_dequantize_ref(q8, qd.repeat_interleave(hq // hk, dim=1))


def assert_within_emulation(name, got, ref64, emu64, out_dtype):
    assert not torch.isnan(got).any(), f"{name}: NaN in kernel output (unwritten element?)"
    err = (got.double() - ref64).abs().max().item()
    err_emu = (emu64 - ref64).abs().max().item()
    bound = 3 * err_emu + OUT_EPS[out_dtype] * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3e} > 3 x FP8 emulation error {err_emu:.3e} + eps"
    return err, err_emu


# b, sq, hq, hk, d, cache, new, q kind, new k/v kind, page, options
CASES = [
    # FP8 q, GQA 2:1, high-precision append quantised on the fly, causal, split keys + merge, sinks
    (2, 1, 4, 2, 40, 45, 3, "fp8", "hp", None, dict(causal=True, num_splits=3, sinks=True)),
    # fp16 q over an FP8 paged cache, FP8 new k/v stored as given, MQA 3:1, two query tokens,
    # window + softcap, fp32 out
    (2, 2, 3, 1, 32, 40, 2, "fp16", "fp8", 16, dict(window_size=(20, 0), softcap=4.0, out_dtype=torch.float32)),
    # FP8 q, cache_batch_idx rows, int cache_seqlens, ALiBi, sinks, no append, no split
    (2, 1, 2, 2, 64, 33, 0, "fp8", None, None, dict(batch_idx=True, alibi=True, sinks=True, seqlens_int=True)),
]


@pytest.mark.parametrize("b,sq,hq,hk,d,cache,new,q_kind,new_kind,page,opts", CASES)
def test_fp8_kvcache(device, b, sq, hq, hk, d, cache, new, q_kind, new_kind, page, opts):
    opts = dict(opts)
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(d)
    q = _rnd(gen, b, sq, hq, d, device=device)
    rows = 2 * b + 1 if opts.pop("batch_idx", False) else b
    block_table = None
    if page:
        per_seq = math.ceil(cache / page)
        num_pages = b * per_seq + 2
        kc, vc = _rnd(gen, num_pages, page, hk, d, device=device), _rnd(gen, num_pages, page, hk, d, device=device)
        block_table = torch.randperm(num_pages, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
        block_table = block_table.to(device)
        capacity = per_seq * page
    else:
        kc, vc = _rnd(gen, rows, cache, hk, d, device=device), _rnd(gen, rows, cache, hk, d, device=device)
        capacity = cache
    k_new = v_new = None
    if new:
        k_new, v_new = _rnd(gen, b, new, hk, d, device=device), _rnd(gen, b, new, hk, d, device=device)
    lens = torch.randint(1, capacity - new + 1, (b,), generator=gen, dtype=torch.int32)
    kw = dict(causal=opts.pop("causal", False), window_size=opts.pop("window_size", (-1, -1)),
              softcap=opts.pop("softcap", 0.0))
    kw["cache_seqlens"] = int(lens[0]) if opts.pop("seqlens_int", False) else lens.to(device)
    if rows != b:
        kw["cache_batch_idx"] = torch.tensor([2 * i + 1 for i in range(b)], dtype=torch.int32, device=device)
    if block_table is not None:
        kw["block_table"] = block_table
    if opts.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(hq, generator=gen).to(device) * 0.3
    if opts.pop("sinks", False):
        kw["sinks"] = _rnd(gen, hq, device=device)
    num_splits = opts.pop("num_splits", 1)
    out_dtype = opts.pop("out_dtype", None)
    assert not opts

    # one descale per (sequence, KV head); a paged cache's pages take the descale of the sequence owning them
    kd = _descale([kc.flatten(0, 1)[None].expand(b, -1, -1, -1)] + ([k_new] if new else []), fp8)
    vd = _descale([vc.flatten(0, 1)[None].expand(b, -1, -1, -1)] + ([v_new] if new else []), fp8)
    owner = torch.zeros(kc.shape[0], dtype=torch.long, device=device)  # cache row / page -> sequence
    if block_table is not None:
        for i in range(b):
            owner[block_table[i].long()] = i
    elif rows != b:
        owner[kw["cache_batch_idx"].long()] = torch.arange(b, device=device)
    kd_rows, vd_rows = kd[owner], vd[owner]
    kc8, vc8 = fp8_scale_ref(kc, kd_rows, fp8), fp8_scale_ref(vc, vd_rows, fp8)
    k_emu = v_emu = k_arg = v_arg = None
    if new:
        k8_new, v8_new = fp8_scale_ref(k_new, kd, fp8), fp8_scale_ref(v_new, vd, fp8)
        k_emu, v_emu = _deq(k8_new, kd), _deq(v8_new, vd)
        if new_kind == "fp8":
            k_arg, v_arg = k8_new, v8_new
        else:
            k_arg, v_arg = k_new.half(), v_new.half()
            k_emu = _deq(fp8_scale_ref(k_arg, kd, fp8), kd)  # the fp16 values are what gets quantised
            v_emu = _deq(fp8_scale_ref(v_arg, vd, fp8), vd)
    if q_kind == "fp8":
        q_arg, qd, q_emu = _fp8_q(q, hk, fp8)
        extra = dict(q_descale=qd)
    else:
        q_arg, extra, q_emu = q.half(), {}, q.half().double()
    k_cache, v_cache = kc8.clone(), vc8.clone()
    out, lse = fa_amd.flash_attn_with_kvcache(q_arg, k_cache, v_cache, k_arg, v_arg, k_descale=kd, v_descale=vd,
                                              num_splits=num_splits, return_softmax_lse=True, out_dtype=out_dtype,
                                              **extra, **kw)
    want_dtype = out_dtype or (torch.bfloat16 if q_kind == "fp8" else torch.float16)
    assert out.dtype == want_dtype and out.shape == q.shape

    ref, ref_lse, _, _ = attention_kvcache_ref(q.double(), kc.double(), vc.double(),
                                               None if not new else k_new.double(),
                                               None if not new else v_new.double(), **kw)
    emu, emu_lse, k_after, v_after = attention_kvcache_ref(q_emu, _deq(kc8, kd_rows), _deq(vc8, vd_rows), k_emu,
                                                           v_emu, **kw)
    assert_within_emulation("out", out, ref, emu, want_dtype)
    assert_within_emulation("lse", lse, ref_lse, emu_lse, torch.float32)
    if new:  # the append wrote exactly the emulated FP8 values (bytes), the rest of the cache untouched
        assert torch.equal(_deq(k_cache, kd_rows), k_after) and torch.equal(_deq(v_cache, vd_rows), v_after)


def test_fp8_kvcache_rotary_append(device):
    """High-precision new k with rotary into an FP8 cache: rotated (fp32), then quantised with k_descale;
    FP8 q rotated too (saturated at the type's max).  The appended keys match the emulation to fp8
    rounding, and the output is the float64 attention of what the cache then holds."""
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(7)
    b, hq, hk, d, cache, new, rot = 2, 2, 1, 32, 40, 2, 24
    q, kc, vc = _rnd(gen, b, 1, hq, d, device=device), _rnd(gen, b, cache, hk, d, device=device), _rnd(
        gen, b, cache, hk, d, device=device)
    k_new, v_new = _rnd(gen, b, new, hk, d, device=device).half(), _rnd(gen, b, new, hk, d, device=device).half()
    cos, sin = (f(torch.rand(cache, rot // 2, generator=gen) * 6).to(device) for f in (torch.cos, torch.sin))
    kd, vd = _descale([kc, k_new.float()], fp8) * 1.5, _descale([vc, v_new.float()], fp8)
    k_cache, v_cache = fp8_scale_ref(kc, kd, fp8), fp8_scale_ref(vc, vd, fp8)
    q8, qd, _ = _fp8_q(q, hk, fp8)
    lens = torch.tensor([5, 31], dtype=torch.int32, device=device)
    out = fa_amd.flash_attn_with_kvcache(q8, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=lens, causal=True, rotary_interleaved=False, q_descale=qd,
                                         k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    pos = lens.long()[:, None] + torch.arange(new, device=device)[None, :]
    k_rot = rotary_ref(k_new.double(), cos, sin, pos, False)  # float64: the kernel rotates in fp32
    for i in range(b):
        got = _deq(k_cache, kd)[i, lens[i]:lens[i] + new]
        want = k_rot[i]
        # one fp8 rounding of the rotated value (e4m3: 2^-4 relative), or the type's subnormal step
        assert (got - want).abs().le(2 ** -4 * want.abs() + kd[i].double().max() * 2 ** -9).all()
    q_rot = rotary_ref(fp8_dequantize_ref(q8, qd.repeat_interleave(hq // hk, dim=1)), cos, sin,
                       pos[:, :1], False)
    exact, _, _, _ = attention_kvcache_ref(q_rot, _deq(k_cache, kd), _deq(v_cache, vd), cache_seqlens=lens + new,
                                           causal=True)
    # left: q's rotated fp8 rounding and P's rounding to fp8 (each 2^-4 relative)
    assert (out.double() - exact).abs().max().item() <= 2 ** -3 * exact.abs().max().item()


@pytest.mark.parametrize("q_kind", ["fp8", "fp16"])
def test_fp8_kvcache_descales_are_read_in_place_with_their_strides(device, q_kind):
    """The decode and append kernels read the caller's descales where they lie (score_mods.load_head_descales;
    no packed copy): transposed and sliced descales give the contiguous ones' cache writes and outputs bit for
    bit, and every (sequence, KV head) takes its own scales (GQA 2:1 over 2 KV heads: a wrong stride would swap
    them, which the distinct per-head factors expose)."""
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(11)
    b, hq, hk, d, cache, new = 2, 4, 2, 32, 37, 2
    q, kc, vc = _rnd(gen, b, 1, hq, d, device=device), _rnd(gen, b, cache, hk, d, device=device), _rnd(
        gen, b, cache, hk, d, device=device)
    k_new, v_new = _rnd(gen, b, new, hk, d, device=device).half(), _rnd(gen, b, new, hk, d, device=device).half()
    factors = torch.tensor([[1.0, 2.0], [0.5, 4.0]], device=device)
    kd, vd = _descale([kc, k_new.float()], fp8) * factors, _descale([vc, v_new.float()], fp8) * factors.flip(1)
    k0, v0 = fp8_scale_ref(kc, kd, fp8), fp8_scale_ref(vc, vd, fp8)
    q_in, qd = (q.half(), None) if q_kind == "fp16" else _fp8_q(q, hk, fp8)[:2]
    lens = torch.tensor([3, 30], dtype=torch.int32, device=device)

    def run(qd, kd, vd):
        k_cache, v_cache = k0.clone(), v0.clone()
        out = fa_amd.flash_attn_with_kvcache(q_in, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                             q_descale=qd, k_descale=kd, v_descale=vd, num_splits=2,
                                             out_dtype=torch.float32)
        return out, k_cache.view(torch.uint8), v_cache.view(torch.uint8)

    want = run(qd, kd, vd)
    for i in range(2):
        got = run(*(strided_descales(x)[i] for x in (qd, kd, vd)))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # and the values they mean: float64 attention over what the cache holds after the append
    q64 = q_in.double() if qd is None else fp8_dequantize_ref(q_in, qd.repeat_interleave(hq // hk, dim=1))
    k_cache, v_cache = want[1].view(fp8), want[2].view(fp8)
    exact, _, _, _ = attention_kvcache_ref(q64, _deq(k_cache, kd), _deq(v_cache, vd), cache_seqlens=lens + new,
                                           causal=True)
    assert (want[0].double() - exact).abs().max().item() <= 2 ** -3 * exact.abs().max().item()


@pytest.mark.parametrize("q_kind", ["fp8", "fp16"])
def test_fp8_paged_varlen(device, q_kind):
    """flash_attn_varlen_func with FP8 pages + block_table and an FP8 q (or an fp16 one, as flash_attn_with_kvcache
    takes over an FP8 cache: audit 2026-11-29, refused here before): the decode kernel's FP8 path, one descale
    per (sequence, KV head)."""
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(3)
    lens_q, lens_k, page, hq, hk, d = [1, 3, 0], [20, 33, 5], 16, 4, 2, 32
    b = len(lens_q)
    per_seq = 3
    num_pages = b * per_seq + 1
    kp, vp = _rnd(gen, num_pages, page, hk, d, device=device), _rnd(gen, num_pages, page, hk, d, device=device)
    block_table = torch.randperm(num_pages, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32).to(device)
    owner = torch.zeros(num_pages, dtype=torch.long, device=device)
    for i in range(b):
        owner[block_table[i].long()] = i
    kd = _descale([kp.flatten(0, 1)[None].expand(b, -1, -1, -1)], fp8)
    vd = _descale([vp.flatten(0, 1)[None].expand(b, -1, -1, -1)], fp8) * torch.tensor([1.0, 2.0, 0.5],
                                                                                      device=device)[:, None]
    kp8, vp8 = fp8_scale_ref(kp, kd[owner], fp8), fp8_scale_ref(vp, vd[owner], fp8)
    q = _rnd(gen, sum(lens_q), hq, d, device=device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    if q_kind == "fp8":
        q8, qd = fp8_quantize_ref(q.reshape(-1, hk, (hq // hk) * d), fp8, cu_q)
        q_in, out_dtype = q8.reshape(q.shape), torch.bfloat16
        q_emu = fp8_dequantize_ref(q_in, qd.repeat_interleave(hq // hk, dim=1), cu_q)
        q_kw = dict(q_descale=qd)
    else:
        q_in, qd, out_dtype, q_kw = q.half(), None, torch.float16, {}
        q_emu = q_in.double()
    out = fa_amd.flash_attn_varlen_func(q_in, kp8, vp8, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                        block_table=block_table, k_descale=kd, v_descale=vd, **q_kw)
    assert out.dtype == out_dtype
    ref, _ = attention_paged_varlen_ref(q.double(), kp.double(), vp.double(), cu_q, cu_k, block_table, causal=True)
    emu, _ = attention_paged_varlen_ref(q_emu, _deq(kp8, kd[owner]), _deq(vp8, vd[owner]), cu_q, cu_k, block_table,
                                        causal=True)
    assert_within_emulation("out", out, ref, emu, out_dtype)


def test_fp8_kvcache_takes_negative_descales_as_they_are(device):
    """The decode kernel's FP8 path takes every descale as it is, a negative one too: the real values are
    x8 * descale, and the kernel has no raw-max path that a negative score scale would break (that is the
    prefill forward's, which refuses or NaNs a negative q_descale * k_descale).  Dense cache with an
    append and paged varlen, GQA 2:1, several query tokens, causal and not: the outputs match float64
    attention of the dequantised values within P's rounding to FP8, and no row is NaN (audit 2026-11-29)."""
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(5)
    b, sq, hq, hk, d, cap, lens = 2, 5, 4, 2, 32, 16, [9, 14]
    q8, k8, v8 = (_rnd(gen, *shape, device=device).to(fp8) for shape in
                  ((b, sq, hq, d), (b, cap, hk, d), (b, cap, hk, d)))
    qd = torch.tensor([[1.0, 0.5], [-1.5, 2.0]], device=device)  # (batch 1, KV head 0): a negative score scale
    kd = torch.tensor([[0.7, -0.4], [0.9, 1.1]], device=device)  # (batch 0, KV head 1): the other sign's way
    vd = torch.tensor([[1.3, -2.0], [0.6, 1.0]], device=device)  # a negated output
    q64 = fp8_dequantize_ref(q8, qd.repeat_interleave(hq // hk, dim=1))
    k64, v64 = _deq(k8, kd), _deq(v8, vd)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    block_table = torch.arange(b, dtype=torch.int32, device=device).view(b, 1)
    for causal in (False, True):
        exact, _, _, _ = attention_kvcache_ref(q64, k64, v64, cache_seqlens=seqlens, causal=causal)
        bound = 2 ** -3 * exact.abs().max().item()  # P rounded to e4m3 for the P.V dot (2^-4 relative per element)
        out = fa_amd.flash_attn_with_kvcache(q8, k8.clone(), v8.clone(), cache_seqlens=seqlens, causal=causal,
                                             q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
        assert not out.isnan().any() and (out.double() - exact).abs().max().item() <= bound, ("kvcache", causal)
        paged = fa_amd.flash_attn_varlen_func(q8.flatten(0, 1), k8, v8, cu_seqlens([sq] * b, device),
                                              cu_seqlens(lens, device), sq, max(lens), causal=causal,
                                              block_table=block_table, q_descale=qd, k_descale=kd, v_descale=vd,
                                              out_dtype=torch.float32)
        assert not paged.isnan().any(), ("paged", causal)
        assert (paged.double().view(exact.shape) - exact).abs().max().item() <= bound, ("paged", causal)


# --------------------------------------------------------------------------- bad input

def test_fp8_kvcache_bad_input(device):
    fp8 = _fp8(device)
    b, hq, hk, d, cap = 2, 4, 2, 32, 20
    q = torch.randn(b, 1, hq, d, device=device).half()
    kc, vc = (torch.randn(b, cap, hk, d, device=device).to(fp8) for _ in range(2))
    hp_cache = torch.randn(b, cap, hk, d, device=device).half()
    ones = torch.ones(b, hk, device=device)
    lens = torch.full((b,), 5, dtype=torch.int32, device=device)
    call = fa_amd.flash_attn_with_kvcache
    cases = [
        # mixed FP8 / non-FP8
        (TypeError, "v_cache", dict(q=q, k_cache=kc, v_cache=hp_cache)),
        (TypeError, "k_cache", dict(q=q.to(fp8), k_cache=hp_cache, v_cache=hp_cache.clone())),
        (TypeError, "v", dict(q=q, k_cache=kc, v_cache=vc, k=torch.randn(b, 1, hk, d, device=device).to(fp8),
                              v=torch.randn(b, 1, hk, d, device=device).half(), cache_seqlens=lens)),
        (TypeError, "float8_e5m2", dict(q=q.to(torch.float8_e5m2), k_cache=kc, v_cache=vc)),
        # descales: wrong shape / dtype, FP8 options on a non-FP8 call, q_descale with a high-precision q
        (ValueError, "k_descale", dict(q=q, k_cache=kc, v_cache=vc, k_descale=torch.ones(b, hq, device=device))),
        (TypeError, "v_descale", dict(q=q, k_cache=kc, v_cache=vc, v_descale=ones.half())),
        (ValueError, "k_descale", dict(q=q, k_cache=hp_cache, v_cache=hp_cache.clone(), k_descale=ones)),
        (ValueError, "q_descale", dict(q=q, k_cache=kc, v_cache=vc, q_descale=ones)),
        (TypeError, "out_dtype", dict(q=q, k_cache=kc, v_cache=vc, out_dtype=torch.int8)),
        (TypeError, "q_descale", dict(q=q.to(fp8), k_cache=kc, v_cache=vc, q_descale=[1.0])),
        # a cache of the wrong rank is named as such, not as a descale of the wrong shape (audit 2026-11-29)
        (ValueError, "k_cache must have rank 4", dict(q=q, k_cache=kc[:, :, 0], v_cache=vc[:, :, 0], k_descale=ones)),
    ]
    # descales that cannot quantise an appended high-precision k / v (x8 = fp8(x / descale)): checked where the
    # values cost no sync (CPU tensors; on a GPU with FA_AMD_CHECK_KVCACHE=1, as the index tensors)
    if device == "cpu":
        new = dict(k=torch.randn(b, 1, hk, d).half(), v=torch.randn(b, 1, hk, d).half(), cache_seqlens=lens)
        for bad in (0.0, -1.0, float("nan")):
            cases.append((ValueError, "k_descale", dict(q=q, k_cache=kc, v_cache=vc, k_descale=ones * bad, **new)))
        cases.append((ValueError, "v_descale", dict(q=q, k_cache=kc, v_cache=vc, v_descale=ones * 0, **new)))
    for exc, word, kwargs in cases:
        with pytest.raises(exc, match=word):
            call(**kwargs)
    # an FP8 type this arch has no dot product for (e4m3fnuz is gfx942's), then an arch with no FP8 at all
    other = torch.float8_e4m3fnuz if fp8 != torch.float8_e4m3fnuz else torch.float8_e4m3fn
    with pytest.raises(TypeError, match="no dot product"):
        call(q, kc.to(other), vc.to(other), k_descale=ones, v_descale=ones)


@pytest.mark.parametrize("route", ["block_table", "seqused_k"])
def test_fp8_paged_varlen_mixed_dtypes_name_the_argument(device, route):
    """Paged / seqused_k flash_attn_varlen_func with only some of q, k, v FP8: a TypeError naming them (audit
    2026-11-29: an AttributeError, the absent new keys' names shadowing the pages')."""
    fp8 = _fp8(device)
    hq, hk, d = 2, 1, 16
    q = torch.randn(3, hq, d, device=device).half()
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
    if route == "block_table":
        kv = [torch.randn(2, 16, hk, d, device=device) for _ in range(2)]
        kw = dict(block_table=torch.tensor([[1, 0]], dtype=torch.int32, device=device))
        cu_k = torch.tensor([0, 20], dtype=torch.int32, device=device)
    else:
        kv = [torch.randn(20, hk, d, device=device) for _ in range(2)]
        kw = dict(seqused_k=torch.tensor([20], dtype=torch.int32, device=device))
        cu_k = torch.tensor([0, 20], dtype=torch.int32, device=device)
    for q_in, k_in, v_in, word in [(q, kv[0].half(), kv[1].to(fp8), "v is torch.float8"),
                                   (q, kv[0].to(fp8), kv[1].half(), "k is torch.float8"),
                                   (q.to(fp8), kv[0].half(), kv[1].half(), "q is torch.float8")]:
        with pytest.raises(TypeError, match=word):
            fa_amd.flash_attn_varlen_func(q_in, k_in, v_in, cu_q, cu_k, 3, 20, **kw)


def test_fp8_kvcache_arch_without_fp8(device, monkeypatch):
    from fa_amd.arch import arch_for
    from fa_amd.tuning import family_of

    fp8 = _fp8(device)
    arch = arch_for(torch.empty(0, device=device))
    monkeypatch.setitem(tables.FP8_DTYPES, family_of(arch), ())
    monkeypatch.delitem(tables.FP8_DTYPES, arch.name, raising=False)
    kc = torch.randn(1, 16, 1, 16, device=device).to(fp8)
    with pytest.raises(ValueError, match=f"{arch.name}.*flash_attn_with_kvcache with a bfloat16 or float16 k_cache"):
        fa_amd.flash_attn_with_kvcache(torch.randn(1, 1, 1, 16, device=device).half(), kc, kc.clone())


# --------------------------------------------------------------------------- GPU: realistic caches

@pytest.mark.gpu
@pytest.mark.parametrize("q_kind", ["fp8", "bf16"])
@pytest.mark.parametrize("page", [None, 256])
def test_fp8_kvcache_gpu(device, q_kind, page):
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(11)
    b, hq, hk, d, cap, new = 4, 32, 8, 128, 4096, 1
    if page:
        num_pages = b * cap // page
        kc, vc = (_rnd(gen, num_pages, page, hk, d, device=device) for _ in range(2))
        block_table = torch.randperm(num_pages, generator=gen).view(b, -1).to(torch.int32).to(device)
        owner = torch.empty(num_pages, dtype=torch.long, device=device)
        for i in range(b):
            owner[block_table[i].long()] = i
        extra = dict(block_table=block_table)
    else:
        kc, vc = (_rnd(gen, b, cap, hk, d, device=device) for _ in range(2))
        owner, extra = torch.arange(b, device=device), {}
    k_new, v_new = (_rnd(gen, b, new, hk, d, device=device).bfloat16() for _ in range(2))
    kd = _descale([kc.flatten(0, 1)[None].expand(b, -1, -1, -1), k_new.float()], fp8)
    vd = _descale([vc.flatten(0, 1)[None].expand(b, -1, -1, -1), v_new.float()], fp8)
    kc8, vc8 = fp8_scale_ref(kc, kd[owner], fp8), fp8_scale_ref(vc, vd[owner], fp8)
    lens = torch.tensor([1, 1000, 2900, cap - new], dtype=torch.int32, device=device)
    q = _rnd(gen, b, 1, hq, d, device=device)
    if q_kind == "fp8":
        q_arg, qd, q_emu = _fp8_q(q, hk, fp8)
        extra["q_descale"] = qd
    else:
        q_arg, q_emu = q.bfloat16(), q.bfloat16().double()
    out = fa_amd.flash_attn_with_kvcache(q_arg, kc8, vc8, k_new, v_new, cache_seqlens=lens, causal=True,
                                         k_descale=kd, v_descale=vd, **extra)
    kw = dict(cache_seqlens=lens, causal=True, block_table=extra.get("block_table"))
    ref, _, _, _ = attention_kvcache_ref(q.double(), kc.double(), vc.double(), k_new.double(), v_new.double(), **kw)
    emu, _, _, _ = attention_kvcache_ref(q_emu, _deq(fp8_scale_ref(kc, kd[owner], fp8), kd[owner]),
                                         _deq(fp8_scale_ref(vc, vd[owner], fp8), vd[owner]),
                                         _deq(fp8_scale_ref(k_new, kd, fp8), kd), _deq(fp8_scale_ref(v_new, vd, fp8),
                                                                                      vd), **kw)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)


# --------------------------------------------------------------------------- NaN in an appended k / v

def test_fp8_kvcache_append_keeps_nan(device):
    """A NaN in high-precision new k / v appended to an FP8 cache is the FP8 type's NaN in the cache, and
    the rows that attend to it come out NaN, as with an fp16 cache (not a silently saturated -max)."""
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(21)
    b, h, d, cap, new = 2, 2, 32, 24, 3
    q = _rnd(gen, b, 1, h, d, device=device).half()
    lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    for which in ("k", "v"):
        kn, vn = (_rnd(gen, b, new, h, d, device=device).half() for _ in range(2))
        (kn if which == "k" else vn)[0, 1, 0, 3] = float("nan")
        kc, vc = (torch.zeros(b, cap, h, d, device=device).to(fp8) for _ in range(2))
        out = fa_amd.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)
        cache = kc if which == "k" else vc
        assert torch.isnan(cache[0, 1, 0, 3].float()), f"appended {which}: NaN stored as {cache[0, 1, 0, 3].float()}"
        hp_k, hp_v = (torch.zeros(b, cap, h, d, device=device).half() for _ in range(2))
        hp_out = fa_amd.flash_attn_with_kvcache(q, hp_k, hp_v, kn, vn, cache_seqlens=lens)
        assert torch.equal(torch.isnan(out), torch.isnan(hp_out)), f"appended {which}: NaN rows differ from fp16"


def test_fp8_kvcache_under_torch_compile(device):
    """Traced, an FP8 cache call takes the custom ops with the three descales as they are (the append's and the
    decode's): the same output and cache bytes as eager."""
    fp8 = _fp8(device)
    gen = torch.Generator().manual_seed(5)
    b, hq, hk, d, cache = 2, 4, 2, 32, 40
    q = _rnd(gen, b, 1, hq, d, device=device).half()
    k_cache, v_cache = (_rnd(gen, b, cache, hk, d, device=device).to(fp8) for _ in range(2))
    k_new, v_new = (_rnd(gen, b, 1, hk, d, device=device).half() for _ in range(2))
    kd, vd = (torch.rand(b, hk, generator=gen).to(device) + 0.5 for _ in range(2))
    lens = torch.tensor([5, 30], dtype=torch.int32, device=device)

    def call(k_cache, v_cache):
        return fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                             k_descale=kd, v_descale=vd.t().contiguous().t(), num_splits=2)

    eager = (k_cache.clone(), v_cache.clone())
    want = call(*eager)
    traced = (k_cache.clone(), v_cache.clone())
    torch._dynamo.reset()
    got = torch.compile(call, backend="aot_eager", fullgraph=True)(*traced)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert all(torch.equal(a.view(torch.uint8), b_.view(torch.uint8)) for a, b_ in zip(traced, eager))
