"""Fused rotary kernel vs a float64 PyTorch reference.

CPU runs go through the Triton interpreter (tests/conftest.py) in fp32 and
fp16; bf16 runs on a GPU only.
"""
import pytest
import torch

from fa_amd.kernels.rotary import (
    apply_rotary_emb,
    hf_apply_rotary_pos_emb,
    rotary_backward,
    rotary_forward,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def hf_cos_sin(batch, seqlen, rotary_dim, device, dtype=torch.float32, offset=0, per_batch_offsets=False):
    """cos/sin exactly as a Hugging Face rotary module returns them: (b, s, rotary_dim), halves duplicated."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    pos = torch.arange(seqlen, dtype=torch.float64)[None, :].repeat(batch, 1) + offset
    if per_batch_offsets:
        pos = pos + 3 * torch.arange(batch, dtype=torch.float64)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rotary_ref(x_bshd, cos, sin, interleaved=False):
    """float64 reference. x: (b, s, h, d); cos/sin: (b or 1, s, rd) duplicated halves."""
    x = x_bshd.double()
    rd = cos.shape[-1]
    half = rd // 2
    c = cos.double()[..., :half].unsqueeze(2)
    s = sin.double()[..., :half].unsqueeze(2)
    rot, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([y, rest], dim=-1)


def _check(actual, expected, dtype):
    assert not torch.isnan(actual).any(), "kernel left NaN (unwritten) elements"
    torch.testing.assert_close(actual.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


CASES = [
    # (seqlen, head_dim, rotary_dim)
    (1, 64, 64),
    (17, 40, 40),
    (17, 59, 32),
    (113, 80, 40),
    (17, 128, 64),
]


def _run_forward_case(device, dtype, seqlen, head_dim, rotary_dim, interleaved):
    torch.manual_seed(seqlen * 1000 + head_dim)
    batch, heads = 2, 3
    x = torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype)
    cos, sin = hf_cos_sin(batch, seqlen, rotary_dim, device, dtype, per_batch_offsets=True)
    out = torch.full_like(x, float("nan"))
    rotary_forward(x, cos, sin, interleaved=interleaved, out=out)
    _check(out, rotary_ref(x, cos, sin, interleaved), dtype)
    # backward = rotation by -theta: applying it undoes the forward
    back = torch.full_like(x, float("nan"))
    rotary_backward(out, cos, sin, interleaved=interleaved, out=back)
    _check(back, x.double(), dtype if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("seqlen,head_dim,rotary_dim", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_backward_kernels(device, dtype, seqlen, head_dim, rotary_dim, interleaved):
    _run_forward_case(device, dtype, seqlen, head_dim, rotary_dim, interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("seqlen,head_dim,rotary_dim", CASES)
def test_forward_backward_kernels_bf16(device, seqlen, head_dim, rotary_dim, interleaved):
    _run_forward_case(device, torch.bfloat16, seqlen, head_dim, rotary_dim, interleaved)


def _hf_reference_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hf_layout_gqa_matches_transformers(device, dtype):
    """q/k as Llama hands them over: (b, h, s, d) transposed views, fewer k heads (GQA)."""
    torch.manual_seed(0)
    b, s, hq, hk, d = 2, 17, 4, 2, 64
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=device, dtype=dtype).transpose(1, 2)
    cos, sin = hf_cos_sin(b, s, d, device, dtype)
    q_rot, k_rot = hf_apply_rotary_pos_emb(q, k, cos, sin)
    q_ref, k_ref = _hf_reference_rope(q, k, cos, sin)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    _check(q_rot, q_ref, dtype)
    _check(k_rot, k_ref, dtype)


def test_strided_inputs_from_fused_qkv(device):
    """q and k sliced out of one fused projection (non-contiguous heads/seq strides)."""
    torch.manual_seed(1)
    b, s, hq, hk, d = 2, 17, 4, 2, 40
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device)
    q = qkv[..., : hq * d].view(b, s, hq, d)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
    assert not q.is_contiguous()
    cos, sin = hf_cos_sin(1, s, d, device)  # batch-broadcast cos/sin
    q_rot, k_rot = apply_rotary_emb(q, k, cos, sin, heads_first=False)
    _check(q_rot, rotary_ref(q, cos, sin), torch.float32)
    _check(k_rot, rotary_ref(k, cos, sin), torch.float32)
    # 2D cos/sin (seq, rotary_dim) are accepted too
    q_rot2, _ = apply_rotary_emb(q, None, cos[0], sin[0], heads_first=False)
    torch.testing.assert_close(q_rot2, q_rot)


@pytest.mark.parametrize("interleaved", [False, True])
def test_autograd_matches_reference(device, interleaved):
    torch.manual_seed(2)
    b, s, hq, hk, d, rd = 2, 17, 4, 2, 80, 40
    q = torch.randn(b, hq, s, d, device=device, requires_grad=True)
    k = torch.randn(b, hk, s, d, device=device, requires_grad=True)
    cos, sin = hf_cos_sin(b, s, rd, device)
    q_rot, k_rot = apply_rotary_emb(q, k, cos, sin, interleaved=interleaved)
    gq, gk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    (q_rot * gq).sum().add((k_rot * gk).sum()).backward()

    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    q_ref = rotary_ref(q64.transpose(1, 2), cos, sin, interleaved).transpose(1, 2)
    k_ref = rotary_ref(k64.transpose(1, 2), cos, sin, interleaved).transpose(1, 2)
    (q_ref * gq.double()).sum().add((k_ref * gk.double()).sum()).backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.grad.double(), k64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_double_backward_matches_reference(device, interleaved):
    """Eager calls run an autograd.Function whose backward is the inverse rotation through the
    same Function, so a gradient of a gradient (create_graph=True) is the kernel too."""
    torch.manual_seed(5)
    b, s, h, d, rd = 1, 13, 3, 32, 16
    x = torch.randn(b, h, s, d, device=device, requires_grad=True)
    cos, sin = hf_cos_sin(b, s, rd, device)
    g = torch.randn(b, h, s, d, device=device, requires_grad=True)
    w = torch.randn(b, h, s, d, device=device)
    (x_rot, _) = apply_rotary_emb(x, None, cos, sin, interleaved=interleaved)
    (gx,) = torch.autograd.grad((x_rot * g).sum(), x, create_graph=True)
    (gx * w).sum().backward()  # d/dg of <R^T g, w> = R w

    x64 = x.detach().double().requires_grad_()
    ref = rotary_ref(x64.transpose(1, 2), cos, sin, interleaved).transpose(1, 2)
    (gx_ref,) = torch.autograd.grad((ref * g.detach().double()).sum(), x64)
    torch.testing.assert_close(gx.detach().double(), gx_ref, atol=1e-5, rtol=1e-5)
    expected_gg = rotary_ref(w.double().transpose(1, 2), cos, sin, interleaved).transpose(1, 2)
    torch.testing.assert_close(g.grad.double(), expected_gg, atol=1e-5, rtol=1e-5)


def test_custom_op_registration(device):
    torch.manual_seed(3)
    x = torch.randn(2, 5, 3, 16, device=device, requires_grad=True)
    cos, sin = hf_cos_sin(2, 5, 16, device)
    torch.library.opcheck(torch.ops.fa_amd.rotary_fwd.default, (x, cos, sin, False))
    torch.library.opcheck(torch.ops.fa_amd.rotary_bwd.default, (x.detach(), cos, sin, True))


def test_torch_compile_fullgraph(device):
    torch.manual_seed(4)
    q = torch.randn(2, 4, 9, 32, device=device, requires_grad=True)
    k = torch.randn(2, 2, 9, 32, device=device, requires_grad=True)
    cos, sin = hf_cos_sin(2, 9, 32, device)

    def f(q, k):
        q_rot, k_rot = apply_rotary_emb(q, k, cos, sin)
        return (q_rot.square().sum() + k_rot.sum()) * 0.5

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k)
    loss.backward()
    grads = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    f(q, k).backward()
    torch.testing.assert_close(loss, f(q, k))
    torch.testing.assert_close(grads[0], q.grad)
    torch.testing.assert_close(grads[1], k.grad)


def test_bad_inputs_raise(device):
    x = torch.randn(1, 4, 2, 16, device=device)
    cos, sin = hf_cos_sin(1, 4, 16, device)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_forward(x, cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_forward(x[..., :8], cos, sin)
    with pytest.raises(ValueError, match="broadcast"):
        rotary_forward(x, cos[:, :3], sin[:, :3])
    with pytest.raises(TypeError, match="float16"):
        apply_rotary_emb(x.to(torch.int32), None, cos, sin)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        hf_apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary_emb(x, None, cos.requires_grad_(), sin)
