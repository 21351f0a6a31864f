"""FWD_MERGED_EDGES (tables.KERNEL_SWITCHES): a masked forward on whole blocks (EVEN_QK) walks all its key blocks in
one loop and masks the window only in the edge blocks (the causal diagonal, a left window's first blocks), under a
branch.  Checked with the switch on and off in every forward entry of this device's table, whole blocks forced
(EVEN_QK_FAMILIES / EVEN_QK_FP8_FAMILIES), outputs poisoned, against the float64 reference: causal with rows that
see no key, left / right / both windows with softcap, ALiBi with dropout, a split or padded head dim, FP8 inputs;
that the launches really take both switches; that both forms agree; and that ragged lengths keep the separate
loops.  The GPU runs these tests too."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward, forward, launch
from fa_amd.reference import attention_ref
from fa_amd.tuning import tables

from .helpers import compare_dense, compare_output, dense_qkv, table_switch_patcher


@pytest.fixture(params=[1, 0], ids=["merged", "separate"])
def merged(request, monkeypatch, device):
    """Every forward entry of this device's family sets FWD_MERGED_EDGES to the param (.value; calling it with
    another value sets that); whole blocks on for both dtypes' forwards; outputs poisoned; no tuned table from disk."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    for name in ("EVEN_QK_FAMILIES", "EVEN_QK_FP8_FAMILIES"):
        monkeypatch.setattr(tables, name, tuple(set(getattr(tables, name)) | {family}))
    patch = table_switch_patcher(monkeypatch, device, "FWD_MERGED_EDGES", ("fwd",), value=request.param)
    patch.value = request.param
    yield patch
    tuning._RESOLVED.clear()


@pytest.fixture
def launched(monkeypatch):
    """[(EVEN_QK, FWD_MERGED_EDGES) of each attn_fwd_kernel launch] made while the test runs."""
    seen = []
    real = launch.jit_launch

    def spy(kernel, grid, args, kwargs):
        if getattr(getattr(kernel, "fn", None), "__name__", None) == "attn_fwd_kernel":
            seen.append((kwargs.get("EVEN_QK"), kwargs.get("FWD_MERGED_EDGES")))
        return real(kernel, grid, args, kwargs)
    for module in (launch, forward, backward):
        monkeypatch.setattr(module, "jit_launch", spy)
    return seen


@pytest.mark.parametrize("sq,sk", [(128, 128), (128, 256), (256, 128)])
def test_causal(device, merged, launched, sq, sk):
    """Causal (bottom-right; at sq > sk the first rows see no key: out 0, lse +inf), GQA 2:1, gradients too."""
    q, k, v = dense_qkv(device, torch.float16, 2, sq, sk, 2, 1, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)
    assert launched and launched[0] == (True, merged.value)


@pytest.mark.parametrize("window", [(40, 0), (33, 17), (-1, 20), (50, -1), (0, 0)])
@pytest.mark.parametrize("d", [64, 96])
def test_windows_softcap(device, merged, window, d):
    """Left / right / both windows with softcap (the scores' second path); d96: two chunks (D_HI) where the family
    splits it, else a padded head dim."""
    q, k, v = dense_qkv(device, torch.float16, 1, 128, 128, 2, 2, d)
    compare_dense(functools.partial(fa_amd.flash_attn_func, window_size=window, softcap=2.5), q, k, v,
                  window_size=window, softcap=2.5)


def test_windows_plain(device, merged):
    """A left and right window without score modifiers (the plain scores' path), sq != sk, fp32."""
    q, k, v = dense_qkv(device, torch.float32, 1, 96, 160, 2, 2, 32)
    compare_dense(functools.partial(fa_amd.flash_attn_func, window_size=(45, 7)), q, k, v, window_size=(45, 7))


def test_dropout_alibi_causal(device, merged):
    """Causal ALiBi with dropout, fp32: the mask return_attn_probs reports is the one the output used."""
    p = 0.2
    q, k, v = dense_qkv(device, torch.float32, 2, 128, 128, 2, 2, 32)
    slopes = torch.rand(2, device=device) * 0.5 + 0.05
    out, _, s_dmask = fa_amd.flash_attn_func(q, k, v, dropout_p=p, alibi_slopes=slopes, return_attn_probs=True,
                                             causal=True)
    kw = dict(alibi_slopes=slopes, dropout_p=p, dropout_mask=s_dmask >= 0, causal=True)
    compare_output(out, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(40, 9)), dict(window_size=(40, 9), softcap=5.0)])
def test_fp8(device, merged, launched, opts):
    """FA3-style FP8 inputs (GQA 2:1) within test_fp8's bound of the float64 attention of the original inputs."""
    from .test_fp8 import check_fa3_style_call

    check_fa3_style_call(device, 128, 256, 4, 2, 64, **opts)
    assert launched and launched[0] == (True, merged.value)


def test_merged_matches_separate(device, merged):
    """The same causal and windowed calls with the switch flipped: the same outputs and lse up to rounding (the loops
    visit the same blocks in the same order)."""
    q, k, v = dense_qkv(device, torch.float16, 2, 128, 256, 4, 2, 64)
    results = []
    for value in (merged.value, 1 - merged.value):
        merged(value)
        with torch.no_grad():
            results.append([fa_amd.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2],
                            fa_amd.flash_attn_func(q, k, v, window_size=(70, 30), return_attn_probs=True)[:2]])
    for (a_out, a_lse), (b_out, b_lse) in zip(*results):
        torch.testing.assert_close(a_out, b_out, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(a_lse, b_lse, atol=1e-4, rtol=1e-4)


def test_ragged_lengths_keep_separate_loops(device, merged, launched):
    """Lengths that are not whole blocks: no EVEN_QK, so the bounded loads and the separate masked loops, right."""
    q, k, v = dense_qkv(device, torch.float16, 1, 77, 93, 2, 2, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)
    assert launched and launched[0] == (False, merged.value)


@pytest.mark.parametrize("window", [(-1, -1), (40, -1)])
def test_sinks_causal(device, merged, window):
    """Learnable sinks (the softmax starts from the sink's logit), causal and a causal sliding window, GQA 2:1."""
    from .test_sinks import _dense_case

    _dense_case(device, torch.float16, (1, 128, 128, 4, 2, 64), causal=True, window_size=window)


def test_broken_promise_stays_inside_the_sequence(device, merged, monkeypatch):
    """EVEN_QK forced on a causal call whose lengths are not whole blocks (the host never does this): the kernel
    rounds the lengths down, so the merged loop too reads only inside the sequence.  The inputs are views of buffers
    holding NaN past it; rows of the first 128 see only keys of the first 128, so they come out finite."""
    n, done = 200, 128
    bufs = [torch.full((1, 320, 2, 64), float("nan"), device=device, dtype=torch.float16) for _ in range(3)]
    for buf in bufs:
        buf[:, :n] = torch.randn(1, n, 2, 64, device=device, dtype=torch.float16)
    q, k, v = (buf[:, :n] for buf in bufs)
    monkeypatch.setattr(forward, "even_qk", lambda *args: True)
    with torch.no_grad():
        out = fa_amd.flash_attn_func(q, k, v, causal=True, window_size=(50, 0))
    assert torch.isfinite(out[:, :done]).all()
