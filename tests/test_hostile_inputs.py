"""Hostile inputs (issue 16): every case of the issue's "Crash" and "Silently wrong" lists for the
kernel API, the fused rotary op and the Transformers glue, and every point of its "What must be
true" that concerns them.  Each case asserts a clear error or the right result (against the
float64 reference).  Cases that once killed the process run in a subprocess (`_worker` below), so
a regression fails a test instead of taking the suite down.  The recipes' cases are in
tests/test_recipes_reliability.py, the argument checks in tests/kernels/test_bad_input.py; every
checked case is tallied (tests/reliability_log.py) for .ci/reliability_counts.py and
docs/RELIABILITY.md.

Where a case checks memory safety, the subprocess also guards every tensor the kernels read or
write: inputs are views into NaN-padded buffers (an out-of-bounds read shows up as NaN in a row
that must be finite) and every output the launchers allocate sits between sentinel-filled guard
regions (an out-of-bounds write changes a sentinel).
"""
from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import fa_amd
from fa_amd import tuning
from fa_amd.arch import arch_for
from fa_amd.kernels import backward, forward, launch
from fa_amd.reference import attention_ref, attention_varlen_ref
from fa_amd.tuning import tables

from .kernels.helpers import compare_dense, compare_varlen, cu_seqlens, randn
from .reliability_log import record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    record("error", match)


# --------------------------------------------------------------------------- the subprocess worker

GUARD = 64  # elements of guard on each side of every guarded tensor
SENTINEL = 7777.0

# name -> (cu_seqlens, max_seqlen): with FA_AMD_CHECK_VARLEN=0 none of these may make a kernel touch
# memory outside its tensors (the issue: [0, 300, 8] segfaulted)
UNCHECKED_CU = {
    "past_end": ([0, 300, 8], 8),
    "decreasing": ([0, 5, 3, 8], 5),
    "negative_entry": ([0, -5, 8], 8),
    "negative_start": ([-100, 3, 8], 8),
    "int32_max": ([0, 2 ** 31 - 1, 8], 8),
    "last_past_end": ([0, 3, 100], 8),
    "all_past_end": ([0, 50, 60], 8),
    "nonzero_start": ([2, 4, 8], 4),
    "max_seqlen_too_small": ([0, 6, 8], 2),
    "max_seqlen_past_total": ([0, 6, 8], 40),
}


def _clamped_segments(cu, max_len, total):
    """The kernels' own clamping rule (score_mods.seq_bounds), to know which rows must be finite."""
    out = []
    for b in range(len(cu) - 1):
        start = min(max(cu[b], 0), total)
        end = min(max(cu[b + 1], start), total)
        out.append((start, min(end - start, max_len)))
    return out


def _worker():
    """Runs every crash case and prints one JSON line per case: first the checked ones (checks
    switched on for them), then the UNCHECKED_CU ones as FA_AMD_CHECK_VARLEN=0 (the test's
    environment for this process) left them: through the dense varlen kernels (forward and
    backward) and through the split-KV decode kernel (seqused_k and block_table, forward only)."""
    import fa_amd
    from fa_amd import interface
    from fa_amd.kernels import backward, decode, forward

    check_varlen_at_import = interface._CHECK_VARLEN

    device = "cuda" if torch.cuda.is_available() else "cpu"
    guards = []

    def guarded_output(like, shape, dtype=None):
        dtype = dtype or like.dtype
        n = math.prod(shape)
        buf = torch.full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device=like.device)
        buf[GUARD:GUARD + n] = float("nan")  # poison: a row the kernels must write and do not stays NaN
        guards.append((buf, n))
        return buf[GUARD:GUARD + n].view(shape)

    forward.new_output = backward.new_output = decode.new_output = guarded_output

    def guarded_input(x):
        buf = torch.full((x.numel() + 2 * GUARD,), float("nan"), dtype=x.dtype, device=x.device)
        buf[GUARD:GUARD + x.numel()] = x.flatten()
        return buf[GUARD:GUARD + x.numel()].view_as(x).requires_grad_()

    def guards_intact():
        return all(bool((buf[:GUARD] == SENTINEL).all() and (buf[GUARD + n:] == SENTINEL).all())
                   for buf, n in guards)

    def report(name, **result):
        print(json.dumps(dict(case=name, **result)), flush=True)

    report("environment", check_varlen_at_import=check_varlen_at_import)
    interface._CHECK_VARLEN = True  # the checked cases
    torch.manual_seed(0)
    # the issue: a strided cu_seqlens view was read as contiguous ("double free or corruption")
    q, k, v = (torch.randn(8, 2, 16, device=device) for _ in range(3))
    cu = torch.tensor([0, 99, 3, 99, 8], dtype=torch.int32, device=device)[::2]
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
    ref, _ = attention_varlen_ref(q, k, v, cu.contiguous(), cu.contiguous())
    report("strided_view", err=float((out.double() - ref).abs().max()))
    # the issue: a write through numpy does not bump the version, and the memo passed the stale check
    if device == "cpu":
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
        cu.numpy()[1] = 200
        try:
            fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
            report("numpy_inplace_change", error=None)
        except ValueError as exc:
            report("numpy_inplace_change", error=str(exc))
    else:
        report("numpy_inplace_change", error="cu_seqlens_q (skipped: numpy views need CPU tensors)")

    interface._CHECK_VARLEN = check_varlen_at_import  # as FA_AMD_CHECK_VARLEN=0 set it
    for i, (name, (cu_list, max_len)) in enumerate(UNCHECKED_CU.items()):
        guards.clear()
        total_q, total_k = 8, 11
        q = guarded_input(torch.randn(total_q, 2, 16, device=device))
        k = guarded_input(torch.randn(total_k, 1, 16, device=device))
        v = guarded_input(torch.randn(total_k, 1, 16, device=device))
        cu_q = torch.tensor(cu_list, dtype=torch.int32, device=device)
        cu_k = torch.tensor([min(c + 3 * (c > 0), 2 ** 31 - 1) for c in cu_list], dtype=torch.int32, device=device)
        out = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_len, max_len, causal=i % 2 == 0,
                                            deterministic=i % 3 == 0)
        out.backward(torch.randn_like(out))
        if device == "cuda":
            torch.cuda.synchronize()
        # rows inside the clamped segments must be finite: a read past a tensor hits its NaN guard
        rows, keys = set(), set()
        for start, length in _clamped_segments(cu_list, max_len, total_q):
            rows.update(range(start, start + length))
        for start, length in _clamped_segments(cu_k.tolist(), max_len, total_k):
            keys.update(range(start, start + length))
        rows, keys = sorted(rows), sorted(keys)
        finite = bool(torch.isfinite(out[rows]).all() and torch.isfinite(q.grad[rows]).all()
                      and torch.isfinite(k.grad[keys]).all() and torch.isfinite(v.grad[keys]).all())
        intact = guards_intact()
        # the split-KV decode kernel's varlen route, with the same cu_seqlens: packed keys limited by
        # seqused_k, and paged keys (two 16-slot pages per sequence)
        guards.clear()
        batch = len(cu_list) - 1
        with torch.no_grad():
            used = torch.full((batch,), min(3, max_len), dtype=torch.int32, device=device)
            fa_amd.flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_len, max_len,
                                          seqused_k=used, causal=i % 2 == 0)
            pages_k = guarded_input(torch.randn(2 * batch, 16, 1, 16, device=device)).detach()
            pages_v = guarded_input(torch.randn(2 * batch, 16, 1, 16, device=device)).detach()
            table = torch.arange(2 * batch, dtype=torch.int32, device=device).view(batch, 2)
            fa_amd.flash_attn_varlen_func(q.detach(), pages_k, pages_v, cu_q, cu_k, max_len, min(max_len, 32),
                                          block_table=table, causal=i % 2 == 1)
        if device == "cuda":
            torch.cuda.synchronize()
        report(name, guards_intact=intact, finite=finite, decode_guards_intact=guards_intact())


