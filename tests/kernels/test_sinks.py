"""Learnable attention sinks (gpt-oss's s_aux, vLLM's `sinks`): one logit per query head that joins
each row's softmax denominator only.  Kernel vs the float64 reference, forward and gradients
(q, k, v and the sinks), on every path: dense, GQA, causal, sliding window, varlen with empty
segments, dropout, rows that see no key; plus argument checks and the compiled path."""
import functools

import pytest
import torch

import fa_amd
from fa_amd.kernels import launch
from fa_amd.reference import attention_ref, attention_varlen_ref

from .helpers import assert_close_to_ref, cu_seqlens, dense_qkv, randn


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _sinks(device, h):
    # spread around typical score magnitudes so the sink's share is sometimes large, sometimes small
    return (torch.randn(h, device=device) * 2.0).requires_grad_()


def _dsinks_from_stored_output(out64, lse64, dout, sinks64, dtype):
    """d sink_h = -sum_i exp(sink_h - lse_i) * rowsum(dO_i * O_i), with O in `dtype` as every flash
    backward stores it: PyTorch's error for the sink gradient computed the flash way.  (delta from a
    half-precision O is the dominant error term of the sink gradient, a sum over all rows: at d256
    it is ~3x that of an fp16 autograd through the full softmax.)"""
    delta = (dout.double() * out64.detach().to(dtype).double()).sum(-1).transpose(-1, -2)  # lse's layout
    if delta.dim() == 2:  # varlen: (h, total)
        return -(torch.exp(sinks64.detach()[:, None] - lse64.detach()) * delta).sum(1)
    return -(torch.exp(sinks64.detach()[None, :, None] - lse64.detach()) * delta).sum((0, 2))


def compare_with_sinks(out, ref_fn, inputs, dout=None):
    """`out`, computed by fa_amd from `inputs` (q, k, v, sinks), vs ref_fn(*inputs) in float64 and in
    the inputs' dtype (the tolerance scale): output and the gradients of every input."""
    dtype = inputs[0].dtype
    leaves64 = [x.detach().double().requires_grad_() for x in inputs]
    leaves_lp = [x.detach().clone().requires_grad_() for x in inputs]
    ref64, lse64 = ref_fn(*leaves64)
    ref_lp, _ = ref_fn(*leaves_lp, upcast=False)
    assert_close_to_ref("out", out, ref64, ref_lp, dtype)
    dout = torch.randn_like(out) if dout is None else dout
    got = torch.autograd.grad(out, inputs, dout)
    g64 = torch.autograd.grad(ref64, leaves64, dout.double())
    g_lp = list(torch.autograd.grad(ref_lp, leaves_lp, dout))
    # the largest same-precision error sets the scale: autograd through the softmax in `dtype`, or the
    # flash formula from the output rounded to `dtype` or computed in `dtype`
    g_lp[3] = max((g_lp[3], _dsinks_from_stored_output(ref64, lse64, dout, leaves64[3], dtype),
                   _dsinks_from_stored_output(ref_lp, lse64, dout, leaves64[3], dtype)),
                  key=lambda g: (g.double() - g64[3]).abs().max().item())
    for name, a, b, c, x in zip(("dq", "dk", "dv", "dsinks"), got, g64, g_lp, inputs):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert_close_to_ref(name, a, b, c, dtype)


def _dense_case(device, dtype, shape, deterministic=False, **kw):
    q, k, v = dense_qkv(device, dtype, *shape)
    sinks = _sinks(device, shape[3])
    out = fa_amd.flash_attn_func(q, k, v, sinks=sinks, deterministic=deterministic, **kw)
    compare_with_sinks(out, lambda q_, k_, v_, s_, **up: attention_ref(q_, k_, v_, sinks=s_, **kw, **up),
                       (q, k, v, sinks))


