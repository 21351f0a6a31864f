"""The mask decides, as in eager: what a model's mask function says beyond padding (a window, packed sequences,
causality) reaches fa_amd's kernels even where the attention module does not pass it (audit 2026-11-29: a family
sweep against eager found each of these silently dropped)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

import fa_amd  # noqa: E402,F401
from fa_amd.integrations import hf_attention  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, attention_dropout=0.0)


def _pair(model_class, config, device):
    """eager and fa_amd copies of one random model, q / k projections scaled so attention is not near-uniform."""
    torch.manual_seed(0)
    models = {impl: model_class._from_config(copy.deepcopy(config), attn_implementation=impl).to(device).eval()
              for impl in ("eager", "fa_amd")}
    with torch.no_grad():
        for name, p in models["eager"].named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight", "query_key_value.weight")):
                p.mul_(8)
    models["fa_amd"].load_state_dict(models["eager"].state_dict())
    return models


def _logits_and_grads(model, real, **inputs):
    model.zero_grad()
    logits = model(**inputs).logits[real]  # (padded rows are garbage in eager, zeros in fa_amd)
    logits.square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_match(models, **inputs):
    mask = inputs.get("attention_mask")
    real = torch.ones_like(inputs["input_ids"], dtype=torch.bool) if mask is None else mask.bool()
    (ref, ref_grads), (got, got_grads) = (_logits_and_grads(models[impl], real, **inputs)
                                          for impl in ("eager", "fa_amd"))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=2e-5, rtol=1e-3)


@pytest.mark.parametrize("padded", [False, True])
def test_window_only_in_the_mask(device, padded):
    """PhiMoE's attention passes no sliding_window (the window lives in create_sliding_window_causal_mask): before,
    fa_amd ran full causal attention (0.43 off eager)."""
    config = transformers.PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    models = _pair(transformers.PhimoeForCausalLM, config, device)
    ids = torch.randint(3, 128, (2, 24), device=device)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
    _assert_match(models, input_ids=ids, attention_mask=mask, use_cache=False)


@pytest.mark.parametrize("family", ["persimmon", "gpt_bigcode"])
def test_packed_sequences_whose_positions_never_reach_the_attention(device, family):
    """Persimmon's attention takes position_ids as a named argument (not forwarded), GPTBigCode's blocks never get
    them: the packed sequences come from the mask's packed-sequence ids instead (before: one causal sequence over
    the row, 0.9 off eager)."""
    if family == "persimmon":
        config = transformers.PersimmonConfig(**{**COMMON, "num_key_value_heads": 4}, qk_layernorm=True)
        model_class = transformers.PersimmonForCausalLM
    else:
        config = transformers.GPTBigCodeConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, multi_query=True,
                                               attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=1,
                                               eos_token_id=2)
        model_class = transformers.GPTBigCodeForCausalLM
    models = _pair(model_class, config, device)
    lengths = (10, 8, 6)
    ids = torch.randint(3, 128, (1, sum(lengths)), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    _assert_match(models, input_ids=ids, position_ids=positions, use_cache=False)


def _reference(q, k, v, keep):
    """float64 attention of (b, h, s, d) tensors under a (b, sq, sk) boolean keep-mask (GQA by repeat)."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("builder", ["bidirectional window", "causal window", "bidirectional"])
def test_attention_follows_the_mask_function(device, builder):
    """The attention computes what the mask function keeps, evaluated by Transformers' own functions on the
    call's positions, whatever sliding_window / is_causal the module passes: Transformers' bidirectional window
    keeps |q - k| <= W (T5Gemma's encoder, Gemma 4 with use_bidirectional_attention="all"), which fa_amd's
    (W - 1, W - 1) for a passed sliding_window missed by one key each side."""
    window = 4
    function = {"bidirectional window": mu.sliding_window_bidirectional_mask_function(window),
                "causal window": mu.sliding_window_causal_mask_function(window),
                "bidirectional": mu.bidirectional_mask_function}[builder]
    b, s = 2, 13
    padding = torch.ones(b, s, dtype=torch.bool, device=device)
    padding[1, :3] = False
    for attention_mask in (None, padding):
        kwargs = {} if builder.startswith("causal") else {"allow_is_bidirectional_skip": True}
        mask = hf_attention.fa_amd_attention_mask(b, s, s, mask_function=function, attention_mask=attention_mask,
                                                  device=device, **kwargs)
        torch.manual_seed(1)
        q = torch.randn(b, 4, s, 16, device=device)
        k, v = torch.randn(b, 2, s, 16, device=device), torch.randn(b, 2, s, 16, device=device)
        module = torch.nn.Module()
        module.is_causal = not builder.startswith("bidirectional")
        out, _ = hf_attention.fa_amd_attention_forward(module, q, k, v, mask, sliding_window=window)
        rows, cols = torch.arange(s, device=device)[:, None], torch.arange(s, device=device)[None, :]
        keep = function(torch.arange(b, device=device)[:, None, None], 0, rows[None], cols[None])
        keep = torch.as_tensor(keep, device=device).expand(b, s, s).clone()
        if attention_mask is not None:
            keep &= attention_mask[:, None, :]
        ref = _reference(q, k, v, keep)
        real = torch.ones(b, s, dtype=torch.bool, device=device) if attention_mask is None else attention_mask
        torch.testing.assert_close(out[real].double(), ref[real], atol=2e-5, rtol=1e-5)


