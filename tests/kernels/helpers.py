"""Shared pieces of the kernel tests: input makers and the flash-attn style
tolerance check (kernel error vs a float64 reference must be at most twice
the error of the same computation done by PyTorch in the inputs' precision,
plus a small epsilon)."""
from __future__ import annotations

import functools

import torch

import fa_amd
from fa_amd.reference import attention_ref, attention_varlen_ref

# per-dtype epsilon added to 2x the PyTorch same-precision error, relative to
# the reference's magnitude.  fp32 gets more room: a flash kernel rebuilds P as
# exp2(s*log2e - lse*log2e), which in fp32 costs ~|s| * 2^-24 relative error that
# PyTorch's two-pass fp32 softmax does not pay, while its own fp32 error is ~1e-7.
EPS = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def randn(*shape, dtype, device, requires_grad=True):
    x = torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)
    return x.requires_grad_(requires_grad)


def dense_qkv(device, dtype, b, sq, sk, hq, hk, d):
    """Fresh random q (b, sq, hq, d) and k, v (b, sk, hk, d) that require grad."""
    return (randn(b, sq, hq, d, dtype=dtype, device=device), randn(b, sk, hk, d, dtype=dtype, device=device),
            randn(b, sk, hk, d, dtype=dtype, device=device))


def assert_close_to_ref(name, got, ref64, ref_lowp, dtype):
    assert not torch.isnan(got).any(), f"{name}: NaN in kernel output (unwritten element?)"
    err = (got.double() - ref64).abs().max().item()
    err_pt = (ref_lowp.double() - ref64).abs().max().item()
    bound = 2 * err_pt + EPS[dtype] * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3e} > 2 x PyTorch {dtype} error {err_pt:.3e} + eps"


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout, allow_unused=False)


def _compare(fa_fn, ref_fn, q, k, v, dout, check_grads):
    """Run fa_fn(q, k, v) and ref_fn in float64 and in the inputs' dtype; assert output and grads."""
    out = fa_fn(q, k, v)
    if isinstance(out, tuple):
        out = out[0]
    return compare_output(out, ref_fn, q, k, v, dout, check_grads)


def compare_output(out, ref_fn, q, k, v, dout=None, check_grads=True):
    """A kernel output already computed from q, k, v (e.g. with a dropout mask that ref_fn
    then reuses) vs ref_fn in float64 and in the inputs' dtype: output and gradients."""
    dtype = q.dtype
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    leaves_lp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref64, _ = ref_fn(*leaves64)
    ref_lp, _ = ref_fn(*leaves_lp, upcast=False)
    assert_close_to_ref("out", out, ref64, ref_lp, dtype)
    if not check_grads:
        return out
    if dout is None:
        dout = torch.randn_like(out)
    g = grads(out, (q, k, v), dout)
    g64 = grads(ref64, leaves64, dout.double())
    g_lp = grads(ref_lp, leaves_lp, dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), g, g64, g_lp):
        assert_close_to_ref(name, a, b, c, dtype)
    return out


def compare_dense(fa_fn, q, k, v, dout=None, check_grads=True, **kw):
    """Dense fa_fn(q, k, v) vs attention_ref(**kw): output and gradients within tolerance."""
    return _compare(fa_fn, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v, dout, check_grads)


def cu_seqlens(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def compare_varlen(fa_fn, q, k, v, cu_q, cu_k, dout=None, check_grads=True, **kw):
    """Varlen fa_fn(q, k, v) vs attention_varlen_ref(**kw): output and gradients within tolerance."""
    return _compare(fa_fn, lambda *x, **up: attention_varlen_ref(*x, cu_q, cu_k, **kw, **up), q, k, v, dout,
                    check_grads)


def check_varlen(device, dtype, lens_q, lens_k, hq, hk, d, deterministic=False, **kw):
    """flash_attn_varlen_func on fresh random packed inputs with these segment lengths vs the
    reference (output and gradients); kw: the attention options both take (causal, window_size, ...)."""
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = randn(sum(lens_q), hq, d, dtype=dtype, device=device)
    k = randn(sum(lens_k), hk, d, dtype=dtype, device=device)
    v = randn(sum(lens_k), hk, d, dtype=dtype, device=device)
    fn = functools.partial(fa_amd.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), deterministic=deterministic, **kw)
    return compare_varlen(fn, q, k, v, cu_q, cu_k, **kw)


def strided_descales(x):
    """Two tensors holding x's values (a (batch, heads) descale) at other strides: transposed, and every other
    column of a wider one (NaN between); (None, None) for None."""
    if x is None:
        return None, None
    wide = torch.full((x.shape[0], 2 * x.shape[1]), float("nan"), device=x.device)
    wide[:, ::2] = x
    return x.t().contiguous().t(), wide[:, ::2]


def check_dropout_alibi(device, causal: bool):
    """Dropout with ALiBi, fp32 (2, 21, 30, 2, 2, 48): output and gradients against the float64 reference under
    the dropout mask the kernels report (return_attn_probs), so the backward must regenerate the forward's."""
    dtype, p = torch.float32, 0.2
    q, k, v = dense_qkv(device, dtype, 2, 21, 30, 2, 2, 48)
    slopes = torch.rand(2, device=device) * 0.5 + 0.05
    out, _, s_dmask = fa_amd.flash_attn_func(q, k, v, dropout_p=p, alibi_slopes=slopes, return_attn_probs=True,
                                             deterministic=True, causal=causal)
    kw = dict(alibi_slopes=slopes, dropout_p=p, dropout_mask=s_dmask >= 0, causal=causal)
    compare_output(out, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v)


def table_switch_patcher(monkeypatch, device, switch: str, kernels, value=1, absent=()):
    """A function patch(value=..., **extra) that sets the kernel switch `switch` (tables.KERNEL_SWITCHES) to `value`
    in every case of every entry of the table kernels `kernels` of `device`'s family (dropped from their overrides),
    plus `extra`, and checks that the table kernels `absent` do not take it; called once here.  Outputs are
    poisoned and no tuned table is read from disk."""
    from fa_amd import tuning
    from fa_amd.arch import arch_for
    from fa_amd.kernels import launch
    from fa_amd.tuning.tables import TABLES

    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(tuning, "_overrides", lambda: {})
    arch = arch_for(torch.empty(0, device=device))
    family = tuning.family_of(arch)
    pristine = TABLES[family]

    def switched(entry, **top):  # the switch dropped from every override of the entry, `top` set at the top
        entry = {k: (switched(v) if isinstance(v, dict) else v) for k, v in entry.items()}
        entry.pop(switch, None)
        return dict(entry, **top)

    def patch(value=value, **extra):
        rows = [{k: (switched(v, **{switch: value}, **extra) if k in kernels else v) for k, v in row.items()}
                for row in pristine]
        monkeypatch.setitem(TABLES, family, rows)
        tuning._RESOLVED.clear()  # no launch plan of an earlier test
        assert tuning.get_config(arch, kernels[0], 128)[switch] == value
        assert tuning.get_config(arch, kernels[0], 128, causal=True)[switch] == value
        for kernel in absent:
            assert switch not in tuning.get_config(arch, kernel, 128)
    patch()
    return patch


def dkdv_switch_patcher(monkeypatch, device, switch: str):
    """table_switch_patcher for a dK/dV switch: set to 1 in every dK/dV entry, absent from the dQ kernel's."""
    return table_switch_patcher(monkeypatch, device, switch, ("dkdv", "dkdv_atomic"), absent=("dq",))
