"""The causal kernels' program order (kernels/blocks.grouped_program_ids, tables.PROGRAM_GROUPS): any group size
gives the same outputs and gradients as the grid order, bit for bit where the kernels are deterministic, and
matches the float64 reference.  Odd shapes: the last group partial, GQA, varlen with an empty segment and the
tail program row, dK/dV with its fused dQ programs.  The GPU test times nothing: it checks bits on the device."""
import pytest
import torch
import triton
import triton.language as tl

import fa_amd
import fa_amd.tuning as tuning
from fa_amd.arch import Arch
from fa_amd.kernels import backward, forward
from fa_amd.kernels.blocks import _grouped_ids, div_small, grouped_program_ids
from fa_amd.tuning import tables

from .helpers import compare_dense, cu_seqlens, dense_qkv, randn

GROUP_SIZES = (1, 2, 3, 16)


@pytest.fixture
def forced_group(monkeypatch):
    """force(g): every forward and backward launch after it runs groups of g (batch, head) pairs."""
    seen = []

    def force(group):
        def rule(arch, kernel, head_dim_padded, programs, causal, fp8=False):
            seen.append((kernel, group))
            return group
        monkeypatch.setattr(forward, "program_group", rule)
        monkeypatch.setattr(backward, "program_group", rule)
        tuning._RESOLVED.clear()  # (launch plans hold their launch arguments)
    force.seen = seen
    yield force
    tuning._RESOLVED.clear()


def _dense_results(q, k, v, dout, causal, **kw):
    out, lse, _ = fa_amd.flash_attn_func(q, k, v, causal=causal, deterministic=True, return_attn_probs=True, **kw)
    return [out, lse, *torch.autograd.grad(out, (q, k, v), dout)]


@pytest.mark.parametrize("causal", [True, False])
def test_dense_gqa_same_bits(device, forced_group, causal):
    torch.manual_seed(0)
    # 3 x 6 = 18 (batch, head) pairs: groups of 16 and of 3 leave a partial last group
    q, k, v = dense_qkv(device, torch.float16, 3, 37, 45, 6, 2, 32)
    dout = torch.randn_like(q)
    results = {}
    for group in GROUP_SIZES:
        forced_group(group)
        results[group] = _dense_results(q, k, v, dout, causal)
    assert {kernel for kernel, _ in forced_group.seen} == {"fwd", "bwd"}
    for group in GROUP_SIZES[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[1], results[group]):
            assert torch.equal(a, b), f"{name}: group {group} differs from the grid order"


def test_varlen_same_bits(device, forced_group):
    torch.manual_seed(1)
    lens = [5, 0, 35, 31]
    cu = cu_seqlens(lens, device)
    # static-buffer style: 4 tokens past cu_seqlens[-1] (the tail program row writes them)
    q = randn(sum(lens) + 4, 6, 32, dtype=torch.float16, device=device)
    k = randn(sum(lens) + 4, 3, 32, dtype=torch.float16, device=device)
    v = randn(sum(lens) + 4, 3, 32, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    results = {}
    for group in GROUP_SIZES:
        forced_group(group)
        out = fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, deterministic=True)
        results[group] = [out, *torch.autograd.grad(out, (q, k, v), dout)]
    for group in GROUP_SIZES[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), results[1], results[group]):
            assert torch.equal(a, b), f"{name}: group {group} differs from the grid order"
    assert torch.equal(results[1][0][sum(lens):], torch.zeros_like(results[1][0][sum(lens):]))


@pytest.mark.parametrize("group", [2, 5])
def test_matches_reference(device, forced_group, group):
    """The grouped order against float64, with the atomic dQ (deterministic=False) and a window."""
    torch.manual_seed(2)
    forced_group(group)
    q, k, v = dense_qkv(device, torch.float16, 2, 41, 29, 4, 4, 48)
    compare_dense(lambda *x: fa_amd.flash_attn_func(*x, causal=True), q, k, v, causal=True)
    compare_dense(lambda *x: fa_amd.flash_attn_func(*x, window_size=(7, 3)), q, k, v, window_size=(7, 3))


def test_fp8_same_bits(device, forced_group):
    torch.manual_seed(3)
    f8 = torch.float8_e4m3fn
    q, k, v = (x.detach().to(f8) for x in dense_qkv(device, torch.float16, 3, 37, 37, 4, 2, 64))
    outs = {}
    for group in (1, 3):
        forced_group(group)
        outs[group] = fa_amd.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(outs[1], outs[3])


@triton.jit
def _div_kernel(X, D, Q, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Q + offs, div_small(tl.load(X + offs, mask=ok, other=0), tl.load(D + offs, mask=ok, other=1)), mask=ok)


