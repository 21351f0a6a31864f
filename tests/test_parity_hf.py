"""fa_amd inside tiny random-init Llama / Mistral models vs eager attention.

Everything is built from configs (no downloads).  CPU runs use the Triton
interpreter in fp32 (plus one fp16 case); the @gpu variants repeat the checks in
bf16 and train for a few steps.
"""
import pytest
import torch

import fa_amd  # noqa: F401  (registers "fa_amd" with transformers)

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from fa_amd.integrations.monkey_patch import apply_fa_amd_to_llama, revert_fa_amd_patches  # noqa: E402

VOCAB = 128
SEQ = 24
SLIDING_WINDOW = 8  # shorter than SEQ, so Mistral's window really cuts

FP32_TOL = dict(atol=2e-5, rtol=2e-5)
HALF_TOL = dict(atol=4e-2, rtol=4e-2)


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    return MistralConfig(sliding_window=SLIDING_WINDOW, **common)


def tiny_model(family: str, device, dtype=torch.float32, attn="fa_amd", **overrides):
    torch.manual_seed(0)
    cls = LlamaForCausalLM if family == "llama" else MistralForCausalLM
    model = cls(tiny_config(family, **overrides)).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(attn)
    return model


def logits_with(model, attn, **inputs):
    model.set_attn_implementation(attn)
    return model(**inputs).logits


def padded_batch(device, side: str, lengths=(SEQ, 17, 9)):
    torch.manual_seed(1)
    batch = len(lengths)
    ids = torch.randint(3, VOCAB, (batch, SEQ), device=device)
    mask = torch.zeros(batch, SEQ, dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, SEQ - n :] = 1
        else:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


FAMILIES = ["llama", "mistral"]


# --------------------------------------------------------------------------- logits


def _check_logits(family, device, dtype, side, tol):
    model = tiny_model(family, device, dtype)
    if side == "none":
        ids = torch.randint(3, VOCAB, (2, SEQ), device=device)
        inputs = dict(input_ids=ids)
        keep = torch.ones(2, SEQ, dtype=torch.bool, device=device)
    else:
        ids, mask = padded_batch(device, side)
        inputs = dict(input_ids=ids, attention_mask=mask)
        keep = mask.bool()
    with torch.no_grad():
        ref = logits_with(model, "eager", **inputs)
        out = logits_with(model, "fa_amd", **inputs)
    assert out.dtype == ref.dtype
    # padded positions are garbage in both implementations; compare real tokens
    torch.testing.assert_close(out[keep].float(), ref[keep].float(), **tol)


@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager_fp32(family, side, device):
    _check_logits(family, device, torch.float32, side, FP32_TOL)


