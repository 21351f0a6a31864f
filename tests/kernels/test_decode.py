"""flash_attn_with_kvcache and the paged / seqused_k varlen route vs the float64 reference
(fa_amd.reference.attention_kvcache_ref), over flash-attn's kvcache grid.

CPU (interpreter): a covering design of small odd shapes -- every option value appears, and the
risky pairs (paged x append x rotary, leftpad x causal, splits x paged, seqlen_q > 1 x rotary x
causal/local, cache_batch_idx x append) combine -- fp16 and fp32.  GPU (@gpu): a wider sampled grid
in bf16/fp16 at realistic cache lengths, and CUDA-graph capture with cache_seqlens changed in place.
After an append, k_cache must match the expected cache (rotary rounding aside) and v_cache exactly.
"""
import math
import random

import pytest
import torch

import fa_amd
from fa_amd import kvcache, tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import decode, launch
from fa_amd.reference import attention_kvcache_ref, attention_paged_varlen_ref, attention_varlen_ref
from fa_amd.tuning import tables

from .helpers import assert_close_to_ref, cu_seqlens


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def make_case(device, dtype=torch.float16, b=2, sq=1, hq=4, hk=2, d=64, cache=37, new=0, rot=0.0, interleaved=False,
              page=None, batch_idx=False, leftpad=False, causal=False, window=(-1, -1), alibi=None, softcap=0.0,
              splits=1, seqlens="tensor", sinks=False, seed=0, fixed_lens=None):
    """Inputs of one flash_attn_with_kvcache call (random, never zero) and the kwargs both sides take
    (`fixed_lens`: these cache_seqlens instead of random ones)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q = rnd(b, sq, hq, d)
    rows = 2 * b + 1 if batch_idx else b
    block_table = None
    if page:
        pages_per_seq = math.ceil(cache / page)
        num_pages = b * pages_per_seq + 3  # spare pages nobody uses
        k_cache, v_cache = rnd(num_pages, page, hk, d), rnd(num_pages, page, hk, d)
        block_table = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq)
        block_table = block_table.to(torch.int32).to(device)
        capacity = pages_per_seq * page
    else:
        k_cache, v_cache = rnd(rows, cache, hk, d), rnd(rows, cache, hk, d)
        capacity = cache
    k = v = None
    if new:
        k, v = rnd(b, new, hk, d), rnd(b, new, hk, d)
    lens = torch.randint(0 if new else 1, capacity - new + 1, (b,), generator=gen, dtype=torch.int32)
    if fixed_lens is not None:
        lens = torch.tensor(fixed_lens, dtype=torch.int32)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    if seqlens == "int":
        kw["cache_seqlens"] = int(lens[0])
    elif seqlens == "tensor":
        kw["cache_seqlens"] = lens.to(device)
    if leftpad:
        kw["cache_leftpad"] = torch.stack([torch.randint(0, int(n) + 1, (), generator=gen) for n in lens]).to(
            torch.int32).to(device)
    if batch_idx:
        kw["cache_batch_idx"] = torch.randperm(rows, generator=gen)[:b].to(torch.int32).to(device)
    if block_table is not None:
        kw["block_table"] = block_table
    rotary_dim = int(rot * d) // 2 * 2
    if rotary_dim:
        angle = torch.rand(capacity, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
        kw.update(rotary_cos=angle.cos().to(dtype).to(device), rotary_sin=angle.sin().to(dtype).to(device),
                  rotary_interleaved=interleaved)
    if alibi == "heads":
        kw["alibi_slopes"] = (torch.rand(hq, generator=gen) * 0.3).to(device)
    elif alibi == "batch_heads":
        kw["alibi_slopes"] = (torch.rand(b, hq, generator=gen) * 0.3).to(device)
    if sinks:  # learnable sinks (gpt-oss); one head without (-inf)
        logits = torch.randn(hq, generator=gen) * 2
        logits[-1] = float("-inf")
        kw["sinks"] = logits.to(device)
    return q, k_cache, v_cache, k, v, kw, splits


def check_case(device, **case):
    q, k_cache, v_cache, k, v, kw, splits = make_case(device, **case)
    dtype = q.dtype
    ref64, lse64, k_expected, v_expected = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    seqlens = kw.get("cache_seqlens")
    seqlens_before = seqlens.clone() if isinstance(seqlens, torch.Tensor) else seqlens
    out, lse = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=splits, return_softmax_lse=True,
                                              **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_close_to_ref("out", out, ref64, ref_lp, dtype)
    # rows that see no key: lse +inf (flash-attn); elsewhere the fp32 log-sum-exp
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64))
    live = torch.isfinite(lse64)
    if live.any():
        assert (lse.double()[live] - lse64[live]).abs().max().item() < 1e-3 * max(1.0, lse64[live].abs().max().item())
    if k is not None:
        torch.testing.assert_close(k_cache.double(), k_expected.double(), atol=1e-3, rtol=1e-3)
        assert torch.equal(v_cache, v_expected)
    else:
        assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    if isinstance(seqlens, torch.Tensor):
        assert torch.equal(seqlens, seqlens_before), "cache_seqlens must never be modified"


# Covering design: every value of every option, and the pairs that share code paths that can go
# wrong together.  (Each case costs ~0.5 s in the interpreter.)
CPU_CASES = {
    "mha_d32": dict(hq=4, hk=4, d=32),
    "append1_d59_heuristic_splits": dict(d=59, new=1, splits=0),
    "append3_sq3_causal_rot_neox": dict(sq=3, new=3, causal=True, rot=1.0),
    "append2_sq2_causal_rot_half_gptj_mqa_d80": dict(sq=2, new=2, causal=True, rot=0.5, interleaved=True, hk=1, d=80),
    "paged16_d128_splits3": dict(page=16, d=128, splits=3, cache=70),
    "paged48_append_rot_gptj_causal_sq2": dict(page=48, new=2, rot=1.0, interleaved=True, causal=True, sq=2, cache=60),
    "paged32_append_leftpad_causal_alibi_splits2": dict(page=32, new=1, leftpad=True, causal=True, alibi="heads",
                                                        splits=2, cache=50),
    "batch_idx_append_d256": dict(batch_idx=True, new=2, d=256, cache=24),
    "batch_idx_leftpad_sq4_causal_local": dict(batch_idx=True, leftpad=True, sq=4, causal=True, window=(6, 0)),
    "leftpad_local_sq3_append_rot_half": dict(leftpad=True, window=(5, 2), sq=3, new=3, rot=0.5),
    "noncausal_rot_q_at_cache_end_alibi": dict(sq=2, new=2, rot=1.0, alibi="batch_heads"),
    "softcap_causal_paged16_splits2_d32": dict(softcap=3.0, causal=True, page=16, splits=2, d=32),
    "softcap_window_left_sq3_mqa": dict(softcap=2.0, window=(4, -1), sq=3, hk=1, hq=3),
    "gqa3_sq6_wide_rows_causal_append_splits2": dict(hq=6, hk=2, sq=6, new=6, causal=True, splits=2),
    "seqlen_new_lt_seqlen_q_causal": dict(sq=3, new=1, causal=True, rot=1.0),
    "paged32_d256_rot_half_append_causal": dict(page=32, d=256, rot=0.5, new=1, causal=True, cache=40),
    "alibi_batch_heads_d80_local_causal": dict(d=80, alibi="batch_heads", causal=True, window=(3, 0), sq=2),
    "int_cache_seqlens_append_rot": dict(seqlens="int", new=2, rot=1.0, interleaved=True),
    "whole_cache_no_seqlens": dict(seqlens=None, sq=2, causal=True),
    "fp32_d128_paged16_append_rot_splits2": dict(dtype=torch.float32, d=128, page=16, new=1, rot=1.0, splits=2),
    "fp32_d59_batch_idx_leftpad_causal": dict(dtype=torch.float32, d=59, batch_idx=True, leftpad=True, causal=True,
                                              sq=2),
    "many_splits_more_than_blocks": dict(splits=64, new=1, causal=True, cache=45),
    "sinks_no_split_causal_sq3": dict(sinks=True, sq=3, causal=True, seed=4),
    "sinks_split_paged_append": dict(sinks=True, splits=3, page=16, new=1, cache=40),
}


@pytest.mark.parametrize("case", [dict(new=1, causal=True), dict(page=16, new=1, cache=40),
                                  dict(leftpad=True, batch_idx=True, sq=2, causal=True)], ids=["append", "paged", "rows"])
def test_index_tensor_dtypes_switch_between_calls(device, case):
    """int32 and int64 index tensors (cache_seqlens, block_table, cache_leftpad, cache_batch_idx) in turn: each
    call is right (a launch plan made for one dtype must not replay with the other; audit 2026-11-28: on the
    GPU the third call read int32 values through the int64 kernel)."""
    for dtype in (torch.int32, torch.int64, torch.int32):
        q, k_cache, v_cache, k, v, kw, splits = make_case(device, seed=5, **case)
        for name in ("cache_seqlens", "block_table", "cache_leftpad", "cache_batch_idx"):
            if name in kw:
                kw[name] = kw[name].to(dtype)
        ref64, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
        ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
        out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=splits, **kw)
        assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)


def test_an_append_refuses_caches_that_share_memory(device):
    """The append writes the caches in place: an expanded cache, or one tensor as both caches, would make the
    writes overwrite each other (audit 2026-11-28: accepted, one row's new key lost); slices of one packed KV
    tensor are two caches and work."""
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, new=1, causal=True, seed=2)
    expanded = k_cache[:1].expand_as(k_cache)
    with pytest.raises(ValueError, match="k_cache has elements that share memory"):
        fa_amd.flash_attn_with_kvcache(q, expanded, v_cache, k, v, **kw)
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, k_cache, k, v, **kw)
    packed = torch.stack([k_cache, v_cache], dim=2)  # (rows, capacity, 2, hk, d)
    ref64, _, k_want, v_want = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    out = fa_amd.flash_attn_with_kvcache(q, packed[:, :, 0], packed[:, :, 1], k, v, **kw)
    assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)
    assert torch.equal(packed[:, :, 1], v_want)
    fa_amd.flash_attn_with_kvcache(q, expanded, v_cache, **kw)  # no append: nothing is written
    # overlapping views of one buffer (audit 2026-11-29: accepted, the k append overwrote a v slot)
    buf = torch.cat([k_cache, k_cache[:, :1]], dim=1)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        fa_amd.flash_attn_with_kvcache(q, buf[:, :-1], buf[:, 1:], k, v, **kw)
    # caches side by side in one buffer share no element: accepted
    side = torch.cat([k_cache, v_cache], dim=0)
    rows = k_cache.shape[0]
    out = fa_amd.flash_attn_with_kvcache(q, side[:rows], side[rows:], k.clone(), v.clone(), **kw)
    assert torch.equal(side[rows:], v_want)


def test_plain_calls_read_tensor_scalars_and_tangents_every_call(device):
    """The plain calls' memo keys hold their scalars: 0-d tensors (softmax_scale, window entries) can change in
    place, and a forward-AD tangent must still be refused after a plain call of the same structure (audit
    2026-11-29: the memo reused the first call's scale and window, and dropped the tangent)."""
    q, k_cache, v_cache, _, _, kw, _ = make_case(device, seed=4)
    kw = {n: x for n, x in kw.items() if n not in ("softmax_scale", "window_size")}
    scale = torch.tensor(0.25)
    fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, softmax_scale=scale, **kw)
    scale.fill_(2.0)
    out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, softmax_scale=scale, **kw)
    assert torch.equal(out, fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, softmax_scale=2.0, **kw))
    scale.fill_(float("nan"))
    with pytest.raises(ValueError, match="softmax_scale"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, softmax_scale=scale, **kw)
    left = torch.tensor(3)
    fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, window_size=(left, 0), **kw)
    left.fill_(-5)
    with pytest.raises(ValueError, match="window_size"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, window_size=(left, 0), **kw)
    import torch.autograd.forward_ad as fwAD
    fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="q carries a tangent"):
            fa_amd.flash_attn_with_kvcache(dual, k_cache, v_cache, **kw)


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_kvcache_grid(device, case):
    check_case(device, **CPU_CASES[case])


