"""Head dims that are not a power of two run as two power-of-two chunks (tables.HEAD_DIM_SPLIT_FAMILIES,
tuning.head_dim_chunks: 192 = 128 + 64, 160 = 128 + 32, 96 = 64 + 32, 80 = 64 + 16), constexpr D_HI of the forward,
dK/dV and dQ kernels.  Each case runs split and padded (the family taken out of the table), checks that
the split launches really carry D_HI, and compares output and gradients with the float64 reference:
GQA with seqlen_q != seqlen_k, masks, softcap, ALiBi + dropout, varlen with empty segments, every way the
backward gets dQ, split GQA groups (partials and atomics), DKDV_SPLIT, and the V NaN rule in both modes."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward, forward, launch
from fa_amd.reference import attention_ref
from fa_amd.tuning import tables

from .helpers import check_varlen, compare_dense, compare_output, dense_qkv


@pytest.fixture
def split_mode(device, monkeypatch, request):
    """Split (the default where the family splits) or padded; records the D_HI of every attention launch."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    others = tuple(f for f in tables.HEAD_DIM_SPLIT_FAMILIES if f != family)
    monkeypatch.setattr(tables, "HEAD_DIM_SPLIT_FAMILIES", others + ((family,) if request.param == "split" else ()))
    seen = []
    for module in (forward, backward):
        real = module.launch

        def spy(kernel, cfg, *args, _real=real, **kwargs):
            seen.append((getattr(kernel, "__name__", None) or kernel.fn.__name__, args[-1]["D_PAD"],
                         args[-1].get("D_HI", 0)))
            return _real(kernel, cfg, *args, **kwargs)
        monkeypatch.setattr(module, "launch", spy)
    return request.param, seen


def _check_launches(split_mode, d):
    mode, seen = split_mode
    lo, hi = tuning.head_dim_chunks(arch_for(torch.empty(0)), d, launch.head_dim_padded(d)) if mode == "split" \
        else (launch.head_dim_padded(d), 0)
    assert seen, "no attention launch recorded"
    attention = [s for s in seen if "probs" not in s[0]]
    assert all(s[1:] == (lo, hi) for s in attention), (seen, lo, hi)
    if mode == "split":
        assert hi > 0, f"d{d} should split"


both = pytest.mark.parametrize("split_mode", ["split", "padded"], indirect=True)


def test_chunk_rule():
    """The split only where it saves work, first chunks of at least 64 columns (tables.HEAD_DIM_SPLIT_MIN_PADDED),
    second chunks of at least 16 (tl.dot's minimum K) with no padded column."""
    arch = arch_for(torch.empty(0))  # the interpreter's family splits (tables.HEAD_DIM_SPLIT_FAMILIES)
    want = {16: (16, 0), 24: (32, 0), 40: (64, 0), 48: (64, 0), 59: (64, 0), 72: (128, 0), 80: (64, 16),
            88: (128, 0), 96: (64, 32), 112: (128, 0), 128: (128, 0), 144: (128, 16), 160: (128, 32),
            176: (256, 0), 192: (128, 64), 200: (256, 0), 256: (256, 0)}
    for d, chunks in want.items():
        assert tuning.head_dim_chunks(arch, d, launch.head_dim_padded(d)) == chunks, d