def test_crash_cases_in_a_subprocess():
    """The issue's three crashes, and point 1: with FA_AMD_CHECK_VARLEN=0 and any cu_seqlens, no
    crash, no write outside an output (guards intact), no read outside an input (rows of the clamped
    segments finite); a strided cu_seqlens view is right; a change through numpy is re-checked.
    One subprocess for all of them (a crash there fails this test, not the suite)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FA_AMD_CHECK_VARLEN="0")
    proc = subprocess.run([sys.executable, "-m", "tests.test_hostile_inputs"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row.pop("case")] = row
    assert proc.returncode == 0, f"the worker died with exit code {proc.returncode} (a crash) after " \
                                 f"{list(results)}: {proc.stderr[-3000:]}"
    assert results["environment"]["check_varlen_at_import"] is False, "FA_AMD_CHECK_VARLEN=0 was not honoured"
    assert results["strided_view"]["err"] < 1e-5
    record("right", "strided cu_seqlens view", isolated=True)
    assert results["numpy_inplace_change"]["error"] and "cu_seqlens_q" in results["numpy_inplace_change"]["error"]
    record("error", "cu_seqlens changed through numpy after a call", isolated=True)
    unsafe = [name for name in UNCHECKED_CU if not results[name]["guards_intact"]]
    assert not unsafe, f"a kernel wrote outside its output tensor for cu_seqlens {unsafe}"
    bad_reads = [name for name in UNCHECKED_CU if not results[name]["finite"]]
    assert not bad_reads, f"a kernel read outside its inputs (NaN guard) or left a row unwritten: {bad_reads}"
    unsafe = [name for name in UNCHECKED_CU if not results[name]["decode_guards_intact"]]
    assert not unsafe, f"the decode kernel wrote outside its output tensor for cu_seqlens {unsafe}"
    for name in UNCHECKED_CU:
        record("safe", f"FA_AMD_CHECK_VARLEN=0, cu_seqlens {name}: varlen fwd+bwd", isolated=True)
        record("safe", f"FA_AMD_CHECK_VARLEN=0, cu_seqlens {name}: seqused_k route", isolated=True)
        record("safe", f"FA_AMD_CHECK_VARLEN=0, cu_seqlens {name}: block_table route", isolated=True)


# --------------------------------------------------------------------------- point 2: tokens past cu_seqlens[-1]

@pytest.mark.parametrize("dq_mode", ["fused", "separate", "atomic"])
def test_tokens_past_the_last_segment(device, monkeypatch, dq_mode):
    """Static buffers longer than the batch: the extra tokens get output 0, lse +inf, dQ 0, and the
    extra keys dK = dV = 0 (the reference's convention); every written element is checked (poison)."""
    monkeypatch.setattr(backward, "BWD_DQ_MODE", dq_mode)
    if dq_mode == "separate":
        monkeypatch.setattr(backward, "DKDV_HEADS_PER_PROGRAM", 1)  # split GQA group: partial sums
    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = randn(sum(lens_q) + 6, 4, 16, dtype=torch.float32, device=device)
    k = randn(sum(lens_k) + 3, 2, 16, dtype=torch.float32, device=device)
    v = randn(sum(lens_k) + 3, 2, 16, dtype=torch.float32, device=device)
    fn = functools.partial(fa_amd.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                           max_seqlen_k=6, causal=True, deterministic=dq_mode != "atomic", return_attn_probs=True)
    out = compare_varlen(fn, q, k, v, cu_q, cu_k, causal=True)
    assert (out[8:] == 0).all()
    _, lse, _ = fn(q, k, v)
    assert torch.isinf(lse[:, 8:]).all() and (lse[:, 8:] > 0).all()
    record("right", f"tokens past cu_seqlens[-1] ({dq_mode} dQ): out 0, lse +inf, gradients 0")


def test_no_token_in_any_sequence(device):
    """batch 0 (cu_seqlens [0]) or only empty segments, with tokens in the buffer: all zeros, lse +inf."""
    q = randn(5, 2, 16, dtype=torch.float32, device=device)
    for cu in ([0], [0, 0, 0]):
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        out, lse, _ = fa_amd.flash_attn_varlen_func(q, q, q, cu_t, cu_t, 0, 0, return_attn_probs=True)
        assert (out == 0).all() and torch.isinf(lse).all()
        (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
        assert (dq == 0).all()
        record("right", f"cu_seqlens {cu} with tokens in the buffer")



def _decode_route_case(route, device):
    """flash_attn_varlen_func through the split-KV decode kernel (seqused_k, or paged keys)."""
    torch.manual_seed(11)
    q, k, v = (torch.randn(11, 2, 16, device=device) for _ in range(3))
    if route == "seqused_k":
        return q, k, v, dict(seqused_k=torch.tensor([3, 5], dtype=torch.int32, device=device))
    pages_k, pages_v = (torch.zeros(4, 16, 2, 16, device=device) for _ in range(2))
    pages_k[0, :3], pages_v[0, :3], pages_k[2, :5], pages_v[2, :5] = k[:3], v[:3], k[3:8], v[3:8]
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    return q, pages_k, pages_v, dict(block_table=table)


@pytest.mark.parametrize("route", ["seqused_k", "block_table"])
def test_decode_route_reads_strided_cu_seqlens(device, route):
    """The issue's strided cu_seqlens view, on the varlen routes that run the decode kernel."""
    q, k, v, kw = _decode_route_case(route, device)
    cu = torch.tensor([0, 99, 3, 99, 8], dtype=torch.int32, device=device)[::2]
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, **kw)
    dense = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    ref, _ = attention_varlen_ref(q[:8], *_dense_keys(q, k, v, route), dense, dense)
    assert (out[:8].double() - ref).abs().max() < 1e-5
    record("right", f"strided cu_seqlens view, {route} route")


@pytest.mark.parametrize("route", ["seqused_k", "block_table"])
def test_decode_route_tokens_past_the_last_segment(device, route):
    """Point 2 on the decode kernel's varlen route: the 3 tokens past cu_seqlens_q[-1] get output 0
    (POISON_OUTPUTS makes an unwritten row NaN)."""
    q, k, v, kw = _decode_route_case(route, device)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, **kw)
    ref, _ = attention_varlen_ref(q[:8], *_dense_keys(q, k, v, route), cu, cu)
    assert (out[:8].double() - ref).abs().max() < 1e-5
    assert (out[8:] == 0).all()
    record("right", f"tokens past cu_seqlens[-1], {route} route")