@pytest.mark.parametrize("case", ["append_rot_causal_sq2", "paged_leftpad_alibi_d59"])
def test_reload_chunk_kernel(device, monkeypatch, case):
    """The register-light variant (tables RELOAD_CHUNK, RDNA rows): q streamed in head-dim chunks;
    with rotary the launcher rotates q first (kernels/rotary.py)."""
    from fa_amd import tuning
    from fa_amd.tuning import tables

    family = tuning._decode_family(fa_amd.arch.arch_for(torch.empty(0, device=device)))
    rows = [dict(r, decode=dict(r["decode"], RELOAD_CHUNK=16)) for r in tables.DECODE_TABLES[family]]
    monkeypatch.setitem(tables.DECODE_TABLES, family, rows)
    monkeypatch.setattr(tuning, "_DECODE_RESOLVED", {})
    cases = {"append_rot_causal_sq2": dict(new=2, rot=1.0, interleaved=True, causal=True, sq=2),
             "paged_leftpad_alibi_d59": dict(page=16, d=59, leftpad=True, alibi="heads", causal=True, sq=3,
                                             splits=2)}
    check_case(device, **cases[case])


def test_rows_without_keys_give_zero_and_inf_lse(device):
    # causal with more query tokens than keys (and an empty cache row): flash-attn's convention
    for splits in (1, 2):
        check_case(device, sq=3, cache=12, seqlens="tensor", causal=True, splits=splits, seed=3)
        # with sinks such rows get lse = sink (and output 0)
        check_case(device, sq=3, cache=12, seqlens="tensor", causal=True, splits=splits, sinks=True, seed=3)
    q, k_cache, v_cache, _, _, kw, _ = make_case(device, sq=2, cache=8)
    kw["cache_seqlens"] = torch.zeros(2, dtype=torch.int32, device=device)
    out, lse = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse > 0).all()


def test_block_table_padding_entries_past_the_sequence_are_never_used(device):
    # Transformers' continuous batching fills unused block-table slots with -1
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, page=16, cache=64, new=1, causal=True, seed=5)
    lens = kw["cache_seqlens"]
    table = kw["block_table"].clone()
    for row, n in enumerate(lens.tolist()):
        table[row, math.ceil((n + 1) / 16):] = -1
    ref, _, k_exp, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    kw["block_table"] = table
    out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k_cache.double(), k_exp.double(), atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------- varlen: block_table / seqused_k

def paged_varlen_inputs(device, lens_q, lens_k, hq, hk, d, dtype, page, spare_pages, extra_q=0):
    """(q, k_pages, v_pages, block_table, cu_seqlens_q, cu_seqlens_k) of a varlen call over paged keys
    (shuffled pages, `spare_pages` nobody uses; `extra_q` tokens past cu_seqlens_q[-1])."""
    per_seq = max(math.ceil(n / page) for n in lens_k)
    num_pages = len(lens_k) * per_seq + spare_pages
    k_pages = torch.randn(num_pages, page, hk, d, device=device).to(dtype)
    v_pages = torch.randn(num_pages, page, hk, d, device=device).to(dtype)
    table = torch.randperm(num_pages, device=device)[: len(lens_k) * per_seq].view(len(lens_k), per_seq).int()
    q = torch.randn(sum(lens_q) + extra_q, hq, d, device=device).to(dtype)
    return q, k_pages, v_pages, table, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)


@pytest.mark.parametrize("page,causal,window", [(16, True, (-1, -1)), (48, False, (7, 3))])
def test_varlen_block_table(device, page, causal, window):
    torch.manual_seed(0)
    lens_q, lens_k = [3, 0, 1, 20], [10, 5, 33, 20]  # an empty query segment; chunked prefill on a cache
    hq, hk, d, dtype = 4, 2, 40, torch.float16
    q, k_pages, v_pages, table, cu_q, cu_k = paged_varlen_inputs(device, lens_q, lens_k, hq, hk, d, dtype, page, 2)
    kw = dict(causal=causal, window_size=window)
    out = fa_amd.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k),
                                        block_table=table, **kw)
    ref64, _ = attention_paged_varlen_ref(q, k_pages, v_pages, cu_q, cu_k, table, **kw)
    ref_lp, _ = attention_paged_varlen_ref(q, k_pages, v_pages, cu_q, cu_k, table, upcast=False, **kw)
    assert_close_to_ref("out", out, ref64, ref_lp, dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_seqused_k(device, paged):
    torch.manual_seed(1)
    lens_q, lens_k, used = [2, 1, 4], [9, 17, 6], [7, 17, 0]
    hq, hk, d, dtype = 2, 1, 64, torch.float32
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = torch.randn(sum(lens_q), hq, d, device=device, dtype=dtype)
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    if paged:
        table = torch.arange(6, device=device, dtype=torch.int32).view(3, 2)
        k = torch.randn(6, 16, hk, d, device=device, dtype=dtype)
        v = torch.randn(6, 16, hk, d, device=device, dtype=dtype)
        ref64, _ = attention_paged_varlen_ref(q, k, v, cu_q, cu_k, table, seqused_k=seqused, causal=True)
        ref_lp, _ = attention_paged_varlen_ref(q, k, v, cu_q, cu_k, table, seqused_k=seqused, causal=True,
                                               upcast=False)
    else:
        table = None
        k = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype)
        v = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype)
        keep = torch.cat([torch.arange(n, device=device) < u for n, u in zip(lens_k, used)])
        cu_used = cu_seqlens(used, device)
        ref64, _ = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, causal=True)
        ref_lp, _ = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, causal=True, upcast=False)
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                        block_table=table, seqused_k=seqused)
    assert_close_to_ref("out", out, ref64, ref_lp, dtype)
    # a head dim with a stride is read from a copy, as the dense varlen path and flash-attn's wrapper do
    k_t, v_t = (torch.stack([t, t], dim=-1)[..., 0] for t in (k, v))
    assert k_t.stride(-1) != 1
    out_t = fa_amd.flash_attn_varlen_func(q, k_t, v_t, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                          block_table=table, seqused_k=seqused)
    assert torch.equal(out_t, out)


@pytest.mark.parametrize("route", ["seqused_k", "block_table", "batch0"])
def test_varlen_paged_routes_without_query_rows_fill_every_token(device, route):
    """q with tokens but no sequence holding one (cu_seqlens_q all zero, max_seqlen_q 0, or no sequence at all):
    no program runs, and every token gets output 0 and lse +inf, as the tail past cu_seqlens_q[-1] does (audit
    2026-11-29: the seqused_k / block_table route returned the poisoned buffers)."""
    hq, hk, d = 2, 1, 16
    q = torch.randn(3, hq, d, device=device)
    kw = {}
    if route == "seqused_k":
        k, v = torch.randn(5, hk, d, device=device), torch.randn(5, hk, d, device=device)
        cu_q, cu_k, kw["seqused_k"] = cu_seqlens([0], device), cu_seqlens([5], device), cu_seqlens([5], device)[1:]
    else:
        k, v = torch.randn(2, 16, hk, d, device=device), torch.randn(2, 16, hk, d, device=device)
        batch = 0 if route == "batch0" else 1
        cu_q, cu_k = cu_seqlens([0] * batch, device), cu_seqlens([5] * batch, device)
        kw["block_table"] = torch.zeros(batch, 1, dtype=torch.int32, device=device)
    out, lse, _ = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 16, return_attn_probs=True, **kw)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, float("inf")))


def test_an_append_to_the_caches_of_an_empty_batch(device):
    """Batch 0 (a serving step with nothing scheduled): two empty caches share address 0 but are two caches; the
    append and the attention do nothing (audit 2026-11-29: "k_cache and v_cache are the same memory")."""
    q = torch.randn(0, 1, 4, 32, device=device)
    k_cache, v_cache = torch.randn(0, 8, 2, 32, device=device), torch.randn(0, 8, 2, 32, device=device)
    new = torch.randn(0, 1, 2, 32, device=device)
    seqlens = torch.zeros(0, dtype=torch.int32, device=device)
    out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, new, new.clone(), cache_seqlens=seqlens)
    assert out.shape == q.shape


@pytest.mark.parametrize("page,splits", [(None, 1), (None, 3), (16, 2)])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_slots_before_cache_leftpad_are_never_read(device, page, splits, poison):
    # memory before cache_leftpad is not the sequence's (an uninitialised cache may hold NaN or inf there):
    # like flash-attn, the output ignores it, also in the key block that holds the leftpad boundary
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, page=page, cache=48, new=1, causal=True, sq=2, seed=11,
                                                 fixed_lens=[30, 40])
    kw["cache_leftpad"] = _i32(device, 5, 23)
    for b, pad in enumerate(kw["cache_leftpad"].tolist()):
        for pos in range(pad):
            if page:
                row, slot = int(kw["block_table"][b, pos // page]), pos % page
            else:
                row, slot = b, pos
            k_cache[row, slot] = poison
            v_cache[row, slot] = poison
    ref64, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=splits, **kw)
    assert torch.isfinite(out).all()
    assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)


@pytest.mark.parametrize("name,value,match", [
    ("cache_seqlens", [3, 10], "cache_seqlens"), ("block_table", [[0, 1], [2, 3]], "block_table"),
    ("softmax_scale", [0.1], "softmax_scale"), ("softcap", [1.0], "softcap"), ("k_cache", "numpy", "k_cache")])
