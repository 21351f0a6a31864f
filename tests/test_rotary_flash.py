"""fa_amd's fused rotary with flash-attn's conventions (flash_attn.ops.triton.rotary.apply_rotary,
flash_attn.layers.rotary.apply_rotary_emb): half tables, seqlen offsets (int or per sequence),
varlen, partial rotary, interleaved, in place, conjugate; vs a float64 reference."""
import pytest
import torch

from fa_amd.kernels import launch
from fa_amd.kernels.rotary import apply_rotary, flash_apply_rotary_emb

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tables(seqlen_ro, rotary_dim, device, dtype=torch.float32):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv_freq
    return freqs.cos().to(device=device, dtype=dtype), freqs.sin().to(device=device, dtype=dtype)


def reference(x, cos, sin, interleaved=False, offsets=0, cu_seqlens=None, conjugate=False):
    """float64: token t of sequence b uses table row t + offset[b]; rows outside the table stay unrotated."""
    x = x.double()
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen)[None, :].repeat(batch, 1)
        seq_of = torch.arange(batch)[:, None].expand(batch, seqlen)
    else:
        bounds = cu_seqlens.tolist()
        pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])
        seq_of = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])
    off = offsets.cpu().long()[seq_of] if isinstance(offsets, torch.Tensor) else offsets
    pos = pos + off
    inside = (pos >= 0) & (pos < cos.shape[0])
    c = torch.where(inside[..., None], cos.double().cpu()[pos.clamp(0, cos.shape[0] - 1)], 1.0).to(x.device)
    s = torch.where(inside[..., None], sin.double().cpu()[pos.clamp(0, cos.shape[0] - 1)], 0.0).to(x.device)
    c, s = c.unsqueeze(-2), (-s if conjugate else s).unsqueeze(-2)
    rd = 2 * cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([y, rest], dim=-1)


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def _close(actual, expected, dtype):
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,interleaved,head_dim,rotary_dim,offset", [
    (torch.float32, False, 32, 32, 0), (torch.float32, True, 40, 24, 5), (torch.float16, False, 59, 16, 3),
    (torch.float16, True, 64, 64, 2),
    pytest.param(torch.bfloat16, False, 128, 64, 7, marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, True, 256, 256, 1, marks=pytest.mark.gpu)])
def test_dense_int_offsets_partial_rotary(device, dtype, interleaved, head_dim, rotary_dim, offset, poison):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, head_dim, device=device, dtype=dtype)
    cos, sin = tables(7 + offset + 2, rotary_dim, device, dtype)
    out = apply_rotary(x, cos, sin, seqlen_offsets=offset, interleaved=interleaved)
    _close(out, reference(x, cos, sin, interleaved, offset), dtype)
    back = apply_rotary(out, cos, sin, seqlen_offsets=offset, interleaved=interleaved, conjugate=True)
    _close(back, x.double(), dtype)


def test_tensor_offsets_varlen_and_out_of_table_positions(device, poison):
    torch.manual_seed(1)
    cos, sin = tables(12, 16, device)
    # per-sequence offsets; the second sequence runs past the table and a negative offset starts before it:
    # those positions are left unrotated, and nothing outside the table is read
    x = torch.randn(3, 6, 2, 24, device=device)
    offsets = torch.tensor([0, 9, -2], dtype=torch.int32, device=device)
    _close(apply_rotary(x, cos, sin, seqlen_offsets=offsets), reference(x, cos, sin, offsets=offsets), torch.float32)
    # varlen: (total, h, d) with an empty sequence, positions restart at each start
    cu = torch.tensor([0, 5, 5, 11, 14], dtype=torch.int32, device=device)
    xv = torch.randn(14, 2, 24, device=device)
    out = apply_rotary(xv, cos, sin, cu_seqlens=cu, max_seqlen=6, interleaved=True)
    _close(out, reference(xv, cos, sin, True, cu_seqlens=cu), torch.float32)
    offs = torch.tensor([1, 0, 3, 4], dtype=torch.int64, device=device)
    out = apply_rotary(xv, cos, sin, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=6)
    _close(out, reference(xv, cos, sin, offsets=offs, cu_seqlens=cu), torch.float32)


