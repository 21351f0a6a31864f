"""Transformers generation on fa_amd's decode kernel: greedy tokens of generate() match eager with
DynamicCache and StaticCache (also under torch.compile), padding masks (also with holes), and
continuous batching (generate_batch and the manager behind `transformers serve`) through the
flash_attention_2 route.  Tiny random models, few tokens (the CPU runs the interpreter)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fa_amd  # noqa: F401  (registers "fa_amd")

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

import fa_amd.kvcache as kvcache  # noqa: E402
from fa_amd.integrations import hf_attention  # noqa: E402
from fa_amd.reference import attention_ref  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 128


def tiny_llama(device, dtype=torch.float32):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def prompts(device, padded: bool):
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12), device=device)
    mask = torch.ones_like(ids)
    if padded:  # left padding, as generate() wants
        mask[1, :5] = 0
        ids[1, :5] = 0
    return ids, mask


def _query_shapes_of_calls(monkeypatch, owner, name):
    """The shapes of the first argument (q) of every call to owner.name from now on."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.fixture
def decode_calls(monkeypatch):
    """The q shapes (flash layout) of the decode kernel's calls from the HF route: through decode_attention (the
    glue imports it at call time), or a decode step's filed plan run directly (hf_attention.run_filed_plan)."""
    calls = _query_shapes_of_calls(monkeypatch, kvcache, "decode_attention")
    real = hf_attention.run_filed_plan

    def spy(plan, q, k_cache, v_cache):
        calls.append(q.transpose(1, 2).shape)  # (the step hands over Transformers' (batch, heads, seq, d) tensors)
        return real(plan, q, k_cache, v_cache)

    monkeypatch.setattr(hf_attention, "run_filed_plan", spy)
    return calls


def greedy(model, attn, ids, mask, new_tokens, compile_backend=None, **kwargs):
    model.set_attn_implementation(attn)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              **kwargs)
    if compile_backend is not None:
        config.compile_config = transformers.CompileConfig(backend=compile_backend, fullgraph=True,
                                                           mode=None if compile_backend != "inductor" else
                                                           "reduce-overhead")
        config.compile_config._compile_all_devices = True  # the CPU too (Transformers compiles on GPUs only)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_takes_the_decode_kernel_and_matches_eager(device, decode_calls, cache):
    # (tests/test_parity_hf.py compares more generate() variants; this one checks the kernel they take)
    model = tiny_llama(device)
    ids, mask = prompts(device, padded=True)
    kwargs = {} if cache == "dynamic" else dict(cache_implementation="static")
    ref = greedy(model, "eager", ids, mask, 3, **kwargs)
    out = greedy(model, "fa_amd", ids, mask, 3, **kwargs)
    assert torch.equal(out, ref), f"fa_amd {out.tolist()} != eager {ref.tolist()}"
    # every decode step (2 after the prefill) of each of the 2 layers ran the decode kernel; with a
    # static cache the 12-token prefill over its whole buffer did too
    assert sum(1 for shape in decode_calls if shape[1] == 1) == 2 * 2
    assert sum(1 for shape in decode_calls if shape[1] == 12) == (2 if cache == "static" else 0)


