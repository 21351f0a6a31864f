"""The opt-in SDPA route (fa_amd.sdpa): torch.nn.functional.scaled_dot_product_attention served by
fa_amd inside the route, compared with SDPA's math backend (float64 = the oracle; the inputs'
dtype = the tolerance scale), forward and backward; calls it cannot serve go to torch unchanged;
nothing changes outside it; torch.compile traces through it; torch's flash-impl registry."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa_bound_early

import fa_amd
from fa_amd import sdpa as route
from fa_amd.kernels import launch
from fa_amd.reference import attention_ref

from .kernels.helpers import assert_close_to_ref


@pytest.fixture(autouse=True)
def poison_and_reset(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    yield
    fa_amd.disable_sdpa_route()
    assert not fa_amd.sdpa_route_enabled()


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the route served on fa_amd."""
    calls = []
    real = route._sdpa_on_fa_amd

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(route, "_sdpa_on_fa_amd", spy)
    return calls


def _math(*tensors, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*tensors, **kw)


def _randn(shape, dtype, device):
    return torch.randn(shape, device=device).to(dtype).requires_grad_()


def _eager(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's definition computed step by step in the inputs' dtype (SDPA's math backend upcasts half
    inputs to fp32 inside, so its error is no measure of a half-precision computation)."""
    if enable_gqa:
        k, v = (x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1) @ v


def _larger_error(ref64, *candidates):
    return max(candidates, key=lambda c: (c.double() - ref64).abs().max().item())


def check_against_math(q, k, v, **kw):
    """The route's SDPA (called through a reference bound before the route began) vs the math backend
    in float64, output and the gradients of q, k, v, within 2x the same-precision PyTorch error (the
    larger of the math backend's and a step-by-step computation's in the inputs' dtype)."""
    dtype = q.dtype
    with fa_amd.sdpa_route():
        out = sdpa_bound_early(q, k, v, **kw)
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    leaves_lp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    leaves_eager = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref64, ref_lp, ref_eager = _math(*leaves64, **kw), _math(*leaves_lp, **kw), _eager(*leaves_eager, **kw)
    assert out.shape == ref64.shape and out.dtype == dtype
    assert_close_to_ref("out", out, ref64, _larger_error(ref64, ref_lp, ref_eager), dtype)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for name, a, b, c, e in zip(("dq", "dk", "dv"), got, torch.autograd.grad(ref64, leaves64, dout.double()),
                                torch.autograd.grad(ref_lp, leaves_lp, dout),
                                torch.autograd.grad(ref_eager, leaves_eager, dout)):
        assert a.shape == b.shape, name
        assert_close_to_ref(name, a, b, _larger_error(b, c, e), dtype)
    return out


CASES = {
    # name: (q shape, k shape, v shape, sdpa kwargs, dtype)
    "plain": ((2, 3, 17, 40), (2, 3, 23, 40), (2, 3, 23, 40), {}, torch.float32),
    "causal_square_fp16": ((2, 4, 19, 64), (2, 4, 19, 64), (2, 4, 19, 64), {"is_causal": True}, torch.float16),
    # SDPA's causal is top-left aligned: more queries than keys, and fewer
    "causal_more_queries": ((1, 2, 21, 32), (1, 2, 9, 32), (1, 2, 9, 32), {"is_causal": True}, torch.float32),
    "causal_fewer_queries": ((1, 2, 7, 32), (1, 2, 19, 32), (1, 2, 19, 32), {"is_causal": True}, torch.float32),
    "gqa_scale": ((2, 6, 13, 59), (2, 2, 13, 59), (2, 2, 13, 59),
                  {"enable_gqa": True, "scale": 0.29, "is_causal": True}, torch.float16),
    "smaller_value_head_dim": ((1, 2, 11, 48), (1, 2, 15, 48), (1, 2, 15, 24), {}, torch.float32),
    "larger_value_head_dim": ((1, 2, 11, 24), (1, 2, 15, 24), (1, 2, 15, 40), {"is_causal": True}, torch.float32),
    "head_dim_256": ((1, 2, 9, 256), (1, 2, 12, 256), (1, 2, 12, 256), {}, torch.float16),
    "rank3": ((3, 14, 32), (3, 14, 32), (3, 14, 32), {"is_causal": True}, torch.float32),
    "rank5": ((2, 2, 2, 9, 16), (2, 2, 2, 11, 16), (2, 2, 2, 11, 16), {}, torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_route_matches_math_backend(device, served, case):
    q_shape, k_shape, v_shape, kw, dtype = CASES[case]
    check_against_math(_randn(q_shape, dtype, device), _randn(k_shape, dtype, device),
                       _randn(v_shape, dtype, device), **kw)
    assert len(served) == 1


def test_arbitrary_strides(device, served):
    # q/k/v as a model makes them: (B, L, H, D) projections viewed as (B, H, L, D), k/v slices of one tensor
    q = torch.randn(2, 13, 4, 32, device=device).transpose(1, 2).requires_grad_()
    kv = torch.randn(2, 17, 2, 4, 32, device=device)
    k, v = (kv[:, :, i].transpose(1, 2).requires_grad_() for i in range(2))
    assert not q.is_contiguous() and not k.is_contiguous()
    check_against_math(q, k, v, is_causal=False)
    assert len(served) == 1


def test_boolean_masks(device, served):
    q, k, v = (_randn((1, 2, 11, 16), torch.float32, device) for _ in range(3))
    causal = torch.ones(11, 11, dtype=torch.bool, device=device).tril()
    check_against_math(q, k, v, attn_mask=causal)  # exactly SDPA's causal mask: served as is_causal
    check_against_math(q, k, v, attn_mask=torch.ones(1, 1, 11, 11, dtype=torch.bool, device=device))  # all True
    assert len(served) == 2
    padding = causal.clone()
    padding[:, -3:] = False  # causal + key padding: not expressible, torch serves it
    check_against_math(q, k, v, attn_mask=padding)
    assert len(served) == 2


def test_unservable_calls_go_to_torch_unchanged_and_are_logged_once(device, served, caplog):
    q, k, v = (torch.randn(1, 2, 9, 16, device=device) for _ in range(3))
    bias = torch.randn(9, 9, device=device)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with caplog.at_level(logging.DEBUG, logger="fa_amd.sdpa"), fa_amd.sdpa_route():
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        c = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert not served
    torch.testing.assert_close(a, expected, rtol=0, atol=0)
    torch.testing.assert_close(b, expected, rtol=0, atol=0)
    assert c.dtype == torch.float64
    notes = [r.getMessage() for r in caplog.records if r.name == "fa_amd.sdpa"]
    assert len(notes) == 2 and all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "fa_amd.sdpa")
    assert "float attn_mask" in notes[0] and "torch.float64" in notes[1]
    # torch's own errors stay torch's
    with pytest.raises(RuntimeError) as outside:
        F.scaled_dot_product_attention(q, k[..., :8], v)
    with fa_amd.sdpa_route(), pytest.raises(RuntimeError) as inside:
        F.scaled_dot_product_attention(q, k[..., :8], v)
    assert str(inside.value) == str(outside.value)
    # torch.func transforms keep working (torch serves them)
    f = lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True).sum()  # noqa: E731
    with fa_amd.sdpa_route():
        g = torch.func.grad(f)(q)
    torch.testing.assert_close(g, torch.func.grad(f)(q), rtol=0, atol=0)
    # and so do its broadcasts (one key head, no enable_gqa)
    with fa_amd.sdpa_route():
        out = F.scaled_dot_product_attention(q, k[:, :1], v[:, :1])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k[:, :1], v[:, :1]), rtol=0, atol=0)
    assert not served