def test_logits_match_eager_fp16(device):
    _check_logits("llama", device, torch.float16, "left", HALF_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager_bf16(family, side, device):
    _check_logits(family, device, torch.bfloat16, side, HALF_TOL)


# --------------------------------------------------------------------------- packing


def _samples(device, lengths=(11, 7, 13)):
    torch.manual_seed(2)
    return [torch.randint(3, VOCAB, (n,)).tolist() for n in lengths]


def _packed_vs_padded(family, device, dtype, tol):
    model = tiny_model(family, device, dtype)
    samples = _samples(device)
    features = [{"input_ids": s} for s in samples]
    with_pos = DataCollatorWithFlattening(return_position_ids=True)(features, return_tensors="pt")
    with_cu = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(
        features, return_tensors="pt"
    )
    assert "cu_seq_lens_q" in with_cu and "position_ids" not in with_cu

    # reference: every sample on its own row (right padded), eager attention
    longest = max(map(len, samples))
    ids = torch.zeros(len(samples), longest, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = torch.tensor(s, device=device)
        mask[row, : len(s)] = 1
    with torch.no_grad():
        ref_rows = logits_with(model, "eager", input_ids=ids, attention_mask=mask)
        ref = torch.cat([ref_rows[row, : len(s)] for row, s in enumerate(samples)])

        model.set_attn_implementation("fa_amd")
        by_pos = model(
            input_ids=with_pos["input_ids"].to(device), position_ids=with_pos["position_ids"].to(device)
        ).logits[0]
        by_cu = model(
            input_ids=with_cu["input_ids"].to(device),
            cu_seq_lens_q=with_cu["cu_seq_lens_q"].to(device),
            cu_seq_lens_k=with_cu["cu_seq_lens_k"].to(device),
            max_length_q=int(with_cu["max_length_q"]),
            max_length_k=int(with_cu["max_length_k"]),
        ).logits[0]
    torch.testing.assert_close(by_pos.float(), ref.float(), **tol)
    torch.testing.assert_close(by_cu.float(), ref.float(), **tol)


@pytest.mark.parametrize("packed", [True, False])
def test_one_row_under_torch_compile_fullgraph(device, packed):
    """A batch-1 forward with position ids and no mask (packed documents, or one plain sequence) compiles with
    fullgraph=True: where the positions restart is read inside fa_amd::attention_fwd_by_positions, not by
    the traced code (a data-dependent guard there refused fullgraph, audit 2026-11-28); logits and gradients
    match the same model's eager run."""
    samples = _samples(device) if packed else _samples(device, lengths=(19,))
    features = [{"input_ids": s} for s in samples]
    batch = DataCollatorWithFlattening(return_position_ids=True)(features, return_tensors="pt")
    ids, positions = batch["input_ids"].to(device), batch["position_ids"].to(device)
    model = tiny_model("llama", device)

    def loss_of(forward):
        model.zero_grad(set_to_none=True)
        logits = forward(input_ids=ids, position_ids=positions, use_cache=False).logits
        logits.float().square().mean().backward()
        return logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    want, want_grad = loss_of(model)
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    got, got_grad = loss_of(torch.compile(model, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, **FP32_TOL)
    torch.testing.assert_close(got_grad, want_grad, **FP32_TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_match_padded(family, device):
    _packed_vs_padded(family, device, torch.float32, FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_match_padded_bf16(family, device):
    _packed_vs_padded(family, device, torch.bfloat16, HALF_TOL)


# --------------------------------------------------------------------------- gradients


def _grads(model, attn, ids, mask, labels):
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    loss.backward()
    params = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), embeds.grad.detach().clone(), params


def _check_grads(family, device, dtype, tol):
    model = tiny_model(family, device, dtype).train()  # attention_dropout is 0: deterministic
    ids, mask = padded_batch(device, "right")
    labels = ids.masked_fill(mask == 0, -100)
    loss_ref, dx_ref, dp_ref = _grads(model, "eager", ids, mask, labels)
    loss, dx, dp = _grads(model, "fa_amd", ids, mask, labels)
    torch.testing.assert_close(loss.float(), loss_ref.float(), **tol)
    keep = mask.bool()
    torch.testing.assert_close(dx[keep].float(), dx_ref[keep].float(), **tol)
    assert dp.keys() == dp_ref.keys() and len(dp) > 0
    for name in dp:
        torch.testing.assert_close(dp[name].float(), dp_ref[name].float(), **tol, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_eager(family, device):
    _check_grads(family, device, torch.float32, dict(atol=5e-5, rtol=5e-4))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_eager_bf16(family, device):
    _check_grads(family, device, torch.bfloat16, dict(atol=6e-2, rtol=6e-2))


# --------------------------------------------------------------------------- generation


def _greedy(model, attn, ids, mask, new_tokens=16, **kwargs):
    model.set_attn_implementation(attn)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return out[:, ids.shape[1] :]


def _check_generate(family, device, dtype, new_tokens=16, lengths=(12, 7), **kwargs):
    model = tiny_model(family, device, dtype)
    ids, mask = padded_batch(device, "left", lengths=lengths)
    ids, mask = ids[:, -12:], mask[:, -12:]
    ref = _greedy(model, "eager", ids, mask, new_tokens, **kwargs)
    out = _greedy(model, "fa_amd", ids, mask, new_tokens, **kwargs)
    assert out.shape[1] == new_tokens
    assert torch.equal(out, ref), f"fa_amd {out.tolist()} != eager {ref.tolist()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_matches_eager(family, device):
    # Mistral: 12 prompt + 16 new tokens > window 8, so decode runs the sliding window over the cache
    _check_generate(family, device, torch.float32)


def test_generate_static_cache_matches_eager(device):
    # Without padding generate() drops the mask, and the static cache hands the
    # attention its whole preallocated buffer: the "fa_amd" mask function must
    # let the attention crop the empty tail.
    _check_generate("llama", device, torch.float32, new_tokens=6, lengths=(12, 12), cache_implementation="static")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_matches_eager_bf16(family, device):
    _check_generate(family, device, torch.bfloat16)


# --------------------------------------------------------------------------- PEFT / LoRA


def _check_lora(device, dtype, tol):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", device, dtype)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    # non-zero B so the adapters change the output and get gradients everywhere
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora.train()
    # right padding: with left padding the first real label is predicted from a
    # pad position, whose logits are implementation-defined garbage
    ids, mask = padded_batch(device, "right")
    labels = ids.masked_fill(mask == 0, -100)

    def run(attn):
        lora.get_base_model().set_attn_implementation(attn)
        lora.zero_grad(set_to_none=True)
        out = lora(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in lora.named_parameters() if p.requires_grad}
        return out.logits.detach(), out.loss.detach(), grads

    logits_ref, loss_ref, grads_ref = run("eager")
    logits, loss, grads = run("fa_amd")
    keep = mask.bool()
    torch.testing.assert_close(logits[keep].float(), logits_ref[keep].float(), **tol)
    torch.testing.assert_close(loss.float(), loss_ref.float(), **tol)
    assert len(grads) > 0 and all(g is not None for g in grads.values())
    for name in grads:
        torch.testing.assert_close(grads[name].float(), grads_ref[name].float(), **tol, msg=name)


def test_peft_lora_forward_backward(device):
    _check_lora(device, torch.float32, dict(atol=5e-5, rtol=5e-4))


@pytest.mark.gpu
def test_peft_lora_forward_backward_bf16(device):
    _check_lora(device, torch.bfloat16, dict(atol=6e-2, rtol=6e-2))


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_fullgraph_forward(family, device):
    """The whole model forward traces as one graph: no graph break in the fa_amd path."""
    model = tiny_model(family, device)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=device)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_torch_compile_fullgraph_fused_rotary(device):
    model = tiny_model("llama", device)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=device)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    try:
        apply_fa_amd_to_llama(model)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = compiled(input_ids=ids).logits
        out.sum().backward()  # compiled backward through both custom ops
    finally:
        revert_fa_amd_patches()
        torch._dynamo.reset()
    torch.testing.assert_close(out.detach(), ref, **FP32_TOL)


# --------------------------------------------------------------------------- patched rotary


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_rotary_matches_unpatched(family, device):
    from fa_amd.integrations.monkey_patch import apply_fa_amd_to_mistral

    patch = apply_fa_amd_to_llama if family == "llama" else apply_fa_amd_to_mistral
    model = tiny_model(family, device, attn="eager")
    ids, mask = padded_batch(device, "right")
    labels = ids.masked_fill(mask == 0, -100)
    plain = model(input_ids=ids, attention_mask=mask, labels=labels)
    plain.loss.backward()
    ref_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    try:
        assert patch(model) is model
        assert model.config._attn_implementation == "fa_amd"
        fused = model(input_ids=ids, attention_mask=mask, labels=labels)
        fused.loss.backward()
    finally:
        revert_fa_amd_patches()
    keep = mask.bool()
    torch.testing.assert_close(fused.logits[keep], plain.logits[keep], **FP32_TOL)
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, ref_grad, atol=5e-5, rtol=5e-4)


# --------------------------------------------------------------------------- the three ways in


def test_from_pretrained_from_config_and_not_saved(tmp_path, device):
    model = tiny_model("llama", device)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="fa_amd")
    assert loaded.config._attn_implementation == "fa_amd"
    assert all(layer.self_attn.config._attn_implementation == "fa_amd" for layer in loaded.model.layers)
    ids = torch.randint(3, VOCAB, (1, 9), device=device)
    with torch.no_grad():
        torch.testing.assert_close(loaded.to(device)(input_ids=ids).logits, model(input_ids=ids).logits)

    from_cfg = AutoModelForCausalLM.from_config(tiny_config("mistral"), attn_implementation="fa_amd")
    assert from_cfg.config._attn_implementation == "fa_amd"

    # the choice lives on the loaded object only: config.json does not record it
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config._attn_implementation != "fa_amd"
    assert "fa_amd" not in (tmp_path / "config.json").read_text()


def test_patch_before_construction_defaults_to_fa_amd(tmp_path, device):
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path)
    try:
        apply_fa_amd_to_llama()
        model = LlamaForCausalLM(tiny_config("llama"))
        assert model.config._attn_implementation == "fa_amd"
        assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "fa_amd"
        assert AutoModelForCausalLM.from_config(tiny_config("llama")).config._attn_implementation == "fa_amd"
        explicit = LlamaForCausalLM._from_config(tiny_config("llama"), attn_implementation="eager")
        assert explicit.config._attn_implementation == "eager"
        import transformers.models.llama.modeling_llama as modeling

        assert modeling.apply_rotary_pos_emb.__module__ == "fa_amd.integrations.monkey_patch"
        mistral = MistralForCausalLM(tiny_config("mistral"))  # other families untouched
        assert mistral.config._attn_implementation != "fa_amd"
    finally:
        revert_fa_amd_patches()
    import transformers.models.llama.modeling_llama as modeling

    assert modeling.apply_rotary_pos_emb.__module__ == modeling.__name__
    assert LlamaForCausalLM(tiny_config("llama")).config._attn_implementation != "fa_amd"