def test_unhashable_arguments_of_a_plain_call_name_the_argument(device, name, value, match):
    # a plain call (no append, rotary, index tensors) first looks its structure up in a memo: an argument
    # that cannot be hashed must still reach the checks that name it
    q, k_cache, v_cache, _, _, kw, _ = make_case(device, cache=32)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=kw["cache_seqlens"])
    args[name] = k_cache.cpu().numpy() if value == "numpy" else value
    with pytest.raises((TypeError, ValueError), match=match):
        fa_amd.flash_attn_with_kvcache(**args)


def test_window_past_the_cache_does_not_make_rotary_per_token(device):
    # flash-attn: window entries >= the cache's capacity bound nothing, so a non-causal call with them is not
    # local, and all of q sits at cache_seqlens for rotary, as with window (-1, -1)
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, cache=32, sq=3, new=2, rot=1.0, seed=2)
    outs = []
    for window in ((-1, -1), (32, 1000), (-1, 40)):
        kw["window_size"] = window
        outs.append(fa_amd.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, **kw))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    kw["window_size"] = (31, -1)  # a window inside the cache is local: q token i at cache_seqlens + i
    ref64, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    out = fa_amd.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, **kw)
    assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)
    assert not torch.equal(out, outs[0])


def test_varlen_block_table_returns_the_lse(device):
    # flash-attn >= 2.6 returns (out, softmax_lse, S_dmask) from a paged varlen call with return_attn_probs; S_dmask
    # is empty without dropout
    torch.manual_seed(3)
    lens_q, lens_k = [2, 0, 5], [17, 4, 40]
    q, k_pages, v_pages, table, cu_q, cu_k = paged_varlen_inputs(device, lens_q, lens_k, 4, 2, 32, torch.float16, 16, 1)
    out, lse, s_dmask = fa_amd.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k),
                                                      causal=True, block_table=table, return_attn_probs=True)
    ref64, lse64 = attention_paged_varlen_ref(q, k_pages, v_pages, cu_q, cu_k, table, causal=True)
    ref_lp, _ = attention_paged_varlen_ref(q, k_pages, v_pages, cu_q, cu_k, table, causal=True, upcast=False)
    assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)
    assert lse.shape == (4, sum(lens_q)) and lse.dtype == torch.float32 and s_dmask.numel() == 0
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64))
    live = torch.isfinite(lse64)
    assert (lse.double()[live] - lse64[live]).abs().max().item() < 1e-3 * max(1.0, lse64[live].abs().max().item())


# --------------------------------------------------------------------------- split heuristic, compile

def test_split_heuristic_fills_the_gpu_and_respects_limits():
    policy = dict(programs_per_sm=2, full_fraction=0.8, efficiency=0.85, max_splits=128, min_blocks_per_split=2)
    assert decode.decode_num_splits(64 * 8, 512, 132, policy) == 1  # batch 64 x 8 KV heads fill 132 SMs
    s = decode.decode_num_splits(8, 2048, 132, policy)  # batch 1, 8 KV heads, 128k keys / 64
    assert 20 <= s <= 128 and 8 * s >= 0.8 * 264
    assert decode.decode_num_splits(8, 3, 132, policy) == 1  # too few key blocks to share
    assert decode.decode_num_splits(8, 2048, 132, policy, requested=1) == 1
    assert decode.decode_num_splits(8, 5, 132, policy, requested=64) == 5  # never more splits than blocks
    assert decode.decode_num_splits(4, 10, 1, policy) == 1  # the interpreter (one SM): CPU tests split on request


def test_split_rule_head_dim_overrides_apply_to_the_rows_own_tile(monkeypatch):
    """A family's DECODE_SPLITS "head_dims" overrides apply to the table row a padded head dim resolves to,
    and only when the launch runs that row's own tile (not its wide / fp32 / FP8-cache variants)."""
    from fa_amd.arch import Arch
    from fa_amd.tuning import get_decode_split_policy, tables

    base = dict(programs_per_sm=2, full_fraction=0.8, efficiency=0.85, max_splits=128, min_blocks_per_split=2)
    monkeypatch.setitem(tables.DECODE_SPLITS, "sm90", dict(base, head_dims={128: dict(programs_per_sm=0.5)}))
    sm90 = Arch("cuda", "sm90", 32)
    assert get_decode_split_policy(sm90, 128)["programs_per_sm"] == 0.5
    assert get_decode_split_policy(sm90, 96)["programs_per_sm"] == 0.5  # (96 resolves to the d128 row)
    assert get_decode_split_policy(sm90, 64) == base
    assert get_decode_split_policy(sm90, 128, table_tile=False) == base
    assert "head_dims" not in get_decode_split_policy(sm90, 256)
    assert get_decode_split_policy(Arch("hip", "gfx942", 64), 128) == tables.DECODE_SPLITS["default"]
    # the sm90 rule as tabled: batch 1 / 8 over 8 KV heads at d128 (128-key tiles, 132 SMs)
    monkeypatch.undo()
    d128 = get_decode_split_policy(sm90, 128)
    assert [decode.decode_num_splits(b * 8, 32768 // 128, 132, d128) for b in (1, 8, 64)] == [16, 2, 1]
    # one key block per split at d128 (the fused merge's steps made 16 splits of 2k faster than 8)
    assert decode.decode_num_splits(8, 2048 // 128, 132, d128) == 16
    assert decode.decode_num_splits(8, 2048 // 128, 132, get_decode_split_policy(sm90, 64)) == 8


def test_l2_flush_modes():
    from fa_amd import bench

    assert bench.l2_flush("none")() is None
    with pytest.raises(ValueError, match="unknown L2 flush 'bogus'"):
        bench.l2_flush("bogus")


def test_decode_tables_cover_every_family():
    from fa_amd.arch import Arch
    from fa_amd.tuning import get_decode_config, tables

    assert set(tables.TABLES) <= set(tables.DECODE_TABLES)
    for family, rows in tables.DECODE_TABLES.items():
        backend = "hip" if family.startswith("gfx") else ("cuda" if family.startswith("sm") else "interpreter")
        arch = Arch(backend, family, 64 if family.startswith("gfx9") else 32)
        for d in (32, 64, 128, 256):
            cfgs = get_decode_config(arch, d)
            assert set(cfgs) == {"decode", "append", "merge"}
            assert cfgs["decode"]["BLOCK_M"] >= 16 and cfgs["decode"]["BLOCK_N"] >= 16  # tl.dot minimum
            assert get_decode_config(arch, d, wide=True)["decode"]["BLOCK_M"] >= cfgs["decode"]["BLOCK_M"]
            if backend != "hip":
                assert not any(k in cfg for cfg in cfgs.values() for k in tables.HIP_ONLY_OPTIONS)


def test_torch_compile_traces_the_custom_ops(device):
    """Under torch.compile the append and the attention are opaque custom ops (fake shapes, mutation)."""
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, new=1, causal=True, rot=1.0, seed=7)
    ref, _, k_exp, v_exp = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)

    def step(q, k_cache, v_cache, k, v, cache_seqlens):
        kw2 = dict(kw, cache_seqlens=cache_seqlens)
        return fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw2)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(q, k_cache, v_cache, k, v, kw["cache_seqlens"])
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k_cache.double(), k_exp.double(), atol=1e-3, rtol=1e-3)
    assert torch.equal(v_cache, v_exp)


@pytest.mark.gpu
def test_split_decode_under_cudagraph_trees():
    """torch.compile(mode="reduce-overhead") runs the decode op inside cudagraph trees, which refuse a tensor
    made in their memory pool that outlives the graph: a split call with the fused merge takes counters of
    its own there, not the stream's cached buffer (that one, first made inside the warm-up, broke
    Transformers' StaticCache + torch.compile generate on the H100)."""
    torch.manual_seed(5)
    q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([4000], dtype=torch.int32, device="cuda")

    def step(q, k_cache, v_cache, lens):
        return fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=4)

    decode._SPLIT_COUNTERS.clear()  # (no buffer made before the compiled region: it is the warm-up's to make)
    ref = step(q, k_cache, v_cache, lens).clone()
    decode._SPLIT_COUNTERS.clear()
    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    try:
        for _ in range(4):  # warm-up, record, replays
            out = compiled(q, k_cache, v_cache, lens).clone()
            torch.testing.assert_close(out, ref, atol=0, rtol=0)
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- bad input

def _i32(device, *values):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("mutate,match", [
    (lambda a, dev: a.update(k=torch.zeros(2, 40, 2, 64, dtype=torch.float16, device=dev),
                             v=torch.zeros(2, 40, 2, 64, dtype=torch.float16, device=dev)), "too small for the append"),
    (lambda a, dev: a.update(cache_seqlens=32), "does not fit"),
    (lambda a, dev: a.update(cache_seqlens=_i32(dev, 3, 32)), "too small for the append"),
    (lambda a, dev: a.update(k=None, v=None, cache_seqlens=_i32(dev, 3, 33)), "cache_seqlens"),
    # (a negative length is named as such, not as a cache too small for the append)
    (lambda a, dev: a.update(cache_seqlens=_i32(dev, 3, -1)), r"^cache_seqlens values must be in \[0, "),
    (lambda a, dev: a.update(cache_batch_idx=_i32(dev, 0, 2)), "cache_batch_idx"),
    (lambda a, dev: a.update(cache_batch_idx=torch.tensor([0, 1], dtype=torch.float32, device=dev)),
     "cache_batch_idx"),
    (lambda a, dev: a.update(cache_leftpad=_i32(dev, 0, 40)), "cache_leftpad"),
    (lambda a, dev: a.update(rotary_cos=torch.ones(32, 40, device=dev), rotary_sin=torch.ones(32, 40, device=dev)),
     "rotary dim"),
    (lambda a, dev: a.update(rotary_cos=torch.ones(32, 16, device=dev)), "together"),
    (lambda a, dev: a.update(rotary_cos=torch.ones(8, 16, device=dev), rotary_sin=torch.ones(8, 16, device=dev)),
     "cover"),
    (lambda a, dev: a.update(v=None), "together"),
    (lambda a, dev: a.update(cache_seqlens=None), "cache_seqlens is required"),
    (lambda a, dev: a.update(k=a["k"].float()), "dtype"),
    (lambda a, dev: a.update(q=a["q"][..., :32]), "head dim"),
    (lambda a, dev: a.update(q=torch.zeros(2, 1, 3, 64, dtype=torch.float16, device=dev)), "multiple"),
    (lambda a, dev: a.update(num_splits=-1), "num_splits"),
    (lambda a, dev: a.update(window_size=(1,)), "window_size"),
    (lambda a, dev: a.update(k_cache=a["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2)),
     "k_cache must be contiguous"),
])
def test_bad_kvcache_arguments_name_the_argument(device, monkeypatch, mutate, match):
    monkeypatch.setenv(kvcache.CHECK_KVCACHE_ENV, "1")  # device values too, on a GPU (opt-in there)
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, new=1, cache=32)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **kw)
    mutate(args, device)
    with pytest.raises((ValueError, TypeError), match=match):
        fa_amd.flash_attn_with_kvcache(**args)


