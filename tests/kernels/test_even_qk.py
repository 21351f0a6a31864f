"""EVEN_QK (kernels/launch.even_qk, tables.EVEN_QK_FAMILIES): a dense call whose query and key counts are whole
multiples of a launch's tiles runs kernels whose masked blocks (causal diagonal, window edges) load without row or key
bounds.  Checked here: which launches take it, the float64 reference on whole-block shapes under every mask and way
of computing dQ (outputs poisoned), whole blocks against bounded loads, and that a launch told EVEN_QK on lengths
that are not whole blocks still reads and writes only inside the sequence (the kernels round the lengths down)."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward, forward, launch
from fa_amd.kernels.launch import even_qk
from fa_amd.reference import attention_ref
from fa_amd.tuning import tables

from .helpers import compare_dense, compare_output, dense_qkv

KERNELS = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")


@pytest.fixture
def poisoned(monkeypatch, device):
    """Outputs poisoned, no tuned table from disk, this device's family in EVEN_QK_FAMILIES, no earlier plan."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    monkeypatch.setattr(tables, "EVEN_QK_FAMILIES", tuple(set(tables.EVEN_QK_FAMILIES) | {family}))
    tuning._RESOLVED.clear()
    yield family
    tuning._RESOLVED.clear()


@pytest.fixture
def launched(monkeypatch):
    """{kernel name: [EVEN_QK of each of its launches]} of the calls made while the test runs."""
    seen = {}
    real = launch.jit_launch

    def spy(kernel, grid, args, kwargs):
        name = getattr(getattr(kernel, "fn", None), "__name__", None)
        seen.setdefault(name, []).append(kwargs.get("EVEN_QK"))
        return real(kernel, grid, args, kwargs)
    for module in (launch, forward, backward):
        monkeypatch.setattr(module, "jit_launch", spy)
    return seen


def test_even_qk_rule():
    assert even_qk(False, 128, 256, (64, 128))
    assert even_qk(False, 256, 128, (64, 128), (128, 64))
    assert not even_qk(False, 192, 256, (64, 128), (128, 64))  # 192 rows: not whole 128-row dQ blocks
    assert not even_qk(False, 128, 200, (64, 128))
    assert not even_qk(True, 128, 128, (64, 64))  # varlen: the lengths are on the device


@pytest.mark.parametrize("dq_mode,deterministic", [("fused", True), ("separate", True), ("atomic", False)])
def test_launches_take_even_qk_on_whole_blocks(device, poisoned, launched, monkeypatch, dq_mode, deterministic):
    """Whole blocks: forward, dK/dV and dQ launches all take it; a ragged length, a varlen call or a family the table
    leaves out: none does."""
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)

    def run(sq, sk):
        q, k, v = dense_qkv(device, torch.float16, 1, sq, sk, 2, 1, 64)
        fa_amd.flash_attn_func(q, k, v, causal=True, deterministic=deterministic).sum().backward()

    run(256, 256)
    took = {name: flags for name, flags in launched.items() if name in KERNELS}
    expected = {"attn_fwd_kernel", "attn_bwd_dkdv_kernel"} | ({"attn_bwd_dq_kernel"} if dq_mode == "separate" else set())
    assert set(took) == expected and all(all(flags) for flags in took.values()), took
    for sq, sk in ((250, 256), (256, 200)):
        launched.clear()
        run(sq, sk)
        assert not any(any(launched.get(name, [])) for name in KERNELS), launched
    launched.clear()
    monkeypatch.setattr(tables, "EVEN_QK_FAMILIES", tuple(f for f in tables.EVEN_QK_FAMILIES if f != poisoned))
    run(256, 256)
    assert not any(any(launched.get(name, [])) for name in KERNELS), launched
    launched.clear()
    cu = torch.tensor([0, 128, 256], dtype=torch.int32, device=device)
    q, k, v = dense_qkv(device, torch.float16, 1, 256, 256, 2, 1, 64)
    monkeypatch.setattr(tables, "EVEN_QK_FAMILIES", tables.EVEN_QK_FAMILIES + (poisoned,))
    fa_amd.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 128, 128, causal=True).sum().backward()
    assert not any(any(launched.get(name, [])) for name in KERNELS), launched