def test_static_cache_under_torch_compile_matches_eager(device, decode_calls):
    model = tiny_llama(device)
    ids, mask = prompts(device, padded=True)
    ref = greedy(model, "eager", ids, mask, 3, cache_implementation="static")
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    out = greedy(model, "fa_amd", ids, mask, 3, compile_backend=backend, cache_implementation="static")
    torch._dynamo.reset()
    assert torch.equal(out, ref), f"fa_amd {out.tolist()} != eager {ref.tolist()}"
    assert decode_calls  # traced through the decode op


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_sliding_window_static_cache_with_padding_matches_eager(device, decode_calls, compile_backend):
    """Mistral-style sliding window with a static cache and a left-padded batch, prompts past the window:
    generate() builds the masks first and the model builds its one mask again from that 2D keep-mask,
    which must come out the same (audit 2026-11-25: every row diverged from eager at the first step)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, sliding_window=8)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to(device).eval()
    with torch.no_grad():  # sharper attention, so a wrong mask cannot hide in near-uniform weights
        for name, p in model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(8)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 14), device=device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :10] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = greedy(model, "eager", ids, mask, 5, cache_implementation="static")
    torch._dynamo.reset()
    out = greedy(model, "fa_amd", ids, mask, 5, compile_backend=compile_backend, cache_implementation="static")
    torch._dynamo.reset()
    assert torch.equal(out, ref), f"fa_amd {out.tolist()} != eager {ref.tolist()}"
    assert decode_calls


def test_mask_builder_is_idempotent_on_its_own_masks():
    """The 2D keep-mask of a sliding layer given back to the builder (generate() with a static cache, one-mask
    models) comes out unchanged, as Transformers' flash mask does; a full layer's too."""
    padding = torch.ones(3, 15, dtype=torch.bool)
    padding[1, :5] = False
    padding[2, :10] = False
    for kv_length, kv_offset in ((8, 7), (20, 0), (15, 0)):
        args = dict(batch_size=3, q_length=1, kv_length=kv_length, q_offset=14, kv_offset=kv_offset)
        first = hf_attention.fa_amd_attention_mask(**args, attention_mask=padding)
        assert first is not None and first.shape == (3, kv_length)
        position = kv_offset + torch.arange(kv_length)
        expected = padding[:, position.clamp(max=14)] & (position < 15)
        if kv_offset + kv_length > 15:  # an unfilled tail: int32, each kept slot its distance to slot 15, plus one
            expected = (expected * (16 - position)).to(torch.int32)
        assert torch.equal(first, expected)
        assert torch.equal(hf_attention.fa_amd_attention_mask(**args, attention_mask=first), first)


def test_decode_with_mask_holes_and_static_buffer_tail(device):
    """A hand-made mask with holes (not left padding) and a static buffer longer than the mask: the
    device-side bounds plus the per-key mask give eager attention's result, without a sync."""
    torch.manual_seed(0)
    b, hq, hk, d, length, buffer = 3, 4, 2, 16, 11, 20
    q = torch.randn(b, hq, 1, d, device=device)
    k = torch.randn(b, hk, buffer, d, device=device)
    v = torch.randn(b, hk, buffer, d, device=device)
    mask = torch.ones(b, length, dtype=torch.long, device=device)
    mask[0, 2:5] = 0  # a hole
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding (the last query still attends what it may)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = hf_attention.fa_amd_attention_forward(module, q, k, v, mask)
    keep = mask.bool()
    for row in range(b):
        kk = k[row:row + 1, :, :length][:, :, keep[row]].transpose(1, 2)
        vv = v[row:row + 1, :, :length][:, :, keep[row]].transpose(1, 2)
        ref, _ = attention_ref(q[row:row + 1].transpose(1, 2), kk, vv, causal=False)
        torch.testing.assert_close(out[row:row + 1].double(), ref, atol=1e-5, rtol=1e-5)


def _sharp_twins(config_cls, device, **config):
    """Two copies of one tiny random model (eager, fa_amd), q/k weights x8 so the attention is far from uniform
    and a wrong mask cannot hide in near-uniform weights."""
    import copy

    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **config)
    models = {}
    for impl in ("eager", "fa_amd"):
        torch.manual_seed(0)
        models[impl] = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                                     attn_implementation=impl).to(device).eval()
    with torch.no_grad():
        for name, p in models["eager"].named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    models["fa_amd"].load_state_dict(models["eager"].state_dict())
    return models


def _chunk_after_a_prompt(models, new_mask):
    """Each model's logits for a new chunk (padded as new_mask says) on a DynamicCache filled by a 6-token prompt."""
    from transformers import DynamicCache

    device = new_mask.device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=gen).to(device)
    new = torch.randint(3, VOCAB, tuple(new_mask.shape), generator=gen).to(device)
    full = torch.cat([torch.ones(2, 6, dtype=torch.long, device=device), new_mask], 1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)[:, -new_mask.shape[1]:]
    out = {}
    for impl, model in models.items():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            out[impl] = model(input_ids=new, attention_mask=full, position_ids=positions, past_key_values=cache,
                              use_cache=True).logits
    return out


def _real_token_logit_error(out, mask):
    return ((out["fa_amd"] - out["eager"]).abs() * mask[..., None]).max().item()


