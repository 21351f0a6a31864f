"""FP8 attention (fa_amd.fp8): FA3-style descaled FP8 inputs through flash_attn_func /
flash_attn_varlen_func, the four quantising functions with their backward, arch handling
and bad input.

Accuracy bound (every test here): the kernel's max error against float64 attention of the
ORIGINAL (unquantised) inputs must be at most 3x the max error of a plain PyTorch emulation
of the same quantisation (fa_amd.reference.fp8_quantize_ref: the same per-(sequence, head)
amax rounding of q, k, v, then float64 attention of the dequantised values), plus the
rounding of the output dtype.  Why 3x: the kernel does two roundings the emulation does not.
It rounds P to V's fp8 type for the P.V dot (as FA3 does), an error of the same relative size
(~2^-4 per element, independent) as the rounding of V that the emulation already pays, so the
error variance about doubles (~1.4x the emulation's error); and it accumulates S and P.V in
fp32 tiles with an online softmax (a small part).  Measured on these shapes: 1.0-1.5x; 3x
leaves room for the max over few samples without hiding a real bug (a wrong descale, a lost
block or a wrongly rounded P gives 5-20x).

Gradients of the quantising functions are compared the same way: against float64 gradients
of the original inputs, bounded by 3x the error of the emulated backward rule
(reference.attention_grads_from_stats: exact gradients at the dequantised q, k, v -- the values the
FP8 forward used -- with the softmax rebuilt from their own out and lse, as the backward does), plus the
fp16 rounding of the kernels' own backward (the bf16/fp16 path's tolerance).

The CPU runs use the interpreter, whose fp8 dots are exact (its fp8 rounding is the one
fa_amd.arch fixes); "cpu" pins the OCP type float8_e4m3fn (tables.FP8_DTYPES), and one test
pins gfx942's float8_e4m3fnuz.
"""
import functools

import pytest
import torch

import fa_amd
from fa_amd import fp8 as fp8_mod
from fa_amd.arch import Arch, arch_for
from fa_amd import tuning
from fa_amd.kernels import launch
from fa_amd.reference import (attention_grads_from_stats, attention_ref, attention_varlen_ref, fp8_dequantize_ref,
                              fp8_quantize_ref)
from fa_amd.tuning import fp8_dtype_names, fp8_v_token_major, tables

from .helpers import cu_seqlens, strided_descales

E4M3 = torch.float8_e4m3fn
# rounding of the output dtype, relative to max |reference|
OUT_EPS = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _fresh(*shape, device, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, device=device).to(dtype).requires_grad_(requires_grad)


def _quantized(q, k, v, fp8_dtype=E4M3, cu_q=None, cu_k=None):
    """FP8 q, k, v with their descales (batch, nheads_k) the way FA3 users pass them: q's descale per
    KV head (one amax per query-head group), k's and v's per KV head."""
    group = q.shape[-2] // k.shape[-2]
    k8, kd = fp8_quantize_ref(k, fp8_dtype, cu_k)
    v8, vd = fp8_quantize_ref(v, fp8_dtype, cu_k)
    # one q scale per (sequence, KV head): quantise the group's query heads together
    qg = q.reshape(*q.shape[:-2], k.shape[-2], group * q.shape[-1])
    q8g, qd = fp8_quantize_ref(qg, fp8_dtype, cu_q)
    return q8g.reshape(q.shape), k8, v8, qd, kd, vd


def _dequantized(q8, k8, v8, qd, kd, vd, cu_q=None, cu_k=None):
    group = q8.shape[-2] // k8.shape[-2]
    return (fp8_dequantize_ref(q8, qd.repeat_interleave(group, dim=1), cu_q), fp8_dequantize_ref(k8, kd, cu_k),
            fp8_dequantize_ref(v8, vd, cu_k))


def assert_within_emulation(name, got, ref64, emu64, out_dtype):
    assert not torch.isnan(got).any(), f"{name}: NaN in kernel output (unwritten element?)"
    err = (got.double() - ref64).abs().max().item()
    err_emu = (emu64 - ref64).abs().max().item()
    bound = 3 * err_emu + OUT_EPS[out_dtype] * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3e} > 3 x FP8 emulation error {err_emu:.3e} + eps"
    return err, err_emu