# --------------------------------------------------------------------------- dropout / dtype


def test_attention_dropout_only_in_training(device):
    model = tiny_model("llama", device, attention_dropout=0.5)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=device)
    with torch.no_grad():
        eval_eager = logits_with(model, "eager", input_ids=ids)
        eval_fa = logits_with(model, "fa_amd", input_ids=ids)
        torch.testing.assert_close(eval_fa, eval_eager, **FP32_TOL)
        model.train()
        torch.manual_seed(0)
        train_a = model(input_ids=ids).logits
        torch.manual_seed(1)
        train_b = model(input_ids=ids).logits
    assert not torch.allclose(train_a, eval_fa, atol=1e-3)
    assert not torch.allclose(train_a, train_b, atol=1e-3)
    assert torch.isfinite(train_a).all()


# --------------------------------------------------------------------------- GPU training


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_decrease_loss(family, device):
    """fa_amd + fused rotary + packing + dropout, bf16 autocast, 10 AdamW steps on a repeated batch."""
    from fa_amd.integrations.monkey_patch import apply_fa_amd

    torch.manual_seed(0)
    cls = LlamaForCausalLM if family == "llama" else MistralForCausalLM
    model = cls(tiny_config(family, attention_dropout=0.1, hidden_size=128, num_attention_heads=8,
                            num_key_value_heads=2)).to(device)
    try:
        apply_fa_amd(model)
        model.train()
        samples = [torch.randint(3, VOCAB, (n,)).tolist() for n in (40, 23, 57, 31)]
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": s} for s in samples], return_tensors="pt"
        )
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(10):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        revert_fa_amd_patches()
    print(f"{family} fa_amd+fused-rope+packing+dropout losses:", [round(x, 4) for x in losses])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses
