"""The forward launcher applies a table entry's "short" override exactly when the launch has at most
tables.SHORT_SEQLEN_K keys per row (dense: seqlen_k; varlen: max_seqlen_k), and the result is right
with either tile.  The interpreter's table has no "short" entry, so one is patched in."""
import functools

import pytest
import torch

import fa_amd
from fa_amd.kernels import backward, forward, launch
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.tuning import tables

from .helpers import check_varlen, compare_dense, dense_qkv

SHORT_TILE = {"BLOCK_M": 16, "BLOCK_N": 16}


@pytest.fixture
def forward_tiles(device, monkeypatch):
    """A "short" override on this device's forward entries (threshold 24 keys); returns the list of
    forward tiles launched."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})
    monkeypatch.setattr(tables, "SHORT_SEQLEN_K", 24)
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    rows = [dict(row, fwd=dict(row["fwd"], short=SHORT_TILE)) for row in tables.TABLES[family]]
    monkeypatch.setitem(tables.TABLES, family, rows)
    launched = []
    real_launch = forward.launch

    def spy(kernel, cfg, *args, **kwargs):
        if kernel is forward.attn_fwd_kernel:
            launched.append((cfg["BLOCK_M"], cfg["BLOCK_N"]))
        return real_launch(kernel, cfg, *args, **kwargs)

    monkeypatch.setattr(forward, "launch", spy)
    return launched


@pytest.mark.parametrize("seqlen_k,short", [(24, True), (25, False)])
def test_dense_short_rows(device, forward_tiles, seqlen_k, short):
    q, k, v = dense_qkv(device, torch.float16, 2, 19, seqlen_k, 4, 2, 40)
    compare_dense(functools.partial(fa_amd.flash_attn_func), q, k, v)
    assert (forward_tiles[0] == (16, 16)) == short


def test_varlen_short_rows_follow_max_seqlen_k(device, forward_tiles):
    check_varlen(device, torch.float16, [5, 0, 17], [7, 3, 24], 2, 1, 59, causal=True)
    assert forward_tiles and all(t == (16, 16) for t in forward_tiles)