def check_fa3_style_call(device, sq, sk, hq, hk, d, **opts):
    """flash_attn_func on FA3-style FP8 inputs (batch 1) within the bound above of the float64 attention of the
    original inputs."""
    q, k, v = torch.randn(1, sq, hq, d, device=device), torch.randn(1, sk, hk, d, device=device), \
        torch.randn(1, sk, hk, d, device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    out = fa_amd.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **opts)
    ref, _ = attention_ref(q, k, v, **opts)
    emu, _ = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), **opts)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)


# --------------------------------------------------------------------------- FA3-style FP8 inputs

DENSE_CASES = [
    # b, sq, sk, hq, hk, d, options
    (2, 37, 45, 2, 2, 40, dict(causal=True)),
    (1, 29, 29, 4, 2, 64, dict()),  # GQA 2:1, unmasked blocks (POSITIVE_SCALE path)
    (1, 33, 20, 3, 1, 32, dict(causal=True, softcap=5.0)),  # MQA, rows with no key (sq > sk, causal)
    (1, 40, 50, 2, 2, 16, dict(window_size=(9, 3), alibi=True)),
]


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,opts", DENSE_CASES)
def test_descaled_fp8_inputs_dense(device, b, sq, sk, hq, hk, d, opts):
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(hq, device=device) * 0.3
    q, k, v = _fresh(b, sq, hq, d, device=device), _fresh(b, sk, hk, d, device=device), _fresh(b, sk, hk, d,
                                                                                               device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    out, lse, _ = fa_amd.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True,
                                         **opts)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref, ref_lse = attention_ref(q, k, v, **opts)
    emu, emu_lse = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), **opts)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # rows with no key: lse +inf, as the other paths
    assert_within_emulation("lse", lse[finite], ref_lse[finite], emu_lse[finite], torch.float32)


@pytest.mark.parametrize("return_probs", [False, True])
def test_descales_are_read_in_place_with_their_strides(device, return_probs):
    """The kernels read the caller's descales where they lie (score_mods.load_head_descales; no packed
    copy): transposed and sliced descales give the contiguous ones' outputs bit for bit, an absent one
    (strides 0) those of explicit ones, and every (batch, KV head) takes its own scales (a wrong stride
    would swap them: GQA 3:1, the q descale per KV head as in FA3)."""
    q, k, v = _fresh(2, 19, 6, 32, device=device), _fresh(2, 23, 2, 32, device=device), _fresh(2, 23, 2, 32,
                                                                                              device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    qd, kd, vd = (x * torch.tensor([[1.0, 2.0], [0.5, 4.0]], device=device) for x in (qd, kd, vd))

    def run(qd, kd, vd):
        return fa_amd.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                      return_attn_probs=return_probs)

    want = run(qd, kd, vd)
    for i in range(2):
        got = run(*(strided_descales(x)[i] for x in (qd, kd, vd)))
        for g, w in zip(got if return_probs else (got,), want if return_probs else (want,)):
            assert torch.equal(g, w)
    ones = torch.ones_like(kd)
    assert torch.equal(run(qd, kd, None)[0] if return_probs else run(qd, kd, None),
                       run(qd, kd, ones)[0] if return_probs else run(qd, kd, ones))
    # the values these descales mean (not the original inputs': the descales were rescaled), within P's FP8
    # rounding (2**-4 relative, module doc) and bf16's
    emu, _ = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), causal=True)
    out = want[0] if return_probs else want
    assert (out.double() - emu).abs().max().item() <= (2 ** -4 + OUT_EPS[torch.bfloat16]) * emu.abs().max().item()


