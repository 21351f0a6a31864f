"""Liger-style patches beyond Llama / Mistral: `apply_fa_amd_to_<family>` for Qwen2, Qwen3, Gemma 2,
Gemma 3, Phi-3 and gpt-oss (fused rotary + fa_amd attention), before construction and on an
instance, each against eager on a tiny random-init config (fp32, padded batch): logits, loss and a
gradient.  Each config exercises its family's rotary quirk (see the patch docstrings)."""
import inspect

import pytest
import torch

import fa_amd

transformers = pytest.importorskip("transformers")
from fa_amd.integrations import hf_attention  # noqa: E402
from fa_amd.integrations import monkey_patch as mp  # noqa: E402

VOCAB, SEQ = 96, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
WINDOW = 5  # shorter than SEQ, so sliding layers really cut


def _config(family):
    t = transformers
    if family == "qwen2":  # second layer slides
        return t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3":  # q/k norm before the rotary
        return t.Qwen3Config(**COMMON, head_dim=16)
    if family == "gemma2":  # query_pre_attn_scalar scaling, softcap, sliding + global layers
        return t.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=30.0, sliding_window=WINDOW)
    if family == "gemma3":  # q/k norm, local and global rotary bases
        return t.Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":  # fused qkv_proj, partial rotary (half of each head rotates)
        return t.Phi3Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                           partial_rotary_factor=0.5))
    if family == "gpt_oss":  # yarn rotary with half tables, sinks, sliding + full layers, tiny MoE
        return t.GptOssConfig(**COMMON, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                              sliding_window=WINDOW, rope_parameters=dict(
                                  rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                  original_max_position_embeddings=32, rope_theta=150000.0))
    raise ValueError(family)


FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", mp.apply_fa_amd_to_qwen2, "transformers.models.qwen2.modeling_qwen2"),
    "qwen3": ("Qwen3ForCausalLM", mp.apply_fa_amd_to_qwen3, "transformers.models.qwen3.modeling_qwen3"),
    "gemma2": ("Gemma2ForCausalLM", mp.apply_fa_amd_to_gemma2, "transformers.models.gemma2.modeling_gemma2"),
    "gemma3": ("Gemma3ForCausalLM", mp.apply_fa_amd_to_gemma3, "transformers.models.gemma3.modeling_gemma3"),
    "phi3": ("Phi3ForCausalLM", mp.apply_fa_amd_to_phi3, "transformers.models.phi3.modeling_phi3"),
    "gpt_oss": ("GptOssForCausalLM", mp.apply_fa_amd_to_gpt_oss, "transformers.models.gpt_oss.modeling_gpt_oss"),
}
TOL = dict(atol=3e-5, rtol=3e-5)


def sinks_supported() -> bool:
    """fa_amd's attention takes learnable sinks (gpt-oss's s_aux): the HF function no longer refuses
    them and the flash-style functions accept a `sinks` argument."""
    return ("s_aux" not in hf_attention.UNSUPPORTED_KWARGS
            and "sinks" in inspect.signature(fa_amd.flash_attn_varlen_func).parameters)


def _model(family, device):
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family][0])(_config(family)).to(device)
    if family == "gpt_oss":  # random sinks, not the init's constant, so a dropped sink would show
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model.set_attn_implementation("eager")
    return model


def _batch(device):
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=device)
    mask = torch.ones(2, SEQ, dtype=torch.long, device=device)
    mask[1, -4:] = 0  # right padding: no pad position predicts a real label, so loss and grads compare
    return ids.masked_fill(mask == 0, 0), mask, ids.masked_fill(mask == 0, -100)


def _run(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), model.get_input_embeddings().weight.grad.clone()


def _check_patch_matches_eager(family, device, attention, dtype=torch.float32, tol=TOL, grad_tol=None):
    model = _model(family, device).to(dtype)
    ids, mask, labels = _batch(device)
    ref_logits, ref_loss, ref_grad = _run(model, ids, mask, labels)
    patch, modeling_name = FAMILIES[family][1:]
    try:
        assert patch(model, attention=attention) is model
        modeling = __import__(modeling_name, fromlist=["apply_rotary_pos_emb"])
        assert modeling.apply_rotary_pos_emb.__module__ == mp.__name__
        assert model.config._attn_implementation == ("fa_amd" if attention else "eager")
        logits, loss, grad = _run(model, ids, mask, labels)
    finally:
        mp.revert_fa_amd_patches()
    keep = mask.bool()
    torch.testing.assert_close(logits[keep].float(), ref_logits[keep].float(), **tol)
    torch.testing.assert_close(loss.float(), ref_loss.float(), **tol)
    torch.testing.assert_close(grad.float(), ref_grad.float(), **(grad_tol or dict(atol=1e-4, rtol=1e-3)))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_oss"])
