"""The reloading kernel variant (RELOAD_CHUNK > 0, what the gfx1100 table rows
launch: d-wide operands reloaded per block, S and dP reduced a head-dim chunk
at a time) vs the reference.  The interpreter cannot run the gfx1100 rows, so
every entry of this device's table is patched to set RELOAD_CHUNK."""
import functools

import pytest
import torch

import fa_amd
from fa_amd.kernels import backward, forward, launch
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.tuning.tables import TABLES

from .helpers import check_varlen, compare_dense, compare_output, dense_qkv

DTYPES = [torch.float16, torch.float32]


@pytest.fixture(params=[16, 64], ids=lambda c: f"chunk{c}")
def reload_chunk(request, device, monkeypatch):
    """Every launch of this device's family uses RELOAD_CHUNK=param (16: several chunks, the
    last ones masked for odd head dims; 64: one chunk up to d64)."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})  # no tuned table from disk
    arch = arch_for(torch.empty(0, device=device))
    family = tuning.family_of(arch)
    rows = [{k: (dict(v, RELOAD_CHUNK=request.param) if isinstance(v, dict) else v) for k, v in row.items()}
            for row in TABLES[family]]
    monkeypatch.setitem(TABLES, family, rows)
    for kernel in tuning.KERNELS:
        assert tuning.get_config(arch, kernel, 64)["RELOAD_CHUNK"] == request.param
    return request.param


# (batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, features): odd sizes, GQA, causal
CASES = {
    "gqa_causal_d40": ((2, 17, 23, 4, 2, 40), {"causal": True}),
    "plain_d59": ((1, 33, 29, 2, 2, 59), {}),
    "mqa_window_softcap_d80": ((1, 37, 37, 3, 1, 80), {"window_size": (9, 4), "softcap": 2.5}),
    "causal_d128": ((1, 19, 35, 2, 1, 128), {"causal": True}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def testdense_qkv(device, reload_chunk, dtype, case, deterministic):
    shape, kw = CASES[case]
    q, k, v = dense_qkv(device, dtype, *shape)
    compare_dense(functools.partial(fa_amd.flash_attn_func, deterministic=deterministic, **kw), q, k, v, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_varlen_gqa_causal(device, reload_chunk, dtype, deterministic):
    check_varlen(device, dtype, [5, 0, 17, 33, 1], [7, 3, 17, 20, 9], 4, 2, 59, deterministic=deterministic,
                 causal=True)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_alibi_dropout_gqa_split(device, reload_chunk, monkeypatch, deterministic):
    """ALiBi + dropout (backward regenerates the forward's mask) with the GQA group split
    over dK/dV programs; the softmax probabilities (return_attn_probs) come from the
    reloading probs kernel."""
    from fa_amd.reference import attention_ref

    monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", 2)
    dtype, p = torch.float32, 0.2
    q, k, v = dense_qkv(device, dtype, 2, 21, 30, 4, 1, 48)
    slopes = torch.rand(4, device=device) * 0.5 + 0.05
    out, _, s_dmask = fa_amd.flash_attn_func(q, k, v, dropout_p=p, causal=True, alibi_slopes=slopes,
                                             return_attn_probs=True, deterministic=deterministic)
    kw = dict(causal=True, alibi_slopes=slopes, dropout_p=p, dropout_mask=s_dmask >= 0)
    compare_output(out, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v)
