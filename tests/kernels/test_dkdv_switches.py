"""The dK/dV kernel switches that change how a program walks its query blocks, against the float64 reference:
- DKDV_COL_BOUNDS=1: query-block loads from the block's scalar start, the masked blocks' scores masked by
  per-key-column row bounds (the tables set it on sm90's d128 non-causal launches);
- DKDV_ONE_MASKED_LOOP=1: a program's masked query blocks -- the causal diagonal's and the ragged or windowed tail's,
  two ranges apart -- in one loop before the unmasked ones (sm90's short causal d64 / d128 launches).
Each test runs with every dK/dV entry of this device's table patched to set the switch in every case (the GPU runs
these tests too), outputs poisoned: causal with seqlen_q != seqlen_k and ragged ends under each way of computing dQ,
windows, softcap, ALiBi + dropout, varlen with empty segments, GQA slices, a padded head dim, a split head dim (D_HI),
DKDV_SPLIT, the other switch and the reloading kernels (which ignore DKDV_COL_BOUNDS)."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward
from fa_amd.tuning.tables import TABLES

from .helpers import check_dropout_alibi, check_varlen, compare_dense, dense_qkv, dkdv_switch_patcher

SWITCHES = ("DKDV_COL_BOUNDS", "DKDV_ONE_MASKED_LOOP")


@pytest.fixture(params=SWITCHES)
def switch_tables(request, device, monkeypatch):
    """Every dK/dV launch of this device's family runs with the switch set (the returned function adds more dK/dV
    keys); .switch names it."""
    patch = dkdv_switch_patcher(monkeypatch, device, request.param)
    patch.switch = request.param
    return patch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dq_mode,deterministic", [("fused", True), ("separate", True), ("atomic", False)])
@pytest.mark.parametrize("sq,sk", [(17, 23), (40, 19), (64, 64), (77, 77)])
def test_causal(device, switch_tables, monkeypatch, dtype, dq_mode, deterministic, sq, sk):
    """Causal (bottom-right) with ragged and whole blocks (both masked ranges non-empty at 77), each way of computing
    dQ, GQA 2:1."""
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    q, k, v = dense_qkv(device, dtype, 2, sq, sk, 2, 1, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True, deterministic=deterministic), q, k, v,
                  causal=True)


@pytest.mark.parametrize("window", [(5, 0), (7, 3), (-1, 4), (6, -1)])
@pytest.mark.parametrize("d", [64, 72])
def test_windows_softcap(device, switch_tables, window, d):
    """Left / right / both windows with softcap (masked blocks on both sides of the unmasked ones); d72: a padded
    head dim (masked columns)."""
    q, k, v = dense_qkv(device, torch.float16, 1, 61, 67, 2, 2, d)
    compare_dense(functools.partial(fa_amd.flash_attn_func, window_size=window, softcap=2.5), q, k, v,
                  window_size=window, softcap=2.5)


def test_full_ragged(device, switch_tables):
    """No mask but the ragged ends (rows past seqlen_q, keys past seqlen_k)."""
    q, k, v = dense_qkv(device, torch.float32, 1, 45, 51, 2, 2, 32)
    compare_dense(fa_amd.flash_attn_func, q, k, v)


@pytest.mark.parametrize("heads_per_program,deterministic", [(1, True), (1, False), (2, True)])
def test_varlen_gqa_slices(device, switch_tables, monkeypatch, heads_per_program, deterministic):
    """Varlen with an empty segment, GQA 4:1 in slices, window + softcap."""
    monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", heads_per_program)
    check_varlen(device, torch.float16, [5, 0, 21, 40], [9, 3, 30, 40], 4, 1, 72, deterministic=deterministic,
                 causal=True, window_size=(11, -1), softcap=3.0)


def test_dropout_alibi(device, switch_tables):
    """Dropout with ALiBi (the ALiBi term and the dropout mask from the block's true start)."""
    check_dropout_alibi(device, causal=True)


@pytest.mark.parametrize("extra", ["DKDV_SPLIT", "RELOAD_CHUNK", "other"])
def test_with_other_switches(device, switch_tables, extra):
    """With DKDV_SPLIT, the reloading kernels and the other switch of SWITCHES."""
    if extra == "other":
        extra = next(s for s in SWITCHES if s != switch_tables.switch)
    switch_tables(**{extra: 16 if extra == "RELOAD_CHUNK" else 1})
    q, k, v = dense_qkv(device, torch.float16, 1, 51, 35, 2, 1, 80)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)


def test_split_head_dim(device, switch_tables):
    """A head dim run as two chunks where the family splits them (d96 = 64 + 32 under D_HI)."""
    q, k, v = dense_qkv(device, torch.float16, 1, 57, 41, 2, 2, 96)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)


def test_bitwise_equal_to_switch_off(device, monkeypatch):
    """Same gradients, bit for bit, with the switch on and off (finite inputs; causal, ragged ends)."""
    monkeypatch.setattr(tuning, "_overrides", lambda: {})
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    q, k, v = dense_qkv(device, torch.float16, 1, 45, 51, 2, 1, 64)
    dout = torch.randn_like(q)
    got = []
    for on in (0, 1):
        rows = [{k_: (dict(v_, DKDV_COL_BOUNDS=on) if k_ in ("dkdv", "dkdv_atomic") else v_)
                 for k_, v_ in row.items()} for row in TABLES[family]]
        monkeypatch.setitem(TABLES, family, rows)
        tuning._RESOLVED.clear()
        out = fa_amd.flash_attn_func(q, k, v, causal=True, window_size=(9, 0))
        got.append(torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*got):
        assert torch.equal(a, b)
