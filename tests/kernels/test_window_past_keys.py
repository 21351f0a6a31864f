"""Window entries that reach past every key bound nothing, as in flash-attn's C++ API (window_size_left /
_right >= seqlen_k -> -1 before causal folds in; seqlen_k is k's length, max_seqlen_k, or a KV cache's
capacity).  Applied literally, a right window >= seqlen_k still masks the top rows of a call with more queries
than keys (bottom-right alignment), so these calls have sq >= sk + 2.  Also: a causal / local
flash_attn_with_kvcache call whose query tokens would be rotated past the rotary tables is refused."""
from __future__ import annotations

import math

import pytest
import torch

import fa_amd
from fa_amd.kernels import launch
from fa_amd.reference import attention_kvcache_ref, attention_paged_varlen_ref, attention_ref, attention_varlen_ref

from .helpers import assert_close_to_ref, cu_seqlens


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _rand(*shape, device, dtype=torch.float16):
    return torch.randn(*shape, device=device).to(dtype)


def _check_unbounded(got, ref_fn, literal_fn, dtype):
    """got equals the unwindowed reference (within the usual bound) and the literal window would differ."""
    ref64, ref_lp = ref_fn(True), ref_fn(False)
    assert_close_to_ref("out", got, ref64, ref_lp, dtype)
    assert (literal_fn().double() - ref64).abs().max().item() > 1e-2, "the case does not tell the two rules apart"


@pytest.mark.parametrize("window", [(-1, 3), (-1, 5), (4, 3)])
def test_dense_right_window_past_the_keys_bounds_nothing(device, window):
    torch.manual_seed(0)
    b, sq, sk, hq, hk, d = 2, 7, 3, 4, 2, 32
    q, k, v = _rand(b, sq, hq, d, device=device), _rand(b, sk, hk, d, device=device), _rand(b, sk, hk, d, device=device)
    out = fa_amd.flash_attn_func(q, k, v, window_size=window)
    _check_unbounded(out, lambda up: attention_ref(q, k, v, upcast=up)[0],
                     lambda: attention_ref(q, k, v, window_size=window)[0], q.dtype)
    # the gradients follow the same rule (the backward takes the forward's window)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(fa_amd.flash_attn_func(qg, kg, vg, window_size=window), (qg, kg, vg), dout)
    grads_none = torch.autograd.grad(fa_amd.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout)
    for g, g0 in zip(grads, grads_none):
        assert torch.equal(g, g0)


def test_dense_causal_still_masks_with_a_wide_window(device):
    # causal folds in after the rule: window (-1, 3) with causal is causal
    torch.manual_seed(1)
    q, k, v = _rand(1, 7, 2, 32, device=device), _rand(1, 3, 2, 32, device=device), _rand(1, 3, 2, 32, device=device)
    out = fa_amd.flash_attn_func(q, k, v, causal=True, window_size=(-1, 3))
    assert torch.equal(out, fa_amd.flash_attn_func(q, k, v, causal=True))


def test_varlen_right_window_past_max_seqlen_k_bounds_nothing(device):
    torch.manual_seed(2)
    lens_q, lens_k, hq, hk, d = [7, 0, 6], [3, 2, 3], 4, 2, 32
    q = _rand(sum(lens_q), hq, d, device=device)
    k, v = _rand(sum(lens_k), hk, d, device=device), _rand(sum(lens_k), hk, d, device=device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    window = (-1, 3)
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_size=window)
    _check_unbounded(out, lambda up: attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=up)[0],
                     lambda: attention_varlen_ref(q, k, v, cu_q, cu_k, window_size=window)[0], q.dtype)


