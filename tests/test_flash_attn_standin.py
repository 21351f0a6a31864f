"""fa_amd's `flash_attn` stand-in: everything commonly imported from flash-attn 2.x resolves to
working code (private interface functions, bert_padding, layers.rotary, ops.triton.rotary, the
layer-norm / RMS-norm / cross-entropy / activation entry points), checked against float64
references; Transformers' is_flash_attn_2_available() answers True where fa_amd runs."""
import pytest
import torch
import torch.nn.functional as F

import fa_amd
from fa_amd.integrations import flash_attn_shim
from fa_amd.reference import attention_ref

from .test_rotary_flash import reference as rotary_reference
from .test_rotary_flash import tables

pytest.importorskip("transformers")

# module -> names libraries import from it
COMMON_IMPORTS = {
    "flash_attn": ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
                   "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
                   "flash_attn_with_kvcache", "__version__"],
    "flash_attn.flash_attn_interface": ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                                        "_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                                        "_flash_attn_varlen_backward", "_wrapped_flash_attn_forward",
                                        "_wrapped_flash_attn_varlen_forward"],
    "flash_attn.bert_padding": ["unpad_input", "pad_input", "index_first_axis", "index_put_first_axis",
                                "unpad_input_for_concatenated_sequences"],
    "flash_attn.layers.rotary": ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_qkv_",
                                 "apply_rotary_emb_kv_", "apply_rotary_emb_torch", "RotaryEmbedding"],
    "flash_attn.ops.triton.rotary": ["apply_rotary"],
    "flash_attn.ops.triton.layer_norm": ["layer_norm_fn", "rms_norm_fn", "RMSNorm", "layer_norm_ref",
                                         "rms_norm_ref", "layer_norm_linear_fn"],
    "flash_attn.ops.layer_norm": ["dropout_add_layer_norm", "DropoutAddLayerNorm", "layer_norm"],
    "flash_attn.ops.rms_norm": ["rms_norm", "RMSNorm", "dropout_add_rms_norm", "DropoutAddRMSNorm"],
    "flash_attn.ops.triton.cross_entropy": ["cross_entropy_loss", "CrossEntropyLoss"],
    "flash_attn.losses.cross_entropy": ["CrossEntropyLoss"],
    "flash_attn.ops.activations": ["swiglu", "gelu_fwd", "gelu_bwd", "sqrelu_fwd", "bias_gelu"],
}


@pytest.fixture(scope="module")
def fa():
    """The stand-in, installed for this module's tests (a real flash-attn would be used instead)."""
    import importlib

    if not flash_attn_shim.install_flash_attn_shim():
        pytest.skip("a real flash-attn is installed")
    yield lambda name: importlib.import_module(name)
    flash_attn_shim.uninstall_flash_attn_shim()


def test_common_imports_resolve_and_unserved_modules_stay_absent(fa):
    for module, names in COMMON_IMPORTS.items():
        mod = fa(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{module} lacks {missing}"
    # no stubs where fa_amd serves nothing: a library's `except ImportError` fallback still runs
    for absent in ("flash_attn.modules.mha", "flash_attn.ops.fused_dense", "flash_attn_2_cuda"):
        with pytest.raises(ImportError):
            fa(absent)


def test_is_flash_attn_2_available_wherever_fa_amd_runs(fa):
    import transformers.modeling_flash_attention_utils as mfu
    from transformers.utils import is_flash_attn_2_available
    from transformers.utils import import_utils

    assert import_utils.is_flash_attn_2_available() and mfu.is_flash_attn_available()
    from transformers.utils import is_flash_attn_2_available as again
    assert again() and is_flash_attn_2_available is again


def _qkv(device, b=2, sq=11, sk=11, hq=4, hk=2, d=16, dtype=torch.float32, varlen=False):
    torch.manual_seed(0)
    shape = (lambda s, h: (b * s, h, d)) if varlen else (lambda s, h: (b, s, h, d))
    return (torch.randn(shape(sq, hq), device=device, dtype=dtype), torch.randn(shape(sk, hk), device=device,
            dtype=dtype), torch.randn(shape(sk, hk), device=device, dtype=dtype))


def test_private_forward_backward_match_reference(fa, device):
    iface = fa("flash_attn.flash_attn_interface")
    q, k, v = (x.requires_grad_() for x in _qkv(device, sk=13))
    out, lse, s_dmask, rng_state = iface._flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, None, True,
                                                             -1, -1, 0.0, None, False)
    assert rng_state.shape == (2,) and s_dmask.numel() == 0
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = iface._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, 0.0,
                                           q.shape[-1] ** -0.5, True, -1, -1, 0.0, None, False, rng_state)
    grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for got, want in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).transpose(1, 2))