def _dense_keys(q, k, v, route):
    """The first 8 keys/values as packed rows (the paged case stores them in pages 0 and 2)."""
    if route == "seqused_k":
        return k[:8], v[:8]
    return torch.cat([k[0, :3], k[2, :5]]), torch.cat([v[0, :3], v[2, :5]])


# --------------------------------------------------------------------------- point 3: numerics

def test_softmax_scale_that_overflows_float32_raises(device):
    q = randn(1, 5, 2, 16, dtype=torch.float16, device=device)
    _raises(ValueError, "softmax_scale = 3e\\+38 overflows", fa_amd.flash_attn_func, q, q, q, softmax_scale=3e38)
    _raises(ValueError, "softmax_scale = -3e\\+38 overflows", fa_amd.flash_attn_func, q, q, q, softmax_scale=-3e38)
    _raises(ValueError, "softcap = 1e\\+39 overflows", fa_amd.flash_attn_func, q, q, q, softcap=1e39)
    _raises(ValueError, "softmax_scale / softcap", fa_amd.flash_attn_func, q, q, q, softmax_scale=1e38, softcap=1e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflows to inf, as the GPU does
@pytest.mark.parametrize("scale,softcap", [(3e38, 5.0), (1e30, 0.0), (1e-30, 0.0), (1e-46, 0.0), (1e-300, 0.0),
                                           (1e-300, 5.0)], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extreme_scales_are_right(device, scale, softcap, causal):
    """A huge scale is fine under softcap (the score is bounded by softcap), and plain scales up to
    where the scores themselves fit float32 (1e30: hard attention) and tiny ones (uniform) are right --
    also below float32's range (1e-46, 1e-300: 0 in the kernels, whose plain path masks the raw scores
    before scaling them, so -inf * 0 gave NaN rows), forward and, for the small scales, backward too; 13 keys (a
    masked tile)."""
    q, k, v = (randn(1, 13, 2, 16, dtype=torch.float32, device=device, requires_grad=True) for _ in range(3))
    out = fa_amd.flash_attn_func(q, k, v, softmax_scale=scale, softcap=softcap, causal=causal)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, softmax_scale=scale, softcap=softcap, causal=causal)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-5
    record("right", f"softmax_scale={scale}, softcap={softcap}, causal={causal}")
    if scale > 1:  # (hard attention: the gradients scale with softmax_scale)
        return
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all() and (g.double() - r).abs().max() < 1e-5, f"d{name}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_softmax_scale_whose_scores_overflow_is_right_or_refused(device):
    q, k, v = (randn(1, 13, 2, 16, dtype=torch.float32, device=device, requires_grad=False) for _ in range(3))
    try:
        out = fa_amd.flash_attn_func(q, k, v, softmax_scale=1e38, causal=True)
    except ValueError as exc:
        assert "softmax_scale" in str(exc)
        record("error", "softmax_scale = 1e38")
        return
    ref, _ = attention_ref(q, k, v, softmax_scale=1e38, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5
    record("right", "softmax_scale = 1e38")


@pytest.mark.parametrize("softcap,dtype", [(1e4, torch.float32), (1e5, torch.float32), (1e6, torch.float32),
                                           (1e4, torch.float16)], ids=str)
def test_large_softcap_is_accurate(device, softcap, dtype):
    """softcap * tanh(s / softcap) for large caps: tanh of a small argument must not cancel (the old
    1 - 2/(e^2x + 1) lost ~1e-7 absolute, x1e6 in the score); forward and backward within the
    suite's 2x-PyTorch tolerance."""
    q, k, v = (randn(1, 21, 2, 32, dtype=dtype, device=device) for _ in range(3))
    compare_dense(functools.partial(fa_amd.flash_attn_func, softcap=softcap, causal=True), q, k, v,
                  softcap=softcap, causal=True)
    record("right", f"softcap={softcap} {dtype}")


def _nan_mode(monkeypatch, device, mode):
    """Where masked forwards find V's NaNs on this device: found inside the kernel as the tables say (read off
    the last query block's output without a left window where tables.FWD_NAN_FROM_OUT_FAMILIES lists the
    family, else marked by the programs that read V's blocks) and written by a fix-up launch after it
    ("fixup"); always marked by the programs ("marks"); or found by a pass before it ("pass")."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    others = tuple(f for f in tables.FWD_NAN_FIXUP_FAMILIES if f != family)
    monkeypatch.setattr(tables, "FWD_NAN_FIXUP_FAMILIES", others + ((family,) if mode != "pass" else ()))
    if mode == "marks":
        monkeypatch.setattr(tables, "FWD_NAN_FROM_OUT_FAMILIES",
                            tuple(f for f in tables.FWD_NAN_FROM_OUT_FAMILIES if f != family))


def _nan_pattern_case(device, where, row, causal, window, varlen):
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 40, h, 16, device=device) for h in (2, 1, 1))
    {"q": q, "k": k, "v": v}[where][0, row, 0, 3] = float("nan")
    kw = dict(causal=causal, window_size=window)
    if varlen:
        cu = cu_seqlens([23, 17], device)
        out = fa_amd.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 23, 23, **kw)
        ref, _ = attention_varlen_ref(q[0], k[0], v[0], cu, cu, **kw)
    else:
        out = fa_amd.flash_attn_func(q, k, v, **kw)
        ref, _ = attention_ref(q, k, v, **kw)
    return out, ref


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16)], ids=str)
@pytest.mark.parametrize("where,row,causal,window,varlen", [
    ("v", 33, True, (-1, -1), False),   # a NaN value that causal masking hides from the early rows
    ("k", 33, True, (-1, -1), False),   # a NaN key hidden by causal masking: rows that see it only
    ("v", 2, False, (4, 2), False),     # sliding window: most rows never visit its block
    ("q", 7, False, (4, 2), False),
    ("v", 30, True, (-1, -1), True),    # varlen: only its own sequence
])
@pytest.mark.parametrize("nan_mode", ["fixup", "marks", "pass"])
def test_nan_pattern_matches_reference(device, monkeypatch, nan_mode, tiles, where, row, causal, window, varlen):
    """A NaN anywhere in q/k/v gives the reference's NaN pattern (which SDPA shares: masked
    probabilities times a NaN value are NaN), whatever the tile sizes, with V's NaNs marked inside the
    forward kernel (fixup) or found by a pass before it; finite entries stay right."""
    _nan_mode(monkeypatch, device, nan_mode)
    real = forward.get_fwd_config
    monkeypatch.setattr(forward, "get_fwd_config",
                        lambda *a, **kw: dict(real(*a, **kw), BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    out, ref = _nan_pattern_case(device, where, row, causal, window, varlen)
    assert torch.equal(out.isnan(), ref.isnan()), f"{int(out.isnan().sum())} NaN vs {int(ref.isnan().sum())}"
    assert (out.double() - ref)[~ref.isnan()].abs().max() < 1e-5
    record("right", f"NaN in {where}[{row}] (causal={causal}, window={window}, varlen={varlen}, tiles {tiles})")



def _v_nan_everywhere(v):
    """One NaN per key position of v (..., keys, 3 KV heads, 16 features): key j in feature j % 16 of KV head
    (j // 16) % 3, so one call tells whether a NaN at any key reaches every row."""
    keys = torch.arange(v.shape[-3])
    v[..., keys, (keys // 16) % 3, keys % 16] = float("nan")
    return v


@pytest.mark.parametrize("tiles", [(16, 32), (32, 16), (16, 16)], ids=str)
@pytest.mark.parametrize("window", [(-1, 0), (-1, 5), (3, 0)], ids=["causal", "right5", "left3-causal"])
@pytest.mark.parametrize("seqlens", [(37, 37), (20, 45), (45, 20), (1, 45), "varlen"], ids=str)
@pytest.mark.parametrize("nan_mode", ["fixup", "marks"])
def test_nan_at_every_key_reaches_every_row(device, monkeypatch, nan_mode, tiles, window, seqlens):
    """The fix-up form of the V NaN rule (the forward's programs share V's key blocks out and mark the NaN
    features they find): a NaN at every key position -- each in its own feature -- gives the reference's
    pattern, every row of the KV head's query heads NaN in those features, whatever block a program reads or
    skips.  GQA 6/3; queries shorter, longer and as long as the keys; causal, a right window wider than causal,
    a left window; varlen segments with no query rows, no keys, or unequal counts.  Both ways of finding them
    without a left window: off the last query block's output, and marks by the programs."""
    _nan_mode(monkeypatch, device, nan_mode)
    real = forward.get_fwd_config
    monkeypatch.setattr(forward, "get_fwd_config",
                        lambda *a, **kw: dict(real(*a, **kw), BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    torch.manual_seed(6)
    if seqlens == "varlen":
        lens_q, lens_k = [20, 0, 37, 5, 9], [30, 6, 37, 0, 4]
        q, k, v = (torch.randn(sum(n), h, 16, device=device) for n, h in ((lens_q, 6), (lens_k, 3), (lens_k, 3)))
        cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
        for s in range(len(lens_k)):  # every key of every segment
            _v_nan_everywhere(v[int(cu_k[s]):int(cu_k[s + 1])])
        out = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_size=window)
        ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, window_size=window)
    else:
        sq, sk = seqlens
        q, k, v = (torch.randn(2, n, h, 16, device=device) for n, h in ((sq, 6), (sk, 3), (sk, 3)))
        _v_nan_everywhere(v[1])
        out = fa_amd.flash_attn_func(q, k, v, window_size=window)
        ref, _ = attention_ref(q, k, v, window_size=window)
    assert ref.isnan().any()
    assert torch.equal(out.isnan(), ref.isnan()), f"{int(out.isnan().sum())} NaN vs {int(ref.isnan().sum())}"
    assert (out.double() - ref)[~ref.isnan()].abs().max() < 1e-5


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16)], ids=str)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("nan_mode", ["fixup", "marks"])
def test_v_nan_behind_rows_that_are_nan_everywhere(device, monkeypatch, nan_mode, varlen, tiles):
    """A NaN value that causal masking hides from the early rows, in a sequence whose last query block's rows are
    all NaN in every feature (a NaN key that only they see): that block's output cannot show which features V's
    NaNs are in, so the fix-up form reads V for them there.  GQA 2/1; the reference's NaN pattern (a NaN feature
    in every row, whole NaN rows after the key), the numbers elsewhere right.  The varlen case has a segment
    whose last block is one such row (16-row tiles) or whose rows are not all NaN (32-row tiles)."""
    _nan_mode(monkeypatch, device, nan_mode)
    real = forward.get_fwd_config
    monkeypatch.setattr(forward, "get_fwd_config",
                        lambda *a, **kw: dict(real(*a, **kw), BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    torch.manual_seed(8)
    if varlen:
        lens = [23, 17]
        q, k, v = (torch.randn(sum(lens), h, 16, device=device) for h in (2, 1, 1))
        k[23 + 16, 0, 5] = float("nan")  # the second segment's last row alone sees it
        v[23 + 16, 0, 3] = float("nan")  # (no earlier program of 16 rows reads it)
        cu = cu_seqlens(lens, device)
        out = fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True)
        ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    else:
        q, k, v = (torch.randn(1, 40, h, 16, device=device) for h in (2, 1, 1))
        k[0, 32, 0, 5] = float("nan")  # rows 32..39 (the last query block of either tile) see it, no earlier one
        v[0, 35, 0, 3] = float("nan")
        out = fa_amd.flash_attn_func(q, k, v, causal=True)
        ref, _ = attention_ref(q, k, v, causal=True)
    assert ref[-17:, :, 3].isnan().all() if varlen else ref[..., 3].isnan().all()
    assert torch.equal(out.isnan(), ref.isnan()), f"{int(out.isnan().sum())} NaN vs {int(ref.isnan().sum())}"
    assert (out.double() - ref)[~ref.isnan()].abs().max() < 1e-5


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_nan_flags_are_clear_for_the_next_call(device, monkeypatch, varlen):
    """The fix-up's NaN flags are one buffer per stream and thread, kept from call to call (no zero-fill
    launch): after a call whose V holds a NaN, the fix-up leaves them zero, so the next calls -- the same
    shape (a replayed launch plan on the GPU), a smaller one and a larger one -- are NaN-free and right;
    a call that stops after its forward kernel ran, or whose fix-up fails, leaves no marked buffer behind.
    (The form whose programs mark V's NaNs: the one with a buffer.)"""
    _nan_mode(monkeypatch, device, "marks")
    monkeypatch.setattr(forward, "_NAN_FLAGS", {})
    monkeypatch.setattr(forward, "_RETIRED_NAN_FLAGS", [])
    out, ref = _nan_pattern_case(device, "v", 33, True, (-1, -1), varlen)
    assert out.isnan().any() and torch.equal(out.isnan(), ref.isnan())
    (buf,) = forward._NAN_FLAGS.values()
    assert not buf.any(), "the fix-up left marks in the kept NaN flags"
    torch.manual_seed(4)
    for heads, length in ((2, 40), (2, 40), (1, 19), (4, 64)):
        q, k, v = (torch.randn(2, length, h, 16, device=device) for h in (heads, heads, heads))
        out = fa_amd.flash_attn_func(q, k, v, causal=True)
        ref, _ = attention_ref(q, k, v, causal=True)
        assert not out.isnan().any(), f"NaN after an earlier call's NaN marks (heads {heads}, length {length})"
        assert (out.double() - ref).abs().max() < 1e-5
    assert all(not b.any() for b in forward._NAN_FLAGS.values())

    # a call that stops after its forward kernel ran (an error, Ctrl-C) leaves no marks for the next one
    monkeypatch.setattr(forward, "memo_get", lambda *a: False)  # (the JIT path, not a replayed plan)
    real_launch, real_jit_launch = forward.launch, forward.jit_launch

    def forward_then_fail(kernel, *args, **kwargs):
        real_launch(kernel, *args, **kwargs)
        raise KeyboardInterrupt

    def failing_fixup(kernel, *args):
        if kernel is forward.v_nan_fixup_kernel:
            raise RuntimeError("fix-up launch failed")
        return real_jit_launch(kernel, *args)
    for name, fails, error in (("launch", forward_then_fail, KeyboardInterrupt),
                               ("jit_launch", failing_fixup, RuntimeError)):
        with monkeypatch.context() as m:
            m.setattr(forward, name, fails)
            with pytest.raises(error):
                _nan_pattern_case(device, "v", 33, True, (-1, -1), varlen)
        assert forward._NAN_FLAGS == {}
        q, k, v = (torch.randn(1, 40, h, 16, device=device) for h in (2, 1, 1))
        out = fa_amd.flash_attn_func(q, k, v, causal=True)
        assert not out.isnan().any(), f"NaN after a call that stopped in {name}"



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (4, 2))], ids=["causal", "window"])
@pytest.mark.parametrize("nan_mode", ["fixup", "pass"])
def test_nan_in_16_bit_v_matches_reference(device, monkeypatch, nan_mode, dtype, causal, window):
    """The V NaN rule in fp16 and bf16: a NaN value that the masks hide from most rows still makes its feature
    NaN in every row, as in the reference (on the CPU, bf16 NaNs are found through the interpreter's bf16
    compare: arch._fix_interpreter_bf16_math)."""
    _nan_mode(monkeypatch, device, nan_mode)
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 37, h, 16, device=device, dtype=dtype) for h in (2, 1, 1))
    v[0, 33 if causal else 2, 0, 3] = float("nan")
    out = fa_amd.flash_attn_func(q, k, v, causal=causal, window_size=window)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal, window_size=window)
    assert torch.equal(out.isnan(), ref.isnan()), f"{int(out.isnan().sum())} NaN vs {int(ref.isnan().sum())}"
    assert (out.double() - ref)[~ref.isnan()].abs().max() < 2e-2
    record("right", f"NaN in {dtype} v (causal={causal}, window={window})")