@pytest.mark.parametrize("dq_mode,deterministic", [("fused", True), ("separate", True), ("atomic", False)])
@pytest.mark.parametrize("sq,sk", [(128, 128), (128, 256), (256, 128)])
def test_causal_whole_blocks(device, poisoned, monkeypatch, dq_mode, deterministic, sq, sk):
    """Causal (bottom-right; rows that see no key at sq > sk), GQA 2:1, each way of computing dQ."""
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    q, k, v = dense_qkv(device, torch.float16, 2, sq, sk, 2, 1, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True, deterministic=deterministic), q, k, v,
                  causal=True)


@pytest.mark.parametrize("window", [(40, 0), (33, 17), (-1, 20), (50, -1)])
@pytest.mark.parametrize("d", [64, 96])
def test_windows_softcap_whole_blocks(device, poisoned, window, d):
    """Left / right / both windows with softcap; d96: a padded head dim, or two chunks (D_HI) where the family
    splits it."""
    q, k, v = dense_qkv(device, torch.float16, 1, 128, 128, 2, 2, d)
    compare_dense(functools.partial(fa_amd.flash_attn_func, window_size=window, softcap=2.5), q, k, v,
                  window_size=window, softcap=2.5)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_alibi_whole_blocks(device, poisoned, causal):
    """Dropout with ALiBi, fp32: the backward regenerates the forward's mask (return_attn_probs reports it)."""
    p = 0.2
    q, k, v = dense_qkv(device, torch.float32, 2, 128, 128, 2, 2, 32)
    slopes = torch.rand(2, device=device) * 0.5 + 0.05
    out, _, s_dmask = fa_amd.flash_attn_func(q, k, v, dropout_p=p, alibi_slopes=slopes, return_attn_probs=True,
                                             deterministic=True, causal=causal)
    kw = dict(alibi_slopes=slopes, dropout_p=p, dropout_mask=s_dmask >= 0, causal=causal)
    compare_output(out, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v)


def test_whole_blocks_match_bounded_loads(device, poisoned, monkeypatch):
    """The same call with EVEN_QK and with every bound kept: the same output and gradients."""
    q, k, v = dense_qkv(device, torch.float16, 2, 128, 256, 4, 2, 64)
    dout = torch.randn(2, 128, 4, 64, device=device, dtype=torch.float16)
    results = []
    for families in (tables.EVEN_QK_FAMILIES, ()):
        monkeypatch.setattr(tables, "EVEN_QK_FAMILIES", families)
        out = fa_amd.flash_attn_func(q, k, v, causal=True, window_size=(60, 0))
        results.append([out, *torch.autograd.grad(out, (q, k, v), dout)])
    for whole, bounded in zip(*results):
        torch.testing.assert_close(whole, bounded, atol=2e-3, rtol=2e-3)


def test_broken_promise_stays_inside_the_sequence(device, poisoned, monkeypatch):
    """EVEN_QK forced on a call whose lengths are not whole blocks (the host never does this).  The inputs are views
    of buffers holding NaN past the sequence; every row sees every key (no causal mask), so one load past the end
    would make every row NaN.  The kernels round the lengths down to whole blocks, so the rows (keys) they compute --
    at least the first 128 with any tile of 128 or less -- come out finite: forward forced, then the backward forced
    under a forward that was not."""
    n, done = 200, 128
    bufs = [torch.full((1, 320, 2, 64), float("nan"), device=device, dtype=torch.float16) for _ in range(3)]
    for buf in bufs:
        buf[:, :n] = torch.randn(1, n, 2, 64, device=device, dtype=torch.float16)
    q, k, v = (buf[:, :n].requires_grad_() for buf in bufs)
    monkeypatch.setattr(forward, "even_qk", lambda *args: True)
    with torch.no_grad():
        assert torch.isfinite(fa_amd.flash_attn_func(q, k, v)[:, :done]).all()
    monkeypatch.setattr(forward, "even_qk", even_qk)
    tuning._RESOLVED.clear()  # (a GPU replays the forced call's launch plan otherwise)
    out = fa_amd.flash_attn_func(q, k, v)
    assert torch.isfinite(out).all()
    monkeypatch.setattr(backward, "even_qk", lambda *args: True)
    tuning._RESOLVED.clear()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g[:, :done]).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("seqlen,causal", [(256, True), (128, False)])