def test_private_varlen_and_dropout_rng_state(fa, device):
    iface = fa("flash_attn.flash_attn_interface")
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)  # an empty sequence in the middle
    q, k, v = (x[:11] for x in _qkv(device, b=1, sq=11, varlen=True))
    out, lse, _, rng_state = iface._flash_attn_varlen_forward(q, k, v, cu, cu, 7, 7, 0.0, None, True)
    assert lse.shape == (4, 11)
    # max_seqlen as Transformers passes it for packed sequences (cu.diff().max(), a 0-d tensor), as flash-attn takes it
    longest = cu.diff().max()
    assert torch.equal(iface._flash_attn_varlen_forward(q, k, v, cu, cu, longest, longest, 0.0, None, True)[0], out)
    assert torch.equal(fa("flash_attn").flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True), out)
    for s, e in ((0, 4), (4, 11)):
        ref, _ = attention_ref(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)
        torch.testing.assert_close(out[s:e].double(), ref[0], atol=1e-5, rtol=1e-5)
    # dropout: the rng_state the forward returned gives the backward the same mask as fa_amd's own autograd
    q, k, v = _qkv(device, b=1, sq=9, sk=9)
    torch.manual_seed(7)
    out, lse, _, rng_state = iface._flash_attn_forward(q, k, v, 0.3, None, False, -1, -1, 0.0, None, False)
    dout = torch.randn_like(out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    iface._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.3, None, False, -1, -1, 0.0, None, False,
                               rng_state)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    same = fa_amd.flash_attn_func(*leaves, dropout_p=0.3)
    torch.testing.assert_close(same.detach(), out)
    same.backward(dout)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)
    with pytest.raises(ValueError, match="rng_state"):
        iface._flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.3, None, False)


def test_private_backward_checks_the_callers_tensors(fa, device):
    # ring attention passes its own out / lse / dout to the private backward: a short lse was read (and its delta
    # twin written) past its end; wrong dtypes reached the kernels; bad cu_seqlens gave wrong gradients
    iface = fa("flash_attn.flash_attn_interface")
    q, k, v = _qkv(device, b=1, sq=9, sk=9)
    out, lse, _, _ = iface._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    dout = torch.randn_like(out)
    bad = [(dict(softmax_lse=lse[:, :, :5]), ValueError, "softmax_lse must have shape"),
           (dict(softmax_lse=lse.transpose(1, 2)), ValueError, "softmax_lse must have shape"),
           (dict(softmax_lse=lse.half()), TypeError, "softmax_lse must be float32"),
           (dict(dout=dout.half()), TypeError, "dout must have q's dtype"),
           (dict(dout=dout[:, :5]), ValueError, "dout must have q's shape"),
           (dict(out=out[:, :5]), ValueError, "out must have q's shape")]
    args = dict(dout=dout, out=out, softmax_lse=lse)
    for change, exc, match in bad:
        call = dict(args, **change)
        with pytest.raises(exc, match=match):
            iface._flash_attn_backward(call["dout"], q, k, v, call["out"], call["softmax_lse"], None, None, None,
                                       0.0, None, True)
    # an lse view with strided rows is taken (made contiguous), with the same gradients
    wide = torch.zeros(lse.shape[0], lse.shape[1], 2 * lse.shape[2], device=device)
    wide[..., ::2] = lse
    grads = [torch.empty_like(t) for t in (q, k, v)]
    grads_view = [torch.empty_like(t) for t in (q, k, v)]
    iface._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, None, True)
    iface._flash_attn_backward(dout, q, k, v, out, wide[..., ::2], *grads_view, 0.0, None, True)
    for a, b in zip(grads, grads_view):
        assert torch.equal(a, b)
    # varlen: the forward's cu_seqlens checks, values included
    qv, kv, vv = (x[0] for x in (q, k, v))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    out_v, lse_v, _, _ = iface._flash_attn_varlen_forward(qv, kv, vv, cu, cu, 5, 5, 0.0, None, True)
    for cu_bad, max_len, exc, match in ((cu.long(), 5, TypeError, "cu_seqlens_q must be int32"),
                                        (torch.tensor([0, 6, 4], dtype=torch.int32, device=device), 6, ValueError,
                                         "non-decreasing"),
                                        (cu, 3, ValueError, "max_seqlen_q = 3 is smaller")):
        with pytest.raises(exc, match=match):
            iface._flash_attn_varlen_backward(out_v, qv, kv, vv, out_v, lse_v, None, None, None, cu_bad, cu_bad,
                                              max_len, max_len, 0.0, None, True)