@pytest.mark.cpu_only
@pytest.mark.parametrize("where,row,causal,window,varlen", [
    ("v", 33, True, (-1, -1), False), ("v", 2, False, (4, 2), False), ("v", 30, True, (-1, -1), True)])
def test_nan_pattern_with_flags_split_over_programs(monkeypatch, where, row, causal, window, varlen):
    """The forward reads the V NaN flags of several programs per (sequence, KV head) (the GPU's split
    flag pass; on CPU tensors they come from one torch pass): run through the flag kernel here, split
    in 3 programs of 8 keys, the NaN pattern is the reference's."""
    def kernel_flags(v, cu_k, varlen, batch, hk, d, d_pad):
        flags = torch.full((batch, hk, 3, d_pad), -1, dtype=torch.int8)
        forward.v_nan_flags_kernel[(3, hk, batch)](v, flags, cu_k, v.shape[1] if not varlen else 0, v.shape[0],
                                                   *launch.row_strides(v, varlen), HEAD_DIM=d, D_PAD=d_pad,
                                                   BLOCK_N=8, IS_VARLEN=varlen)
        return flags

    monkeypatch.setattr(forward, "_v_nan_flags_torch", kernel_flags)
    _nan_mode(monkeypatch, "cpu", "pass")
    out, ref = _nan_pattern_case("cpu", where, row, causal, window, varlen)
    assert torch.equal(out.isnan(), ref.isnan()), f"{int(out.isnan().sum())} NaN vs {int(ref.isnan().sum())}"
    assert (out.double() - ref)[~ref.isnan()].abs().max() < 1e-5


