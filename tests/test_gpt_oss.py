"""gpt-oss (learnable attention sinks `s_aux`, sliding and full layers alternating) with
attn_implementation="fa_amd" vs eager, on a tiny random-init config (no download): logits, loss,
and every gradient, the sinks' included, on a padded batch (the varlen path) longer than the
sliding window; and greedy generation through the KV cache."""
import copy

import pytest
import torch

import fa_amd  # noqa: F401  (registers "fa_amd" with transformers)

transformers = pytest.importorskip("transformers")
GptOssConfig = pytest.importorskip("transformers.models.gpt_oss").GptOssConfig
from transformers import GptOssForCausalLM  # noqa: E402

VOCAB = 128
SEQ = 20
WINDOW = 6  # shorter than SEQ: the sliding layers really cut


def tiny_gpt_oss(device, dtype=torch.float32, attn="fa_amd"):
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GptOssForCausalLM(copy.deepcopy(config))
    with torch.no_grad():  # sinks at init are ~N(0, 0.02): make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.5, 1.0)
    model = model.to(device=device, dtype=dtype)
    model.set_attn_implementation(attn)
    return model


def _batch(device):
    torch.manual_seed(1)
    lengths = (SEQ, 13, 8)
    ids = torch.randint(3, VOCAB, (len(lengths), SEQ), device=device)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1  # right padding
    return ids.masked_fill(mask == 0, 0), mask


def _run(model, attn, ids, mask):
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _check_parity(device, dtype, tol):
    model = tiny_gpt_oss(device, dtype).train()  # attention_dropout 0: deterministic
    ids, mask = _batch(device)
    logits_ref, loss_ref, grads_ref = _run(model, "eager", ids, mask)
    logits, loss, grads = _run(model, "fa_amd", ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(logits[keep].float(), logits_ref[keep].float(), **tol)
    torch.testing.assert_close(loss.float(), loss_ref.float(), **tol)
    assert grads.keys() == grads_ref.keys()
    sinks = [n for n in grads if n.endswith("self_attn.sinks")]
    assert len(sinks) == 2  # both layers' sinks get a gradient
    for name in grads:
        torch.testing.assert_close(grads[name].float(), grads_ref[name].float(), **tol, msg=name)


def test_gpt_oss_logits_and_gradients_match_eager(device):
    _check_parity(device, torch.float32, dict(atol=5e-5, rtol=5e-4))


@pytest.mark.gpu
def test_gpt_oss_logits_and_gradients_match_eager_bf16(device):
    _check_parity(device, torch.bfloat16, dict(atol=6e-2, rtol=6e-2))


def _greedy(model, attn, ids, mask, new_tokens):
    model.set_attn_implementation(attn)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("new_tokens", [pytest.param(3, id="cpu"), pytest.param(24, id="gpu", marks=pytest.mark.gpu)])
def test_gpt_oss_generate_matches_eager(device, new_tokens):
    """Left-padded prompts, decode through the KV cache (one query row against the cache, sinks in
    its softmax) past the sliding window."""
    model = tiny_gpt_oss(device).eval()
    ids, mask = _batch(device)
    ids, mask = ids.flip(1)[1:, -9:], mask.flip(1)[1:, -9:]  # left padding, as generate() wants
    ref = _greedy(model, "eager", ids, mask, new_tokens)
    out = _greedy(model, "fa_amd", ids, mask, new_tokens)
    assert torch.equal(out, ref), f"fa_amd {out.tolist()} != eager {ref.tolist()}"