def test_bert_padding(fa, device):
    bp = fa("flash_attn.bert_padding")
    x = torch.randn(2, 5, 3, device=device)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], device=device)
    tokens, indices, cu, max_len, used = bp.unpad_input(x, mask)
    assert tokens.shape == (7, 3) and cu.tolist() == [0, 3, 7] and max_len == 4 and used.tolist() == [3, 4]
    back = bp.pad_input(tokens, indices, 2, 5)
    torch.testing.assert_close(back, x * mask[..., None])
    lengths = torch.tensor([[2, 3, 0, 0, 0], [5, 0, 0, 0, 0]], device=device)
    tokens, indices, cu, max_len = bp.unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 10] and max_len == 5 and tokens.shape == (10, 3)


def test_rotary_embedding_module(fa, device):
    rot = fa("flash_attn.layers.rotary")
    torch.manual_seed(1)
    b, s, h, d = 2, 6, 2, 16
    # qkv (b, s, 3, h, d) in place, int offset; then GQA layout (b, s, hq + 2 hk, d) with XPos scaling
    emb = rot.RotaryEmbedding(d).to(device)
    qkv = torch.randn(b, s, 3, h, d, device=device)
    expected = qkv.clone()
    assert emb(qkv, seqlen_offset=2) is qkv
    emb._update_cos_sin_cache(s + 2, device=device, dtype=qkv.dtype)
    for i in (0, 1):
        expected[:, :, i] = rotary_reference(expected[:, :, i], emb._cos_cached, emb._sin_cached, offsets=2).float()
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)
    xpos = rot.RotaryEmbedding(d, scale_base=512, interleaved=True).to(device)
    fused = torch.randn(b, s, 4 + 2 * 2, d, device=device, requires_grad=True)
    work = fused * 1.0
    xpos(work, num_heads_q=4)
    cos, sin, cos_k, sin_k = xpos._cos_cached, xpos._sin_cached, xpos._cos_k_cached, xpos._sin_k_cached
    torch.testing.assert_close(work[:, :, :4], rotary_reference(fused[:, :, :4].detach(), cos, sin, True).float())
    torch.testing.assert_close(work[:, :, 4:6], rotary_reference(fused[:, :, 4:6].detach(), cos_k, sin_k, True).float())
    torch.testing.assert_close(work[:, :, 6:], fused[:, :, 6:].detach())
    work.sum().backward()  # in place under autograd: gradients flow through the rotation
    assert torch.isfinite(fused.grad).all() and not torch.equal(fused.grad[:, :, :4], torch.ones_like(fused.grad[:, :, :4]))
    # q + kv, and the plain-torch function agrees with the fused one
    q, kv = torch.randn(b, s, h, d, device=device), torch.randn(b, s, 2, h, d, device=device)
    q_ref = rot.apply_rotary_emb_torch(q, *tables(s, d, device))
    k_ref = rot.apply_rotary_emb_torch(kv[:, :, 0], *tables(s, d, device))
    q2, kv2 = rot.RotaryEmbedding(d).to(device)(q, kv=kv)
    torch.testing.assert_close(q2, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv2[:, :, 0], k_ref, atol=1e-5, rtol=1e-5)


def _norm_ref(x, w, b, eps, rms):
    x = x.double()
    if rms:
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    else:
        y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    y = y * w.double()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("rms", [False, True])