def test_descaled_fp8_inputs_with_sinks(device):
    """Learnable sinks on the FP8 path (forward only): the sink joins the denominator that the FP8
    kernel sums in P * 2**FP8_P_LOG2 units (kernels/forward.py scales the sink's start term too);
    causal rows past the keys see the sink alone (output 0, lse = sink)."""
    q, k, v = _fresh(1, 30, 4, 32, device=device), _fresh(1, 21, 2, 32, device=device), _fresh(1, 21, 2, 32,
                                                                                              device=device)
    sinks = torch.randn(4, device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    out, lse, _ = fa_amd.flash_attn_func(q8, k8, v8, causal=True, sinks=sinks, q_descale=qd, k_descale=kd,
                                         v_descale=vd, return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, sinks=sinks)
    emu, emu_lse = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), causal=True, sinks=sinks)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)
    assert_within_emulation("lse", lse, ref_lse, emu_lse, torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        fa_amd.flash_attn_func(q8, k8, v8, sinks=sinks.clone().requires_grad_(), q_descale=qd)


def test_descaled_fp8_out_dtype_and_default_descales(device):
    """out_dtype picks the output type; descales left out are 1 (the FP8 values are the real ones)."""
    q, k, v = (_fresh(1, 19, 2, 32, device=device) for _ in range(3))
    q8, k8, v8 = (x.to(E4M3) for x in (q, k, v))
    out = fa_amd.flash_attn_func(q8, k8, v8, causal=True, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    exact, _ = attention_ref(q8.double(), k8.double(), v8.double(), causal=True)
    # inputs are exact in fp8 here: the only rounding left is P's (3x the emulation has nothing to
    # scale; bound it by the rounding of P itself, 2^-4 relative, on the output's magnitude)
    assert (out.double() - exact).abs().max().item() <= 2 ** -4 * exact.abs().max().item()


def test_descaled_fp8_inputs_varlen_gqa_empty_segments(device):
    lens_q, lens_k = [7, 0, 23, 1], [9, 4, 0, 30]
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    hq, hk, d = 4, 2, 24
    q, k, v = (_fresh(sum(lens_q), hq, d, device=device), _fresh(sum(lens_k), hk, d, device=device),
               _fresh(sum(lens_k), hk, d, device=device))
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, cu_q=cu_q, cu_k=cu_k)
    out = fa_amd.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                        q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    emu, _ = attention_varlen_ref(*_dequantized(q8, k8, v8, qd, kd, vd, cu_q, cu_k), cu_q, cu_k, causal=True)
    assert_within_emulation("out", out, ref, emu, torch.float16)


def test_token_major_v_layout(device, monkeypatch):
    """The token-major V path (tables.FP8_V_TOKEN_MAJOR, Hopper): padded rows (seqlen_k not a
    multiple of 16) read by the masked tiles; same result as the head-dim-major layout."""
    q, k, v = _fresh(2, 21, 2, 32, device=device), _fresh(2, 27, 1, 32, device=device), _fresh(2, 27, 1, 32,
                                                                                               device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    call = functools.partial(fa_amd.flash_attn_func, q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                             v_descale=vd, out_dtype=torch.float32)
    natural = call()
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", ("cpu",))
    v_tm = fp8_mod._v_layout(v8, False, Arch("interpreter", "cpu", 32))
    assert v_tm.stride(1) == 1 and v_tm.stride(-1) == 32  # rows padded from 27 to 32 tokens
    assert torch.equal(v_tm.float(), v8.float())
    assert torch.equal(call(), natural)
    quantising = fa_amd.flash_attn_fp8_func(q, k, v, causal=True)  # quantised straight into the layout
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", ())
    assert torch.equal(quantising, fa_amd.flash_attn_fp8_func(q, k, v, causal=True))


def test_token_major_v_is_read_in_place(device, monkeypatch):
    """A V that is already token-major with rows exactly seqlen_k long (a transposed contiguous
    (batch, nheads, d, seqlen) tensor) reaches the forward as it is: not made head-dim contiguous and
    copied back (two copies per call, fixed 2026-11-24)."""
    q, k, v = _fresh(2, 19, 4, 64, device=device), _fresh(2, 32, 2, 64, device=device), _fresh(2, 32, 2, 64,
                                                                                               device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    natural = fa_amd.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", ("cpu",))
    v_tm = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)

    def no_copy(v):
        raise AssertionError("token-major V was copied")
    monkeypatch.setattr(fp8_mod, "token_major_copy", no_copy)
    out = fa_amd.flash_attn_func(q8, k8, v_tm, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out, natural)


@pytest.mark.parametrize("nan_mode", ["fixup", "pass"])
@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("causal,window,varlen", [(True, (-1, -1), False), (False, (4, 2), False),
                                                  (True, (-1, -1), True)])
def test_nan_in_fp8_v_matches_reference(device, monkeypatch, nan_mode, token_major, causal, window, varlen):
    """A NaN in FP8 V gives the reference's NaN pattern under masks that skip its block (masked
    probabilities times a NaN value are NaN), found by the forward's marks and fix-up launch
    (tables.FWD_NAN_FIXUP_FAMILIES; FP8 too since 2026-11-24) or by the pass before it, V read
    head-dim-major or token-major."""
    family = tuning.family_of(arch_for(torch.empty(0, device=device)))
    others = tuple(f for f in tables.FWD_NAN_FIXUP_FAMILIES if f != family)
    monkeypatch.setattr(tables, "FWD_NAN_FIXUP_FAMILIES", others + ((family,) if nan_mode == "fixup" else ()))
    if token_major:
        monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", tables.FP8_V_TOKEN_MAJOR + ("cpu",))
    torch.manual_seed(3)
    q, k, v = _fresh(2, 40, 4, 32, device=device), _fresh(2, 40, 2, 32, device=device), _fresh(2, 40, 2, 32,
                                                                                             device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    v8[1, 33, 1, 3] = float("nan")
    descaled = dict(q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    if varlen:  # the second sequence holds the NaN: only its rows of KV head 1 see it
        cu = cu_seqlens([40, 40], device)
        out = fa_amd.flash_attn_varlen_func(q8.flatten(0, 1), k8.flatten(0, 1), v8.flatten(0, 1), cu, cu, 40, 40,
                                            causal=causal, window_size=window, **descaled).unflatten(0, (2, 40))
    else:
        out = fa_amd.flash_attn_func(q8, k8, v8, causal=causal, window_size=window, **descaled)
    ref, _ = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), causal=causal, window_size=window)
    assert torch.equal(out.isnan(), ref.isnan()), f"{int(out.isnan().sum())} NaN vs {int(ref.isnan().sum())}"
    assert ref.isnan().any() and not ref.isnan().all()


# --------------------------------------------------------------------------- quantising functions

def test_quantize_fp8_matches_reference(device):
    """(More cases, and why descales may differ in the last bit on a GPU: test_fp8_quantize.py.)"""
    x = _fresh(2, 13, 3, 16, device=device) * 7
    x[1, :, 2] = 0  # an all-zero head: descale 1
    x8, descale = fp8_mod.quantize_fp8(x, E4M3)
    r8, rd = fp8_quantize_ref(x, E4M3)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.allclose(descale, rd, rtol=2 ** -22)
    assert descale[1, 2] == 1.0 and x8.float().abs().amax().item() == 448.0
    cu = cu_seqlens([5, 0, 8], device)
    xv = _fresh(13, 2, 16, device=device)
    x8, descale = fp8_mod.quantize_fp8(xv, E4M3, cu)
    r8, rd = fp8_quantize_ref(xv, E4M3, cu)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.allclose(descale, rd, rtol=2 ** -22)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_func_forward_and_probs(device, dtype):
    b, sq, sk, hq, hk, d = 1, 30, 37, 4, 2, 40
    q, k, v = _fresh(b, sq, hq, d, device=device, dtype=dtype), _fresh(b, sk, hk, d, device=device, dtype=dtype), \
        _fresh(b, sk, hk, d, device=device, dtype=dtype)
    out, lse, probs = fa_amd.flash_attn_fp8_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.dtype == dtype and probs.numel() == 0  # without dropout S_dmask is empty, as in flash-attn
    # with dropout: the probabilities, negated where dropped
    probs = fa_amd.flash_attn_fp8_func(q, k, v, causal=True, dropout_p=0.2, return_attn_probs=True)[2]
    assert probs.shape == (b, hq, sq, sk) and (probs < 0).any()
    probs = probs.abs()
    q8, qd = fp8_quantize_ref(q, E4M3)
    k8, kd = fp8_quantize_ref(k, E4M3)
    v8, vd = fp8_quantize_ref(v, E4M3)
    emu_in = (fp8_dequantize_ref(q8, qd), fp8_dequantize_ref(k8, kd), fp8_dequantize_ref(v8, vd))
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    emu, emu_lse = attention_ref(*emu_in, causal=True)
    assert_within_emulation("out", out, ref, emu, dtype)
    assert_within_emulation("lse", lse, ref_lse, emu_lse, torch.float32)
    # the probabilities of the quantised scores (the kernel's S), rows summing to 1
    masked = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)
    emu_scores = torch.einsum("bqhd,bkhd->bhqk", emu_in[0], emu_in[1].repeat_interleave(hq // hk, 2)) * d ** -0.5
    emu_probs = torch.softmax(emu_scores.masked_fill(masked, float("-inf")), -1)
    assert (probs.double() - emu_probs).abs().max().item() < 1e-3
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(b, hq, sq, dtype=torch.float64, device=device), atol=1e-3,
                               rtol=0)


def _packed_grad_check(out, qkv, ref_fn, grads_fn, dout):
    """out of an FP8 qkvpacked call on qkv (leaf, requires grad) vs float64: gradient of qkv within
    3x the emulated rule's error + the fp16 rounding of the kernels' backward."""
    (g,) = torch.autograd.grad(out, qkv, dout)
    leaf = qkv.detach().double().requires_grad_()
    ref_out = ref_fn(leaf)
    (g64,) = torch.autograd.grad(ref_out, leaf, dout.double())
    g_emu = grads_fn()
    err = (g.double() - g64).abs().max().item()
    err_emu = (g_emu - g64).abs().max().item()
    bound = 3 * err_emu + 1e-3 * g64.abs().max().item()
    assert not torch.isnan(g).any() and err <= bound, f"grad: max error {err:.3e} > 3 x emulated {err_emu:.3e} + eps"
    return err, err_emu


@pytest.mark.parametrize("token_major", [False, True])
def test_qkvpacked_fp8_backward(device, monkeypatch, token_major):
    """The ROCm example's path: backward through flash_attn_qkvpacked_fp8_func, with V quantised
    token-major (tables.FP8_V_TOKEN_MAJOR: Hopper, gfx942) or not."""
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", ("cpu", "sm89", "sm90", "sm120", "gfx942") if token_major else ())
    b, s, h, d = 1, 35, 2, 32
    qkv = _fresh(b, s, 3, h, d, device=device, dtype=torch.float16, requires_grad=True)
    out = fa_amd.flash_attn_qkvpacked_fp8_func(qkv, causal=True)
    assert out.dtype == torch.float16
    dout = torch.randn_like(out)

    def emulated():
        q, k, v = qkv.detach().unbind(2)
        deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, E4M3)) for x in (q, k, v)]
        emu_out, emu_lse = attention_ref(*deq, causal=True)
        return torch.stack(attention_grads_from_stats(*deq, emu_out, emu_lse, dout, causal=True), dim=2)

    _packed_grad_check(out, qkv, lambda x: attention_ref(*x.unbind(2), causal=True)[0], emulated, dout)
    # close to the fp16 path's gradients too (the same kernels, at the round-tripped values)
    (g8,) = torch.autograd.grad(fa_amd.flash_attn_qkvpacked_fp8_func(qkv, causal=True), qkv, dout)
    (g16,) = torch.autograd.grad(fa_amd.flash_attn_qkvpacked_func(qkv, causal=True), qkv, dout)
    assert (g8.float() - g16.float()).abs().max() <= 0.1 * g16.float().abs().max()