def test_bad_paged_arguments_name_the_argument(device, monkeypatch):
    monkeypatch.setenv(kvcache.CHECK_KVCACHE_ENV, "1")
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, page=16, cache=32, new=1)
    table = kw.pop("block_table")
    with pytest.raises(ValueError, match="multiple of 16"):
        fa_amd.flash_attn_with_kvcache(q, k_cache[:, :8], v_cache[:, :8], k, v, block_table=table, **kw)
    bad = table.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block_table entries"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=bad, **kw)
    with pytest.raises(ValueError, match="cache_batch_idx cannot be combined with block_table"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=table, cache_batch_idx=_i32(device, 0, 1),
                                       **kw)
    with pytest.raises(ValueError, match="block_table must have shape"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=table[:1], **kw)
    with pytest.raises(TypeError, match="block_table must be an int32"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=table.float(), **kw)
    # the varlen route checks the same things
    cu = _i32(device, 0, 1, 2)
    with pytest.raises(ValueError, match=r"block_table entries .* \(the pages of k\)"):  # (its argument's name)
        fa_amd.flash_attn_varlen_func(q[:, 0], k_cache, v_cache, cu, _i32(device, 0, 20, 40), 1, 20, block_table=bad)
    with pytest.raises(ValueError, match=r"page size \(k\.shape\[1\] with a block_table\) must be .* multiple of 16"):
        fa_amd.flash_attn_varlen_func(q[:, 0], k_cache[:, :8], v_cache[:, :8], cu, cu, 1, 1, block_table=table)
    with pytest.raises(ValueError, match="dropout_p"):
        fa_amd.flash_attn_varlen_func(q[:, 0], k_cache, v_cache, cu, cu, 1, 1, dropout_p=0.1, block_table=table)


def test_gradients_are_refused(device):
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, new=1, cache=32)
    with pytest.raises(ValueError, match="forward-only"):
        fa_amd.flash_attn_with_kvcache(q.requires_grad_(), k_cache, v_cache, k, v, **kw)
    with torch.no_grad():
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)


def test_paged_varlen_runs_under_autograd_and_refuses_backward(device):
    """flash_attn_varlen_func with block_table on a q (or k / v pages) that requires grad, in grad mode: the forward
    runs as flash-attn's does (flash-attn's own paged tests call it so), and a backward through it raises, naming
    the call, instead of leaving q without a gradient."""
    q, k_cache, v_cache, _, _, _, _ = make_case(device, new=0, cache=32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
    table = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    pages_k, pages_v = k_cache[:2].reshape(4, 16, *k_cache.shape[2:]), v_cache[:2].reshape(4, 16, *v_cache.shape[2:])
    with torch.no_grad():
        want = fa_amd.flash_attn_varlen_func(q[:, 0], pages_k, pages_v, cu, cu_k, 1, 20, causal=True, block_table=table)
    for leaf in ("q", "k"):
        q_in = q[:, 0].clone().requires_grad_(leaf == "q")
        k_in = pages_k.clone().requires_grad_(leaf == "k")
        out, lse, _ = fa_amd.flash_attn_varlen_func(q_in, k_in, pages_v, cu, cu_k, 1, 20, causal=True,
                                                    block_table=table, return_attn_probs=True)
        assert torch.equal(out.detach(), want) and out.requires_grad and not lse.requires_grad
        with pytest.raises(RuntimeError, match="block_table/seqused_k is forward-only"):
            out.sum().backward()


def test_gradients_of_the_other_tensor_arguments_are_refused(device):
    """rotary tables, ALiBi slopes and sinks that require grad would be silently detached (the decode
    kernels are forward-only): an error names them, on flash_attn_with_kvcache and the paged varlen route."""
    q, k_cache, v_cache, k, v, kw, _ = make_case(device, new=1, cache=32)
    d = q.shape[-1]
    cos, sin = torch.rand(64, d // 4, device=device), torch.rand(64, d // 4, device=device)
    slopes = torch.rand(q.shape[2], device=device)
    for name, extra in (("rotary_cos", dict(rotary_cos=cos.clone().requires_grad_(), rotary_sin=sin)),
                        ("rotary_sin", dict(rotary_cos=cos, rotary_sin=sin.clone().requires_grad_())),
                        ("alibi_slopes", dict(alibi_slopes=slopes.clone().requires_grad_())),
                        ("sinks", dict(sinks=torch.zeros(q.shape[2], device=device, requires_grad=True)))):
        with pytest.raises(ValueError, match=f"forward-only.*{name} requires grad"):
            fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **extra, **kw)
        with torch.no_grad():
            fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **extra, **kw)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
    table = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    pages_k, pages_v = k_cache[:2].reshape(4, 16, *k_cache.shape[2:]), v_cache[:2].reshape(4, 16, *v_cache.shape[2:])
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        fa_amd.flash_attn_varlen_func(q[:, 0], pages_k, pages_v, cu, cu_k, 1, 20, block_table=table,
                                      alibi_slopes=slopes.clone().requires_grad_())


def test_bad_device_values_never_touch_memory_outside_the_tensors(device, monkeypatch):
    """With the value checks off (the GPU default: they would need a device sync), out-of-range
    cache_seqlens / leftpad / cache_batch_idx / block_table / rotary positions are clamped in the
    kernels: every cache lives inside a larger NaN-filled buffer, which must stay NaN, and the
    output must be finite (nothing read from the guard bands)."""
    monkeypatch.setattr(kvcache, "_check_values_now", lambda t: False)
    dtype, hk, d, guard = torch.float16, 2, 32, 4096

    def guarded(*shape):
        n = math.prod(shape)
        buf = torch.full((n + 2 * guard,), float("nan"), dtype=dtype, device=device)
        buf[guard:guard + n] = torch.randn(n, device=device).to(dtype)
        return buf, buf[guard:guard + n].view(*shape)

    q = torch.randn(2, 2, 4, d, device=device).to(dtype)
    k, v = torch.randn(2, 3, hk, d, device=device).to(dtype), torch.randn(2, 3, hk, d, device=device).to(dtype)
    for paged in (False, True):
        kbuf, k_cache = guarded(*((5, 16, hk, d) if paged else (3, 20, hk, d)))
        vbuf, v_cache = guarded(*k_cache.shape)
        capacity = 32 if paged else 20
        angle = torch.rand(capacity, 8, device=device) * 6.28
        kw = dict(cache_seqlens=_i32(device, capacity - 1, -7), cache_leftpad=_i32(device, 50, -3), causal=True,
                  num_splits=2, rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype))
        if paged:
            kw["block_table"] = torch.tensor([[9, -4], [1, 2]], dtype=torch.int32, device=device)
        else:
            kw["cache_batch_idx"] = _i32(device, 7, -2)
        out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
        assert torch.isfinite(out).all()
        for buf in (kbuf, vbuf):
            assert torch.isnan(buf[:guard]).all() and torch.isnan(buf[-guard:]).all(), "wrote outside the cache"


def test_value_checks_on_the_gpu_are_opt_in(monkeypatch):
    t = torch.zeros(2, dtype=torch.int32)
    assert kvcache._check_values_now(t)  # CPU tensors: free to check
    fake_gpu = type("T", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.delenv(kvcache.CHECK_KVCACHE_ENV, raising=False)
    assert not kvcache._check_values_now(fake_gpu)  # the default decode path has no host sync


# --------------------------------------------------------------------------- GPU: wider grid, graph capture

def _gpu_grid():
    rng = random.Random(0)
    cases = []
    for d in (32, 59, 64, 80, 128, 256):
        for _ in range(24):
            new = rng.choice([0, 1, 4])
            sq = rng.choice([1, 1, 4, 16]) if new == 0 else rng.choice([new, new + 2])
            page = rng.choice([None, None, 16, 64, 256])
            case = dict(d=d, dtype=rng.choice([torch.bfloat16, torch.float16]), b=rng.choice([1, 3, 8]), sq=sq,
                        hq=rng.choice([6, 8]), hk=None, cache=rng.choice([128, 339, 1024, 2048, 20000]), new=new,
                        rot=rng.choice([0.0, 0.5, 1.0]) if new else 0.0, interleaved=rng.random() < 0.5, page=page,
                        batch_idx=page is None and rng.random() < 0.3, leftpad=rng.random() < 0.3,
                        causal=rng.random() < 0.5, window=rng.choice([(-1, -1), (-1, -1), (37, 5), (200, 0)]),
                        alibi=rng.choice([None, None, "heads", "batch_heads"]), softcap=rng.choice([0.0, 0.0, 5.0]),
                        splits=rng.choice([0, 0, 1, 3]), seed=len(cases))
            case["hk"] = rng.choice([h for h in (1, 2, case["hq"]) if case["hq"] % h == 0])
            cases.append(case)
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_grid(), ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items() if k != "dtype"))
def test_kvcache_grid_gpu(case):
    check_case("cuda", **case)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_cuda_graph_capture_then_change_cache_seqlens(paged, append):
    """Capture one call, change cache_seqlens (and the appended k/v) in place, replay: the replay
    must equal the reference for the new lengths (no host sync, nothing baked into the graph)."""
    torch.manual_seed(0)
    q, k_cache, v_cache, k, v, kw, _ = make_case("cuda", dtype=torch.bfloat16, b=4, sq=1, hq=32, hk=8, d=128,
                                                 cache=4096, new=1 if append else 0, rot=1.0 if append else 0.0,
                                                 page=64 if paged else None, causal=True, splits=0)
    seqlens = kw["cache_seqlens"]
    k_base, v_base = k_cache.clone(), v_cache.clone()

    def call():
        return fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for new_lens in ([1, 4000, 17, 2048], [4095 if not append else 4094, 0 if append else 1, 300, 64]):
        k_cache.copy_(k_base)
        v_cache.copy_(v_base)
        seqlens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        if append:
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
        k_exp, v_exp = replay_and_check(graph, out, q, k_base, v_base, k, v, kw)
        if append:
            torch.testing.assert_close(k_cache.double(), k_exp.double(), atol=2e-2, rtol=2e-2)
            assert torch.equal(v_cache, v_exp)


def replay_and_check(graph, out, q, k_cache, v_cache, k, v, kw):
    """Replay `graph`, whose captured call wrote `out`: it must equal the reference over the caches as
    given (before the call's append of k / v), and leave the fused merge's counters at zero (there are
    none where the merge is launched).  Returns the expected caches after the append."""
    graph.replay()
    torch.cuda.synchronize()
    ref, _, k_exp, v_exp = attention_kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    assert_close_to_ref("graph replay", out, ref, ref_lp, torch.bfloat16)
    assert _counters_all_zero()
    return k_exp, v_exp