def test_overlay_reach_is_measured():
    reach = hf_attention._overlay_reach
    assert reach(mu.sliding_window_overlay(5)) == (4, -1)
    assert reach(mu.sliding_window_bidirectional_overlay(5)) in ((5, 5), (4, 4))  # (inclusive since Transformers 5.x)
    assert reach(lambda b, h, q, k: (k - q).abs() < 3) == (2, 2)
    spec = hf_attention._mask_function_spec(mu.and_masks(mu.sliding_window_causal_mask_function(6),
                                                         mu.padding_mask_function(torch.ones(1, 4, dtype=torch.bool))))
    assert spec == (True, (5, -1), None)
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    spec = hf_attention._mask_function_spec(mu.and_masks(mu.causal_mask_function,
                                                         mu.packed_sequence_mask_function(ids)))
    assert spec[0] is True and spec[1] is None and spec[2] is ids


def test_unused_window_zero_mask_is_left_untagged(device):
    """Qwen2-MoE without use_sliding_window still builds a sliding mask with window 0 (keeping nothing), which no
    layer uses: it must not stop the model (the audit's first version of this code raised there)."""
    config = transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32)
    assert hf_attention._mask_function_spec(mu.sliding_window_causal_mask_function(0)) is None
    models = _pair(transformers.Qwen2MoeForCausalLM, config, device)
    ids = torch.randint(3, 128, (2, 12), device=device)
    _assert_match(models, input_ids=ids, use_cache=False)


def test_generate_with_sliding_and_global_layers_matches_eager(device):
    """EXAONE 4 keeps `sliding_window` on every attention module and passes it only on its sliding layers: a
    global layer's None must stay None (a first version of this audit's fix read the module's attribute and
    windowed the global layers' decode steps).  A left-padded prompt longer than the window, greedy."""
    config = transformers.Exaone4Config(**COMMON, sliding_window=8, layer_types=["sliding_attention",
                                                                                 "full_attention"])
    models = _pair(transformers.Exaone4ForCausalLM, config, device)
    ids = torch.randint(3, 128, (2, 20), device=device)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    out = {impl: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                pad_token_id=0, return_dict_in_generate=True, output_logits=True)
           for impl, model in models.items()}
    assert torch.equal(out["fa_amd"].sequences, out["eager"].sequences)
    for got, ref in zip(out["fa_amd"].logits, out["eager"].logits):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_window_only_in_the_mask_over_a_cache(device):
    """Several new tokens over a sliding cache (a chunked prefill; assisted decoding verifies candidates the same
    way): PhiMoE's window reaches the attention from the mask there too (the gen sweep of 2026-11-29 found every
    cached key attended).  One-token steps stay untagged: the sliding cache holds only the window's keys."""
    config = transformers.PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    models = _pair(transformers.PhimoeForCausalLM, config, device)
    ids = torch.randint(3, 128, (1, 24), device=device)
    logits = {}
    with torch.no_grad():
        for impl, model in models.items():
            cache = transformers.DynamicCache(config=model.config)
            model(input_ids=ids[:, :12], past_key_values=cache, use_cache=True)
            chunk = model(input_ids=ids[:, 12:], past_key_values=cache, use_cache=True).logits
            step = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
            logits[impl] = (chunk, step)
    for got, ref in zip(logits["fa_amd"], logits["eager"]):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