def test_layer_norm_fn_matches_float64(fa, device, rms):
    ln = fa("flash_attn.ops.triton.layer_norm")
    torch.manual_seed(2)
    x = torch.randn(3, 5, 24, device=device, dtype=torch.float16, requires_grad=True)
    res = torch.randn(3, 5, 24, device=device, dtype=torch.float16)
    w = torch.randn(24, device=device, requires_grad=True)
    b = None if rms else torch.randn(24, device=device)
    rowscale = torch.rand(3, 5, device=device)
    fn = ln.rms_norm_fn if rms else ln.layer_norm_fn
    y, new_res = fn(x, w, b, residual=res, eps=1e-5, rowscale=rowscale, prenorm=True, zero_centered_weight=True)
    summed = x.double() * rowscale.double()[..., None] + res.double()
    expected = _norm_ref(summed, w + 1.0, b, 1e-5, rms)
    assert y.dtype == torch.float16 and new_res.dtype == torch.float16
    torch.testing.assert_close(y.double(), expected, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(new_res.double(), summed, atol=3e-3, rtol=3e-3)
    g = torch.randn_like(expected)
    (y.double() * g).sum().backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (_norm_ref(xr * rowscale.double()[..., None] + res.double(), wr + 1.0, b, 1e-5, rms) * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=1e-2, rtol=1e-2)  # through fp16 outputs
    # dropout with the mask returned, a second weight (parallel output), residual_in_fp32, out_dtype
    x1 = torch.randn_like(x)
    y, y1, r, mask, mask1 = ln.layer_norm_fn(x, w, b, x1=x1, weight1=w * 2, bias1=b, eps=1e-5, dropout_p=0.25,
                                             prenorm=True, residual_in_fp32=True, is_rms_norm=rms,
                                             return_dropout_mask=True, out_dtype=torch.float32)
    assert r.dtype == torch.float32 and y.dtype == torch.float32 and mask.dtype == torch.bool
    kept = torch.where(mask, x.double() / 0.75, 0) + torch.where(mask1, x1.double() / 0.75, 0)
    torch.testing.assert_close(r.double(), kept, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(y1.double(), _norm_ref(kept, w * 2, b, 1e-5, rms), atol=1e-3, rtol=1e-3)


def test_legacy_norms_and_modules(fa, device):
    lnm, rmsm, tln = fa("flash_attn.ops.layer_norm"), fa("flash_attn.ops.rms_norm"), fa("flash_attn.ops.triton.layer_norm")
    x = torch.randn(4, 16, device=device)
    w, b = torch.randn(16, device=device), torch.randn(16, device=device)
    torch.testing.assert_close(lnm.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (16,), w, b, 1e-5), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(rmsm.rms_norm(x, w, 1e-5).double(), _norm_ref(x, w, None, 1e-5, True), atol=1e-5,
                               rtol=1e-5)
    z, mask = lnm.dropout_add_layer_norm(x, x, w, b, 0.0, 1e-5, return_dropout_mask=True)
    assert mask.dtype == torch.uint8 and mask.all()
    for module in (rmsm.RMSNorm(16), rmsm.DropoutAddRMSNorm(16), tln.RMSNorm(16), lnm.DropoutAddLayerNorm(16)):
        assert torch.isfinite(module.to(device)(x)).all()
    with pytest.raises(NotImplementedError, match="dropout_add_rms_norm_subset"):
        rmsm.dropout_add_rms_norm_subset(x, None, w, None, 0.0, 1e-5)


def test_cross_entropy(fa, device):
    ce_mod, ce_triton = fa("flash_attn.losses.cross_entropy"), fa("flash_attn.ops.triton.cross_entropy")
    torch.manual_seed(3)
    logits = torch.randn(6, 11, device=device, requires_grad=True)
    labels = torch.tensor([1, 5, -100, 10, 0, 3], device=device)
    for smoothing in (0.0, 0.1):
        loss = ce_mod.CrossEntropyLoss(label_smoothing=smoothing)(logits, labels)
        torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=smoothing))
    losses, z = ce_triton.cross_entropy_loss(logits, labels, logit_scale=0.5, lse_square_scale=1e-2)
    lse = torch.logsumexp(0.5 * logits.double(), -1)
    want = F.cross_entropy(0.5 * logits.double(), labels, reduction="none") + 1e-2 * lse.square()
    torch.testing.assert_close(losses.double(), torch.where(labels != -100, want, 0.0))
    torch.testing.assert_close(z.double(), torch.where(labels != -100, 1e-2 * lse.square(), 0.0))
    total, z_total = ce_mod.CrossEntropyLoss(reduction="sum", lse_square_scale=1e-2, return_z_loss=True)(logits, labels)
    total.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[2].abs().sum() == 0  # ignored row
    with pytest.raises(NotImplementedError, match="process_group"):
        ce_triton.cross_entropy_loss(logits, labels, process_group=object())


def test_activations(fa, device):
    act = fa("flash_attn.ops.activations")
    x, y = torch.randn(5, 8, device=device, requires_grad=True), torch.randn(5, 8, device=device)
    torch.testing.assert_close(act.swiglu(x, y), F.silu(x) * y)
    torch.testing.assert_close(act.gelu_fwd(x), F.gelu(x, approximate="tanh"))
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(F.gelu(x, approximate="tanh"), x, g)
    torch.testing.assert_close(act.gelu_bwd(g, x.detach()), grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(act.sqrelu_fwd(x), F.relu(x) ** 2)


def test_private_forward_return_softmax_needs_dropout(fa, device):
    """flash-attn's C++ forward refuses return_softmax without dropout (audit 2026-11-29: the stand-in built the
    probabilities anyway)."""
    iface = fa("flash_attn.flash_attn_interface")
    q, k, v = _qkv(device, sk=13)
    with pytest.raises(ValueError, match="return_softmax=True needs dropout_p > 0"):
        iface._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, True)
    qv, kv, vv = _qkv(device, sq=7, sk=7, varlen=True)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="return_softmax=True needs dropout_p > 0"):
        iface._flash_attn_varlen_forward(qv, kv, vv, cu, cu, 7, 7, 0.0, None, True, return_softmax=True)