@pytest.mark.cpu_only
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_cpu_nan_flags_equal_the_flag_kernel(varlen):
    """On CPU tensors the V NaN flags come from one torch pass; they flag exactly the (sequence, KV
    head, feature) cells the GPU's flag kernel flags (run here through the interpreter), empty and
    token-major segments included."""
    torch.manual_seed(5)
    lens = [9, 0, 37]
    v = torch.randn(3, 37, 2, 24) if not varlen else torch.randn(sum(lens), 2, 24)
    for cell in ([0, 3, 1, 5], [2, 36, 0, 23]) if not varlen else ([3, 1, 5], [45, 0, 23], [8, 1, 0]):
        v[tuple(cell)] = float("nan")
    cu = cu_seqlens(lens, "cpu")
    args = (v, cu if varlen else v, varlen, 3, 2, 24, 32, 37)
    flags = forward._v_nan_flags_torch(v, args[1], varlen, 3, 2, 24, 32)
    splits = 3  # (several programs per (sequence, KV head), each walking every third key block)
    kernel_flags = torch.full((3, 2, splits, 32), -1, dtype=torch.int8)
    forward.v_nan_flags_kernel[(splits, 2, 3)](
        v, kernel_flags, args[1], 37, v.shape[0], *launch.row_strides(v, varlen),
        HEAD_DIM=24, D_PAD=32, BLOCK_N=16, IS_VARLEN=varlen)
    assert torch.equal(flags.amax(2) != 0, kernel_flags.amax(2) != 0) and int((flags != 0).sum()) >= 2

