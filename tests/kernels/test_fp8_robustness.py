"""FP8 paths under torch.compile, with non-finite inputs, on the interpreter's FP8 conversions, and
with descales that require grad (fa_amd.fp8, fa_amd/kernels/quantize.py, fa_amd.arch).

* The four quantising functions compile with fullgraph=True (forward and backward) through their
  custom ops (fa_amd::attention_fwd_fp8_quantized, fa_amd::quantize_fp8, ...) and give the eager
  results; quantize_fp8 and the FA3-style path's token-major V copy compile too.
* A NaN or +-inf in a high-precision input poisons only the attention rows that use it: the rows
  where fa_amd's fp32 path gives NaN for a NaN at that place (a NaN in K: the rows that attend to
  its key; in V: its feature in every row, the V NaN rule; in Q: its row); every other row stays
  within the usual FP8 error of the float64 reference (test_fp8.py's bound).  (An inf becomes the
  FP8 type's NaN: the fp32 path may give a finite limit there, FP8 gives NaN.)
* The interpreter's FP8 -> wider conversions (and FP8 dot operands) keep NaN and inf, bit for bit
  as torch converts the same bytes (triton 3.9 read e4m3fn NaN as 480.0: arch._fix_interpreter_rounding).
"""
import pytest
import torch

import fa_amd
from fa_amd import arch
from fa_amd import fp8 as fp8_mod
from fa_amd.kernels import quantize
from fa_amd.reference import attention_ref, fp8_dequantize_ref, fp8_quantize_ref
from fa_amd.tuning import tables

from .helpers import cu_seqlens
from .test_fp8 import E4M3, _dequantized, _fresh, _quantized, assert_within_emulation

ON_INTERPRETER = arch.INTERPRET and not arch.LATE_INTERPRET
interpreter_only = pytest.mark.skipif(not ON_INTERPRETER, reason="checks Triton's CPU interpreter")
AMAX_FLOOR = float(getattr(quantize.AMAX_FLOOR, "value", quantize.AMAX_FLOOR))
FP8_TYPES = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n)]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    from fa_amd.kernels import launch

    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _backend(device):
    return "inductor" if device == "cuda" else "aot_eager"


# --------------------------------------------------------------------------- torch.compile


