"""torch.compile audit: the custom ops' fake implementations against the real ops (torch.library.opcheck:
schema, fake tensor, autograd registration, AOT dispatch), and compiled autograd over an eager forward.

Two bugs these pin:
- fa_amd::attention_bwd / attention_bwd_by_positions faked dsinks in the sinks' dtype while the kernels
  return it in fp32: with fp16 sinks passed to the public op, inductor read the fp32 buffer as fp16 in the
  ops after it (a sinks gradient off by 1000x).
- an eager forward (fa_amd.ops.EagerAttention) whose backward ran under compiled autograd
  (torch._dynamo.compiled_autograd, torch._dynamo.config.compiled_autograd) crashed: the tracer ran the
  Triton launchers on fake tensors.  The backward now emits fa_amd::attention_bwd there, as fa_amd.fp8's
  backward already did.
"""
import pytest
import torch

import fa_amd
from fa_amd import fp8 as fa_fp8
from tests.kernels.helpers import cu_seqlens, dense_qkv, randn

FAKE_CHECKS = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _opcheck(op, args, test_utils=FAKE_CHECKS):
    torch.library.opcheck(op, args, test_utils=test_utils)


def _fwd_args(q, k, v, cu_q=None, cu_k=None, max_q=None, max_k=None, *, right=-1, probs=False, sinks=None,
              alibi=None):
    d = q.shape[-1]
    max_q = q.shape[1] if max_q is None else max_q
    max_k = k.shape[1] if max_k is None else max_k
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.0, d ** -0.5, -1, right, 0.0, alibi, None, probs, False)
    return args + ((sinks,) if sinks is not None else ())


@pytest.mark.parametrize("sinks_dtype", [torch.float16, torch.float32])
def test_attention_bwd_fake_dsinks_is_fp32_like_the_real_op(device, sinks_dtype):
    """The backward op's dsinks is fp32 whatever the sinks' dtype, in the fake as in the real op."""
    q, k, v = dense_qkv(device, torch.float16, 2, 5, 7, 4, 2, 8)
    q, k, v = q.detach(), k.detach(), v.detach()
    sinks = torch.randn(4, device=device).to(sinks_dtype)
    out, lse, _ = torch.ops.fa_amd.attention_fwd(*_fwd_args(q, k, v, right=0, sinks=sinks))
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, None, None, 5, 7, 0.0, 8 ** -0.5, -1, 0, 0.0, None, None, False, sinks)
    assert torch.ops.fa_amd.attention_bwd(*args)[3].dtype == torch.float32
    _opcheck(torch.ops.fa_amd.attention_bwd.default, args)


def test_attention_bwd_by_positions_fake_dsinks_is_fp32(device):
    d = 8
    q, k, v = (torch.randn(9, h, d, device=device, dtype=torch.float16) for h in (4, 2, 2))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]], device=device)
    sinks = torch.randn(4, device=device).to(torch.float16)
    out, lse = torch.ops.fa_amd.attention_fwd_by_positions(q, k, v, pos, 0.0, d ** -0.5, -1, 0, 0.0, None, False,
                                                           sinks)
    args = (torch.randn_like(out), q, k, v, out, lse, pos, 0.0, d ** -0.5, -1, 0, 0.0, None, False, sinks)
    _opcheck(torch.ops.fa_amd.attention_bwd_by_positions.default, args)


@pytest.mark.parametrize("case", ["gqa_causal", "probs", "alibi_sinks", "varlen_probs"])
def test_attention_fwd_opcheck(device, case):
    """Fake shapes / dtypes / strides of attention_fwd match the real op on odd shapes (GQA, varlen with
    seqlen_q != seqlen_k per segment, return_probs), and its autograd registration passes AOT dispatch."""
    if case == "varlen_probs":
        q, k, v = (randn(t, h, 8, dtype=torch.float32, device=device) for t, h in ((8, 4), (9, 2), (9, 2)))
        args = _fwd_args(q, k, v, cu_seqlens([3, 5], device), cu_seqlens([4, 5], device), 5, 5, probs=True)
    else:
        q, k, v = dense_qkv(device, torch.float32, 2, 5, 7, 4, 2, 8)
        args = _fwd_args(q, k, v, right=0 if case == "gqa_causal" else -1, probs=case == "probs",
                         sinks=torch.randn(4, device=device, requires_grad=True) if case == "alibi_sinks" else None,
                         alibi=torch.rand(2, 4, device=device) if case == "alibi_sinks" else None)
    _opcheck(torch.ops.fa_amd.attention_fwd.default, args)