@pytest.mark.parametrize("new_tokens", [4, 20])  # the decode kernel's route, the varlen one
def test_right_padded_chunk_on_a_cache_matches_eager(device, new_tokens):
    """A batch continues on a filled cache with new chunks of different lengths, right-padded: the queries
    end the keys (Transformers' flash convention), so the real tokens sit before the padding (audit
    2026-11-28: they were aligned to the row's last kept key, logits off by 0.2-0.4)."""
    new_mask = torch.ones(2, new_tokens, dtype=torch.long, device=device)
    new_mask[1, new_tokens // 2:] = 0
    out = _chunk_after_a_prompt(_sharp_twins(LlamaConfig, device), new_mask)
    assert _real_token_logit_error(out, new_mask) < 1e-4


@pytest.mark.parametrize("every_row_padded", [False, True])
@pytest.mark.parametrize("length", [8, 20])
def test_right_padded_prefill_into_a_static_cache_matches_eager(device, length, every_row_padded):
    """fa_amd's mask for a cache with an unfilled tail tells, in every kept slot, where the queries end, so a
    right-padded prompt's real tokens keep their places (audit 2026-11-28: logits off by 0.45-0.7), also when
    every row ends in padding (a second audit that day: a marker on the newest filled slot alone was lost
    there, logits off by 0.64), and so does the next decode step on that cache."""
    from transformers import StaticCache

    models = _sharp_twins(LlamaConfig, device)
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, length * 2 // 3:] = 0
    if every_row_padded:
        mask[0, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    out, step = {}, {}
    for impl, model in models.items():
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=cache).logits
            step[impl] = model(input_ids=torch.tensor([[5], [6]], device=device), attention_mask=step_mask,
                               position_ids=step_mask.sum(-1, keepdim=True) - 1, use_cache=True,
                               past_key_values=cache).logits
    assert _real_token_logit_error(out, mask) < 1e-4
    assert (step["fa_amd"] - step["eager"]).abs().max().item() < 1e-4


def test_sliding_window_over_a_left_padded_chunk_matches_eager(device):
    """A sliding window (Mistral, 5) on a cache continued by a left-padded 20-token chunk: gaps in the middle of
    the mask.  The window counts cache slots, as eager does (the decode kernel; the varlen route packed the
    kept keys and counted the window over them: logits off by 0.67, audit 2026-11-28)."""
    from transformers import MistralConfig

    new_mask = torch.ones(2, 20, dtype=torch.long, device=device)
    new_mask[1, :10] = 0
    out = _chunk_after_a_prompt(_sharp_twins(MistralConfig, device, sliding_window=5), new_mask)
    assert _real_token_logit_error(out, new_mask) < 1e-4


@pytest.mark.parametrize("mode", ["beam", "prompt_lookup"])
def test_beam_search_and_prompt_lookup_match_eager_per_step(device, decode_calls, mode):
    """Beam search (the cache's rows reordered every step) on a left-padded batch, and prompt-lookup decoding
    (several draft tokens verified at once against the cache, which is then cropped), on a sliding-window model
    whose prompt outruns the window: tokens and every step's logits equal eager's (audit 2026-11-29)."""
    from transformers import MistralConfig

    models = _sharp_twins(MistralConfig, device, sliding_window=5)
    gen = torch.Generator().manual_seed(1)
    if mode == "beam":
        ids = torch.randint(3, VOCAB, (2, 9), generator=gen).to(device)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        kwargs = dict(num_beams=2, max_new_tokens=3)
    else:  # a repetitive prompt, so the lookup finds drafts
        base = torch.randint(3, VOCAB, (1, 6), generator=gen)
        ids = torch.cat([base, base, base[:, :3]], 1).to(device)
        mask = torch.ones_like(ids)
        kwargs = dict(prompt_lookup_num_tokens=3, max_new_tokens=6)
    ids = ids.masked_fill(mask == 0, 0)
    out = {}
    for impl, model in models.items():
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                                   return_dict_in_generate=True, output_logits=True, **kwargs)
    assert torch.equal(out["fa_amd"].sequences, out["eager"].sequences)
    assert len(out["fa_amd"].logits) == len(out["eager"].logits)
    for got, ref in zip(out["fa_amd"].logits, out["eager"].logits):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert decode_calls and (mode == "beam" or any(shape[1] > 1 for shape in decode_calls))