@pytest.mark.gpu
def test_no_host_sync_on_the_decode_path():
    q, k_cache, v_cache, k, v, kw, _ = make_case("cuda", dtype=torch.bfloat16, b=2, hq=8, hk=2, d=128, cache=2048,
                                                 new=1, rot=1.0, page=64, causal=True, splits=0)
    fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_repeated_calls_reuse_checks_and_plans_but_still_check(device):
    """A decode loop repeats one call structure: the second call takes the memoized host checks and
    launch plan (decode is host-bound) and gives the same result; a call that differs in anything the
    checks look at (requires_grad, a bool flag, the int cache_seqlens) is checked again."""
    import fa_amd.kvcache as kvcache
    from fa_amd.kernels import decode as dec

    torch.manual_seed(7)
    q = torch.randn(3, 1, 6, 40, device=device, dtype=torch.float16)
    k_cache = torch.randn(3, 75, 2, 40, device=device, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([75, 1, 33], dtype=torch.int32, device=device)
    kvcache._CHECKED_PLAIN_CALLS.clear()
    dec.forget_plans()
    first = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    assert len(kvcache._CHECKED_PLAIN_CALLS) == 1 and len(dec._PLANS) == 1
    again = fa_amd.flash_attn_with_kvcache(q.clone(), k_cache, v_cache, cache_seqlens=lens, causal=True)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    kvcache._CHECKED_PLAIN_CALLS.clear()
    dec.forget_plans()  # the full path again (its results are checked against float64 by the grid tests)
    fresh = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    torch.testing.assert_close(fresh, first, rtol=0, atol=0)
    paged = fa_amd.flash_attn_with_kvcache(q, k_cache.reshape(-1, 25, 2, 40)[:, :16].contiguous(),
                                           v_cache.reshape(-1, 25, 2, 40)[:, :16].contiguous(),
                                           cache_seqlens=torch.tensor([16, 1, 9], dtype=torch.int32, device=device),
                                           block_table=torch.arange(3, dtype=torch.int32, device=device)[:, None] * 3)
    assert paged.shape == q.shape and len(dec._PLANS) == 2
    with pytest.raises(ValueError, match="requires grad"):
        fa_amd.flash_attn_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, cache_seqlens=lens)
    with pytest.raises(TypeError, match="causal"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=1)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=76)
    if device == "cpu":  # device values are checked where that costs no sync, memo or not
        with pytest.raises(ValueError, match="cache_seqlens"):
            fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + 1, causal=True)


def test_key_mask_calls_reuse_the_plan_with_their_own_mask(device):
    """Transformers' decode route passes a per-key mask: those calls take the memoized plan too, and
    a plan hit reads the mask of its own call (a hole moved between calls moves the result)."""
    from fa_amd.kernels import decode as dec

    torch.manual_seed(11)
    q = torch.randn(2, 1, 4, 24, device=device, dtype=torch.float16)
    k_cache = torch.randn(2, 37, 2, 24, device=device, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    masks = [torch.ones(2, 37, dtype=torch.uint8, device=device) for _ in range(2)]
    masks[0][0, 5], masks[1][1, 30] = 0, 0

    def call(mask):
        return dec.decode_forward(q, k_cache, v_cache, 24 ** -0.5, -1, -1, 0.0, None, key_mask=mask)[0]

    dec.forget_plans()
    call(masks[0])
    assert len(dec._PLANS) == 1
    hit = call(masks[1])
    assert len(dec._PLANS) == 1
    dec.forget_plans()
    fresh = call(masks[1])
    torch.testing.assert_close(hit, fresh, rtol=0, atol=0)
    keep = masks[1].bool()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k_cache.double().repeat_interleave(2, 2)) * 24 ** -0.5
    probs = scores.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", probs, v_cache.double().repeat_interleave(2, 2))
    assert (hit.double() - ref).abs().max() < 2e-3


class _Param:
    def __init__(self, name, default=None, is_constexpr=False):
        self.name, self.default, self.is_constexpr = name, default, is_constexpr


class _FakeKernel:
    """A JIT function's parameter list: X, Y (tensors), n (int), S (tensor kwarg), K (constexpr), D
    (constexpr with a default)."""
    params = [_Param("X"), _Param("Y"), _Param("n"), _Param("S"), _Param("K", is_constexpr=True),
              _Param("D", 7, is_constexpr=True)]


class _FakeCompiled:
    """A CompiledKernel's runner (records (grid, args)) and launcher (records its whole argument list)."""
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []
        self.direct = []

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.calls.append((grid, args))

    def run(self, *args):
        self.direct.append(args)


@pytest.mark.parametrize("args_mode", ["all", "runtime"])
def test_compiled_launch_orders_arguments_and_guards_specialisation(monkeypatch, args_mode):
    """The replayed launch passes the kernel's parameters in order (constexprs too from triton 3.3 on,
    tables.COMPILED_LAUNCH), each call's own tensors in their slots, defaults filled; it refuses
    (launches nothing) a tensor Triton would specialise differently (16-byte alignment), and keeps
    no reference to the first call's tensors."""
    from fa_amd.kernels.launch import CompiledLaunch
    from fa_amd.tuning import tables

    if args_mode == "runtime":
        monkeypatch.setitem(tables.COMPILED_LAUNCH, "args", "runtime")
    base = torch.zeros(64)
    x, y, s = base[:8], base[16:24], base[32:40]  # 64-byte offsets: 16-byte aligned
    compiled = _FakeCompiled()
    launch = CompiledLaunch(_FakeKernel, compiled, (3, 1, 1), (x, y, 5), {"S": s, "K": 2, "num_warps": 4},
                            ("X", "Y", "S"), hip=False)
    assert all(v is None or not isinstance(v, torch.Tensor) for v in launch.values)
    x2, y2, s2 = base[8:16], base[24:32], base[40:48]
    assert launch.run((x2, y2, s2))
    grid, args = compiled.calls[-1]
    assert grid == (3, 1, 1)
    want = [x2, y2, 5, s2] + ([2, 7] if args_mode == "all" else [])
    assert len(args) == len(want) and all(a is b if isinstance(b, torch.Tensor) else a == b
                                          for a, b in zip(args, want))
    assert not launch.run((base[1:9], y2, s2)) and len(compiled.calls) == 1  # 4-byte offset: not aligned
    assert not launch.run((x2.double(), y2, s2)) and len(compiled.calls) == 1  # another dtype: other code
    # with a stream and no launch hook registered, the launcher itself: the runner's leading arguments
    # (no launch metadata, no hooks), then the same values, tensors as their device addresses
    assert launch.run((x2, y2, s2), stream=77) and len(compiled.calls) == 1
    lead, values = compiled.direct[-1][:9], compiled.direct[-1][9:]
    assert lead == (3, 1, 1, 77, "function", "metadata", None, None, None)
    assert list(values) == [b.data_ptr() if isinstance(b, torch.Tensor) else b for b in want]
    hooks = launch.hooks  # a profiler's hook registered: through the runner, which hands it the metadata
    monkeypatch.setattr(hooks, "launch_enter_hook", lambda metadata: None)
    assert launch.run((x2, y2, s2), stream=77) and len(compiled.calls) == 2 and len(compiled.direct) == 1