def test_off_outside_the_route_nesting_and_global_switch(device, served):
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    assert not fa_amd.sdpa_route_enabled()  # importing fa_amd turns nothing on
    F.scaled_dot_product_attention(q, k, v)
    assert not served
    with fa_amd.sdpa_route():
        with fa_amd.sdpa_route():
            F.scaled_dot_product_attention(q, k, v)
        assert fa_amd.sdpa_route_enabled()  # the outer block still holds it
        F.scaled_dot_product_attention(q, k, v)
    assert not fa_amd.sdpa_route_enabled() and len(served) == 2
    F.scaled_dot_product_attention(q, k, v)
    assert len(served) == 2
    fa_amd.enable_sdpa_route()
    with fa_amd.sdpa_route():
        pass
    assert fa_amd.sdpa_route_enabled()  # a block that closes does not end the global route
    with torch.inference_mode():  # below autograd too
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(served) == 3
    torch.testing.assert_close(out, _math(q, k, v, is_causal=True), rtol=2e-5, atol=2e-5)
    fa_amd.disable_sdpa_route()
    assert not fa_amd.sdpa_route_enabled()
    F.scaled_dot_product_attention(q, k, v)
    assert len(served) == 3


def test_dropout_on_fa_amd_rng(device, served):
    """dropout_p runs on fa_amd's Philox stream (seeded from torch's generator): the output and
    gradients are those of the reference with fa_amd's own keep-mask for that seed."""
    p = 0.25
    q, k, v = (_randn((2, 2, 15, 32), torch.float32, device) for _ in range(3))
    torch.manual_seed(123)
    with fa_amd.sdpa_route():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    torch.manual_seed(123)
    _, _, s_dmask = fa_amd.flash_attn_func(*(x.detach().transpose(1, 2) for x in (q, k, v)), dropout_p=p,
                                           causal=True, return_attn_probs=True)
    keep = s_dmask >= 0
    assert 0.5 < keep.float().mean() < 0.95
    leaves = [x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=True, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(ref, leaves, dout.double().transpose(1, 2))):
        torch.testing.assert_close(a.double(), b.transpose(1, 2), rtol=1e-4, atol=1e-5)
    assert len(served) == 1