@pytest.mark.parametrize("split_mode", ["split"], indirect=True)
def test_reloading_entries_take_one_chunk(device, split_mode, monkeypatch):
    """RELOAD_CHUNK kernels take no second chunk (they static_assert it): an entry that sets it runs padded."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    rows = [{k: (dict(v, RELOAD_CHUNK=16) if isinstance(v, dict) else v) for k, v in row.items()}
            for row in tables.TABLES[family]]
    monkeypatch.setitem(tables.TABLES, family, rows)
    q, k, v = dense_qkv(device, torch.float16, 1, 13, 21, 2, 1, 80)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)
    assert {s[1:] for s in split_mode[1]} == {(128, 0)}


@both
@pytest.mark.parametrize("d", [80, 96, 192])
def test_gqa_causal(device, split_mode, d):
    q, k, v = dense_qkv(device, torch.float16, 2, 19, 37, 4, 2, d)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)
    _check_launches(split_mode, d)


@both
@pytest.mark.parametrize("dq_mode,deterministic", [("fused", True), ("separate", True), ("atomic", False)])
def test_dq_modes_window_softcap(device, split_mode, monkeypatch, dq_mode, deterministic):
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    q, k, v = dense_qkv(device, torch.float32, 1, 23, 17, 3, 1, 80)
    kw = dict(window_size=(6, 2), softcap=3.0)
    compare_dense(functools.partial(fa_amd.flash_attn_func, deterministic=deterministic, **kw), q, k, v, **kw)
    _check_launches(split_mode, 80)


@both
@pytest.mark.parametrize("heads_per_program,deterministic", [(1, True), (1, False)])
def test_varlen_empty_segments_gqa_slices(device, split_mode, monkeypatch, heads_per_program, deterministic):
    """Varlen with an empty segment; dK/dV programs over slices of the group (fp32 partials, or atomics)."""
    monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", heads_per_program)
    check_varlen(device, torch.float16, [5, 0, 21], [9, 3, 30], 4, 2, 96, deterministic=deterministic,
                 causal=True, window_size=(11, -1))
    _check_launches(split_mode, 96)


@both
def test_dkdv_split_programs(device, split_mode, monkeypatch):
    """DKDV_SPLIT (dK and dV from separate programs, the sm90 d192 row's backward) with the second chunk."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    rows = [{k: (dict(v, DKDV_SPLIT=1) if k in ("dkdv", "dkdv_atomic") else v) for k, v in row.items()}
            for row in tables.TABLES[family]]
    monkeypatch.setitem(tables.TABLES, family, rows)
    q, k, v = dense_qkv(device, torch.float16, 1, 17, 29, 2, 1, 192)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)
    _check_launches(split_mode, 192)


@both
def test_alibi_dropout(device, split_mode):
    """Dropout (the backward regenerates the forward's mask) with ALiBi, read back through return_attn_probs."""
    torch.manual_seed(5)
    q, k, v = dense_qkv(device, torch.float16, 1, 21, 21, 2, 2, 96)
    slopes = torch.rand(2, device=device, dtype=torch.float32)
    out, _, probs = fa_amd.flash_attn_func(q, k, v, dropout_p=0.25, alibi_slopes=slopes, return_attn_probs=True,
                                           deterministic=True)
    kw = dict(alibi_slopes=slopes, dropout_p=0.25, dropout_mask=probs >= 0)  # dropped entries come back negative
    compare_output(out, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v)
    _check_launches(split_mode, 96)


@both
@pytest.mark.parametrize("nan_mode", ["fixup", "pass"])
def test_v_nan_rule_in_both_chunks(device, split_mode, monkeypatch, nan_mode):
    """A NaN in V under a window makes its feature NaN in every row (as in the reference), whichever chunk
    holds the feature, with the NaN marked inside the forward (and written by the fix-up launch) or found
    by the pass before it."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    others = tuple(f for f in tables.FWD_NAN_FIXUP_FAMILIES if f != family)
    monkeypatch.setattr(tables, "FWD_NAN_FIXUP_FAMILIES", others + ((family,) if nan_mode == "fixup" else ()))
    q, k, v = (torch.randn(1, 19, h, 192, device=device, dtype=torch.float16) for h in (2, 1, 1))
    v[0, 11, 0, 150] = float("nan")
    v[0, 2, 0, 5] = float("nan")
    out = fa_amd.flash_attn_func(q, k, v, window_size=(3, 3))
    ref = attention_ref(q.double(), k.double(), v.double(), window_size=(3, 3))[0]
    assert torch.equal(out.isnan(), ref.isnan())
    assert out.isnan().any(1).any(1)[0].nonzero().flatten().tolist() == [5, 150]
    assert (out.double() - ref)[~ref.isnan()].abs().max() < 2e-3
    _check_launches(split_mode, 192)