def test_compiled_launch_reads_a_stand_ins_address_from_its_tensor():
    """`same_as`: a parameter that always takes an earlier parameter's tensor (decode passes q for the absent
    ones) gets that tensor's address, and the slots around it theirs -- with the tensor parameters' slots split
    by an int (X, Y | 5 | S) and the stand-in in the middle run or the last one."""
    from fa_amd.kernels.launch import CompiledLaunch

    base = torch.zeros(64)
    x, y, s = base[:8], base[16:24], base[32:40]
    for same_as, pick in (([0, 0, 2], lambda a, b, c: (a, a, c)), ([0, 1, 0], lambda a, b, c: (a, b, a)),
                          ([0, 1, 1], lambda a, b, c: (a, b, b)), ([0, 1, 2], lambda a, b, c: (a, b, c))):
        compiled = _FakeCompiled()
        launch = CompiledLaunch(_FakeKernel, compiled, (3, 1, 1), (x, y, 5), {"S": s, "K": 2, "num_warps": 4},
                                ("X", "Y", "S"), hip=False, same_as=same_as)
        x2, y2, s2 = base[8:16], base[24:32], base[40:48]
        launch.launch(pick(x2, y2, s2), stream=77)
        a, b, c = pick(x2, y2, s2)
        assert list(compiled.direct[-1][9:13]) == [a.data_ptr(), b.data_ptr(), 5, c.data_ptr()], same_as
        twin = launch.patched({"n": 6})
        twin.launch(pick(x2, y2, s2), stream=77)
        assert list(compiled.direct[-1][9:13]) == [a.data_ptr(), b.data_ptr(), 6, c.data_ptr()], same_as


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [False, True])
def test_replayed_decode_launches_equal_the_jit_launches(sinks):
    """A decode loop's later calls launch through the plan's replayed CompiledKernels: bit-equal to a
    JIT launch on fresh data, inside CUDA-graph capture too, and a misaligned view (another Triton
    specialisation) goes through the JIT and is still right."""
    from fa_amd import tuning
    from fa_amd.kernels import decode as dec

    torch.manual_seed(3)
    hq, hk, d = 8, 2, 128
    k_cache = torch.randn(3, 1000, hk, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([1000, 17, 513], dtype=torch.int32, device="cuda")
    sink = torch.randn(hq, device="cuda") if sinks else None

    def call(q):
        return dec.decode_forward(q, k_cache, v_cache, d ** -0.5, -1, -1, 0.0, None, cache_seqlens=lens,
                                  sinks=sink, num_splits=4)

    dec.forget_plans()
    call(torch.randn(3, 1, hq, d, device="cuda", dtype=torch.bfloat16))  # builds the plan
    call(torch.randn(3, 1, hq, d, device="cuda", dtype=torch.bfloat16))  # its JIT launch becomes the replay
    (plan,) = dec._PLANS.values()
    fused = tuning.family_of(fa_amd.arch.arch_for(k_cache)) in tuning.tables.DECODE_FUSED_MERGE_FAMILIES
    assert set(plan.replays) == ({"decode"} if fused else {"decode", "merge"}) and bool(plan.counters) == fused
    q = torch.randn(3, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    replayed = call(q)
    dec.forget_plans()
    jit = call(q)
    assert all(torch.equal(a, b) for a, b in zip(replayed, jit))
    call(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(q)
    q_new = torch.randn_like(q)
    q.copy_(q_new)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(captured, call(q_new)))
    storage = torch.randn(3 * hq * d + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = storage[1:].view(3, 1, hq, d)  # 2-byte offset
    misaligned.copy_(q)
    # (another specialisation is other machine code: equal up to rounding, not bit for bit)
    for a, b in zip(call(misaligned), call(q)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_replay_refuses_a_host_tensor():
    """Replays hand Triton's launcher bare device addresses: a host tensor in a device plan's slot is refused
    by the replay's check and reaches the JIT, which raises (no launch on a host address), and the next
    device call still replays right."""
    from fa_amd.kernels import decode as dec

    torch.manual_seed(5)
    k_cache = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([300, 41], dtype=torch.int32, device="cuda")

    def call(q, lens):
        return dec.decode_forward(q, k_cache, v_cache, 0.125, -1, -1, 0.0, None, cache_seqlens=lens)[0]

    dec.forget_plans()
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    call(q, lens)
    call(q, lens)  # the replay exists now
    with pytest.raises(Exception, match="(?i)cpu|host|pointer"):
        call(q, lens.cpu())
    torch.cuda.synchronize()
    ref = attention_kvcache_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=lens,
                                softmax_scale=0.125)[0]
    torch.testing.assert_close(call(q, lens).double(), ref, atol=2e-3, rtol=0)


def test_plan_hits_with_sinks_and_splits_equal_the_full_path(device):
    """A memoized call with learnable sinks and split keys merges the splits with the sinks, as the
    first (full-path) call does."""
    from fa_amd.kernels import decode as dec

    torch.manual_seed(13)
    q = torch.randn(2, 1, 4, 24, device=device, dtype=torch.float16)
    k_cache = torch.randn(2, 70 if device == "cpu" else 700, 2, 24, device=device, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    sinks = torch.randn(4, device=device) + 1.0

    def call():
        return dec.decode_forward(q, k_cache, v_cache, 24 ** -0.5, -1, -1, 0.0, None, sinks=sinks, num_splits=3)

    dec.forget_plans()
    full = call()
    hit = call()
    assert len(dec._PLANS) == 1 and next(iter(dec._PLANS.values())).part_shapes is not None
    for a, b in zip(hit, full):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mask, window_left, full_paths", [(False, -1, 2), (True, -1, 2), (True, 40, 3)])
def test_a_growing_cache_takes_its_plan_with_the_new_capacity(device, monkeypatch, mask, window_left, full_paths):
    """Transformers' dynamic cache hands over one key more at every step, as a new (b, hk, L, d) tensor
    seen through its (b, L, hk, d) view (strides that follow L), with a per-key mask as wide as the
    cache.  A step whose capacity ints keep their Triton specialisation, whose split count and window
    flag stay, takes the last full path's plan with those ints changed (no full path, no JIT launch on
    the GPU); each step matches a float64 reference.  Full paths here: L=33 and the first L divisible
    by 16 (48), and with a 40-key left window the step whose cache outgrows it (L=42: HAS_LEFT on)."""
    torch.manual_seed(17)
    ran = []
    real_launch = decode.launch
    monkeypatch.setattr(decode, "launch", lambda *args: ran.append(args[0]) or real_launch(*args))
    decode.forget_plans()
    b, hq, hk, d, scale = 2, 4, 2, 32, 32 ** -0.5
    q = torch.randn(b, 1, hq, d, device=device, dtype=torch.float16)
    for length in range(33, 50):
        k_cache = torch.randn(b, hk, length, d, device=device, dtype=torch.float16).transpose(1, 2)
        v_cache = torch.randn(b, hk, length, d, device=device, dtype=torch.float16).transpose(1, 2)
        key_mask = None
        if mask:
            key_mask = torch.ones(b, length, dtype=torch.uint8, device=device)
            key_mask[0, 3] = key_mask[1, length - 5] = 0
        out, lse = decode.decode_forward(q, k_cache, v_cache, scale, window_left, -1, 0.0, None, key_mask=key_mask,
                                         num_splits=2)
        keep = torch.ones(b, length, dtype=torch.bool, device=device) if key_mask is None else key_mask.bool()
        if window_left >= 0:
            keep &= torch.arange(length, device=device) >= length - 1 - window_left
        scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k_cache.double().repeat_interleave(hq // hk, 2))
        scores = (scores * scale).masked_fill(~keep[:, None, None, :], float("-inf"))
        ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v_cache.double().repeat_interleave(hq // hk, 2))
        assert (out.double() - ref).abs().max() < 2e-3, length
        torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-3, rtol=0)
    assert len(ran) == full_paths and len(decode._PLANS) == 49 - 33 + 1


def test_many_short_programs_take_the_many_tile(device, monkeypatch):
    """tables.DECODE_MANY: an unsplit launch with at least min_programs_per_sm programs per SM over at most
    max_keys keys runs the family's "many" tile (here another key block than the table's), others the table's; a
    growing dense cache that crosses max_keys takes a full path there, not the last plan with the other tile.
    Every step matches a float64 reference."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    row = tuning._decode_row(arch_for(torch.empty(0, device=device)), 32)["head_dim"]
    table_n = tuning.get_decode_config(arch_for(torch.empty(0, device=device)), 32)["decode"]["BLOCK_N"]
    many_n = 16 if table_n != 16 else 32
    length = table_n + 20  # (two key blocks of the table's tile: a split is possible)
    monkeypatch.setitem(tables.DECODE_MANY, family, {"min_programs_per_sm": 2, "max_keys": length + 4,
                                                     "head_dims": {row: {"BLOCK_N": many_n}}})
    monkeypatch.setattr(decode, "_sms", lambda q: 1)
    tuning._DECODE_RESOLVED.clear()
    block_ns = []
    real_launch = decode.launch
    monkeypatch.setattr(decode, "launch", lambda kernel, cfg, *a: block_ns.append(cfg["BLOCK_N"]) or
                        real_launch(kernel, cfg, *a))
    decode.forget_plans()
    torch.manual_seed(23)
    b, hq, hk, d = 2, 4, 2, 32
    q = torch.randn(b, 1, hq, d, device=device, dtype=torch.float16)
    for length, splits, expect in ((length, 1, many_n), (length + 4, 1, None), (length + 8, 1, table_n),
                                   (length, 2, table_n)):
        k_cache = torch.randn(b, hk, length, d, device=device, dtype=torch.float16).transpose(1, 2)
        v_cache = torch.randn(b, hk, length, d, device=device, dtype=torch.float16).transpose(1, 2)
        before = len(block_ns)
        out, _ = decode.decode_forward(q, k_cache, v_cache, d ** -0.5, -1, -1, 0.0, None, num_splits=splits)
        if expect is None:
            assert len(block_ns) == before  # (4 keys more: the last plan with its capacity ints changed)
        else:
            assert block_ns[before:] == [expect], (length, splits)
        ref, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache)
        assert (out.double() - ref).abs().max() < 2e-3, (length, splits)
    tuning._DECODE_RESOLVED.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
def test_many_tile_at_the_tabled_rows(monkeypatch, page):
    """The GPU family's tables.DECODE_MANY tile as tabled (d128, GQA 32/8): a batch of 40 sequences with caches
    of up to 2000 keys takes it (dense and paged), and matches the float64 reference as the table's tile does."""
    arch = arch_for(torch.empty(0, device="cuda"))
    if tuning.decode_many_rule(arch, 128) is None:
        pytest.skip(f"{arch.name} has no DECODE_MANY tile")
    taken = []
    real = decode._takes_many_tile
    monkeypatch.setattr(decode, "_takes_many_tile", lambda *a: taken.append(real(*a)) or taken[-1])
    monkeypatch.setattr(decode, "_sms", lambda q: 8)  # (any GPU: 40 x 8 programs are many per SM)
    decode.forget_plans()
    q, k_cache, v_cache, _, _, kw, _ = make_case("cuda", dtype=torch.bfloat16, b=40, hq=32, hk=8, d=128, cache=2000,
                                                 page=page, causal=True, seed=31)
    ref64, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, upcast=False, **kw)
    out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert taken == [True]
    assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["plain", "leftpad", "window", "paged"])
def test_masked_stages_at_the_tabled_rows(monkeypatch, feature):
    """The GPU family's tables.DECODE_MASKED_STAGES as tabled (d128, GQA 32/8, batch 1 at ~2k keys, split): the
    launch takes it (masked loops unpipelined) and matches the float64 reference -- ragged lengths (a masked
    tail), leftpad / a left window (a masked front), paged."""
    arch = arch_for(torch.empty(0, device="cuda"))
    if not tuning.decode_masked_stages(arch, 128):
        pytest.skip(f"{arch.name} has no DECODE_MASKED_STAGES row at d128")
    seen = []
    real_launch = decode.launch
    monkeypatch.setattr(decode, "launch", lambda kernel, cfg, grid0, grid, args, kwargs: seen.append(
        (cfg["num_stages"], kwargs.get("MASKED_STAGES", 0))) or real_launch(kernel, cfg, grid0, grid, args, kwargs))
    decode.forget_plans()
    for cache, lens in ((2000, [1999]), (2048, [1301])):
        q, k_cache, v_cache, _, _, kw, _ = make_case(
            "cuda", dtype=torch.bfloat16, b=1, hq=32, hk=8, d=128, cache=cache, page=16 if feature == "paged" else None,
            leftpad=feature == "leftpad", window=(700, -1) if feature == "window" else (-1, -1), causal=True,
            seed=37, fixed_lens=lens)
        ref64, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, **kw)
        ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, upcast=False, **kw)
        out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        assert_close_to_ref("out", out, ref64, ref_lp, q.dtype)
    want_stages = tuning.get_decode_config(arch, 128)["decode"]["num_stages"]
    assert seen and all(s == (want_stages, tuning.decode_masked_stages(arch, 128)) for s in seen), seen
    decode.forget_plans()


@pytest.mark.gpu
def test_resized_replays_equal_the_full_path():
    """On the GPU the resized plan replays the recorded CompiledKernel with the new capacity ints: bit
    for bit the full path's (JIT) result at that capacity, for a split call and an unsplit one."""
    torch.manual_seed(19)
    b, hq, hk, d = 3, 16, 4, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    for length, splits in ((1000, 0), (4001, 1)):
        keys = torch.randn(b, hk, length + 3, d, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)

        def call(n):  # a fresh (b, hk, n, d) tensor per step, as the dynamic cache's torch.cat gives
            k_cache, v_cache = keys[:, :, :n].contiguous(), values[:, :, :n].contiguous()
            return decode.decode_forward(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), d ** -0.5, -1, -1,
                                         0.0, None, num_splits=splits)

        decode.forget_plans()
        call(length)
        call(length)  # its JIT launch becomes the template's replay
        (template,) = decode._PLANS.values()
        assert "decode" in template.replays
        resized = call(length + 2)  # the same specialisation: no capacity here is divisible by 16
        assert len(decode._PLANS) == 2 and "decode" in decode._PLANS[next(reversed(decode._PLANS))].replays
        decode.forget_plans()
        full = call(length + 2)
        assert all(torch.equal(x, y) for x, y in zip(resized, full)), length


