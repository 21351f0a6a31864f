"""The public custom ops (torch.ops.fa_amd.attention_fwd / attention_bwd) take the layouts their
callers hand them: a head dim with a stride and non-contiguous cu_seqlens.  Besides fa_amd.interface
(which copies those first), the flash_attn stand-in's private `_flash_attn_forward` /
`_flash_attn_backward` / `_flash_attn_varlen_*` call the ops directly, as ring-attention libraries
use them -- flash-attn's own versions copy such tensors (`maybe_contiguous`).  The kernels address
the head dim with unit stride and read cu_seqlens as contiguous, so before the ops copied them the
results were silently wrong (errors ~1-5 on unit-variance data)."""
import pytest
import torch

from fa_amd.reference import attention_ref, attention_varlen_ref

from .helpers import EPS


def _assert_close(name, got, ref64, dtype):
    err = (got.double() - ref64).abs().max().item()
    # fp16 rounding of O(1) outputs / gradients over a handful of keys; the bug gave errors of O(1)
    bound = (2e-2 if dtype == torch.float16 else 1e-5) + EPS[dtype]
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.1e}"


def _strided(t):
    """t's values in a tensor whose head dim has stride 2 (last dim not contiguous)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    view = wide[..., ::2]
    assert view.stride(-1) == 2 and torch.equal(view, t)
    return view


@pytest.mark.parametrize("which", ["q", "k", "v", "dout", "out"])
def test_attention_ops_take_a_strided_head_dim(device, which):
    torch.manual_seed(0)
    dtype, scale = torch.float16, 0.3
    q, k, v = (torch.randn(2, s, 2, 16, dtype=dtype, device=device) for s in (7, 5, 5))
    args = dict(q=q, k=k, v=v)
    if which in args:
        args[which] = _strided(args[which])
    fwd = (None, None, 7, 5, 0.0, scale, -1, -1, 0.0, None, None, False, False)
    out, lse, _ = torch.ops.fa_amd.attention_fwd(args["q"], args["k"], args["v"], *fwd)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, causal=False, softmax_scale=scale)
    _assert_close("out", out, ref, dtype)
    _assert_close("lse", lse, ref_lse, torch.float32)
    dout = torch.randn_like(out)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    out_arg = _strided(out) if which == "out" else out
    dout_arg = _strided(dout) if which == "dout" else dout
    grads = torch.ops.fa_amd.attention_bwd(dout_arg, args["q"], args["k"], args["v"], out_arg, lse, None, None, 7,
                                           5, 0.0, scale, -1, -1, 0.0, None, None, False)
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], ref_grads):
        _assert_close(name, got, want, dtype)


def test_flash_attn_private_backward_with_a_strided_q(device):
    from fa_amd.integrations.flash_attn_compat import _flash_attn_backward, _flash_attn_forward

    torch.manual_seed(1)
    dtype = torch.float16
    q = _strided(torch.randn(2, 7, 2, 16, dtype=dtype, device=device))
    k, v = (torch.randn(2, 5, 2, 16, dtype=dtype, device=device) for _ in range(2))
    out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.3, True, -1, -1, 0.0, None, False, rng_state)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=True, softmax_scale=0.3)
    _assert_close("out", out, ref, dtype)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), torch.autograd.grad(ref, leaves, dout.double())):
        _assert_close(name, got, want, dtype)


def test_flash_attn_private_varlen_with_non_contiguous_cu_seqlens(device):
    from fa_amd.integrations.flash_attn_compat import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    torch.manual_seed(2)
    dtype = torch.float16
    q, k, v = (torch.randn(9, 2, 16, dtype=dtype, device=device) for _ in range(3))
    cu = torch.tensor([0, -1, 4, -1, 9, -1], dtype=torch.int32, device=device)[::2]  # [0, 4, 9], stride 2
    assert not cu.is_contiguous()
    out, lse, _, rng_state = _flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.0, 0.25, True)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_varlen_ref(*leaves, cu.contiguous(), cu.contiguous(), causal=True, softmax_scale=0.25)
    _assert_close("out", out, ref, dtype)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu, cu, 5, 5, 0.0, 0.25, True,
                                rng_state=rng_state)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), torch.autograd.grad(ref, leaves, dout.double())):
        _assert_close(name, got, want, dtype)


def test_flash_attn_private_varlen_refuses_cu_seqlens_of_different_lengths(device):
    """A cu_seqlens_k shorter than cu_seqlens_q was read past its end (silently: zeros or garbage for the
    later sequences); the ops now refuse it, as flash_attn_varlen_func does."""
    from fa_amd.integrations.flash_attn_compat import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    dtype = torch.float16
    q, k, v = (torch.randn(9, 2, 16, dtype=dtype, device=device) for _ in range(3))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 9, 0.0, 0.25, False)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_q, 5, 5, 0.0, 0.25, False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        _flash_attn_varlen_backward(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 5, 9, 0.0,
                                    0.25, False)


def test_flash_attn_private_varlen_forward_takes_paged_kv(device):
    """flash-attn's private `_flash_attn_varlen_forward(..., block_table=, seqused_k=, num_splits=)` (upstream's
    test_flash_attn_varlen_paged_kv_num_splits calls it so) runs fa_amd's paged varlen path: the public
    function's output and lse, flash-attn's 4-tuple, num_splits=0 the default, explicit splits close to it."""
    import fa_amd
    from fa_amd.integrations.flash_attn_compat import _flash_attn_varlen_forward

    torch.manual_seed(5)
    dtype, page, hq, hk, d = torch.float16, 16, 4, 2, 32
    kv_lens = [19, 40]
    pages_per_seq = 3
    k_cache, v_cache = (torch.randn(2 * pages_per_seq, page, hk, d, dtype=dtype, device=device) for _ in range(2))
    block_table = torch.randperm(2 * pages_per_seq, device=device).to(torch.int32).view(2, pages_per_seq)
    q = torch.randn(2, hq, d, dtype=dtype, device=device)
    cu_q = torch.arange(3, dtype=torch.int32, device=device)
    seqused_k = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    cu_k = torch.nn.functional.pad(seqused_k.cumsum(0), (1, 0)).to(torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=max(kv_lens), dropout_p=0.0,
              softmax_scale=d ** -0.5, causal=False, window_size_left=-1, window_size_right=0,
              block_table=block_table, seqused_k=seqused_k)
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(q, k_cache, v_cache, **kw)
    assert lse.shape == (hq, 2) and lse.dtype == torch.float32 and s_dmask.numel() == 0
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    public, public_lse, _ = fa_amd.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, 1, max(kv_lens), softmax_scale=d ** -0.5, window_size=(-1, 0),
        block_table=block_table, seqused_k=seqused_k, return_attn_probs=True)
    assert torch.equal(out, public) and torch.equal(lse, public_lse)
    assert torch.equal(_flash_attn_varlen_forward(q, k_cache, v_cache, **kw, num_splits=0)[0], out)
    # float64 reference: each sequence's first kv_lens[b] keys, gathered from its pages
    for b, n in enumerate(kv_lens):
        keys = [k_cache[block_table[b, j // page], j % page] for j in range(n)]
        vals = [v_cache[block_table[b, j // page], j % page] for j in range(n)]
        ref, _ = attention_ref(q[b:b + 1, None].double(), torch.stack(keys)[None].double(),
                               torch.stack(vals)[None].double(), softmax_scale=d ** -0.5)
        _assert_close(f"out[{b}]", out[b:b + 1, None], ref, dtype)
        split = _flash_attn_varlen_forward(q, k_cache, v_cache, **kw, num_splits=3)[0]
        _assert_close(f"out[{b}], 3 splits", split[b:b + 1, None], ref, dtype)
    with pytest.raises(ValueError, match="num_splits"):
        _flash_attn_varlen_forward(q, k_cache, v_cache, **kw, num_splits=-1)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        _flash_attn_varlen_forward(q, k_cache, v_cache, **kw, leftpad_k=torch.zeros_like(seqused_k))
