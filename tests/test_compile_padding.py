"""torch.compile(fullgraph=True) with padding: fa_amd's mask function and padded path do no
data-dependent Python control flow and no device->host sync, so a left- and right-padded batch
compiles as one graph (forward and backward) and matches eager, and KV-cache generation with a
StaticCache runs compiled.  Plus the padded path's exactness on masks with holes and on a static
cache's unfilled tail (CPU: tiny 1-layer models, aot_eager)."""
import pytest
import torch

import fa_amd  # noqa: F401
from fa_amd.kernels import launch
from fa_amd.reference import attention_ref

transformers = pytest.importorskip("transformers")
from fa_amd.integrations.hf_attention import fa_amd_attention_forward, fa_amd_attention_mask  # noqa: E402

VOCAB = 64


def _tiny_llama(device):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device)


def _left_and_right_padded(device):
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 10), device=device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0   # left padded
    mask[1, 7:] = 0   # right padded
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_padded_batch_compiles_fullgraph_and_matches_eager(device, backend):
    model = _tiny_llama(device)
    ids, mask = _left_and_right_padded(device)
    labels = ids.masked_fill(mask == 0, -100)
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, attention_mask=mask)
    model.set_attn_implementation("fa_amd")
    eager_fa = model(input_ids=ids, attention_mask=mask, labels=labels)
    eager_fa.loss.backward()
    ref_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break raises
    out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep].detach(), ref.logits[keep].detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.loss, eager_fa.loss, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, ref_grad, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_static_cache_generation_compiles_and_matches_eager(device, backend):
    model = _tiny_llama(device).eval()
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 8), device=device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.set_attn_implementation("eager")
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    model.set_attn_implementation("fa_amd")
    config = transformers.CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True  # Transformers compiles decoding on GPUs only unless told
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = model.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=config, **kwargs)
    assert torch.equal(out, ref)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decode steps ran compiled
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


class _Module(torch.nn.Module):
    is_causal = True


def test_padded_path_is_exact_for_holes_and_unfilled_cache_slots(device, monkeypatch):
    """Any 2D keep-mask (holes too), and a static cache's buffer whose tail is unfilled: each row
    attends its kept keys, queries are the newest tokens; padded rows come back as zeros.  The mask is
    int32, as fa_amd's own static-cache masks are: each kept column holds its distance to where the row's
    queries end plus one (rows filled to different slots here: each row's end after its last kept key;
    hf_attention._query_ends)."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    torch.manual_seed(3)
    b, hq, hk, d, length = 3, 4, 2, 16, 12
    k = torch.randn(b, hk, length, d, device=device)
    v = torch.randn(b, hk, length, d, device=device)
    mask = torch.ones(b, length, dtype=torch.bool, device=device)
    mask[0, [2, 5, 6]] = False  # holes
    mask[1, 9:] = False  # a static cache filled up to slot 9
    mask[2, :4] = False
    mask[2, 10:] = False  # left padding + unfilled tail
    for q_len in (length, 1, 3):  # prefill, decode, chunked prefill
        q = torch.randn(b, hq, q_len, d, device=device, requires_grad=True)
        ends = (mask * torch.arange(1, length + 1, device=device)).amax(-1, keepdim=True)
        encoded = (mask * (ends - torch.arange(length, device=device) + 1)).to(torch.int32)
        out, _ = fa_amd_attention_forward(_Module(), q, k, v, encoded)
        for row in range(b):
            kept = mask[row].nonzero().flatten()
            if q_len == length:
                queries = kept  # prefill: each kept token is a query
            else:
                queries = torch.arange(q_len, device=device) + (kept[-1] - q_len + 1)
            cols = queries if q_len == length else torch.arange(q_len, device=device)
            ref, _ = attention_ref(q[row:row + 1, :, cols].transpose(1, 2), k[row:row + 1, :, kept].transpose(1, 2),
                                   v[row:row + 1, :, kept].transpose(1, 2), causal=True)
            torch.testing.assert_close(out[row, cols].double(), ref[0].detach(), atol=1e-5, rtol=1e-5)
            if q_len == length:
                assert torch.equal(out[row, ~mask[row]], torch.zeros_like(out[row, ~mask[row]]))
        out.sum().backward()
        assert torch.isfinite(q.grad).all()
        if q_len == length:  # padded query rows get exactly zero gradient
            assert torch.equal(q.grad.transpose(1, 2)[~mask], torch.zeros_like(q.grad.transpose(1, 2)[~mask]))


def test_mask_function_has_no_data_dependent_control_flow():
    """Under torch.compile the mask is built from shapes alone; static-cache offsets stay tensors."""
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :2] = False

    def build(mask, offset):
        return fa_amd_attention_mask(2, 1, 16, q_offset=offset, kv_offset=0, attention_mask=mask)

    torch._dynamo.reset()
    out = torch.compile(build, backend="eager", fullgraph=True)(mask, torch.tensor(6))
    assert out.shape == (2, 16) and torch.equal(out[:, :7].bool(), mask) and not out[:, 7:].any()
    # (int32, a static cache's mask: each kept column holds its distance to the queries' end, slot 7, plus one)
    assert out.dtype == torch.int32 and torch.equal(out[:, :7], mask * (8 - torch.arange(7)))
    nothing_padded = torch.compile(lambda m: fa_amd_attention_mask(2, 7, 7, attention_mask=m), backend="eager",
                                   fullgraph=True)(torch.ones(2, 7, dtype=torch.bool))
    assert nothing_padded.shape == (2, 7) and nothing_padded.all()  # compiled: a mask, not a mask.all() branch
    assert fa_amd_attention_mask(2, 7, 7, attention_mask=torch.ones(2, 7, dtype=torch.bool)) is None  # eager
    torch._dynamo.reset()