@pytest.mark.parametrize("keep, merge", [(True, "fused"), (False, "fused"), (False, "launch")])
def test_plans_reuse_their_scratch_and_leave_results_alone(device, monkeypatch, keep, merge):
    """A planned split call writes its partials (and, when the caller drops it, its lse) into buffers kept
    for its stream: later calls on other data give what the full path gives, the lse the caller asks for
    is a tensor of its own, and buffers above the size limit are not kept -- nor the partials of a split
    merged by a second launch (another thread's call on the stream could land between the two)."""
    if not keep:
        monkeypatch.setattr(decode, "_MAX_KEPT_SCRATCH", 0 if merge == "fused" else 1 << 30)
    _use_merge(monkeypatch, device, merge)
    torch.manual_seed(23)
    # (3 splits need 3 key blocks of the table's tile: 128 keys on the H100)
    k_cache = torch.randn(2, 90 if device == "cpu" else 400, 2, 24, device=device, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)

    def call(q, need_lse):
        return decode.decode_forward(q, k_cache, v_cache, 24 ** -0.5, -1, -1, 0.0, None, num_splits=3,
                                     need_lse=need_lse)

    decode.forget_plans()
    call(torch.randn(2, 1, 4, 24, device=device, dtype=torch.float16), False)  # the plan
    (plan,) = decode._PLANS.values()
    assert plan.part_shapes is not None and not decode._SCRATCH  # (the full path allocates its own)
    needs = (False, True, True)
    queries = [torch.randn(2, 1, 4, 24, device=device, dtype=torch.float16) for _ in needs]
    results = [call(q, need_lse) for q, need_lse in zip(queries, needs)]  # planned calls
    assert len(decode._PLANS) == 1 and len(decode._SCRATCH) == keep
    assert results[1][1] is not results[2][1] and results[1][1].data_ptr() != results[2][1].data_ptr()
    for q, need_lse, (out, lse) in zip(queries, needs, results):
        decode.forget_plans()
        full = call(q, True)  # the full path
        torch.testing.assert_close(out, full[0], rtol=0, atol=0)
        if need_lse:
            torch.testing.assert_close(lse, full[1], rtol=0, atol=0)
        else:
            assert lse is None


def test_compiled_launch_patched_changes_only_the_named_ints():
    """CompiledLaunch.patched: a copy that passes the new ints in their parameters' positions; the
    original launches as before."""
    from fa_amd.kernels.launch import CompiledLaunch, int_specialization

    base = torch.zeros(64)
    compiled = _FakeCompiled()
    first = CompiledLaunch(_FakeKernel, compiled, (3, 1, 1), (base[:8], base[16:24], 5), {"S": base[32:40], "K": 2},
                           ("X", "Y", "S"), hip=False)
    twin = first.patched({"n": 37})
    tensors = (base[8:16], base[24:32], base[40:48])
    assert twin.run(tensors) and first.run(tensors)
    assert compiled.calls[0][1][2] == 37 and compiled.calls[1][1][2] == 5
    assert int_specialization(32) != int_specialization(33) != int_specialization(1)
    assert int_specialization(2 ** 31) != int_specialization(2 ** 31 - 16)


# --------------------------------------------------------------------------- split merge: fused or launched

class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("split_merge_kernel launched, but the decode kernel merges its splits here")


_SPLIT_MERGE_KERNEL = decode.split_merge_kernel


def _use_merge(monkeypatch, device, mode):
    """'fused': the last split program of each tile merges (tables.DECODE_FUSED_MERGE_FAMILIES; a merge
    launch fails the test); 'launch': split_merge_kernel after the decode kernel."""
    from fa_amd import tuning
    from fa_amd.tuning import tables

    family = tuning.family_of(fa_amd.arch.arch_for(torch.empty(0, device=device)))
    others = tuple(f for f in tables.DECODE_FUSED_MERGE_FAMILIES if f != family)
    monkeypatch.setattr(tables, "DECODE_FUSED_MERGE_FAMILIES", others + ((family,) if mode == "fused" else ()))
    if mode == "fused":
        monkeypatch.setattr(decode, "split_merge_kernel", _NoLaunch())
    elif isinstance(decode.split_merge_kernel, _NoLaunch):  # (a nested context undoing an outer "fused")
        monkeypatch.setattr(decode, "split_merge_kernel", _SPLIT_MERGE_KERNEL)


def _counters_all_zero():
    return all(not buf.any() for buf in decode._SPLIT_COUNTERS.values())


# key splits forced (num_splits), so the interpreter (one SM: the heuristic never splits) merges
SPLIT_CASES = {
    "gqa3_sq3_causal_splits3": dict(hq=6, hk=2, sq=3, causal=True, splits=3, cache=45),
    "paged16_sinks_splits4": dict(page=16, sinks=True, splits=4, cache=70, seed=2),
    # seq 0: 2 keys in the first of 5 one-block splits (4 empty splits); seq 1: no key at all
    "empty_splits_sinks": dict(b=3, hq=6, hk=3, d=40, cache=80, splits=5, fixed_lens=[2, 0, 75], sinks=True),
    "wide_rows_append_rot_d59": dict(hq=6, hk=2, sq=6, new=6, causal=True, rot=1.0, splits=2, d=59),
    # 37 query rows per KV head: two (wide) row tiles, each with its own counter; many rows see no key
    "two_row_tiles_mha_sq37": dict(hq=2, hk=2, sq=37, causal=True, splits=2, cache=60, d=24),
    "fp32_mqa_local_sq2": dict(dtype=torch.float32, hq=3, hk=1, sq=2, causal=True, window=(9, 0), splits=3, cache=50),
}


@pytest.mark.parametrize("mode", ["fused", "launch"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_merge_modes(device, monkeypatch, case, mode):
    _use_merge(monkeypatch, device, mode)
    check_case(device, **SPLIT_CASES[case])
    assert _counters_all_zero()


def test_fused_and_launched_merge_give_the_same_bits(device, monkeypatch):
    """Both modes run the one merge helper (_merge_splits) over the same partials: equal outputs and lse."""
    results = []
    for mode in ("fused", "launch"):
        with monkeypatch.context() as m:
            _use_merge(m, device, mode)
            q, k_cache, v_cache, _, _, kw, splits = make_case(device, **SPLIT_CASES["empty_splits_sinks"])
            results.append(fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits,
                                                          return_softmax_lse=True, **kw))
    for fused, launched in zip(*results):
        torch.testing.assert_close(fused, launched, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows,step", [(1, 16), (2, 3), (4, 1), (16, 5)])
@pytest.mark.parametrize("case", ["gqa3_sq3_causal_splits3", "empty_splits_sinks", "two_row_tiles_mha_sq37"])
def test_fused_merge_chunks_are_a_speed_choice(device, monkeypatch, case, rows, step):
    """The fused merge's rows per chunk and splits per step (tuning.decode_merge_step) change only how its loads are
    grouped: any choice -- chunks narrower than the tile's live rows (several chunks, the last one partly live), steps
    past the split count or not dividing it -- gives the launched merge's bits and counters back at zero."""
    results = []
    for mode in ("launch", "fused"):
        with monkeypatch.context() as m:
            _use_merge(m, device, mode)
            m.setattr(decode, "decode_merge_step", lambda arch, live_rows, block_m: (rows, step))
            decode.forget_plans()
            q, k_cache, v_cache, _, _, kw, splits = make_case(device, **SPLIT_CASES[case])
            results.append(fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits,
                                                          return_softmax_lse=True, **kw))
            decode.forget_plans()
    for launched, fused in zip(*results):
        torch.testing.assert_close(fused, launched, rtol=0, atol=0, equal_nan=True)
    assert _counters_all_zero()


def test_fused_merge_step_rule():
    """One query token of a GQA group: its rows (the group's heads) rounded up to a power of two, within the tile,
    and more splits per step the fewer the rows (tables.DECODE_MERGE_STEP: 32 rows x splits, at most 8 splits)."""
    from fa_amd import tuning

    arch = fa_amd.arch.arch_for(torch.empty(0))
    assert tuning.decode_merge_step(arch, 4, 16) == (4, 8)
    assert tuning.decode_merge_step(arch, 3, 16) == (4, 8)
    assert tuning.decode_merge_step(arch, 1, 16) == (1, 8)
    assert tuning.decode_merge_step(arch, 8, 16) == (8, 4)
    assert tuning.decode_merge_step(arch, 16, 16) == (16, 2)
    assert tuning.decode_merge_step(arch, 37, 16) == (16, 2)
    assert tuning.decode_merge_step(arch, 37, 64) == (64, 2)


@pytest.mark.parametrize("mode", ["fused", "launch"])
def test_split_merge_varlen_q_paged(device, monkeypatch, mode):
    """Varlen q (packed tokens, an empty segment, tokens past cu_seqlens_q[-1]) over paged keys with
    key splits and sinks: the merged rows land in the packed output without a batch axis."""
    _use_merge(monkeypatch, device, mode)
    torch.manual_seed(5)
    lens_q, lens_k = [3, 0, 1, 2], [40, 7, 33, 5]
    hq, hk, d, dtype = 6, 2, 48, torch.float16
    # (2 tokens of no sequence at the end: static buffers)
    q, k_pages, v_pages, table, cu_q, cu_k = paged_varlen_inputs(device, lens_q, lens_k, hq, hk, d, dtype, 16, 1,
                                                                 extra_q=2)
    n = sum(lens_q)
    sinks = torch.randn(hq, device=device)
    out, lse = decode.decode_forward(q, k_pages, v_pages, d ** -0.5, -1, 0, 0.0, None, cu_seqlens_q=cu_q,
                                     max_seqlen_q=max(lens_q), cu_seqlens_k=cu_k, block_table=table, num_splits=3,
                                     sinks=sinks)
    kw = dict(causal=True, sinks=sinks)
    ref64, lse64 = attention_paged_varlen_ref(q[:n], k_pages, v_pages, cu_q, cu_k, table, **kw)
    ref_lp, _ = attention_paged_varlen_ref(q[:n], k_pages, v_pages, cu_q, cu_k, table, upcast=False, **kw)
    assert_close_to_ref("out", out[:n], ref64, ref_lp, dtype)
    assert (lse[:, :n].double() - lse64).abs().max().item() < 1e-3 * max(1.0, lse64.abs().max().item())
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isposinf(lse[:, n:]).all()
    assert _counters_all_zero()


def test_split_counters_stay_zero_and_grow(device, monkeypatch):
    """The fused merge's counters are zero after every call (plan miss and hit, dense and paged, sinks),
    with no memset per call: one buffer per (device, stream), reused; a call that needs more counters
    gets a bigger zeroed buffer, and the old one is kept (a captured graph may still use it)."""
    _use_merge(monkeypatch, device, "fused")
    monkeypatch.setattr(decode, "_SPLIT_COUNTERS", {})
    monkeypatch.setattr(decode, "_RETIRED_COUNTERS", [])
    decode.forget_plans()
    for case in ("paged16_sinks_splits4", "paged16_sinks_splits4", "gqa3_sq3_causal_splits3"):  # miss, hit, another
        # (caches long enough for the forced splits under a GPU's wider key tiles too)
        q, k_cache, v_cache, k, v, kw, splits = make_case(device, **dict(SPLIT_CASES[case], cache=600))
        fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=splits, **kw)
        assert len(decode._SPLIT_COUNTERS) == 1 and _counters_all_zero()
    (buf,) = decode._SPLIT_COUNTERS.values()
    assert buf.dtype == torch.int32 and buf.numel() >= 256
    q = torch.empty(1, device=device)
    assert decode._split_counters(q, 10) is buf
    bigger = decode._split_counters(q, buf.numel() + 1)
    assert bigger.numel() == 2 * buf.numel() and not bigger.any() and decode._RETIRED_COUNTERS == [buf]
    assert decode._split_counters(q, 3) is bigger