def test_varlen_qkvpacked_fp8_backward_empty_segment(device):
    lens = [9, 0, 14]
    cu = cu_seqlens(lens, device)
    h, d = 2, 16
    qkv = _fresh(sum(lens), 3, h, d, device=device, dtype=torch.float16, requires_grad=True)
    out = fa_amd.flash_attn_varlen_qkvpacked_fp8_func(qkv, cu, max(lens))
    dout = torch.randn_like(out)
    bounds = cu.tolist()

    def per_segment(fn):
        parts = [fn(i, bounds[i], bounds[i + 1]) for i in range(len(lens)) if lens[i]]
        return torch.cat(parts, dim=0)

    def ref_fn(x):
        return per_segment(lambda i, a, e: attention_ref(*x[None, a:e].unbind(2))[0][0])

    def emulated():
        def seg(i, a, e):
            q, k, v = qkv.detach()[None, a:e].unbind(2)
            deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, E4M3)) for x in (q, k, v)]
            emu_out, emu_lse = attention_ref(*deq)
            return torch.stack(attention_grads_from_stats(*deq, emu_out, emu_lse, dout[None, a:e]), dim=2)[0]
        return per_segment(seg)

    _packed_grad_check(out, qkv, ref_fn, emulated, dout)


def test_fp8_func_with_dropout(device):
    """Dropout in the FP8 forward, same mask in the high-precision backward (S_dmask tells it)."""
    b, s, h, d = 1, 24, 2, 16
    q, k, v = (_fresh(b, s, h, d, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
    torch.manual_seed(3)
    out, _, s_dmask = fa_amd.flash_attn_fp8_func(q, k, v, dropout_p=0.25, return_attn_probs=True)
    keep = s_dmask > 0
    deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, E4M3)) for x in (q, k, v)]
    ref, _ = attention_ref(q, k, v, dropout_p=0.25, dropout_mask=keep)
    emu, _ = attention_ref(*deq, dropout_p=0.25, dropout_mask=keep)
    assert_within_emulation("out", out, ref, emu, torch.float16)
    assert 0.5 < keep.float().mean() < 0.95
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # the backward's dropout mask is the forward's: its gradients are those of the emulation with that mask
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_grads = torch.autograd.grad(attention_ref(*leaves, dropout_p=0.25, dropout_mask=keep)[0], leaves,
                                    dout.double())
    deq_leaves = [x.requires_grad_() for x in deq]
    emu_grads = torch.autograd.grad(attention_ref(*deq_leaves, dropout_p=0.25, dropout_mask=keep)[0], deq_leaves,
                                    dout.double())
    for name, g, g64, g_emu in zip(("dq", "dk", "dv"), grads, ref_grads, emu_grads):
        assert_within_emulation(name, g, g64, g_emu, torch.float16)