def test_mask_patterns_fa_amd_does_not_compute_raise():
    """Chunked attention (Llama 4), bidirectional blocks or a model's own or/and overlay (Gemma 3's image
    tokens) would be silently dropped: the mask builder raises; the patterns it computes pass."""
    mu = pytest.importorskip("transformers.masking_utils")
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[1, :3] = False
    args = dict(batch_size=2, q_length=10, kv_length=10, attention_mask=padding)
    for fine in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(4),
                 mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(padding))):
        assert hf_attention.fa_amd_attention_mask(**args, mask_function=fine) is not None

    def image_blocks(batch_idx, head_idx, q_idx, kv_idx):  # a model's own overlay
        return kv_idx < 0

    for unsupported in (mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)),
                        mu.or_masks(mu.causal_mask_function, image_blocks),
                        mu.and_masks(mu.causal_mask_function, image_blocks)):
        with pytest.raises(ValueError, match="fa_amd computes causal.*attn_implementation='sdpa'"):
            hf_attention.fa_amd_attention_mask(**args, mask_function=unsupported)


def test_training_forward_with_a_cache_keeps_the_differentiable_kernel(device, decode_calls):
    q = torch.randn(1, 4, 1, 16, device=device, requires_grad=True)
    k = torch.randn(1, 2, 9, 16, device=device)
    v = torch.randn(1, 2, 9, 16, device=device)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = hf_attention.fa_amd_attention_forward(module, q, k, v, None)
    out.sum().backward()
    assert q.grad is not None and not decode_calls