@pytest.mark.parametrize("page", [None, 16])
def test_kvcache_right_window_past_the_capacity_bounds_nothing(device, page):
    torch.manual_seed(3)
    b, sq, hq, hk, d, capacity = 2, 19, 4, 2, 32, 16
    q = _rand(b, sq, hq, d, device=device)
    kw = dict(cache_seqlens=torch.tensor([16, 11], dtype=torch.int32, device=device))
    if page:
        k_cache, v_cache = _rand(b + 2, page, hk, d, device=device), _rand(b + 2, page, hk, d, device=device)
        kw["block_table"] = torch.tensor([[3], [0]], dtype=torch.int32, device=device)
    else:
        k_cache, v_cache = _rand(b, capacity, hk, d, device=device), _rand(b, capacity, hk, d, device=device)
    window = (-1, capacity)
    out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, window_size=window, **kw)
    _check_unbounded(out, lambda up: attention_kvcache_ref(q, k_cache, v_cache, None, None, upcast=up, **kw)[0],
                     lambda: attention_kvcache_ref(q, k_cache, v_cache, None, None, window_size=window, **kw)[0],
                     q.dtype)


def test_paged_varlen_right_window_past_max_seqlen_k_bounds_nothing(device):
    torch.manual_seed(4)
    lens_q, lens_k, hq, hk, d, page = [19, 4], [16, 9], 4, 2, 32, 16
    q = _rand(sum(lens_q), hq, d, device=device)
    k_pages, v_pages = _rand(4, page, hk, d, device=device), _rand(4, page, hk, d, device=device)
    table = torch.tensor([[2], [1]], dtype=torch.int32, device=device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    window = (-1, 16)
    out = fa_amd.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k),
                                        window_size=window, block_table=table)

    def ref(up, **kw):
        return attention_paged_varlen_ref(q, k_pages, v_pages, cu_q, cu_k, table, upcast=up, **kw)[0]

    _check_unbounded(out, lambda up: ref(up), lambda: ref(True, window_size=window), q.dtype)


def test_fp8_right_window_past_the_keys_bounds_nothing(device):
    from fa_amd.fp8 import fp8_dtypes

    torch.manual_seed(5)
    fp8 = fp8_dtypes(torch.empty(0, device=device))[0]
    q, k, v = (torch.randn(1, *shape, device=device).clamp(-3, 3).to(fp8) for shape in ((7, 2, 32), (3, 2, 32),
                                                                                          (3, 2, 32)))
    assert torch.equal(fa_amd.flash_attn_func(q, k, v, window_size=(-1, 3)), fa_amd.flash_attn_func(q, k, v))


def _rotary_case(device, seqlens):
    torch.manual_seed(6)
    b, hq, hk, d, capacity = 2, 2, 1, 32, 16
    q = _rand(b, 4, hq, d, device=device)
    k_cache, v_cache = _rand(b, capacity, hk, d, device=device), _rand(b, capacity, hk, d, device=device)
    k, v = _rand(b, 1, hk, d, device=device), _rand(b, 1, hk, d, device=device)
    angle = torch.rand(capacity + 2, d // 4, device=device) * 2 * math.pi
    return q, k_cache, v_cache, k, v, angle.cos(), angle.sin(), seqlens


@pytest.mark.parametrize("form", ["int", "tensor"])
def test_kvcache_refuses_query_positions_past_the_rotary_tables(device, form):
    # causal: query token i is rotated at cache_seqlens + i; 14 + 3 = 17 is past 16 rows of tables
    q, k_cache, v_cache, k, v, cos, sin, _ = _rotary_case(device, None)
    seqlens = 14 if form == "int" else torch.tensor([14, 3], dtype=torch.int32, device=device)
    if form == "tensor" and device != "cpu":
        pytest.skip("device values are checked on the host only on the CPU or under FA_AMD_CHECK_KVCACHE=1")
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin cover 16 positions.*query token i"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos[:16], rotary_sin=sin[:16],
                                       cache_seqlens=seqlens, causal=True)
    # tables that reach position 17 take the call
    out = fa_amd.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, rotary_cos=cos[:18],
                                         rotary_sin=sin[:18], cache_seqlens=seqlens, causal=True)
    assert torch.isfinite(out).all()
    # not causal or local: every query token sits at cache_seqlens, inside the tables
    fa_amd.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, rotary_cos=cos[:16],
                                   rotary_sin=sin[:16], cache_seqlens=seqlens)
