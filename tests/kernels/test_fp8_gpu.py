"""FP8 attention on a GPU with an FP8 dot (gfx942, gfx950, sm89+): the wide sweep of
tests/kernels/test_fp8.py (same bound: 3x the error of a PyTorch emulation of the same
quantisation, plus the output dtype's rounding; see that module's docstring), with bf16
inputs and outputs, long sequences, every head-dim class, the arch's FP8 types, both V
layouts, return_attn_probs, dropout, and the backward against the bf16 path's."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import fp8 as fp8_mod
from fa_amd.arch import arch_for
from fa_amd.kernels import launch
from fa_amd.reference import attention_grads_from_stats, attention_ref, attention_varlen_ref, fp8_dequantize_ref, \
    fp8_quantize_ref
from fa_amd.tuning import fp8_dtype_names, fp8_v_token_major

from .helpers import cu_seqlens
from .test_fp8 import _dequantized, _quantized, assert_within_emulation

pytestmark = pytest.mark.gpu


def _fp8_types():
    if not torch.cuda.is_available():
        return []
    return [getattr(torch, n) for n in fp8_dtype_names(arch_for(torch.empty(0, device="cuda")))]


@pytest.fixture(autouse=True)
def needs_fp8(monkeypatch):
    if not _fp8_types():
        pytest.skip("this GPU has no FP8 dot product (tables.FP8_DTYPES)")
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    yield
    torch.cuda.empty_cache()


def _qkv(b, sq, sk, hq, hk, d, dtype=torch.bfloat16, requires_grad=False):
    def rnd(*shape):
        return torch.randn(*shape, device="cuda").to(dtype).requires_grad_(requires_grad)
    return rnd(b, sq, hq, d), rnd(b, sk, hk, d), rnd(b, sk, hk, d)


@pytest.mark.parametrize("d", [40, 64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 113, 1025, 4096])
def test_descaled_inputs_sweep(d, causal, seqlen):
    b, hq, hk = (1, 2, 1) if seqlen >= 4096 else (2, 4, 2)
    q, k, v = _qkv(b, seqlen, seqlen + 7, hq, hk, d)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, _fp8_types()[0])
    out = fa_amd.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16
    ref, _ = attention_ref(q, k, v, causal=causal)
    emu, _ = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), causal=causal)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "gqa8", "mqa"])
def test_descaled_inputs_features(feature):
    hq, hk = {"gqa8": (8, 1), "mqa": (4, 1)}.get(feature, (4, 2))
    kw = {"window": {"window_size": (77, 31)}, "softcap": {"softcap": 30.0, "causal": True},
          "alibi": {"alibi_slopes": torch.rand(hq, device="cuda") * 0.3, "causal": True}}.get(feature, {"causal": True})
    q, k, v = _qkv(2, 391, 517, hq, hk, 128)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, _fp8_types()[0])
    out, lse, probs = fa_amd.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                             return_attn_probs=True, out_dtype=torch.float32, **kw)
    ref, _ = attention_ref(q, k, v, **kw)
    emu, emu_lse = attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), **kw)
    assert_within_emulation("out", out, ref, emu, torch.float32)
    finite = torch.isfinite(emu_lse)
    # Hopper's FP8 tensor cores add up products in a narrower accumulator than fp32 (~14 mantissa bits,
    # as FA3 and DeepSeek-V3 report), so scores of magnitude ~10 carry ~1e-3 absolute error; the
    # emulation is float64 (on the CPU interpreter, whose FP8 dots are exact, the same case is 6e-7)
    assert (lse[finite].double() - emu_lse[finite]).abs().max() < 4e-3
    assert probs.numel() == 0  # without dropout S_dmask is empty, as in flash-attn; with it the probabilities
    probs = fa_amd.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, dropout_p=0.1,
                                   return_attn_probs=True, out_dtype=torch.float32, **kw)[2].abs()
    torch.testing.assert_close(probs.double().sum(-1)[finite], torch.ones_like(emu_lse)[finite], atol=2e-3, rtol=0)


@pytest.mark.parametrize("fp8_index", [0, 1], ids=["e4m3", "e5m2"])
def test_every_fp8_type_of_the_arch(fp8_index):
    fp8_dtype = _fp8_types()[fp8_index]
    q, k, v = _qkv(2, 300, 300, 4, 4, 128)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, fp8_dtype)
    out = fa_amd.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_within_emulation("out", out, attention_ref(q, k, v, causal=True)[0],
                            attention_ref(*_dequantized(q8, k8, v8, qd, kd, vd), causal=True)[0], torch.bfloat16)


@pytest.mark.parametrize("seqlen", [256, 1000])
def test_v_layouts_agree(seqlen):
    """Head-dim-major V, a transposed contiguous V (used as it is where the arch reads V token-major)
    and the padded copy give the same output."""
    fp8_dtype = _fp8_types()[0]
    q, k, v = _qkv(2, seqlen, seqlen, 4, 2, 128)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, fp8_dtype)
    call = functools.partial(fa_amd.flash_attn_func, q8, k8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    natural = call(v8)
    transposed = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert torch.equal(call(transposed), natural)
    if fp8_v_token_major(arch_for(q)):
        arch = arch_for(q)
        assert fp8_mod._v_layout(transposed, False, arch) is transposed  # no copy per call
        padded = fp8_mod._v_layout(v8, False, arch)
        assert padded.stride(1) == 1 and padded.stride(-1) % 16 == 0


def test_varlen_ragged_empty_segments():
    fp8_dtype = _fp8_types()[0]
    lens_q, lens_k = [1, 0, 700, 33, 2048], [5, 17, 0, 1200, 2048]
    cu_q, cu_k = cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda")
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda") for _ in range(2))
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, fp8_dtype, cu_q, cu_k)
    out = fa_amd.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                        q_descale=qd, k_descale=kd, v_descale=vd)
    ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    emu, _ = attention_varlen_ref(*_dequantized(q8, k8, v8, qd, kd, vd, cu_q, cu_k), cu_q, cu_k, causal=True)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)
    # the quantising varlen function (per (sequence, head) scales) on the same inputs
    out = fa_amd.flash_attn_varlen_fp8_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, max(lens_q),
                                            max(lens_k), causal=True)
    deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, fp8_dtype, cu), cu) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k))]
    emu, _ = attention_varlen_ref(*deq, cu_q, cu_k, causal=True)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_qkvpacked_backward_close_to_bf16_path(causal, d):
    """Gradients of flash_attn_qkvpacked_fp8_func (bf16) vs float64: within 3x the emulated rule's error
    plus 2x the bf16 path's own gradient error (the kernels compute them in bf16)."""
    fp8_dtype = _fp8_types()[0]
    qkv = torch.randn(2, 777, 3, 4, d, device="cuda").bfloat16().requires_grad_()
    dout = torch.randn(2, 777, 4, d, device="cuda").bfloat16()
    (g8,) = torch.autograd.grad(fa_amd.flash_attn_qkvpacked_fp8_func(qkv, causal=causal), qkv, dout)
    (g16,) = torch.autograd.grad(fa_amd.flash_attn_qkvpacked_func(qkv, causal=causal), qkv, dout)
    leaf = qkv.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(attention_ref(*leaf.unbind(2), causal=causal)[0], leaf, dout.double())
    q, k, v = qkv.detach().unbind(2)
    deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, fp8_dtype)) for x in (q, k, v)]
    emu_out, emu_lse = attention_ref(*deq, causal=causal)
    g_emu = torch.stack(attention_grads_from_stats(*deq, emu_out, emu_lse, dout, causal=causal), dim=2)
    err = (g8.double() - g64).abs().max().item()
    bound = 3 * (g_emu - g64).abs().max().item() + 2 * (g16.double() - g64).abs().max().item()
    assert torch.isfinite(g8).all() and err <= bound, (err, bound)