@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 10.0), (torch.float16, 20.0), (torch.float16, 50.0)])
def test_fp8_func_backward_peaked_softmax(device, dtype, scale):
    """Sharply peaked attention (logits of std ~100-2500): the backward rebuilds P = exp(S - lse) from q and k
    put through FP8 and back in the inputs' dtype, so it must take lse (and out) from those same values.  With
    the FP8 forward's lse (S of the exact FP8 products) rows of P summed to 0.4-9.5 here.  Two identities of
    softmax attention check that, whatever ties the quantisation makes: with every row's P summing to 1,
    sum_j dV_j = sum_i dO_i, and sum_j dK_j = 0 (shifting every key by one vector shifts a row's scores by one
    constant).  Tolerance: twice what the bf16 / fp16 path's own gradients show on the same identities, plus
    the dtype's rounding of the sums."""
    torch.manual_seed(4)
    b, sq, sk, h, d = 2, 13, 15, 2, 32
    q, k = (torch.randn(b, n, h, d, device=device) * scale for n in (sq, sk))
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, torch.randn(b, sk, h, d, device=device)))
    dout = torch.randn(b, sq, h, d, device=device).to(dtype)

    def identity_errors(fn):
        _, dk, dv = torch.autograd.grad(fn(q, k, v, causal=True), (q, k, v), dout)
        dv_err = (dv.double().sum(1) - dout.double().sum(1)).abs().max().item()
        return dv_err, dk.double().sum(1).abs().max().item()

    got = identity_errors(fa_amd.flash_attn_fp8_func)
    path = identity_errors(fa_amd.flash_attn_func)
    eps = OUT_EPS[dtype] * sq * dout.abs().max().item()
    for name, err, err_path in zip(("sum_j dV_j - sum_i dO_i", "sum_j dK_j"), got, path):
        assert err <= 2 * err_path + eps, f"{name}: {err:.3e} (the {dtype} path: {err_path:.3e})"