def _compile_matches_eager(device, fn, inputs, grads=True):
    """fn compiled with fullgraph=True gives eager's outputs (and gradients) for the same inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_backend(device), fullgraph=True)
    ours = [x.detach().clone().requires_grad_(grads) for x in inputs]
    theirs = [x.detach().clone().requires_grad_(grads) for x in inputs]
    got, want = compiled(*ours), fn(*theirs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    if grads:
        dout = torch.randn_like(want[0])
        for a, b, g in zip(torch.autograd.grad(got[0], ours, dout), torch.autograd.grad(want[0], theirs, dout), ours):
            assert a.shape == g.shape and not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_quantising_functions_compile_fullgraph(device):
    """All four quantising functions under torch.compile(fullgraph=True): forward and backward as in
    eager (varlen passes one cu_seqlens tensor as both cu_seqlens_q and cu_seqlens_k)."""
    torch.manual_seed(18)
    cu = cu_seqlens([5, 0, 4], device)
    _compile_matches_eager(device, lambda q, k, v: fa_amd.flash_attn_fp8_func(q, k, v, causal=True),
                           [_fresh(1, 9, 4, 16, device=device), _fresh(1, 11, 2, 16, device=device),
                            _fresh(1, 11, 2, 16, device=device)])
    _compile_matches_eager(device, lambda q, k, v: fa_amd.flash_attn_varlen_fp8_func(q, k, v, cu, cu, 5, 5,
                                                                                     causal=True),
                           [_fresh(9, 2, 16, device=device) for _ in range(3)])
    _compile_matches_eager(device, lambda qkv: fa_amd.flash_attn_qkvpacked_fp8_func(qkv, window_size=(3, 1)),
                           [_fresh(2, 7, 3, 2, 16, device=device, dtype=torch.float16)])
    _compile_matches_eager(device, lambda qkv: fa_amd.flash_attn_varlen_qkvpacked_fp8_func(qkv, cu, 5),
                           [_fresh(9, 3, 2, 16, device=device)])
    # inference (no autograd), and the (out, lse, probs) tuple
    _compile_matches_eager(device, lambda q, k, v: fa_amd.flash_attn_varlen_fp8_func(q, k, v, cu, cu, 5, 5,
                                                                                     return_attn_probs=True),
                           [_fresh(9, 2, 16, device=device) for _ in range(3)], grads=False)


def test_quantize_and_token_major_copy_compile(device, monkeypatch):
    """quantize_fp8 (token-major output too) and the FA3-style path's token-major copy of V compile,
    over two sequence lengths (the second call recompiles with dynamic shapes)."""
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", tables.FP8_V_TOKEN_MAJOR + (arch.arch_for(
        torch.empty(0, device=device)).name,))
    fp8 = fp8_mod.fp8_dtypes(torch.empty(0, device=device))[0] if device != "cpu" else E4M3
    torch._dynamo.reset()
    quantize = torch.compile(lambda x: fp8_mod.quantize_fp8(x, fp8, token_major=True), backend=_backend(device),
                             fullgraph=True)
    fa3 = torch.compile(lambda q, k, v: fa_amd.flash_attn_func(q, k, v, causal=True, out_dtype=torch.float32),
                        backend=_backend(device), fullgraph=True)
    for s in (9, 21):
        x = _fresh(2, s, 3, 16, device=device)
        (got8, got_d), (want8, want_d) = quantize(x), fp8_mod.quantize_fp8(x, fp8, token_major=True)
        assert got8.stride() == want8.stride() and torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
        assert torch.equal(got_d, want_d)
        q8, k8, v8 = (_fresh(1, s, 2, 32, device=device).to(fp8) for _ in range(3))
        assert torch.equal(fa3(q8, k8, v8), fa_amd.flash_attn_func(q8, k8, v8, causal=True, out_dtype=torch.float32))


# --------------------------------------------------------------------------- NaN and inf inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["dense", "token_major", "varlen"])
def test_quantize_nonfinite_and_degenerate_heads(device, dtype, layout):
    """NaN / +-inf: the FP8 type's NaN, out of the head's amax (the other values keep their scale);
    an all-non-finite, an all-zero and a tiny (amax below AMAX_FLOOR) head get finite descales > 0."""
    torch.manual_seed(7)
    varlen = layout == "varlen"
    cu = cu_seqlens([6, 11], device) if varlen else None
    x = (_fresh(17, 5, 24, device=device) if varlen else _fresh(2, 17, 5, 24, device=device)) * 300
    first = x if varlen else x[0]  # (tokens, heads, d) of the first sequence
    first[3, 0, 5], first[4, 0, 7], first[5, 0, 1] = float("nan"), float("inf"), float("-inf")
    first[:, 1] = float("nan")
    first[:5, 1, :3] = float("inf")  # head 1: nothing finite
    first[:, 2] = 0  # head 2: all zero
    first[:, 3] *= 1e-35  # head 3: amax ~1e-32, below the floor (fp8_max / amax overflowed fp32)
    x = x.to(dtype)
    x8, descale = fp8_mod.quantize_fp8(x, E4M3, cu, token_major=layout == "token_major")
    assert torch.isfinite(descale).all() and (descale > 0).all()
    assert descale[0, 1] == 1.0 and descale[0, 2] == 1.0
    r8, rd = fp8_quantize_ref(x, E4M3, cu)
    same = torch.ones(x.shape[-2], dtype=torch.bool)
    same[3] = False  # the tiny head: the reference's scale is inf (0 * inf: NaN)
    if varlen:
        r8, x8s = r8[:, same], x8[:, same]
    else:
        r8, x8s = r8[:, :, same], x8[:, :, same]
    assert torch.equal(x8s.contiguous().view(torch.uint8), r8.view(torch.uint8))
    torch.testing.assert_close(descale[:, same], rd[:, same], rtol=2 ** -22, atol=0)
    # the tiny head: descale floor / 448, its values (all < floor * 2^-10) rounded, nothing NaN
    tiny8 = (x8[:6, 3] if varlen else x8[0, :, 3]).float()
    assert descale[0, 3] == AMAX_FLOOR / 448 and not tiny8.isnan().any()
    tiny = first[:tiny8.shape[0], 3].to(dtype).double()
    assert (tiny8.double() * AMAX_FLOOR / 448 - tiny).abs().max() < AMAX_FLOOR * 2 ** -4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nonfinite_input_poisons_only_its_rows(device, which, bad):
    """A NaN / inf in the last key (or value, or a query row) of one KV head, causal and GQA: the
    output's NaN pattern is the fp32 path's for a NaN at that place, and the other rows are as
    accurate as without it (3x the FP8 emulation's error against float64)."""
    torch.manual_seed(11)
    b, s, hq, hk, d = 2, 13, 4, 2, 24
    q, k, v = _fresh(b, s, hq, d, device=device), _fresh(b, s, hk, d, device=device), _fresh(b, s, hk, d,
                                                                                             device=device)
    k *= 50  # large keys: the scale matters
    x = {"q": q, "k": k, "v": v}
    pos = (1, s - 1 if which != "q" else 6, 1, 5)
    x[which][pos] = bad
    out = fa_amd.flash_attn_fp8_func(q, k, v, causal=True)
    with_nan = {n: t.clone() for n, t in x.items()}
    with_nan[which][pos] = float("nan")
    expect_nan = fa_amd.flash_attn_func(*(with_nan[n] for n in "qkv"), causal=True).isnan()
    assert expect_nan.any() and not expect_nan.all()
    assert torch.equal(out.isnan(), expect_nan)
    ok = ~expect_nan
    ref, _ = attention_ref(q, k, v, causal=True)
    deq = [fp8_dequantize_ref(*fp8_quantize_ref(t, E4M3)) for t in (q, k, v)]
    emu, _ = attention_ref(*deq, causal=True)
    assert not ref[ok].isnan().any()
    assert_within_emulation("finite rows", out[ok], ref[ok], emu[ok], torch.float32)


def test_nonfinite_input_varlen_backward(device):
    """Varlen, with gradients: a NaN in the second sequence's keys leaves the first sequence's
    output and gradients finite and equal to those of a run without the bad sequence."""
    torch.manual_seed(5)
    lens = [7, 9]
    cu = cu_seqlens(lens, device)
    q, k, v = (_fresh(16, 2, 16, device=device, requires_grad=True) for _ in range(3))
    k_bad = k.detach().clone()
    k_bad[12, 0, 3] = float("nan")
    k_bad.requires_grad_()
    out = fa_amd.flash_attn_varlen_fp8_func(q, k_bad, v, cu, cu, 9, 9)
    assert out[7:, 0].isnan().all() and not out[:7].isnan().any() and not out[7:, 1].isnan().any()
    alone = fa_amd.flash_attn_varlen_fp8_func(q[:7], k[:7], v[:7], cu[:2], cu[:2], 7, 7)
    torch.testing.assert_close(out[:7], alone, rtol=1e-6, atol=1e-6)
    (dq,) = torch.autograd.grad(out[:7].sum(), q)
    (dq_alone,) = torch.autograd.grad(alone.sum(), q)
    assert not dq[:7].isnan().any() and dq[:7].abs().max() > 0
    torch.testing.assert_close(dq[:7], dq_alone[:7], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the interpreter's FP8 upcasts


@interpreter_only
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy's NaN products)
@pytest.mark.parametrize("fp8_dtype", FP8_TYPES, ids=str)
def test_interpreter_fp8_upcasts_like_torch(fp8_dtype):
    """Every byte of each FP8 type cast to fp32 / fp16 / bf16 in a kernel equals torch's conversion of
    the same byte, bit for bit (NaN encodings NaN, e5m2's inf inf), and an FP8 dot keeps NaN and inf
    (its operands go through the same conversion; triton 3.9 read e4m3fn NaN as 480.0)."""
    import triton
    import triton.language as tl

    @triton.jit
    def upcasts(X, Y32, Y16, YB, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(X + offs)
        tl.store(Y32 + offs, x.to(tl.float32))
        tl.store(Y16 + offs, x.to(tl.float16))
        tl.store(YB + offs, x.to(tl.bfloat16))

    @triton.jit
    def dot(A, B, C, N: tl.constexpr):
        r = tl.arange(0, N)
        tile = r[:, None] * N + r[None, :]
        tl.store(C + tile, tl.dot(tl.load(A + tile), tl.load(B + tile)))

    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)
    y32, y16, yb = torch.empty(256), torch.empty(256, dtype=torch.float16), torch.empty(256, dtype=torch.bfloat16)
    upcasts[(1,)](x, y32, y16, yb, 256)
    assert torch.equal(y32.view(torch.int32), x.float().view(torch.int32))
    assert torch.equal(y16.view(torch.int16), x.half().view(torch.int16))
    assert torch.equal(yb.view(torch.int16), x.bfloat16().view(torch.int16))
    assert x.float().isnan().any()  # (every FP8 type has NaN encodings)
    # A holds all 256 bytes; B = I (rows of A with NaN or inf: NaN, as 0 * inf is) or ones (row sums)
    a = x.view(16, 16)
    for b in (torch.eye(16).to(fp8_dtype), torch.ones(16, 16).to(fp8_dtype)):
        c = torch.empty(16, 16)
        dot[(1,)](a, b, c, 16)
        ref = (a.double()[:, :, None] * b.double()[None]).sum(1)
        assert torch.equal(c.isnan(), ref.isnan()) and ref.isnan().any()
        assert torch.equal(c.isinf(), ref.isinf()) and torch.equal(c[c.isinf()], ref[ref.isinf()].float())
        finite = torch.isfinite(ref)
        torch.testing.assert_close(c.double()[finite], ref[finite], rtol=2 ** -20, atol=0)


def test_nan_in_fp8_inputs_reaches_the_output(device):
    """NaN stored in FP8 q / k / v (FA3-style inputs): the output's NaN pattern is the float64
    reference's of the same values (on the interpreter too: its dots and upcasts keep FP8 NaNs)."""
    torch.manual_seed(2)
    q, k, v = _fresh(1, 9, 4, 16, device=device), _fresh(1, 11, 2, 16, device=device), _fresh(1, 11, 2, 16,
                                                                                              device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    for name in ("q", "k", "v"):
        x8 = {"q": q8.clone(), "k": k8.clone(), "v": v8.clone()}
        x8[name][0, 2, 1, 3] = float("nan")
        out = fa_amd.flash_attn_func(x8["q"], x8["k"], x8["v"], causal=True, q_descale=qd, k_descale=kd,
                                     v_descale=vd, out_dtype=torch.float32)
        group = q.shape[2] // k.shape[2]
        ref, _ = attention_ref(fp8_dequantize_ref(x8["q"], qd.repeat_interleave(group, dim=1)),
                               fp8_dequantize_ref(x8["k"], kd), fp8_dequantize_ref(x8["v"], vd), causal=True)
        assert ref.isnan().any() and torch.equal(out.isnan(), ref.isnan()), name


# --------------------------------------------------------------------------- negative descales


@pytest.mark.parametrize("causal", [False, True])
def test_negative_descale_products(device, causal, monkeypatch):
    """The forward's unmasked tiles take the raw scores' row max, right for a positive score scale only
    (fp8._score_descale).  q_descale * k_descale < 0: a ValueError where the values are read without a sync
    (CPU tensors), else NaN rows for exactly those (sequence, KV head)s -- never a wrong softmax.  A positive
    product of two negative descales is the attention of the real values x8 * descale (float64, P's rounding).
    Dense GQA and varlen."""
    torch.manual_seed(5)
    q8, k8, v8 = _fresh(2, 41, 4, 64, device=device).to(E4M3), *(_fresh(2, 41, 2, 64, device=device).to(E4M3)
                                                                  for _ in range(2))
    qd = torch.full((2, 2), 1.25, device=device)
    kd = torch.full((2, 2), 0.75, device=device)
    qd[0, 1], kd[0, 1] = -1.25, -0.75  # product > 0: fine
    kd[1, 0] = -0.75  # product < 0
    if device == "cpu":
        with pytest.raises(ValueError, match=r"q_descale \* k_descale must be >= 0.*\(1, 0\)"):
            fa_amd.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd)
    monkeypatch.setattr(fp8_mod, "_check_values_now", lambda t: False)  # as on a GPU without FA_AMD_CHECK_KVCACHE
    got = fa_amd.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, out_dtype=torch.float32)
    nan = torch.zeros_like(got, dtype=torch.bool)
    nan[1, :, :2] = True  # batch 1, query heads 0-1 (KV head 0)
    assert torch.equal(got.isnan(), nan)
    exact, _ = attention_ref(*_dequantized(q8, k8, v8, qd, kd, torch.ones_like(kd)), causal=causal)
    ok = ~nan
    assert (got.double()[ok] - exact[ok]).abs().max().item() <= 2 ** -4 * exact.abs().max().item()
    cu = cu_seqlens([41, 0, 35], device)
    qv, kv, vv = (torch.cat([x[0], x[1, :35]]) for x in (q8, k8, v8))
    qdv = torch.ones(3, 2, device=device)
    qdv[2, 1] = -0.5
    out = fa_amd.flash_attn_varlen_func(qv, kv, vv, cu, cu, 41, 41, causal=causal, q_descale=qdv,
                                        out_dtype=torch.float32)
    assert torch.equal(out.isnan().any(-1), torch.arange(76, device=device)[:, None].ge(41) &
                       torch.tensor([False, False, True, True], device=device))


@pytest.mark.parametrize("zero", ["q_descale", "k_descale"])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_descales_give_the_uniform_softmax(device, zero, causal):
    """q_descale or k_descale 0: the real queries or keys are 0, every score is 0 and each row averages the values
    it sees -- not NaN (the scores' scale is 0 then, and the plain path masks the raw scores before scaling them:
    -inf * 0).  Dense GQA with a masked key tile (41 keys), varlen with an empty segment, and the KV-cache decode."""
    torch.manual_seed(6)
    q8, k8, v8 = _fresh(2, 41, 4, 64, device=device).to(E4M3), *(_fresh(2, 41, 2, 64, device=device).to(E4M3)
                                                                  for _ in range(2))
    descales = dict(q_descale=torch.ones(2, 2, device=device), k_descale=torch.ones(2, 2, device=device))
    descales[zero][1, 0] = 0.0  # batch 1, KV head 0 (query heads 0-1)
    got = fa_amd.flash_attn_func(q8, k8, v8, causal=causal, out_dtype=torch.float32, **descales)
    exact, _ = attention_ref(*_dequantized(q8, k8, v8, descales["q_descale"], descales["k_descale"],
                                           torch.ones(2, 2, device=device)), causal=causal)
    assert torch.isfinite(got).all()
    uniform = exact[1, :, :2]  # the zero head: a plain mean of the values each row sees
    assert (got.double()[1, :, :2] - uniform).abs().max().item() <= 2 ** -6 * uniform.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 ** -4 * exact.abs().max().item()
    cu = cu_seqlens([41, 0, 35], device)
    qv, kv, vv = (torch.cat([x[0], x[1, :35]]) for x in (q8, k8, v8))
    zero_v = torch.ones(3, 2, device=device)
    zero_v[2, 1] = 0.0
    out = fa_amd.flash_attn_varlen_func(qv, kv, vv, cu, cu, 41, 41, causal=causal, out_dtype=torch.float32,
                                        **{zero: zero_v})
    assert torch.isfinite(out).all()
    cache = dict(k_cache=k8, v_cache=v8, cache_seqlens=torch.tensor([41, 30], dtype=torch.int32, device=device))
    dec = fa_amd.flash_attn_with_kvcache(q8[:, :3], **cache, causal=causal, out_dtype=torch.float32, **descales)
    assert torch.isfinite(dec).all()


# --------------------------------------------------------------------------- descales that require grad


def test_descales_that_require_grad_raise(device):
    q8, k8, v8 = (_fresh(2, 8, 2, 16, device=device).to(E4M3) for _ in range(3))
    cu = cu_seqlens([3, 5], device)
    for name in ("q_descale", "k_descale", "v_descale"):
        descale = {name: torch.ones(2, 2, device=device, requires_grad=True)}
        with pytest.raises(ValueError, match=f"{name} requires grad.*forward-only"):
            fa_amd.flash_attn_func(q8, k8, v8, **descale)
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            fa_amd.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 5, 5, **descale)
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            fa_amd.flash_attn_with_kvcache(q8[:, :1], k8, v8, cache_seqlens=8, **descale)
        with torch.no_grad():  # no graph to detach from: fine
            out = fa_amd.flash_attn_func(q8, k8, v8, **descale)
        assert torch.equal(out, fa_amd.flash_attn_func(q8, k8, v8, **{name: descale[name].detach()}))