CASES = {
    # name: ((b, sq, sk, hq, hk, d), options, dtype)
    "plain_gqa": ((2, 17, 23, 4, 2, 40), {}, torch.float32),
    "causal_fp16": ((2, 19, 19, 4, 1, 64), {"causal": True}, torch.float16),
    # causal with more queries than keys: the first rows see no key (output 0, lse = sink)
    "causal_rows_without_keys": ((1, 13, 6, 2, 2, 32), {"causal": True}, torch.float32),
    # gpt-oss's sliding layers: a causal window
    "sliding_window": ((1, 37, 37, 2, 1, 59), {"causal": True, "window_size": (7, 0)}, torch.float16),
    "softcap_scale": ((1, 9, 30, 2, 2, 16), {"softcap": 3.0, "softmax_scale": 0.41}, torch.float32),
    "head_dim_256": ((1, 11, 14, 2, 1, 256), {"causal": True}, torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dense(device, case):
    shape, kw, dtype = CASES[case]
    # both backward flavours: deterministic dQ programs, and the tables' default (atomics on AMD)
    _dense_case(device, dtype, shape, deterministic=case.endswith("fp16"), **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_varlen(device, dtype):
    lens_q, lens_k = [5, 0, 17, 9], [7, 3, 17, 0]  # empty query and empty key segments
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = randn(sum(lens_q), 4, 40, dtype=dtype, device=device)
    k = randn(sum(lens_k), 2, 40, dtype=dtype, device=device)
    v = randn(sum(lens_k), 2, 40, dtype=dtype, device=device)
    sinks = _sinks(device, 4)
    kw = dict(causal=True, window_size=(6, 0))
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sinks=sinks,
                                        deterministic=dtype == torch.float32, **kw)
    compare_with_sinks(out, lambda q_, k_, v_, s_, **up: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, sinks=s_,
                                                                            **kw, **up), (q, k, v, sinks))


def test_dropout_uses_the_forward_mask(device):
    """Dropout acts on the keys' probabilities after the softmax (the sink's share is in their
    denominator), as gpt-oss's eager attention does: the reference with the kernel's own keep-mask
    gives the same output and gradients, so the backward regenerates that mask."""
    p = 0.3
    q, k, v = dense_qkv(device, torch.float32, 2, 21, 26, 4, 2, 32)
    sinks = _sinks(device, 4)
    out, _, s_dmask = fa_amd.flash_attn_func(q, k, v, dropout_p=p, causal=True, sinks=sinks, return_attn_probs=True)
    kw = dict(causal=True, dropout_p=p, dropout_mask=s_dmask >= 0)
    compare_with_sinks(out, lambda q_, k_, v_, s_, **up: attention_ref(q_, k_, v_, sinks=s_, **kw, **up),
                       (q, k, v, sinks))


def test_lse_probs_and_rows_without_keys(device):
    q, k, v = dense_qkv(device, torch.float32, 1, 9, 4, 2, 2, 32)
    sinks = torch.tensor([0.7, -1.3], device=device)
    out, lse, _ = fa_amd.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    # (the probabilities come with dropout only, as in flash-attn; negated where dropped)
    probs = fa_amd.flash_attn_func(q, k, v, causal=True, sinks=sinks, dropout_p=0.3, return_attn_probs=True)[2].abs()
    ref, lse_ref = attention_ref(q.double(), k.double(), v.double(), causal=True, sinks=sinks.double())
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5)
    # the first 5 rows see no key: output 0 and lse = the sink (not +inf as without sinks)
    assert torch.all(out[:, :5] == 0)
    torch.testing.assert_close(lse[0, :, :5], sinks[:, None].expand(2, 5))
    # probabilities exclude the sink's share: each row sums to 1 - exp(sink - lse)
    torch.testing.assert_close(probs.double().sum(-1), 1 - torch.exp(sinks.double()[None, :, None] - lse_ref),
                               rtol=1e-5, atol=1e-6)


def test_minus_inf_sink_is_no_sink(device):
    """A -inf sink (a head without one) gives exactly the no-sink result, lse +inf on empty rows included."""
    q, k, v = dense_qkv(device, torch.float32, 1, 9, 4, 2, 2, 32)
    sinks = torch.full((2,), float("-inf"), device=device, requires_grad=True)
    out, lse, _ = fa_amd.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    plain, lse_plain, _ = fa_amd.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=0)
    dsinks = torch.autograd.grad(out.sum(), sinks)[0]
    assert torch.all(dsinks == 0)