# --------------------------------------------------------------------------- point 4: double backward

def test_double_backward_raises_on_every_path(device):
    q, k, v = (randn(1, 7, 2, 16, dtype=torch.float32, device=device) for _ in range(3))
    # the gradient penalty: loss = out.sum() + |d out.sum() / dq|^2
    out = fa_amd.flash_attn_func(q, k, v, causal=True)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="fa_amd attention does not support double backward"):
        (out.sum() + g.pow(2).sum()).backward()
    record("error", "double backward (gradient penalty), eager")
    # the custom op (what torch.compile runs)
    out, _, _ = torch.ops.fa_amd.attention_fwd(q, k, v, None, None, 7, 7, 0.0, 0.25, -1, 0, 0.0, None, None, False,
                                               False)
    (g,) = torch.autograd.grad(out.sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match="fa_amd attention does not support double backward"):
        g.pow(2).sum().backward()
    record("error", "double backward through the custom op")
    # varlen, a gradient of dv: as loud
    cu = cu_seqlens([7], device)
    out = fa_amd.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 7)
    (g,) = torch.autograd.grad((out * out).sum(), v, create_graph=True)
    with pytest.raises(RuntimeError, match="fa_amd attention does not support double backward"):
        torch.autograd.grad(g.sum(), q)
    record("error", "double backward, varlen")