_CB_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, fa_amd
    fa_amd.integrations.route_flash_attention_2()
    import fa_amd.kvcache as kvcache
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    dtype = getattr(torch, os.environ.get("CB_DTYPE", "bfloat16" if device == "cuda" else "float32"))
    warmup = os.environ.get("CB_WARMUP") == "1"  # warm-up: CUDA graphs captured first (their pool shared)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    prompts = [[5, 9, 17, 33, 4], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    new = 4
    model.set_attn_implementation("eager")
    # eos disabled on both sides (continuous batching ignores min_new_tokens)
    expected = [model.generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False,
                               pad_token_id=0, eos_token_id=-1)[0, len(p):].tolist() for p in prompts]

    # the paged decode kernel, whichever way Transformers reaches it: fa_amd's attention function
    # (append_and_attend) or flash_attn_with_kvcache through the flash_attn stand-in (Transformers 5.17)
    paged_calls = []
    real = kvcache.decode_attention
    def spy(*args, **kwargs):
        if kwargs.get("block_table") is not None:
            paged_calls.append(1)
        return real(*args, **kwargs)
    kvcache.decode_attention = spy

    model.set_attn_implementation("flash_attention_2")
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=-1)
    import inspect
    # the page-size argument was renamed (block_size in Transformers <= 5.17, page_size later)
    page_arg = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    # ask for the decode fast path (block tables) where this Transformers has the option
    fast = {"max_blocks_per_request": 8} if "max_blocks_per_request" in inspect.signature(
        ContinuousBatchingConfig).parameters else {}
    cb = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, **{page_arg: 16}, **fast)
    results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False, warmup=warmup)
    got = [results[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert got == expected, (got, expected)

    # the manager behind `transformers serve`
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        rid = manager.add_request(prompts[2], max_new_tokens=new)
        result = manager.get_result(request_id=rid, timeout=600)
    finally:
        manager.stop(block=True)
    assert result is not None and result.generated_tokens == expected[2], result
    # decode-only batches take the block-table fast path (the paged decode kernel) wherever this
    # Transformers resolved it on (it offers it for flash implementations on CUDA only)
    resolved = getattr(getattr(manager, "continuous_batching_config", None), "max_blocks_per_request", None)
    if device == "cuda" and resolved:
        assert paged_calls, "the paged decode path never ran"
    print("fast path", resolved, file=sys.stderr)
    print("cb-ok", len(paged_calls))
    """
)


def _run_cb_script(**env):
    # conftest.py put TRITON_INTERPRET=1 in os.environ when there is no GPU; the child inherits it
    result = subprocess.run([sys.executable, "-c", _CB_SCRIPT], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=600, env=dict(os.environ, **env))
    assert result.returncode == 0 and "cb-ok" in result.stdout, (result.stdout + result.stderr)[-4000:]


def test_continuous_batching_through_the_flash_attention_2_route():
    """generate_batch and the serving manager run on fa_amd (varlen prefill; on a GPU also the paged
    decode kernel) and their greedy tokens equal eager generate()'s."""
    _run_cb_script()


@pytest.mark.gpu
def test_continuous_batching_fp32_with_graph_warmup_gpu():
    """float32 (whose decode tiles split the keys: the fused merge's counters) with generate_batch's warm-up,
    which captures CUDA graphs after eager runs inside the graphs' memory pool (audit 2026-11-25: the
    counters were allocated there and a graph's replays overwrote them)."""
    _run_cb_script(CB_DTYPE="float32", CB_WARMUP="1")


def test_bench_decode_and_generate_smoke(tmp_path):
    from fa_amd import bench_decode, cli

    perf = tmp_path / "PERF.md"
    perf.write_text("# Performance\n\nprefill tables\n")
    assert cli.main(["bench", "--decode", "--generate", "--smoke", "--out", str(tmp_path), "--markdown",
                     str(perf)]) == 0
    doc = (tmp_path / "decode.md").read_text()
    assert "KV GB/s" in doc and "new tokens/s" in doc
    assert "| b1 cache 40 |" in doc
    bench_decode.write_section(str(perf), "second run")  # replaces the section, keeps the rest
    text = perf.read_text()
    assert text.startswith("# Performance\n\nprefill tables") and text.count("## Decode and generation") == 1
    assert "second run" in text and "KV GB/s" not in text


def test_generate_table_shows_each_cells_round_spread():
    """generate() rounds are host-bound and spread widely: a cell gives the median round's new tokens/s and the
    slowest .. fastest round's, so a reader sees whether two cells' rounds overlap."""
    from fa_amd import bench_decode

    rows = [bench_decode.GenerateResult("fa_amd", "dynamic", tokens_per_s=1024 / 1.0, seconds=1.0,
                                        rounds_s=[1.0, 1.25, 0.8]),
            bench_decode.GenerateResult("sdpa", "dynamic", tokens_per_s=1000.0, seconds=1.024, rounds_s=[1.024])]
    doc = bench_decode.generate_markdown(rows, smoke=False)
    assert "| dynamic | 1024 (819 .. 1280) | 1000 |" in doc, doc


# --------------------------------------------------------------------------- GPU (bf16, real compile)

def test_unmasked_decode_steps_take_their_filed_plan(device, decode_calls, monkeypatch):
    """generate() with a dynamic cache and no padding: each step's first layer misses its step key (the cache
    grew by one key).  The first step's takes the full path, which files the plan under the step's key and its
    structure under the capacity-free grow key; later steps' first layers find their plan through that
    (decode.grown_plan), and every second layer's call takes the first's plan -- all without the glue, still
    through the decode kernel, with the same tokens as the full path every time, and as eager."""
    from fa_amd.kernels import decode

    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 dot is not exact)
    model = tiny_llama(device, dtype)
    ids, mask = prompts(device, padded=False)
    ref = greedy(model, "eager", ids, mask, 5)
    taken = _query_shapes_of_calls(monkeypatch, hf_attention, "_planned_decode_step")
    grown = []
    real_grown_plan = hf_attention.grown_plan
    monkeypatch.setattr(hf_attention, "grown_plan", lambda *args: grown.append(real_grown_plan(*args)) or grown[-1])
    out = greedy(model, "fa_amd", ids, mask, 5)
    # 4 steps after the prefill: layer 2 of each, and layer 1 of the later ones whose grow key found a plan (one
    # whose key count reaches a multiple of 16 takes the full path: Triton specialises that int differently)
    hits = sum(plan is not None for plan in grown)
    assert len(grown) == 4 and grown[0] is None and hits >= 2
    assert len(taken) == 4 + hits and all(shape[2] == 1 for shape in taken)
    assert sum(1 for shape in decode_calls if shape[1] == 1) == 2 * 4  # both layers, every step: the decode kernel
    decode.forget_plans()
    monkeypatch.setattr(hf_attention, "_decode_step_key", lambda *args: None)  # the full path every time
    full = greedy(model, "fa_amd", ids, mask, 5)
    assert torch.equal(out, full)
    assert torch.equal(out[:, :3], ref[:, :3]), f"fa_amd {out.tolist()} != eager {ref.tolist()}"


def test_grown_decode_steps_match_the_full_path(device, monkeypatch):
    """A dynamic cache's steps (one more key each call) through decode.grown_plan give the full path's outputs bit
    for bit, with a sliding window that the growing cache crosses (the window the full path derives from the key
    length is part of the grow key), causal and not, and a cache whose strides are not contiguous."""
    from fa_amd.kernels import decode

    module = torch.nn.Module().eval()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 1, 16, generator=gen, dtype=torch.float16).to(device)
    k_all = torch.randn(3, 2, 30, 24, generator=gen, dtype=torch.float16).to(device)[..., :16]  # (row stride 24)
    v_all = torch.randn(3, 2, 30, 16, generator=gen, dtype=torch.float16).to(device)

    def steps():
        outs = []
        for causal, window in ((True, 12), (False, None)):
            for n in range(9, 16):
                k = k_all[:, :, :n]
                v = v_all[:, :, :n].contiguous()
                out, _ = hf_attention.fa_amd_attention_forward(module, q, k, v, None, scaling=0.3,
                                                               sliding_window=window, is_causal=causal)
                outs.append(out)
        return outs

    # the window the full path derives from the key length: 12 keys fit a 12-key window, 13 do not
    key = hf_attention._decode_step_key(module, q, k_all[:, :, :12], v_all[:, :, :12], 0.0, None, 12, None, True, {})
    assert (hf_attention._decode_grow_key(key, q, k_all[:, :, :12], v_all[:, :, :12], 12)
            != hf_attention._decode_grow_key(key, q, k_all[:, :, :13], v_all[:, :, :13], 12))
    grown = []
    real_grown_plan = hf_attention.grown_plan
    monkeypatch.setattr(hf_attention, "grown_plan", lambda *args: grown.append(real_grown_plan(*args)) or grown[-1])
    decode.forget_plans()
    with torch.no_grad():
        fast = steps()
        assert sum(plan is not None for plan in grown) >= 10  # (a window crossing or a new split count: full path)
        decode.forget_plans()
        monkeypatch.setattr(hf_attention, "_decode_step_key", lambda *args: None)  # the full path every time
        full = steps()
    for a, b in zip(fast, full):
        assert torch.equal(a, b)