def test_dropout_backward_uses_the_forward_mask():
    q, k, v = _qkv(2, 333, 333, 4, 2, 64, requires_grad=True)
    torch.manual_seed(0)
    out, _, s_dmask = fa_amd.flash_attn_fp8_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)
    keep = s_dmask > 0
    fp8_dtype = _fp8_types()[0]
    deq = [fp8_dequantize_ref(*fp8_quantize_ref(x, fp8_dtype)) for x in (q, k, v)]
    emu, _ = attention_ref(*deq, causal=True, dropout_p=0.2, dropout_mask=keep)
    ref, _ = attention_ref(q, k, v, causal=True, dropout_p=0.2, dropout_mask=keep)
    assert_within_emulation("out", out, ref, emu, torch.bfloat16)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref64, _ = attention_ref(*leaves, causal=True, dropout_p=0.2, dropout_mask=keep)
    g64 = torch.autograd.grad(ref64, leaves, dout.double())
    # the backward rule in float64 (q, k, v as the FP8 forward used them; out and lse of those values; the
    # same mask): a wrong mask in the kernels' backward is off by O(1), far outside 3x its error
    emu_lse = attention_ref(*deq, causal=True)[1]
    g_emu = attention_grads_from_stats(*deq, emu, emu_lse, dout, causal=True, dropout_p=0.2, dropout_mask=keep)
    for name, a, b, e in zip("qkv", g, g64, g_emu):
        err, err_emu = (a.double() - b).abs().max().item(), (e - b).abs().max().item()
        assert err <= 3 * err_emu + 1e-3 * b.abs().max().item(), f"d{name}: {err:.3e} > 3 x emulated {err_emu:.3e}"


def test_cuda_graph_capture_of_fp8_inputs():
    fp8_dtype = _fp8_types()[0]
    q, k, v = _qkv(2, 512, 512, 4, 2, 128)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v, fp8_dtype)
    call = functools.partial(fa_amd.flash_attn_func, q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                             v_descale=vd)
    expect = call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("shape,lens", [((2, 4099, 8, 128), None), ((3, 1000, 4, 64), None),
                                        ((9000, 8, 128), [4000, 0, 4990, 7])])
def test_quantiser_matches_reference(shape, lens):
    """The quantising functions' Triton passes (kernels/quantize.py) at sizes where every program walks
    many blocks: x8 bit for bit as fa_amd.reference.fp8_quantize_ref (dense in both V layouts, varlen
    with an empty segment and 3 tail tokens past cu_seqlens[-1], cast with scale 1); descales equal
    but for the last bit (test_fp8_quantize.py says why)."""
    fp8_dtype = _fp8_types()[0]
    x = (torch.randn(*shape, device="cuda") * 37).bfloat16()
    cu = cu_seqlens(lens, "cuda") if lens else None
    fp8_max = torch.finfo(fp8_dtype).max
    for token_major in (False,) if lens else (False, True):
        x8, descale = fp8_mod.quantize_fp8(x, fp8_dtype, cu, token_major=token_major,
                                           max_seqlen=max(lens) if lens else None)
        r8, rd = fp8_quantize_ref(x, fp8_dtype, cu)
        n = sum(lens) if lens else x.shape[0]
        assert torch.equal(x8[:n].contiguous().view(torch.uint8), r8[:n].contiguous().view(torch.uint8))
        assert torch.allclose(descale, rd, rtol=2 ** -22, atol=0)
        if lens:
            tail = x[n:].float().clamp(-fp8_max, fp8_max).to(fp8_dtype)
            assert torch.equal(x8[n:].view(torch.uint8), tail.view(torch.uint8))