def test_fp8_double_backward_raises(device):
    """The quantising FP8 functions (fa_amd.fp8) reuse the once-differentiable backward."""
    from fa_amd import fp8

    try:
        fp8.fp8_dtypes(torch.empty(0, device=device))
    except ValueError as exc:
        pytest.skip(str(exc))
    q, k, v = (randn(1, 7, 2, 16, dtype=torch.float32, device=device) for _ in range(3))
    out = fp8.flash_attn_fp8_func(q, k, v, causal=True)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="fa_amd attention does not support double backward"):
        (out.sum() + g.pow(2).sum()).backward()
    record("error", "double backward, FP8 attention")


def test_create_graph_without_second_backward_is_fine(device):
    """create_graph=True alone (the gradients used as values) gives the right gradients."""
    q, k, v = (randn(1, 7, 2, 16, dtype=torch.float32, device=device) for _ in range(3))
    out = fa_amd.flash_attn_func(q, k, v)
    g = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    g_plain = torch.autograd.grad(fa_amd.flash_attn_func(q, k, v).sum(), (q, k, v))
    for a, b in zip(g, g_plain):
        torch.testing.assert_close(a.detach(), b)
    record("right", "create_graph=True without a second backward")


def test_rotary_double_backward_is_right_through_the_custom_op(device):
    """The fused rotary op is linear in x: its double backward is computed, not refused (eager:
    tests/test_rotary.py).  Here the torch.library op path, against plain PyTorch rotary."""
    from fa_amd.kernels.rotary import _rotary_fwd_op

    torch.manual_seed(5)
    x = torch.randn(1, 9, 2, 16, device=device, requires_grad=True)
    angles = torch.randn(1, 9, 8, device=device)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    w = torch.randn(1, 9, 2, 16, device=device)

    def rotate_ref(t):
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        t1, t2 = t[..., :8], t[..., 8:]
        return t * c + torch.cat([-t2, t1], -1) * s

    def penalty(rot):
        y = rot(x)
        (g,) = torch.autograd.grad((y * y * w).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        return gg

    torch.testing.assert_close(penalty(lambda t: _rotary_fwd_op(t, cos, sin, False)), penalty(rotate_ref),
                               atol=1e-5, rtol=1e-5)
    record("right", "rotary double backward, custom op")


def test_rotary_double_backward_is_right_in_eager_mode(device):
    """flash-attn's rotary layer (fa_amd.flash_apply_rotary_emb, autograd) in eager mode: the issue's
    gradient penalty through it is computed, and equals plain PyTorch rotary's."""
    from fa_amd.kernels.rotary import flash_apply_rotary_emb

    torch.manual_seed(6)
    x = torch.randn(1, 9, 2, 16, device=device, requires_grad=True)
    angles = torch.randn(9, 8, device=device)
    w = torch.randn(1, 9, 2, 16, device=device)

    def rotate_ref(t):
        c, s = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        t1, t2 = t[..., :8], t[..., 8:]
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], -1)

    def penalty(rot):
        y = rot(x)
        (g,) = torch.autograd.grad((y * y * w).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(y.sum() + g.pow(2).sum(), x)
        return gg

    got = penalty(lambda t: flash_apply_rotary_emb(t, angles.cos(), angles.sin()))
    torch.testing.assert_close(got, penalty(rotate_ref), atol=1e-5, rtol=1e-5)
    record("right", "rotary double backward, eager")


def test_rotary_tables_that_need_a_gradient_raise(device):
    """No gradient flows to cos/sin (as in flash-attn): tables that require one are refused, not
    silently left without a gradient."""
    from fa_amd.kernels.rotary import apply_rotary_emb, flash_apply_rotary_emb

    x = torch.randn(1, 2, 5, 16, device=device, requires_grad=True)
    cos = torch.randn(5, 16, device=device, requires_grad=True)
    _raises(ValueError, "does not propagate gradients to cos/sin", apply_rotary_emb, x, None, cos, cos.detach())
    _raises(ValueError, "does not propagate gradients to cos/sin", flash_apply_rotary_emb, x.transpose(1, 2),
            cos[:, :8], cos[:, :8].detach())


# --------------------------------------------------------------------------- point 5: Transformers glue

def _tiny_llama(device):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation("fa_amd")
    return model


def test_hf_masks_of_the_wrong_shape_raise(device):
    """The issue: a 3x6 mask for an 8-token input was accepted (logits off by 0.35), and
    wrong-batch all-ones masks too (Transformers drops an all-ones mask before attention)."""
    model = _tiny_llama(device)
    ids = torch.randint(3, 64, (3, 8), device=device)
    with torch.no_grad():
        _raises(ValueError, r"attention_mask has shape \(3, 6\).*8 input tokens", model, ids,
                attention_mask=torch.ones(3, 6, dtype=torch.long, device=device))
        _raises(ValueError, r"attention_mask has shape \(5, 8\) but the input has batch size 3", model, ids,
                attention_mask=torch.ones(5, 8, dtype=torch.long, device=device))
        _raises(ValueError, r"attention_mask has shape \(1, 8\) but the input has batch size 3", model, ids,
                attention_mask=torch.ones(1, 8, dtype=torch.long, device=device))
        # wider than the keys (no cache): Transformers' builders read its first columns; left padding was then
        # silently misread (audit 2026-11-28), all-ones dropped
        for wide in (torch.ones(3, 10, dtype=torch.long, device=device),
                     torch.tensor([[1] * 10, [0, 0, 0] + [1] * 7, [1] * 10], device=device)):
            _raises(ValueError, r"attention_mask has shape \(3, 10\): 10 key positions for 8 tokens", model, ids,
                    attention_mask=wide)
        # with a cache: the mask covers the cached tokens and the new ones, no more
        from transformers import DynamicCache

        cache = DynamicCache()
        model(ids, attention_mask=torch.ones(3, 8, dtype=torch.long, device=device), past_key_values=cache)
        _raises(ValueError, r"attention_mask has shape \(3, 12\): 12 key positions for 10 tokens", model, ids[:, :2],
                attention_mask=torch.ones(3, 12, dtype=torch.long, device=device), past_key_values=cache)


def test_hf_position_ids_of_another_batch_name_position_ids(device):
    """position_ids of batch 2 for a batch-1 input: the rotary broadcast q and k to batch 2 while v kept 1, and the
    error named the kernel's k and v (audit 2026-11-28); eager fails in a matmul."""
    model = _tiny_llama(device)
    ids = torch.randint(3, 64, (1, 10), device=device)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * 2, device=device)
    with torch.no_grad():
        _raises(ValueError, r"position_ids has shape \(2, 10\) but the input has batch size 1", model, ids,
                position_ids=positions)