@pytest.mark.cpu_only
def test_gfx942_fnuz_type(device, monkeypatch):
    """gfx942's float8_e4m3fnuz (max 240, bias 8) through the same kernels (the interpreter standing
    in for an MI300: a GPU of another arch cannot build them)."""
    monkeypatch.setitem(tables.FP8_DTYPES, "cpu", ("float8_e4m3fnuz", "float8_e5m2fnuz"))
    fnuz = torch.float8_e4m3fnuz
    q, k, v = _fresh(1, 26, 2, 32, device=device), _fresh(1, 31, 2, 32, device=device), _fresh(1, 31, 2, 32,
                                                                                               device=device)
    out = fa_amd.flash_attn_fp8_func(q, k, v, causal=True)
    deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, fnuz)) for x in (q, k, v)]
    assert_within_emulation("out", out, attention_ref(q, k, v, causal=True)[0],
                            attention_ref(*deq, causal=True)[0], torch.float32)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, fnuz)
    out = fa_amd.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_within_emulation("out", out, attention_ref(q, k, v)[0],
                            attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd))[0], torch.bfloat16)
    with pytest.raises(TypeError, match="float8_e4m3fn.*cpu has no dot product"):
        fa_amd.flash_attn_func(q.to(E4M3), k.to(E4M3), v.to(E4M3))