@pytest.mark.gpu
def test_split_counters_stay_out_of_a_graph_pool(monkeypatch):
    """A split decode call made first inside a memory pool that CUDA graphs share (Transformers' continuous
    batching warms each graph up eagerly in its pool): the fused merge's counters, which must stay zero
    between calls, are not allocated there, so replaying a graph that freed small blocks into the pool cannot
    overwrite them."""
    monkeypatch.setattr(decode, "_SPLIT_COUNTERS", {})
    pool = torch.cuda.MemPool()
    source = torch.arange(256, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (source * 3 + 5).sum()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.id):
        for _ in range(8):  # small intermediates, freed into the pool when the capture ends
            source = (source * 3 + 5) % 1000 + 7
        total = source.sum()
    q, k_cache, v_cache, _, _, kw, _ = make_case("cuda", b=1, cache=512, fixed_lens=[500], seed=9)
    ref64, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, **kw)
    ref_lp, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, upcast=False, **kw)
    with torch.cuda.use_mem_pool(pool):
        first = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=4, **kw)
        assert_close_to_ref("out", first, ref64, ref_lp, q.dtype)  # (before a replay: `first` is in the pool)
    for _ in range(3):
        graph.replay()
        again = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=4, **kw)
        assert_close_to_ref("out", again, ref64, ref_lp, q.dtype)
    assert int(total) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("warm_on_capture_stream", [False, True])
def test_fused_merge_under_graph_capture(monkeypatch, warm_on_capture_stream):
    """The fused merge inside a CUDA graph: its counters are the capture stream's cached buffer (a call
    on that stream before the capture) or, when the capture's call is that stream's first, a fresh
    zeroed one captured with the graph; every replay is right and leaves the cached counters at zero.
    The launched merge gives the same result."""
    _use_merge(monkeypatch, "cuda", "fused")
    monkeypatch.setattr(decode, "_SPLIT_COUNTERS", {})
    torch.manual_seed(2)
    q, k_cache, v_cache, _, _, kw, _ = make_case("cuda", dtype=torch.bfloat16, b=2, hq=8, hk=2, d=128, cache=3000,
                                                 causal=True, sinks=True, page=64)

    def call():
        return fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=6, return_softmax_lse=True, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile
    capture_stream = torch.cuda.Stream()
    if warm_on_capture_stream:
        capture_stream.wait_stream(side)
        with torch.cuda.stream(capture_stream):
            call()
    torch.cuda.synchronize()
    cached = len(decode._SPLIT_COUNTERS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        out, lse = call()
    assert len(decode._SPLIT_COUNTERS) == cached  # (a capture never caches a buffer)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        replay_and_check(graph, out, q, k_cache, v_cache, None, None, kw)
    with monkeypatch.context() as m:
        _use_merge(m, "cuda", "launch")
        launched, launched_lse = call()
    torch.testing.assert_close(out, launched, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, launched_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("feature", ["plain", "leftpad", "window", "paged"])
def test_unpipelined_masked_loops(device, monkeypatch, feature):
    """tables.DECODE_MASKED_STAGES runs the masked front / tail loops unpipelined (MASKED_STAGES), split or not,
    the unmasked loop as the table tile says.  Ragged lengths (a masked tail), leftpad or a left window (a masked
    front), paged: every call matches the float64 reference."""
    arch = arch_for(torch.empty(0, device=device))
    family = tuning.family_of(arch)
    row = tuning._decode_row(arch, 32)["head_dim"]
    table_n = tuning.get_decode_config(arch, 32)["decode"]["BLOCK_N"]
    monkeypatch.setitem(tables.DECODE_MASKED_STAGES, family, {row: 1})
    monkeypatch.setattr(tuning, "_DECODE_RESOLVED", {})
    seen = []
    real_launch = decode.launch
    monkeypatch.setattr(decode, "launch", lambda kernel, cfg, grid0, grid, args, kwargs: seen.append(
        (cfg["num_stages"], kwargs.get("MASKED_STAGES"))) or real_launch(kernel, cfg, grid0, grid, args, kwargs))
    decode.forget_plans()
    torch.manual_seed(29)
    b, hq, hk, d = 2, 8, 2, 32
    cache = 4 * table_n
    q = torch.randn(b, 1, hq, d, device=device, dtype=torch.float16)
    k_cache = torch.randn(b, cache, hk, d, device=device, dtype=torch.float16)
    v_cache = torch.randn(b, cache, hk, d, device=device, dtype=torch.float16)
    kw = dict(cache_seqlens=_i32(device, cache - 5, 2 * table_n + 3))
    window = (-1, -1)
    if feature == "leftpad":
        kw["cache_leftpad"] = _i32(device, 3, table_n + 7)
    if feature == "window":
        window = (table_n + 9, -1)
    if feature == "paged":
        page = 16
        n_pages = b * cache // page
        perm = torch.randperm(n_pages, device=device)
        kw["block_table"] = perm.view(b, -1).to(torch.int32)
        k_pages = torch.empty(n_pages, page, hk, d, device=device, dtype=torch.float16)
        v_pages = torch.empty_like(k_pages)
        k_pages[perm] = k_cache.reshape(n_pages, page, hk, d)
        v_pages[perm] = v_cache.reshape(n_pages, page, hk, d)
    for splits, checked in ((2, True), (1, True), (4, True), (0, False)):
        before = len(seen)
        if feature == "paged":
            out = fa_amd.flash_attn_with_kvcache(q, k_pages, v_pages, num_splits=splits, window_size=window, **kw)
        else:
            out = fa_amd.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits, window_size=window, **kw)
        if checked:
            assert seen[before:] == [(tuning.get_decode_config(arch, 32)["decode"]["num_stages"], 1)]
        ref_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "block_table"}
        ref, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, window_size=window, **ref_kw)
        assert (out.double() - ref).abs().max() < 2e-3, (feature, splits)
    decode.forget_plans()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=True, window_size=(30, 0)), dict(window_size=(5, 3))])
def test_v_nan_reaches_every_row_of_a_tile_whatever_the_splits(device, paged, opts):
    """A NaN in V feature f reaches feature f of every row of a one-tile call (speculative decoding: 5 tokens,
    GQA 2) when some row's window reaches its key (the reference multiplies the masked probabilities, zeros, by
    it), whatever the key splits (audit 2026-11-29: a split whose keys a row does not see dropped the NaN in
    the merge)."""
    gen = torch.Generator().manual_seed(11)
    b, sq, hq, hk, d, lens = 2, 5, 4, 2, 32, [100, 70]
    cap = 112
    q = torch.randn(b, sq, hq, d, generator=gen).to(torch.float16).to(device)
    kc = torch.randn(b, cap, hk, d, generator=gen).to(torch.float16)
    vc = torch.randn(b, cap, hk, d, generator=gen).to(torch.float16)
    vc[0, 99, 1, 5] = float("nan")  # the last key: only the last query token sees it under causal
    vc[1, 63, 0, 7] = float("nan")
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), **opts)
    if paged:
        pages = cap // 16
        perm = torch.randperm(b * pages, generator=gen)
        table = perm.view(b, pages).to(torch.int32)
        kp = torch.empty(b * pages, 16, hk, d, dtype=torch.float16)
        vp = torch.empty_like(kp)
        kp[perm] = kc.reshape(b * pages, 16, hk, d)
        vp[perm] = vc.reshape(b * pages, 16, hk, d)
        caches = dict(k_cache=kp.to(device), v_cache=vp.to(device), block_table=table.to(device))
    else:
        caches = dict(k_cache=kc.to(device), v_cache=vc.to(device))
    ref, ref_lse, _, _ = attention_kvcache_ref(q, kc.to(device), vc.to(device), **kw)
    for splits in (1, 2, 4):
        out, lse = fa_amd.flash_attn_with_kvcache(q, **caches, num_splits=splits, return_softmax_lse=True, **kw)
        assert torch.equal(out.isnan(), ref.isnan()), f"num_splits={splits}"
        assert torch.equal(lse.isnan(), ref_lse.isnan())
        fine = ~ref.isnan()
        torch.testing.assert_close(out[fine].double(), ref[fine], atol=2e-2, rtol=0)


def test_v_nan_in_a_split_some_rows_do_not_see(device):
    """One row tile, two key splits: the split holding the appended NaN value is empty for the first query token
    (causal), which must still take the NaN (audit 2026-11-29: the merge dropped that split's NaNs)."""
    gen = torch.Generator().manual_seed(3)
    b, sq, hq, hk, d = 1, 7, 2, 1, 32
    q = torch.randn(b, sq, hq, d, generator=gen).to(torch.float16).to(device)
    kc = torch.randn(b, 160, hk, d, generator=gen).to(torch.float16).to(device)
    vc = torch.randn(b, 160, hk, d, generator=gen).to(torch.float16).to(device)
    k = torch.randn(b, 3, hk, d, generator=gen).to(torch.float16).to(device)
    v = torch.randn(b, 3, hk, d, generator=gen).to(torch.float16).to(device)
    v[0, 2, 0, 8] = float("nan")
    kw = dict(cache_seqlens=torch.tensor([147], dtype=torch.int32, device=device), causal=True,
              window_size=(30, 0))
    ref, _, _, _ = attention_kvcache_ref(q, kc, vc, k, v, **kw)
    out = fa_amd.flash_attn_with_kvcache(q, kc, vc, k, v, num_splits=2, **kw)
    assert ref[0, :, :, 8].isnan().all()
    assert torch.equal(out.isnan(), ref.isnan())