def test_patch_on_instance_matches_eager(family, device):
    _check_patch_matches_eager(family, device, attention=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patch_on_instance_matches_eager_bf16(family, device):
    if family == "gpt_oss" and not sinks_supported():
        pytest.skip("fa_amd's attention does not take learnable sinks (gpt-oss's s_aux) yet")
    half = dict(atol=6e-2, rtol=6e-2)
    _check_patch_matches_eager(family, device, attention=True, dtype=torch.bfloat16, tol=half, grad_tol=half)


def test_gpt_oss_fused_rotary_matches_eager(device):
    """gpt-oss's yarn half-table rotary, fused, with eager attention (runs whether or not sinks exist)."""
    _check_patch_matches_eager("gpt_oss", device, attention=False)


def test_gpt_oss_patch_matches_eager(device):
    if not sinks_supported():
        pytest.skip("fa_amd's attention does not take learnable sinks (gpt-oss's s_aux) yet; this runs once it "
                    "does (fa_amd.flash_attn_varlen_func(sinks=...) and hf_attention accepting s_aux)")
    _check_patch_matches_eager("gpt_oss", device, attention=True)


def test_patch_before_construction_and_dispatch(device):
    """Patched before building, every family defaults to fa_amd (an explicit choice still wins) with
    the fused rotary; apply_fa_amd picks the family from config.model_type, no ValueError for Qwen2."""
    for family, (cls_name, patch, modeling_name) in FAMILIES.items():
        cls = getattr(transformers, cls_name)
        try:
            assert patch() is None
            modeling = __import__(modeling_name, fromlist=["apply_rotary_pos_emb"])
            assert modeling.apply_rotary_pos_emb.__module__ == mp.__name__, family
            assert cls(_config(family)).config._attn_implementation == "fa_amd", family
            assert cls._from_config(_config(family), attn_implementation="eager").config._attn_implementation \
                == "eager"
        finally:
            mp.revert_fa_amd_patches()
        assert modeling.apply_rotary_pos_emb.__module__ == modeling.__name__
        model = cls(_config(family))
        model.set_attn_implementation("eager")
        try:
            assert mp.apply_fa_amd(model, attention=family != "gpt_oss" or sinks_supported()) is model
            assert modeling.apply_rotary_pos_emb.__module__ == mp.__name__, family
        finally:
            mp.revert_fa_amd_patches()
    gemma3 = transformers.Gemma3ForCausalLM(_config("gemma3"))
    with pytest.raises(TypeError, match="Qwen2PreTrainedModel"):
        mp.apply_fa_amd_to_qwen2(gemma3)
    # a call that raises patched nothing (the rotary was swapped before the model was checked)
    qwen2 = __import__(FAMILIES["qwen2"][2], fromlist=["apply_rotary_pos_emb"])
    assert qwen2.apply_rotary_pos_emb.__module__ == qwen2.__name__ and not mp._originals


def test_fused_rotary_keeps_the_stock_contract(device):
    """The fused stand-in binds its arguments by the stock function's signature (unsqueeze_dim is the fifth,
    positional or not; q/k (b, s, h, d) with 2), and where the stock function takes full-width tables only
    (every family but Phi-3), a narrower cos goes to the stock function -- which rejects it, as it always has."""
    llama = __import__("transformers.models.llama.modeling_llama", fromlist=["apply_rotary_pos_emb"])
    stock = llama.apply_rotary_pos_emb
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 4, 16, device=device), torch.randn(2, 4, 2, 16, device=device)  # (b, s, h, d)
    angles = torch.randn(2, 4, 8, device=device)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # HF tables: halves repeated
    want = stock(q, k, cos, sin, 2)
    try:
        mp.apply_fa_amd_to_llama(attention=False)
        fused = llama.apply_rotary_pos_emb
        assert fused is not stock
        for got in (fused(q, k, cos, sin, 2), fused(q, k, cos, sin, unsqueeze_dim=2)):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        with pytest.raises(RuntimeError):  # stock Llama has no partial rotary
            stock(q.transpose(1, 2), k.transpose(1, 2), cos[..., :8], sin[..., :8])
        with pytest.raises(RuntimeError):
            fused(q.transpose(1, 2), k.transpose(1, 2), cos[..., :8], sin[..., :8])
        # float64 (a reference model of the family, patched with it): the stock function (audit 2026-11-28:
        # the fused kernel's TypeError)
        q64, k64, cos64, sin64 = (t.double() for t in (q, k, cos, sin))
        assert all(torch.equal(a, b) for a, b in zip(fused(q64, k64, cos64, sin64, 2), stock(q64, k64, cos64, sin64, 2)))
        mp.apply_fa_amd_to_llama(attention=False)  # twice: the stock function stays the one wrapped
        assert llama.apply_rotary_pos_emb.fa_amd_stock is stock
    finally:
        mp.revert_fa_amd_patches()
    assert llama.apply_rotary_pos_emb is stock