# --------------------------------------------------------------------------- arch table

def test_fp8_arch_table():
    def names(backend, name):
        return fp8_dtype_names(Arch(backend, name, 32))

    assert names("hip", "gfx942")[0] == "float8_e4m3fnuz" and names("hip", "gfx940")[0] == "float8_e4m3fnuz"
    assert names("hip", "gfx950")[0] == "float8_e4m3fn"
    assert names("cuda", "sm89")[0] == names("cuda", "sm90")[0] == names("cuda", "sm100")[0] == "float8_e4m3fn"
    for arch in (("hip", "gfx908"), ("hip", "gfx90a"), ("hip", "gfx1100"), ("cuda", "sm80"), ("cuda", "sm86")):
        assert names(*arch) == ()
    assert names("interpreter", "cpu")[0] == "float8_e4m3fn"
    assert fp8_v_token_major(Arch("cuda", "sm90", 32)) and fp8_v_token_major(Arch("cuda", "sm89", 32))
    assert fp8_v_token_major(Arch("hip", "gfx942", 64)) and not fp8_v_token_major(Arch("hip", "gfx950", 64))
    assert not fp8_v_token_major(Arch("interpreter", "cpu", 32))  # CI covers the token-major path by patching


@pytest.mark.parametrize("arch", ["gfx90a", "gfx908", "gfx1100", "sm80"])
def test_arch_without_fp8_raises(device, monkeypatch, arch):
    monkeypatch.setattr(fp8_mod, "arch_for", lambda t: Arch("hip" if arch.startswith("gfx") else "cuda", arch, 64))
    q = _fresh(1, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match=f"{arch} does not have.*flash_attn_func with bfloat16"):
        fa_amd.flash_attn_fp8_func(q, q, q)
    with pytest.raises(ValueError, match=f"{arch} does not have"):
        fa_amd.flash_attn_func(q.to(E4M3), q.to(E4M3), q.to(E4M3))


def test_old_triton_for_gfx950_raises(device, monkeypatch):
    monkeypatch.setattr(fp8_mod, "arch_for", lambda t: Arch("hip", "gfx950", 64))
    monkeypatch.setattr(fp8_mod, "TRITON_VERSION", (3, 5))
    q = _fresh(1, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="gfx950 needs triton >= 3.6"):
        fa_amd.flash_attn_fp8_func(q, q, q)


# --------------------------------------------------------------------------- bad input