def test_s_aux_alias_packed_variants_and_determinism(device):
    qkv = randn(2, 15, 3, 4, 32, dtype=torch.float16, device=device)
    sinks = _sinks(device, 4)
    a = fa_amd.flash_attn_qkvpacked_func(qkv, causal=True, s_aux=sinks, deterministic=True)
    b = fa_amd.flash_attn_func(*qkv.unbind(2), causal=True, sinks=sinks, deterministic=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    dout = torch.randn_like(a)
    g1 = torch.autograd.grad(a, (qkv, sinks), dout)
    g2 = torch.autograd.grad(fa_amd.flash_attn_qkvpacked_func(qkv, causal=True, s_aux=sinks, deterministic=True),
                             (qkv, sinks), dout)
    for x, y in zip(g1, g2):  # deterministic=True: bitwise-identical gradients, the sinks' included
        assert torch.equal(x, y)
    # a half-precision parameter (gpt-oss keeps sinks in the model dtype) gets a half gradient
    s16 = sinks.detach().half().requires_grad_()
    out = fa_amd.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu_seqlens([15, 15], device), 15, sinks=s16)
    assert torch.autograd.grad(out.sum(), s16)[0].dtype == torch.float16


def test_bad_sinks(device):
    q, k, v = dense_qkv(device, torch.float16, 1, 8, 8, 4, 2, 32)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        fa_amd.flash_attn_func(q, k, v, sinks=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match=r"s_aux must have shape \(4,\)"):
        fa_amd.flash_attn_func(q, k, v, s_aux=torch.zeros(1, 4, device=device))
    with pytest.raises(TypeError, match="sinks must be a floating tensor"):
        fa_amd.flash_attn_func(q, k, v, sinks=torch.zeros(4, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        fa_amd.flash_attn_func(q, k, v, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match="not both"):
        fa_amd.flash_attn_func(q, k, v, sinks=torch.zeros(4, device=device), s_aux=torch.zeros(4, device=device))
    if device == "cuda":
        with pytest.raises(ValueError, match="sinks is on cpu"):
            fa_amd.flash_attn_func(q, k, v, sinks=torch.zeros(4))


def test_compiled_matches_eager(device):
    """torch.compile(fullgraph=True): the custom ops carry the sinks and their gradient, bit for bit
    the eager autograd.Function's result."""
    torch._dynamo.reset()
    q, k, v = dense_qkv(device, torch.float32, 1, 12, 12, 2, 1, 16)
    sinks = _sinks(device, 2)
    fn = functools.partial(fa_amd.flash_attn_func, causal=True, deterministic=True)
    eager = fn(q, k, v, sinks=sinks)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, sinks=sinks)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, (q, k, v, sinks), dout),
                    torch.autograd.grad(compiled, (q, k, v, sinks), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- GPU sweep

@pytest.mark.timeout(600)  # fp32 d128/d256 backward compiles take ~2 min on a busy GPU host
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": True, "window_size": (127, 0)}],
                         ids=["plain", "causal", "sliding"])
def test_gpu_sweep(dtype, d, kw):
    _dense_case("cuda", dtype, (2, 333, 517, 8, 2, d), deterministic=d == 128, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_varlen_and_dropout(dtype):
    lens_q, lens_k = [1, 0, 257, 1025, 63], [9, 3, 257, 1100, 0]
    cu_q, cu_k = cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")
    q = randn(sum(lens_q), 8, 64, dtype=dtype, device="cuda")
    k, v = (randn(sum(lens_k), 1, 64, dtype=dtype, device="cuda") for _ in range(2))
    sinks = _sinks("cuda", 8)
    kw = dict(causal=True, window_size=(128, 0))
    out = fa_amd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sinks=sinks, **kw)
    compare_with_sinks(out, lambda q_, k_, v_, s_, **up: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, sinks=s_,
                                                                            **kw, **up), (q, k, v, sinks))
    q, k, v = dense_qkv("cuda", dtype, 2, 300, 300, 8, 2, 128)
    out, _, s_dmask = fa_amd.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, sinks=sinks,
                                             return_attn_probs=True)
    kw = dict(causal=True, dropout_p=0.2, dropout_mask=s_dmask >= 0)
    compare_with_sinks(out, lambda q_, k_, v_, s_, **up: attention_ref(q_, k_, v_, sinks=s_, **kw, **up),
                       (q, k, v, sinks))