def test_decode_and_append_opcheck(device):
    b, hq, hk, d = 2, 4, 2, 8
    k_cache, v_cache = (torch.randn(b, 32, hk, d, device=device) for _ in range(2))
    lens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    q = torch.randn(b, 3, hq, d, device=device)
    args = (q, k_cache, v_cache, d ** -0.5, -1, 0, 0.0, None, None, None, lens, None, 0, None, None, None, None, None,
            None, None, None, False, False, 2, None)
    _opcheck(torch.ops.fa_amd.decode_fwd.default, args)
    k, v = (torch.randn(b, 2, hk, d, device=device) for _ in range(2))
    _opcheck(torch.ops.fa_amd.kvcache_append.default,
             (k, v, k_cache.clone(), v_cache.clone(), lens, None, None, None, None, None, False))


def test_fp8_ops_opcheck(device):
    fp8_dtype = fa_fp8.fp8_dtypes(torch.empty(0, device=device))[0]
    x = torch.randn(2, 7, 2, 16, device=device)
    for token_major in (False, True):
        _opcheck(torch.ops.fa_amd.quantize_fp8.default, (x, fp8_dtype, None, None, token_major))
    _opcheck(torch.ops.fa_amd.quantize_fp8.default,
             (torch.randn(9, 2, 16, device=device), fp8_dtype, cu_seqlens([4, 5], device), 5, False))
    _opcheck(torch.ops.fa_amd.fp8_round_trip.default, (x, fp8_dtype, None, None))
    q, k, v = dense_qkv(device, torch.float32, 2, 5, 7, 4, 2, 16)
    _opcheck(torch.ops.fa_amd.attention_fwd_fp8_quantized.default, _fwd_args(q, k, v, right=0))
    # (FP8 inputs: opcheck's schema test cannot compare FP8 tensors on the CPU)
    q8, k8, v8 = (t.detach().to(fp8_dtype) for t in (q, k, v))
    q_descale, k_descale, v_descale = (torch.rand(2, 2, device=device) + 0.5 for _ in range(3))
    _opcheck(torch.ops.fa_amd.attention_fwd_fp8.default,
             (q8, k8, v8, q_descale, k_descale, v_descale, None, None, 5, 7, 0.0, 0.25, -1, 0, 0.0, None, None, True,
              torch.float16),
             test_utils=FAKE_CHECKS[1:])


def _backward_under_compiled_autograd(loss):
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        loss.backward()
    torch._dynamo.reset()


@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_autograd_over_eager_forward(device, varlen):
    """An eager forward's backward traced by compiled autograd gives the eager backward's gradients, bit
    for bit (dropout's mask included: the saved rng_state), sinks too."""
    torch.manual_seed(0)
    q0, k0, v0 = (t.detach() for t in dense_qkv(device, torch.float32, 2, 6, 6, 4, 2, 8))
    s0 = torch.randn(4, device=device)
    cu = cu_seqlens([6, 6], device)

    def grads(compiled):
        q, k, v, s = (t.clone().requires_grad_() for t in (q0, k0, v0, s0))
        torch.manual_seed(1)
        if varlen:
            out = fa_amd.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 6, 6,
                                                dropout_p=0.25, causal=True, sinks=s)
        else:
            out = fa_amd.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, sinks=s)
        assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
        loss = (out * torch.arange(out.numel(), device=device).view(out.shape).sin()).sum()
        if compiled:
            _backward_under_compiled_autograd(loss)
        else:
            loss.backward()
        return [t.grad for t in (q, k, v, s)]

    for want, got in zip(grads(False), grads(True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_compiled_autograd_over_eager_forward(device, interleaved):
    """apply_rotary_emb run eagerly, its backward traced by compiled autograd: the custom op's backward (the
    launcher itself would run on fake tensors), the eager gradients bit for bit."""
    from fa_amd.kernels.rotary import apply_rotary_emb

    torch.manual_seed(2)
    x0 = torch.randn(2, 7, 3, 16, device=device)
    # HF-style tables (seq, rotary_dim), halves duplicated: rotary dim 12 of 16
    cos, sin = (torch.cat([t, t], -1) for t in (torch.randn(7, 6, device=device) for _ in range(2)))

    def grad(compiled):
        x = x0.clone().requires_grad_()
        out, _ = apply_rotary_emb(x, None, cos, sin, interleaved=interleaved, heads_first=False)
        loss = (out * torch.arange(out.numel(), device=device).view(out.shape).cos()).sum()
        if compiled:
            _backward_under_compiled_autograd(loss)
        else:
            loss.backward()
        return x.grad

    torch.testing.assert_close(grad(True), grad(False), rtol=0, atol=0)