def test_bad_fp8_input(device):
    q = _fresh(2, 8, 4, 16, device=device)
    k = _fresh(2, 8, 2, 16, device=device)
    q8, k8 = q.to(E4M3), k.to(E4M3)
    ones = torch.ones(2, 2, device=device)
    with pytest.raises(TypeError, match="v is torch.bfloat16 while q is torch.float8_e4m3fn"):
        fa_amd.flash_attn_func(q8, k8, k.to(torch.bfloat16))
    with pytest.raises(TypeError, match="q is torch.float16 while k is torch.float8_e4m3fn"):
        fa_amd.flash_attn_func(q.half(), k8, k8)
    with pytest.raises(TypeError, match="share one FP8 dtype"):
        fa_amd.flash_attn_func(q8, k8, k.to(torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, nheads_k\) = \(2, 2\), got \(2, 4\)"):
        fa_amd.flash_attn_func(q8, k8, k8, k_descale=torch.ones(2, 4, device=device))
    with pytest.raises(ValueError, match=r"q_descale must have shape"):
        fa_amd.flash_attn_func(q8, k8, k8, q_descale=torch.ones(2, device=device))
    with pytest.raises(TypeError, match="v_descale must be float32, got torch.float16"):
        fa_amd.flash_attn_func(q8, k8, k8, v_descale=ones.half())
    with pytest.raises(TypeError, match="q_descale must be a torch.Tensor"):
        fa_amd.flash_attn_func(q8, k8, k8, q_descale=1.0)
    with pytest.raises(TypeError, match="out_dtype must be"):
        fa_amd.flash_attn_func(q8, k8, k8, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_descale applies to FP8 q, k, v only"):
        fa_amd.flash_attn_func(q, k, k, q_descale=ones)
    with pytest.raises(ValueError, match="out_dtype applies to FP8"):
        fa_amd.flash_attn_func(q, k, k, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="FP8 v requires grad.*no backward"):  # (names the input that does)
        fa_amd.flash_attn_func(q8, k8, k8.clone().requires_grad_())
    with pytest.raises(ValueError, match="FP8 q and k require grad"):
        fa_amd.flash_attn_func(q8.clone().requires_grad_(), k8.clone().requires_grad_(), k8)
    with pytest.raises(ValueError, match="nheads of q"):  # the usual checks still apply
        fa_amd.flash_attn_func(k8, q8, q8)
    cu = cu_seqlens([3, 5], device)
    with pytest.raises(ValueError, match=r"v_descale must have shape \(batch, nheads_k\) = \(2, 2\)"):
        fa_amd.flash_attn_varlen_func(q8[0], k8[0], k8[0], cu, cu, 5, 5, v_descale=torch.ones(1, 2, device=device))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):  # quantising functions take high precision
        fa_amd.flash_attn_fp8_func(q8, k8, k8)


# --------------------------------------------------------------------------- P rounding vs the row sum

def test_fp8_output_normalisation_matches_fa3(device):
    """The FP8 P.V product multiplies V by P rounded to FP8 and divides by the row sum of the unrounded P
    (FA3's choice, kept: an exact sum of the rounded P costs the FP8 forward 11 % on an H200, docs/TUNING_NOTES
    v25).  So a constant V comes out within P's rounding of that constant, not exactly: each rounded P is
    within 2**-4 of P (e4m3: 3 mantissa bits), so the output is within 2**-4 of the constant, and on average
    far closer.  The lse stays exact (the unrounded sum)."""
    gen = torch.Generator().manual_seed(14)
    b, s, h, d = 1, 37, 2, 32
    q, k = (torch.randn(b, s, h, d, generator=gen).to(device) for _ in range(2))
    v = torch.full((b, s, h, d), 0.75, device=device)
    for causal in (False, True):
        out = fa_amd.flash_attn_fp8_func(q, k, v, causal=causal)  # quantising function, fp32 out
        err = (out.double() - 0.75).abs()
        assert err.max().item() <= 0.75 * 2 ** -4 and err.mean().item() <= 0.75 * 2 ** -6, f"causal={causal}"
        out = fa_amd.flash_attn_func(q.to(E4M3), k.to(E4M3), torch.ones_like(v).to(E4M3), causal=causal,
                                     out_dtype=torch.float32)  # FA3-style, default descales
        err = (out.double() - 1.0).abs()
        assert err.max().item() <= 2 ** -4 and err.mean().item() <= 2 ** -6, f"FA3-style, causal={causal}"