@pytest.mark.cpu_only
def test_div_small():
    """div_small is x // d over its range: random pairs, the range's edges, exact multiples and their neighbours."""
    gen = torch.Generator().manual_seed(5)
    top = 2 ** 22
    x = torch.cat([torch.randint(0, top, (4000,), generator=gen), torch.tensor([0, 1, top - 1, top - 1, top - 2, 12345])])
    d = torch.cat([torch.randint(1, 64, (2000,), generator=gen), torch.randint(1, top, (2000,), generator=gen),
                   torch.tensor([1, 1, 1, top - 1, 3, 12345])])
    exact = torch.randint(1, 2 ** 11, (1000,), generator=gen)
    mult = torch.randint(0, 2 ** 11, (1000,), generator=gen)
    x = torch.cat([x, exact * mult, exact * mult + 1, (exact * mult - 1).clamp(min=0)]).to(torch.int32)
    d = torch.cat([d, exact, exact, exact]).to(torch.int32)
    q = torch.full_like(x, -7)
    _div_kernel[(triton.cdiv(x.numel(), 256),)](x, d, q, x.numel(), BLOCK=256)
    assert torch.equal(q, torch.div(x, d, rounding_mode="floor"))


@triton.jit
def _ids_kernel(Out, group_size, SMALL: tl.constexpr):
    pid_0 = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if SMALL:
        got = grouped_program_ids(group_size, True)
    else:  # the exact branch's arithmetic, which launches below 2**22 programs never take
        got = _grouped_ids(pid_0, h + tl.num_programs(1) * b, tl.num_programs(1),
                           tl.num_programs(1) * tl.num_programs(2), group_size, False)
    at = ((b * tl.num_programs(1) + h) * tl.num_programs(0) + pid_0) * 3
    tl.store(Out + at, got[0])
    tl.store(Out + at + 1, got[1])
    tl.store(Out + at + 2, got[2])


@pytest.mark.cpu_only
@pytest.mark.parametrize("group", [1, 2, 3, 16])
def test_grouped_ids_both_branches(group):
    """grouped_program_ids (div_small) and the exact branch map a grid with a partial last group the same way,
    onto every (pid_0, head, batch) once."""
    grid = (5, 3, 7)
    got = {}
    for small in (True, False):
        out = torch.full((grid[2], grid[1], grid[0], 3), -1, dtype=torch.int32)
        _ids_kernel[grid](out, group, SMALL=small)
        got[small] = out.reshape(-1, 3)
    assert torch.equal(got[True], got[False])
    assert len({tuple(r) for r in got[True].tolist()}) == grid[0] * grid[1] * grid[2]


def test_rule():
    """tuning.program_group reads tables.PROGRAM_GROUPS: 1 unless causal and listed; T // programs, clamped."""
    sm90 = Arch("cuda", "sm90", 32)
    fwd = tables.PROGRAM_GROUPS["sm90"]["fwd"][128]
    assert tuning.program_group(sm90, "fwd", 128, 64, causal=False) == 1
    assert tuning.program_group(sm90, "fwd", 128, 64, causal=True) == max(1, fwd["causal"] // 64)
    assert tuning.program_group(sm90, "fwd", 128, 64, causal=True, fp8=True) == max(1, fwd["fp8"] // 64)
    assert tuning.program_group(sm90, "fwd", 128, 1, causal=True) == tables.PROGRAM_GROUP_MAX
    assert tuning.program_group(sm90, "fwd", 128, 10 ** 6, causal=True) == 1
    assert tuning.program_group(sm90, "fwd", 64, 16, causal=True) == 1  # d64: not listed
    for name in ("gfx942", "gfx90a", "gfx1100"):  # AMD: untimed, the grid order
        assert tuning.program_group(Arch("hip", name, 64), "fwd", 128, 16, causal=True) == 1


@pytest.mark.gpu
def test_gpu_same_bits(forced_group):
    """On the device: the table's own group sizes and forced ones give the grid order's bits (bf16, FP8)."""
    torch.manual_seed(4)
    q, k, v = dense_qkv("cuda", torch.bfloat16, 3, 1000, 1000, 8, 2, 128)
    dout = torch.randn_like(q)
    results = {}
    for group in (1, 4, 13):
        forced_group(group)
        results[group] = _dense_results(q, k, v, dout, True)
        if torch.cuda.get_device_capability() >= (8, 9):
            f8 = torch.float8_e4m3fn
            results[group].append(fa_amd.flash_attn_func(q.detach().to(f8), k.detach().to(f8), v.detach().to(f8),
                                                         causal=True))
    for group in (4, 13):
        for a, b in zip(results[1], results[group]):
            assert torch.equal(a, b)