def test_hf_attention_function_checks_masks_itself(device):
    from fa_amd.integrations.hf_attention import fa_amd_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = (torch.randn(3, h, 8, 16, device=device) for h in (2, 1, 1))
    _raises(ValueError, r"attention_mask has shape \(3, 6\)", fa_amd_attention_forward, Module(), q, k, v,
            torch.ones(3, 6, device=device))
    _raises(ValueError, "attention_mask has shape .* batch size 3", fa_amd_attention_forward, Module(), q, k, v,
            torch.ones(2, 8, device=device))
    _raises(ValueError, r"attention_mask covers 9 keys but only 8 were given", fa_amd_attention_forward, Module(),
            q, k, v, torch.ones(3, 9, device=device))
    _raises(ValueError, r"attention_mask must be a 2D \(batch, key length\) padding mask", fa_amd_attention_forward,
            Module(), q, k, v, torch.ones(3, 1, 8, 8, device=device))
    # decode (more keys than queries, no gradient): the split-KV kernel's route checks the batch too
    _raises(ValueError, "attention_mask batch 2 does not match the query batch 3", fa_amd_attention_forward,
            Module(), q[:, :, :1], k, v, torch.ones(2, 8, device=device))


def test_hf_packed_boundaries_name_the_users_arguments(device):
    from fa_amd.integrations.hf_attention import fa_amd_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = (torch.randn(1, h, 8, 16, device=device) for h in (2, 1, 1))

    def call(**kw):
        return fa_amd_attention_forward(Module(), q, k, v, None, **kw)

    cu = torch.tensor([0, 3, 8], device=device)
    _raises(ValueError, r"cu_seq_lens_q\[-1\] = 9 exceeds the 8 tokens", call, cu_seq_lens_q=torch.tensor([0, 3, 9]),
            cu_seq_lens_k=cu, max_length_q=6, max_length_k=5)
    _raises(ValueError, "cu_seq_lens_k must be non-decreasing", call, cu_seq_lens_q=cu,
            cu_seq_lens_k=torch.tensor([0, 5, 3]), max_length_q=5, max_length_k=5)
    _raises(ValueError, r"max_length_q = 2 is smaller than the longest segment in cu_seq_lens_q", call,
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=2, max_length_k=5)
    _raises(ValueError, "cu_seq_lens_q and cu_seq_lens_k must have the same length", call, cu_seq_lens_q=cu,
            cu_seq_lens_k=torch.tensor([0, 8]), max_length_q=5, max_length_k=8)
    _raises(TypeError, "cu_seq_lens_q must hold integer offsets", call, cu_seq_lens_q=cu.float(),
            cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    _raises(ValueError, r"position_ids has shape \(1, 6\) but the input has 8 tokens", call,
            position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]], device=device))


def test_hf_packed_boundaries_short_of_the_tokens_give_zero_rows(device):
    """cu_seq_lens_q/k ending before the tokens (a static buffer): the covered tokens are right, the
    rest get attention output 0 -- never uninitialised memory (the issue)."""
    from fa_amd.integrations.hf_attention import fa_amd_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = (torch.randn(1, h, 10, 16, device=device, requires_grad=True) for h in (2, 1, 1))
    cu = torch.tensor([0, 3, 7], device=device)
    out, _ = fa_amd_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                                      max_length_k=4)
    ref, _ = attention_varlen_ref(*(x[0].transpose(0, 1) for x in (q, k, v)), cu.int(), cu.int(), causal=True)
    assert (out[0, 7:] == 0).all()
    assert (out[0].double() - ref).abs().max() < 1e-5
    # and they take no part in training: zero gradients for those queries, keys and values
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all((g[:, :, 7:] == 0).all() for g in (dq, dk, dv))
    record("right", "HF cu_seq_lens_q/k ending before the tokens")


def test_hf_position_ids_that_open_mid_sequence(device):
    """Packed position_ids whose first token is not at the row's minimum (3, 4, 0, 1, 2, ...): the
    leading tokens form their own segment (the varlen call would have said cu_seqlens_q[0] != 0)."""
    from fa_amd.integrations.hf_attention import cu_seqlens_from_position_ids, fa_amd_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    pos = torch.tensor([[3, 4, 0, 1, 2, 0, 1]], device=device)
    cu, max_len = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 2, 5, 7] and max_len == 3
    q, k, v = (torch.randn(1, h, 7, 16, device=device) for h in (2, 1, 1))
    out, _ = fa_amd_attention_forward(Module(), q, k, v, None, position_ids=pos)
    ref, _ = attention_varlen_ref(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, cu, causal=True)
    assert (out[0].double() - ref).abs().max() < 1e-5
    record("right", "HF position_ids opening mid-sequence")


if __name__ == "__main__":
    _worker()
