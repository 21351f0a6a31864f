"""The split dK/dV backward (kernel switch DKDV_SPLIT=1: dK and dV from separate programs of one
launch, each holding one accumulator) vs the reference.  The tables switch it on nowhere yet (it
is a d256 candidate timed by .ci/d256_ab.py), so every dK/dV entry of this device's table is
patched to set it; each way of computing dQ (fused into the launch, a second launch, atomics),
GQA slices, varlen with empty segments, dropout + ALiBi, and the reloading kernels under it."""
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
def split_tables(device, monkeypatch):
    """Every dK/dV launch of this device's family runs with DKDV_SPLIT=1 (extra: more entry keys)."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})  # no tuned table from disk
    arch = arch_for(torch.empty(0, device=device))
    family = tuning.family_of(arch)

    def patch(**extra):
        rows = [{k: (dict(v, DKDV_SPLIT=1, **extra) if k in ("dkdv", "dkdv_atomic") else
                     (dict(v, **extra) if isinstance(v, dict) and extra else v)) for k, v in row.items()}
                for row in TABLES[family]]
        monkeypatch.setitem(TABLES, family, rows)
        assert tuning.get_config(arch, "dkdv", 256)["DKDV_SPLIT"] == 1
        assert "DKDV_SPLIT" not in tuning.get_config(arch, "dq", 256)
    patch()
    return patch


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("dq_mode,deterministic", [("fused", True), ("separate", True), ("atomic", False)])
def test_d256_like_gqa_causal(device, split_tables, monkeypatch, dtype, dq_mode, deterministic):
    """A head dim padded to 256 (200), GQA 2:1, causal with seqlen_q != seqlen_k."""
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    q, k, v = dense_qkv(device, dtype, 1, 17, 23, 2, 1, 200)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True, deterministic=deterministic), q, k, v,
                  causal=True)


@pytest.mark.parametrize("early_return", [True, False])
@pytest.mark.parametrize("dq_mode", ["fused", "separate"])
def test_blocks_past_the_sequence(device, split_tables, monkeypatch, early_return, dq_mode):
    """Key blocks past a short (or empty) sequence: split programs return early, or run with empty query
    ranges, every load and store masked off (tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES picks per family)."""
    from fa_amd.tuning import tables

    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    others = tuple(f for f in tables.DKDV_SPLIT_EARLY_RETURN_FAMILIES if f != family)
    monkeypatch.setattr(tables, "DKDV_SPLIT_EARLY_RETURN_FAMILIES", others + ((family,) if early_return else ()))
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    tuning._RESOLVED.clear()  # no launch plan of an earlier test
    check_varlen(device, torch.float16, [3, 0, 40], [5, 0, 47], 2, 1, 80, deterministic=True, causal=True)


@pytest.mark.parametrize("heads_per_program,deterministic", [(1, True), (1, False), (2, True)])
def test_varlen_gqa_slices(device, split_tables, monkeypatch, heads_per_program, deterministic):
    """Varlen with an empty segment, GQA 4:1 summed by dK/dV programs over slices of the group
    (partials, or atomics where deterministic=False allows them), window + softcap."""
    monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", heads_per_program)
    check_varlen(device, torch.float16, [5, 0, 21], [9, 3, 30], 4, 1, 72, deterministic=deterministic,
                 causal=True, window_size=(11, -1), softcap=3.0)


def test_dropout_alibi(device, split_tables):
    """Dropout (the backward regenerates the forward's mask in both program kinds) with ALiBi."""
    check_dropout_alibi(device, causal=False)


def test_with_reload_chunk(device, split_tables):
    """DKDV_SPLIT with the reloading kernels (RELOAD_CHUNK) of every entry."""
    split_tables(RELOAD_CHUNK=16)
    q, k, v = dense_qkv(device, torch.float16, 1, 19, 35, 2, 1, 80)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=True), q, k, v, causal=True)


def test_switch_scope():
    """DKDV_SPLIT reaches only the dK/dV kernel: the others' launch dicts never carry it, an entry
    of theirs that sets it is a table error, and it does not keep dQ out of the fused launch."""
    from fa_amd.tuning import bwd_fusable, resolve_entry

    cfg = resolve_entry({"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}, kernel="dkdv")
    assert cfg["DKDV_SPLIT"] == 0 and cfg["RELOAD_CHUNK"] == 0
    for kernel in ("fwd", "dq"):
        assert "DKDV_SPLIT" not in resolve_entry({"BLOCK_M": 16, "BLOCK_N": 32}, kernel=kernel)
        with pytest.raises(ValueError, match="takes no DKDV_SPLIT"):
            resolve_entry({"BLOCK_M": 16, "BLOCK_N": 32, "DKDV_SPLIT": 1}, kernel=kernel)
    dq = resolve_entry({"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}, kernel="dq")
    assert bwd_fusable("sm90", dict(cfg, DKDV_SPLIT=1), dq)
    assert not bwd_fusable("sm90", dict(cfg, DKDV_SPLIT=1, num_stages=2), dq)


# the sm90 d256 candidates of .ci/d256_ab.py (8 warps, 128-key tiles), in the GPU's own precision
GPU_CANDIDATES = {
    "split16": (dict(BLOCK_M=16, BLOCK_N=128, num_warps=8, num_stages=2, DKDV_SPLIT=1),
                dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)),
    "split32": (dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2, DKDV_SPLIT=1),
                dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", list(GPU_CANDIDATES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim,causal,deterministic", [(256, False, False), (256, True, True), (192, True, False),
                                                           (200, False, True)])
def test_d256_candidates_gpu(device, monkeypatch, candidate, dtype, head_dim, causal, deterministic):
    """The candidate d256 rows (dK/dV split, fused dQ) on odd lengths, GQA 2:1."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    dkdv, dq = GPU_CANDIDATES[candidate]
    rows = [dict(r, dkdv=dkdv, dq=dq) if r["head_dim"] >= 256 else r for r in TABLES[family]]
    monkeypatch.setitem(TABLES, family, rows)
    q, k, v = dense_qkv(device, dtype, 2, 301, 517, 4, 2, head_dim)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=causal, deterministic=deterministic), q, k, v,
                  causal=causal)
