"""gpt-oss (learnable attention sinks `s_aux`, sliding and full layers alternating) with
attn_implementation="fa_amd" vs eager, on a tiny random-init config (no download): logits, loss,
and every gradient, the sinks' included, on a padded batch (the varlen path) longer than the
sliding window; and greedy generation through the KV cache."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fa_amd  # noqa: F401  (registers "fa_amd" with transformers)

transformers = pytest.importorskip("transformers")
GptOssConfig = pytest.importorskip("transformers.models.gpt_oss").GptOssConfig
from transformers import GptOssForCausalLM  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


_CB_SCRIPT = textwrap.dedent(
    """
    import copy, inspect, os, sys, torch, fa_amd
    fa_amd.integrations.route_flash_attention_2()
    import fa_amd.kvcache as kvcache
    import transformers.generation.continuous_batching.initialization as cb_init
    from transformers import ContinuousBatchingConfig, GenerationConfig, GptOssConfig, GptOssForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32  # greedy tokens of a random tiny model: bf16 rounding could flip a near tie
    # force the decode fast path (block tables: the paged decode kernel), which Transformers offers on CUDA only
    if hasattr(cb_init, "ensure_decode_fast_path_is_available"):
        cb_init.ensure_decode_fast_path_is_available = lambda *args, **kwargs: None
    decode_sinks = []
    real = kvcache.decode_attention
    def spy(*args, **kwargs):
        if kwargs.get("block_table") is not None:
            decode_sinks.append(kwargs.get("sinks") is not None)
        return real(*args, **kwargs)
    kvcache.decode_attention = spy

    def model_for(layer_types):
        cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=6, layer_types=layer_types,
                           max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)
        torch.manual_seed(0)
        model = GptOssForCausalLM(cfg).eval()
        with torch.no_grad():  # sinks that change the tokens (at init they are ~N(0, 0.02))
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(2.0, 1.0)
        return model.to(device=device, dtype=dtype)

    torch.manual_seed(3)
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (5, 3, 11)]
    new = 6
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=-1)
    params = inspect.signature(ContinuousBatchingConfig).parameters
    page_arg = "page_size" if "page_size" in params else "block_size"  # renamed after Transformers 5.17
    fast = {"max_blocks_per_request": 8} if "max_blocks_per_request" in params else {}

    def eager(model):
        model.set_attn_implementation("eager")
        return [model.generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False,
                               pad_token_id=0, eos_token_id=-1)[0, len(p):].tolist() for p in prompts]

    # sliding + full layers (Transformers 5.24 turns the decode fast path off for sliding layers), then full only
    for layer_types in (["sliding_attention", "full_attention"], ["full_attention", "full_attention"]):
        model = model_for(layer_types)
        expected = eager(model)
        without_sinks = copy.deepcopy(model)
        with torch.no_grad():
            for layer in without_sinks.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        assert eager(without_sinks) != expected, "the sinks must change the tokens for this check to mean anything"
        model.set_attn_implementation("flash_attention_2")
        # not auto-corrected to a Hub kernel of gpt-oss's _compatible_flash_implementations
        assert model.config._attn_implementation == "flash_attention_2", model.config._attn_implementation
        # (no CUDA graphs: with them, on an H200 with Transformers 5.17 and torch 2.11, the capture failed inside
        # gpt-oss's MoE experts -- Transformers' grouped_mm path copies a CPU tensor during capture -- not in the
        # attention)
        cb = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, use_cuda_graph=False, **{page_arg: 16},
                                      **fast)
        results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
        got = [results[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert got == expected, (layer_types, got, expected)
    # the full-attention model's decode-only batches ran the paged decode kernel, sinks included
    assert decode_sinks and all(decode_sinks), decode_sinks
    print("cb-ok", len(decode_sinks))
    """
)


def test_gpt_oss_continuous_batching_through_the_flash_attention_2_route():
    """generate_batch on gpt-oss (learnable sinks) through route_flash_attention_2(): "flash_attention_2" stays
    fa_amd (not the Hub kernel gpt-oss's `_compatible_flash_implementations` names), the sinks reach the varlen
    and the paged decode kernels, and the greedy tokens equal eager generate()'s. In a fresh interpreter: the
    routing is process-global."""
    result = subprocess.run([sys.executable, "-c", _CB_SCRIPT], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=600, env=dict(os.environ))
    assert result.returncode == 0 and "cb-ok" in result.stdout, (result.stdout + result.stderr)[-4000:]