def test_torch_compile_traces_through_the_route(device, served):
    """Compiled inside the route (fullgraph: no graph break) the graph holds fa_amd's custom ops (running it
    calls no SDPA any more): same output and gradients, bit for bit, as the eager route."""
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"

    def qk(x, wq, wk):
        return (x @ wq).unflatten(-1, (4, 16)).transpose(1, 2), (x @ wk).unflatten(-1, (2, 16)).transpose(1, 2)

    def layer(x, wq, wk):
        q, k = qk(x, wq, wk)
        return F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum(1)

    x = torch.randn(2, 12, 32, device=device)
    wq, wk = (torch.randn(32, n, device=device).requires_grad_() for n in (64, 32))
    compiled_layer = torch.compile(layer, fullgraph=True, backend=backend)
    torch.use_deterministic_algorithms(True)  # the route's backward then has no atomics
    try:
        with fa_amd.sdpa_route():
            eager = layer(x, wq, wk)
            assert len(served) == 1
            compiled = compiled_layer(x, wq, wk)
            traced = len(served)
            assert traced > 1  # the route ran while tracing
            compiled_layer(x, wq, wk)
            assert len(served) == traced  # and the graph calls fa_amd directly
            dout = torch.randn_like(eager)
            g_eager = torch.autograd.grad(eager, (wq, wk), dout)
            g_comp = torch.autograd.grad(compiled, (wq, wk), dout)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q, k = (t.double() for t in qk(x, wq, wk))
    torch.testing.assert_close(eager.double(), _math(q, k, k, is_causal=True, enable_gqa=True).sum(1),
                               rtol=1e-4, atol=1e-4)


def test_compiles_after_switching_the_route_see_the_switch(device, served):
    """torch.compile's dispatcher caches per op which kernel a call takes: switching the route clears it.
    Compiled inside the route, then (after torch.compiler.reset()) outside it, a model's parameters before the
    attention still get their gradients; compiled outside, then inside, the graph holds fa_amd's op."""
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch.manual_seed(0)
    wqkv, wo = torch.randn(32, 96, device=device).requires_grad_(), torch.randn(32, 32, device=device)

    def model(x):
        q, k, v = (x @ wqkv).view(2, 11, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return (F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 11, 32) @ wo)

    x = torch.randn(2, 11, 32, device=device)
    want = torch.autograd.grad(model(x).sum(), wqkv)[0]
    torch.compiler.reset()
    with fa_amd.sdpa_route():
        torch.compile(model, backend=backend)(x)
    assert served
    torch.compiler.reset()
    got = torch.autograd.grad(torch.compile(model, backend=backend)(x).sum(), wqkv)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.compiler.reset()
    served.clear()
    with fa_amd.sdpa_route():
        torch.compile(model, backend=backend)(x)
    assert served  # the route ran while tracing
    torch.compiler.reset()


def test_scales_past_the_kernels_float32_range_go_to_torch(device, served):
    q, k, v = (torch.randn(1, 2, 9, 16, device=device) for _ in range(3))
    with fa_amd.sdpa_route():
        got = F.scaled_dot_product_attention(q, k, v, scale=1e33)
    assert not served
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, scale=1e33), rtol=0, atol=0)


@pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"),
                    reason="this torch has no flash-implementation registry")
def test_flash_impl_registry(device):
    """"fa_amd" is registered in torch's registry (not active); the route activates it and restores the
    previous state after; then SDPA's flash kernels (aten::_scaled_dot_product_flash_attention and its
    backward) run on fa_amd, dropout included (the backward regenerates the forward's mask)."""
    attention = torch.nn.attention
    assert "fa_amd" in attention.list_flash_attention_impls()
    before = attention.current_flash_attention_impl()
    assert before != "fa_amd"
    q, k, v = (_randn((2, 3, 13, 32), torch.float16, device) for _ in range(3))
    with fa_amd.sdpa_route():
        if hasattr(attention, "restore_flash_attention_impl"):
            assert attention.current_flash_attention_impl() == "fa_amd"
        torch.manual_seed(5)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.2, True, scale=0.3)[0]
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert attention.current_flash_attention_impl() == before
    torch.manual_seed(5)
    ours = fa_amd.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), dropout_p=0.2, causal=True,
                                  softmax_scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, ours, rtol=0, atol=0)
    for a, b in zip(grads, torch.autograd.grad(ours, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["causal", "gqa", "long_causal_more_queries", "d256"])
def test_gpu_route_matches_math_backend(served, dtype, case):
    q_shape, k_shape, kw = {
        "causal": ((2, 16, 1024, 128), (2, 16, 1024, 128), {"is_causal": True}),
        "gqa": ((2, 16, 777, 64), (2, 4, 777, 64), {"enable_gqa": True, "is_causal": True}),
        "long_causal_more_queries": ((1, 8, 2048, 128), (1, 8, 1500, 128), {"is_causal": True}),
        "d256": ((2, 4, 513, 256), (2, 4, 600, 256), {}),
    }[case]
    check_against_math(_randn(q_shape, dtype, "cuda"), _randn(k_shape, dtype, "cuda"),
                       _randn(k_shape, dtype, "cuda"), **kw)
    assert len(served) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason="this torch has no flash-implementation registry")