def test_other_backwards_and_fp8_follow_their_tables(device, poisoned, launched, monkeypatch, seqlen, causal):
    """The backward of a launch past tables.SHORT_SEQLEN_K (256 keys here) or of an unmasked one takes EVEN_QK only
    where EVEN_QK_OTHER_BWD_FAMILIES lists the family, an FP8 forward only where EVEN_QK_FP8_FAMILIES does; the
    bf16 forward either way."""
    monkeypatch.setattr(tables, "SHORT_SEQLEN_K", 128)
    for families in ((), (poisoned,)):
        monkeypatch.setattr(tables, "EVEN_QK_OTHER_BWD_FAMILIES", families)
        tuning._RESOLVED.clear()
        launched.clear()
        q, k, v = dense_qkv(device, torch.float16, 1, seqlen, seqlen, 2, 2, 64)
        fa_amd.flash_attn_func(q, k, v, causal=causal).sum().backward()
        assert all(launched["attn_fwd_kernel"])
        assert all(launched["attn_bwd_dkdv_kernel"]) == bool(families) and any(launched["attn_bwd_dkdv_kernel"]) \
            == bool(families)
    fp8 = fa_amd.fp8.fp8_dtypes(device)[0]
    for families in ((), (poisoned,)):
        monkeypatch.setattr(tables, "EVEN_QK_FP8_FAMILIES", families)
        tuning._RESOLVED.clear()
        launched.clear()
        q8, k8, v8 = (torch.randn(1, 128, 2, 64, device=device).to(fp8) for _ in range(3))
        fa_amd.flash_attn_func(q8, k8, v8, causal=True)
        assert launched["attn_fwd_kernel"] == [bool(families)]


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(40, 9), softcap=5.0)])
def test_fp8_whole_blocks(device, poisoned, monkeypatch, opts):
    """FP8 inputs (FA3-style descales, GQA 2:1) on whole blocks, EVEN_QK on: within test_fp8's bound of the float64
    attention of the original inputs."""
    from .test_fp8 import check_fa3_style_call

    monkeypatch.setattr(tables, "EVEN_QK_FP8_FAMILIES", (poisoned,))
    check_fa3_style_call(device, 128, 256, 4, 2, 64, **opts)


@pytest.mark.parametrize("deterministic", [True, False], ids=["partial sums", "atomic sum"])
def test_gqa_slices_whole_blocks(device, poisoned, monkeypatch, deterministic):
    """GQA groups split over dK/dV programs (one query head each): fp32 partial dK/dV summed afterwards, or added
    with atomics into the group's KV head -- the store path without row bounds."""
    monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", 1)
    q, k, v = dense_qkv(device, torch.float16, 1, 128, 256, 4, 2, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True, deterministic=deterministic), q, k, v,
                  causal=True)


@pytest.mark.parametrize("switch", ["DKDV_SPLIT", "RELOAD_CHUNK"])
def test_kernel_switches_whole_blocks(device, poisoned, monkeypatch, switch):
    """Whole blocks under the dK/dV programs split into dK and dV ones (DKDV_SPLIT) and under the reloading kernels
    (RELOAD_CHUNK, gfx1100's rows: operands streamed a head-dim chunk at a time), every entry of the family patched."""
    from fa_amd.tuning.tables import TABLES

    arch = arch_for(torch.empty(0, device=device))
    value = {"DKDV_SPLIT": 1, "RELOAD_CHUNK": 16}[switch]
    kernels = ("dkdv", "dkdv_atomic") if switch == "DKDV_SPLIT" else tuning.KERNELS
    rows = [{k: (dict(v, **{switch: value}) if k in kernels and isinstance(v, dict) else v) for k, v in row.items()}
            for row in TABLES[poisoned]]
    monkeypatch.setitem(TABLES, poisoned, rows)
    tuning._RESOLVED.clear()
    assert tuning.get_config(arch, "dkdv", 64)[switch] == value
    q, k, v = dense_qkv(device, torch.float16, 1, 128, 128, 4, 2, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, window_size=(50, 0), deterministic=True), q, k, v,
                  window_size=(50, 0))