def test_inplace_and_autograd(device, poison):
    torch.manual_seed(2)
    cos, sin = tables(9, 16, device)
    x = torch.randn(2, 9, 3, 20, device=device)
    expected = reference(x, cos, sin)
    y = x.clone()
    assert apply_rotary(y, cos, sin, inplace=True) is y
    _close(y, expected, torch.float32)  # the 4 pass-through features stayed in place
    # autograd, also in place on a non-leaf view (a fused qkv slice)
    base = torch.randn(2, 9, 3, 3, 20, device=device, requires_grad=True)
    qkv = base * 1.0
    out = flash_apply_rotary_emb(qkv[:, :, 0], cos, sin, inplace=True)
    _close(qkv[:, :, 0].detach(), reference(base[:, :, 0].detach(), cos, sin), torch.float32)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    ref_grad = reference(g, cos, sin, conjugate=True)
    _close(base.grad[:, :, 0], ref_grad, torch.float32)
    assert torch.equal(base.grad[:, :, 1:], torch.zeros_like(base.grad[:, :, 1:]))
    # varlen + offsets through autograd
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    xv = torch.randn(9, 2, 16, device=device, requires_grad=True)
    out = flash_apply_rotary_emb(xv, cos[:7], sin[:7], interleaved=True, seqlen_offsets=2, cu_seqlens=cu,
                                 max_seqlen=5)
    _close(out.detach(), reference(xv.detach(), cos[:7], sin[:7], True, 2, cu), torch.float32)
    out.backward(g.reshape(-1)[: out.numel()].view_as(out))
    _close(xv.grad, reference(g.reshape(-1)[: out.numel()].view_as(out), cos[:7], sin[:7], True, 2, cu, True),
           torch.float32)


def test_torch_compile_fullgraph_flash_rotary(device):
    torch.manual_seed(3)
    cos, sin = tables(10, 16, device)
    x = torch.randn(2, 6, 2, 16, device=device, requires_grad=True)
    offsets = torch.tensor([0, 4], dtype=torch.int32, device=device)

    def f(x):
        return flash_apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets).square().sum()

    torch._dynamo.reset()
    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    loss.backward()
    grad = x.grad.clone()
    x.grad = None
    f(x).backward()
    torch.testing.assert_close(grad, x.grad)
    torch._dynamo.reset()


def test_bad_inputs_raise(device):
    cos, sin = tables(8, 16, device)
    x = torch.randn(1, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="outside the 8 rows"):
        apply_rotary(x, cos, sin, seqlen_offsets=1)
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary(x[0], cos, sin, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(x[..., :8], cos, sin)
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary(x, cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="seqlen_offsets"):
        apply_rotary(x, cos, sin, seqlen_offsets=1.5)
    with pytest.raises(TypeError, match="float16"):
        apply_rotary(x.to(torch.int32), cos, sin)


def test_inplace_on_leaves_that_require_grad_as_flash_attn(device, poison):
    """flash-attn's own tests rotate leaves that require grad in place (the rotation runs inside its autograd
    Function); autograd refuses a plain in-place write to them (audit 2026-11-28: a RuntimeError here).  The
    leaf's memory holds the rotation and its gradient is the conjugate rotation, for x, a view of one, and the
    stand-in's packed qkv / kv helpers."""
    from fa_amd.integrations import flash_attn_compat as fa

    torch.manual_seed(4)
    cos, sin = tables(7, 12, device)
    x = torch.randn(2, 7, 3, 16, device=device, requires_grad=True)
    before = x.detach().clone()
    out = flash_apply_rotary_emb(x, cos, sin, interleaved=True, inplace=True)
    _close(x.detach(), reference(before, cos, sin, True), torch.float32)  # rotated in place
    g = torch.randn_like(out)
    out.backward(g)
    _close(x.grad, reference(g, cos, sin, True, conjugate=True), torch.float32)

    qkv = torch.randn(2, 7, 3, 2, 16, device=device, requires_grad=True)
    before = qkv.detach().clone()
    out = fa.apply_rotary_emb_qkv_(qkv, cos, sin)
    out.backward(g.unsqueeze(2).expand(-1, -1, 3, -1, -1)[..., :2, :])
    for i in range(2):  # q and k rotated, v as it was; gradients through the conjugate rotation
        _close(qkv.detach()[:, :, i], reference(before[:, :, i], cos, sin), torch.float32)
        _close(qkv.grad[:, :, i], reference(g[..., :2, :], cos, sin, conjugate=True), torch.float32)
    assert torch.equal(qkv.detach()[:, :, 2], before[:, :, 2])
    assert torch.equal(qkv.grad[:, :, 2], g[..., :2, :])

    kv = torch.randn(2, 7, 2, 3, 16, device=device, requires_grad=True)
    out = fa.apply_rotary_emb_kv_(kv, cos, sin)
    out.sum().backward()
    _close(kv.grad[:, :, 0], reference(torch.ones_like(g), cos, sin, conjugate=True), torch.float32)


def test_xpos_tables_of_a_module_cast_to_bf16(device):
    """RotaryEmbedding with scale_base (XPos) computes its scale in fp32 even after the module was cast to
    bf16 (audit 2026-11-28: the bf16 scale buffer put 1.1 % errors into the tables at 1000 tokens)."""
    from fa_amd.integrations import flash_attn_compat as fa

    full = fa.RotaryEmbedding(64, scale_base=512.0, device=device)
    cast = fa.RotaryEmbedding(64, scale_base=512.0, device=device).to(torch.bfloat16)
    for module in (full, cast):
        module._update_cos_sin_cache(1000, torch.device(device), torch.bfloat16)
    assert cast.scale.dtype == torch.bfloat16
    assert torch.equal(cast._cos_k_cached, full._cos_k_cached) and torch.equal(cast._cos_cached, full._cos_cached)