def test_gpu_sdpa_flash_backend_runs_fa_amd_when_activated():
    """torch.nn.attention.activate_flash_attention_impl("fa_amd") alone (no route): SDPA's flash backend
    runs fa_amd's kernels (bitwise fa_amd's result, dropout mask included)."""
    attention = torch.nn.attention
    if not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("this torch build has no SDPA flash backend")
    q, k, v = (_randn((2, 8, 512, 128), torch.bfloat16, "cuda") for _ in range(3))
    previous = attention.current_flash_attention_impl()
    attention.activate_flash_attention_impl("fa_amd")
    try:
        torch.manual_seed(11)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        if previous is None and hasattr(attention, "restore_flash_attention_impl"):
            attention.restore_flash_attention_impl()
        elif previous is not None:
            attention.activate_flash_attention_impl(previous)
    torch.manual_seed(11)
    ours = fa_amd.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), dropout_p=0.1, causal=True)
    torch.testing.assert_close(out, ours.transpose(1, 2), rtol=0, atol=0)
    for a, b in zip(grads, torch.autograd.grad(ours.transpose(1, 2), (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_hf_sdpa_model_under_the_route(served):
    """A Transformers model with attn_implementation="sdpa" inside the route: its SDPA calls run on
    fa_amd (no padding: is_causal), logits and gradients as with torch's SDPA."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (2, 300), device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}

    ref_logits, ref_grads = run()
    with fa_amd.sdpa_route():
        logits, grads = run()
    assert len(served) == 2  # both layers
    torch.testing.assert_close(logits, ref_logits, atol=6e-2, rtol=6e-2)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=6e-2, rtol=6e-2, msg=name)


def test_routed_output_has_the_query_layout(device, served):
    """torch's SDPA gives the output the query's layout (empty_like(query)): a contiguous query gets a contiguous
    output that .view() takes (audit 2026-11-28: the route gave a transposed one); a model's transposed (B, L, H, E)
    query keeps the layout the kernel wrote (no copy)."""
    q = torch.randn(2, 3, 5, 16, device=device)
    with fa_amd.sdpa_route():
        out = F.scaled_dot_product_attention(q, q, q)
        bl = torch.randn(2, 5, 3, 16, device=device).transpose(1, 2)
        out_bl = F.scaled_dot_product_attention(bl, bl, bl)
    assert len(served) == 2
    assert out.is_contiguous() and out.view(6, 5, 16).shape == (6, 5, 16)
    assert out_bl.stride() == bl.stride()
    torch.testing.assert_close(out, _math(q, q, q), atol=1e-5, rtol=1e-5)


def test_forward_mode_ad_is_refused_not_dropped(device):
    """fa_amd's kernels have no jvp: a dual tensor's tangent must not vanish (audit 2026-11-28: the output had
    none).  flash_attn_func raises naming the argument; the route hands such calls to torch, which computes or
    refuses them as it would without the route."""
    import torch.autograd.forward_ad as forward_ad

    q, k, v = (torch.randn(1, 5, 2, 16, device=device) for _ in range(3))
    with forward_ad.dual_level():
        dual_k = forward_ad.make_dual(k, torch.randn_like(k))
        with pytest.raises(NotImplementedError, match="no forward-mode AD.*but k carries a tangent"):
            fa_amd.flash_attn_func(q, dual_k, v)
        assert fa_amd.flash_attn_func(q, k, v).shape == q.shape  # plain tensors inside a dual level are fine
        qt, kt, vt = q.transpose(1, 2), dual_k.transpose(1, 2), v.transpose(1, 2)
        outcomes = []
        for routed in (False, True):
            with fa_amd.sdpa_route() if routed else torch.no_grad():
                try:
                    out = F.scaled_dot_product_attention(qt, kt, vt)
                    outcomes.append(forward_ad.unpack_dual(out).tangent)
                except NotImplementedError:
                    outcomes.append("refused")
        if isinstance(outcomes[0], torch.Tensor):
            torch.testing.assert_close(outcomes[1], outcomes[0])
        else:
            assert outcomes == ["refused", "refused"]