def test_decode_step_keys_leave_out_what_the_plan_cannot_cover():
    """No step key (the full path every call) for casts, padded V, a strided head dim, gradients, dropout
    while training, or kwargs that are not bookkeeping (sinks, a paged cache); keys differ in every input the
    full path derives the launch from."""
    module = torch.nn.Module().eval()
    q = torch.randn(2, 4, 1, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 9, 16, dtype=torch.float16)
    v = torch.randn_like(k)

    def key(q=q, k=k, v=v, dropout=0.0, scaling=None, window=None, softcap=None, causal=None, kwargs=None):
        return hf_attention._decode_step_key(module, q, k, v, dropout, scaling, window, softcap, causal,
                                             kwargs or {})

    assert key() is not None and key() == key(kwargs={"position_embeddings": None, "use_cache": True})
    assert key(q=q.float(), k=k.float(), v=v.float()) is None  # fp32: the autocast / PEFT casts
    assert key(k=k.to(torch.bfloat16)) is None and key(v=v[..., :8]) is None
    assert key(k=torch.randn(2, 2, 9, 32, dtype=torch.float16)[..., ::2]) is None
    assert key(kwargs={"s_aux": torch.zeros(4)}) is None and key(kwargs={"cache": object()}) is None
    module.train()
    assert key(dropout=0.1) is None and key() is not None
    with torch.enable_grad():
        assert key(q=q.clone().requires_grad_()) is None
    variants = [key(), key(scaling=0.3), key(window=4), key(softcap=5.0), key(causal=False), key(k=k[:, :, :8]),
                key(q=q.transpose(1, 3).contiguous().transpose(1, 3))]
    assert len(set(variants)) == len(variants)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_bf16_matches_eager_gpu(decode_calls, cache):
    model = tiny_llama("cuda", torch.bfloat16)
    ids, mask = prompts("cuda", padded=True)
    kwargs = {} if cache == "dynamic" else dict(cache_implementation="static")
    ref = greedy(model, "sdpa", ids, mask, 8, **kwargs)
    out = greedy(model, "fa_amd", ids, mask, 8, **kwargs)
    # bf16: the first tokens must agree (later ones may flip on near-ties)
    assert torch.equal(out[:, :3], ref[:, :3]) and decode_calls
