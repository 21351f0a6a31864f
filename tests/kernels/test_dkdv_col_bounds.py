"""The dK/dV kernel switch DKDV_COL_BOUNDS=1 (query-block loads from the block's scalar start, the masked
blocks' scores masked by per-key-column row bounds) vs the reference.  The tables switch it on for sm90's d128
non-causal launches only (.ci/bwd_spill_ab.py timed it), so every dK/dV entry of this device's table is patched to
set it in every case (the GPU runs these tests too): causal
with seqlen_q != seqlen_k, windows, softcap, ALiBi + dropout, varlen with empty segments, GQA slices, a
padded head dim, a split head dim (D_HI), DKDV_SPLIT and the reloading kernels (which ignore it)."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward, launch
from fa_amd.tuning.tables import TABLES

from .helpers import check_dropout_alibi, check_varlen, compare_dense, dense_qkv


@pytest.fixture
def bounds_tables(device, monkeypatch):
    """Every dK/dV launch of this device's family runs with DKDV_COL_BOUNDS=1 (extra: more dK/dV keys)."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})  # no tuned table from disk
    arch = arch_for(torch.empty(0, device=device))
    family = tuning.family_of(arch)

    def switched_on(entry, **extra):  # the switch set at the top and dropped from every override of the entry
        entry = {k: (switched_on(v) if isinstance(v, dict) else v) for k, v in entry.items()}
        entry.pop("DKDV_COL_BOUNDS", None)
        return dict(entry, **extra)

    def patch(**extra):
        rows = [{k: (switched_on(v, DKDV_COL_BOUNDS=1, **extra) if k in ("dkdv", "dkdv_atomic") else v)
                 for k, v in row.items()} for row in TABLES[family]]
        monkeypatch.setitem(TABLES, family, rows)
        tuning._RESOLVED.clear()  # no launch plan of an earlier test
        assert tuning.get_config(arch, "dkdv", 128)["DKDV_COL_BOUNDS"] == 1
        assert tuning.get_config(arch, "dkdv", 128, causal=True)["DKDV_COL_BOUNDS"] == 1
        assert "DKDV_COL_BOUNDS" not in tuning.get_config(arch, "dq", 128)
    patch()
    return patch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dq_mode,deterministic", [("fused", True), ("separate", True), ("atomic", False)])
@pytest.mark.parametrize("sq,sk", [(17, 23), (40, 19), (64, 64)])
def test_causal(device, bounds_tables, monkeypatch, dtype, dq_mode, deterministic, sq, sk):
    """Causal (bottom-right) with ragged and whole blocks, each way of computing dQ, GQA 2:1."""
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    q, k, v = dense_qkv(device, dtype, 2, sq, sk, 2, 1, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True, deterministic=deterministic), q, k, v,
                  causal=True)


@pytest.mark.parametrize("window", [(5, 0), (7, 3), (-1, 4), (6, -1)])
@pytest.mark.parametrize("d", [64, 72])
def test_windows_softcap(device, bounds_tables, window, d):
    """Left / right / both windows with softcap; d72: a padded head dim (masked columns)."""
    q, k, v = dense_qkv(device, torch.float16, 1, 29, 37, 2, 2, d)
    compare_dense(functools.partial(fa_amd.flash_attn_func, window_size=window, softcap=2.5), q, k, v,
                  window_size=window, softcap=2.5)


def test_full_ragged(device, bounds_tables):
    """No mask but the ragged ends (rows past seqlen_q, keys past seqlen_k)."""
    q, k, v = dense_qkv(device, torch.float32, 1, 45, 51, 2, 2, 32)
    compare_dense(fa_amd.flash_attn_func, q, k, v)


@pytest.mark.parametrize("heads_per_program,deterministic", [(1, True), (1, False), (2, True)])
def test_varlen_gqa_slices(device, bounds_tables, monkeypatch, heads_per_program, deterministic):
    """Varlen with an empty segment, GQA 4:1 in slices, window + softcap."""
    monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", heads_per_program)
    check_varlen(device, torch.float16, [5, 0, 21], [9, 3, 30], 4, 1, 72, deterministic=deterministic,
                 causal=True, window_size=(11, -1), softcap=3.0)


def test_dropout_alibi(device, bounds_tables):
    """Dropout with ALiBi (the ALiBi term and the dropout mask from the block's start)."""
    check_dropout_alibi(device, causal=True)


@pytest.mark.parametrize("extra", [{"DKDV_SPLIT": 1}, {"RELOAD_CHUNK": 16}], ids=["split", "reload"])
def test_with_other_switches(device, bounds_tables, extra):
    """With DKDV_SPLIT, and with the reloading kernels (which keep their own masks)."""
    bounds_tables(**extra)
    q, k, v = dense_qkv(device, torch.float16, 1, 19, 35, 2, 1, 80)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)


def test_split_head_dim(device, bounds_tables):
    """A head dim run as two chunks where the family splits them (d96 = 64 + 32 under D_HI)."""
    q, k, v = dense_qkv(device, torch.float16, 1, 33, 41, 2, 2, 96)
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
