"""Registration, argument handling, Liger-style patching and flash_attention_2 routing."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fa_amd

transformers = pytest.importorskip("transformers")

from fa_amd.integrations import hf_attention, register  # noqa: E402
from fa_amd.integrations.hf_attention import (  # noqa: E402
    cu_seqlens_from_position_ids,
    fa_amd_attention_forward,
    sliding_window_to_window_size,
)
from fa_amd.reference import attention_ref  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeAttentionModule(torch.nn.Module):
    """What Transformers passes as `module`: is_causal, a config, Linear layers."""

    def __init__(self, dtype=torch.float32, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.proj = torch.nn.Linear(4, 4).to(dtype)
        self.config = transformers.LlamaConfig()


def _qkv(b=2, hq=4, hk=2, sq=9, sk=9, d=16, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    k = torch.randn(b, hk, sk, d, dtype=dtype, device=device)
    v = torch.randn(b, hk, sk, d, dtype=dtype, device=device)
    return q, k, v


def _eager_and_fa_amd(model_class, config, device):
    """One random model (seed 0) as eager and as fa_amd, the same weights, each from its own copy of config."""
    import copy

    torch.manual_seed(0)
    models = {impl: model_class._from_config(copy.deepcopy(config), attn_implementation=impl).to(device)
              for impl in ("eager", "fa_amd")}
    models["fa_amd"].load_state_dict(models["eager"].state_dict())
    return models


# --------------------------------------------------------------------------- registration


def test_register_is_idempotent_and_registers_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register()
    register()
    assert AttentionInterface._global_mapping["fa_amd"] is fa_amd_attention_forward
    assert AttentionMaskInterface._global_mapping["fa_amd"] is hf_attention.fa_amd_attention_mask


def test_old_transformers_gets_a_clear_error(monkeypatch):
    import fa_amd.integrations as integrations

    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    monkeypatch.setattr(integrations, "_registered", False)
    with pytest.raises(ImportError, match=r"transformers>=5\.0.*found transformers 4\.46\.0"):
        integrations.register()


def test_import_fa_amd_does_not_import_transformers_when_missing():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["transformers"] = None  # what an uninstalled package looks like to find_spec/import
        import fa_amd
        import fa_amd.integrations
        assert sys.modules["transformers"] is None
        assert not any(name.startswith("transformers.") for name in sys.modules)
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


# --------------------------------------------------------------------------- the attention function


def test_output_layout_and_none_weights(device):
    q, k, v = _qkv(device=device)
    out, weights = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None)
    assert weights is None
    assert out.shape == (2, 9, 4, 16)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_with_kv_cache_is_bottom_right_causal(device):
    q, k, v = _qkv(sq=1, sk=13, device=device)
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None)
    # a single new token sees the whole cache
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_non_causal_module_and_is_causal_kwarg(device):
    q, k, v = _qkv(device=device)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
    out, _ = fa_amd_attention_forward(FakeAttentionModule(is_causal=False), q, k, v, None)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out, _ = fa_amd_attention_forward(FakeAttentionModule(is_causal=True), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_mapping_matches_transformers_flash():
    # transformers: window_size=(W-1, W-1) with causal, only when keys exceed the window
    assert sliding_window_to_window_size(None, True, 100) == (-1, -1)
    assert sliding_window_to_window_size(8, True, 8) == (-1, -1)
    assert sliding_window_to_window_size(8, True, 9) == (7, 0)
    assert sliding_window_to_window_size(8, False, 9) == (7, 7)
    with pytest.raises(ValueError, match="sliding_window"):
        sliding_window_to_window_size(0, True, 9)


def test_sliding_window_matches_reference(device):
    q, k, v = _qkv(sq=20, sk=20, device=device)
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None, sliding_window=5)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=(4, 0))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_padding_mask_zero_length_row_and_chunked_prefill(device):
    q, k, v = _qkv(b=3, sq=6, sk=10, device=device)
    mask = torch.ones(3, 10, dtype=torch.long, device=device)
    mask[1, :4] = 0  # left padded
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, mask)
    for row in range(3):
        keep = mask[row].bool()
        ref, _ = attention_ref(
            q[row : row + 1].transpose(1, 2),
            k[row : row + 1, :, keep].transpose(1, 2),
            v[row : row + 1, :, keep].transpose(1, 2),
            causal=True,
        )
        torch.testing.assert_close(out[row : row + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_autocast_fp32_inputs_are_cast_like_transformers_flash(device):
    q, k, v = _qkv(device=device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None)
    assert out.dtype == torch.float16
    # PEFT upcast: fp32 activations in a half-precision model go back to the weights' dtype
    out, _ = fa_amd_attention_forward(FakeAttentionModule(dtype=torch.float16), q, k, v, None)
    assert out.dtype == torch.float16
    # a real fp32 model stays fp32
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None)
    assert out.dtype == torch.float32


def test_smaller_value_head_dim_is_padded_and_cropped(device):
    q, k, v = _qkv(device=device)
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v[..., :8], None)
    assert out.shape == (2, 9, 4, 8)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v[..., :8].transpose(1, 2), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_dropout_ignored_in_eval_mode(device):
    q, k, v = _qkv(device=device)
    module = FakeAttentionModule().eval()
    a, _ = fa_amd_attention_forward(module, q, k, v, None, dropout=0.9)
    b, _ = fa_amd_attention_forward(module, q, k, v, None, dropout=0.0)
    torch.testing.assert_close(a, b)
    module.train()
    c, _ = fa_amd_attention_forward(module, q, k, v, None, dropout=0.9)
    assert not torch.allclose(c, b)


def test_packed_position_ids_boundaries():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu, max_len = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and max_len == 4


def test_packed_check_syncs_once_per_position_ids(monkeypatch):
    # every layer sees the same position_ids: the packed-or-not check (a device->host
    # sync) runs once per tensor, and again only for a new tensor or an in-place change
    calls = []
    real = hf_attention._positions_restart
    monkeypatch.setattr(hf_attention, "_positions_restart", lambda p: calls.append(1) or real(p))
    plain = torch.arange(3, 13).unsqueeze(0)
    assert not any(hf_attention._is_packed(plain, 1) for _ in range(4)) and len(calls) == 1
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    assert all(hf_attention._is_packed(packed, 1) for _ in range(4)) and len(calls) == 2
    packed[0, 4:] = torch.arange(4, 10)
    assert not hf_attention._is_packed(packed, 1) and len(calls) == 3
    assert not hf_attention._is_packed(packed, 2) and len(calls) == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(s_aux=torch.zeros(3)), r"s_aux must have shape \(4,\)"),
        (dict(position_bias=torch.zeros(1)), "position_bias"),
        (dict(block_table=torch.zeros(1)), "block_table"),
        (dict(some_new_feature=torch.zeros(1)), "some_new_feature"),
    ],
)
def test_unsupported_kwargs_raise(device, kwargs, match):
    q, k, v = _qkv(device=device)
    kwargs = {name: t.to(device) for name, t in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None, **kwargs)


@pytest.mark.parametrize("name", ["s_aux", "sinks"])
def test_attention_sinks_reach_the_kernels(device, name):
    """gpt-oss passes its learnable sinks as s_aux: decode against a cache (one query row) and a
    padded prefill both honour them."""
    q, k, v = _qkv(sq=1, sk=13, device=device)
    sinks = torch.randn(4, device=device)
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None, **{name: sinks})
    ref, _ = attention_ref(*(x.transpose(1, 2).double() for x in (q, k, v)), sinks=sinks.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    q, k, v = _qkv(device=device)
    mask = torch.ones(2, 9, dtype=torch.long, device=device)
    mask[1, 6:] = 0
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, mask, sliding_window=4, **{name: sinks})
    ref, _ = attention_ref(*(x.transpose(1, 2)[1:, :6].double() for x in (q, k, v)), causal=True,
                           window_size=(3, 0), sinks=sinks.double())
    torch.testing.assert_close(out[1:, :6].double(), ref, atol=1e-5, rtol=1e-5)


def test_harmless_and_none_kwargs_pass(device):
    q, k, v = _qkv(device=device)
    fa_amd_attention_forward(
        FakeAttentionModule(), q, k, v, None, s_aux=None, use_cache=True, output_attentions=True, cache_position=None
    )
    # Transformers' loss kwargs reach every attention call through **kwargs (context parallelism, padding-free
    # collators); eager ignores them
    labels = torch.zeros(2, 9, dtype=torch.long, device=device)
    fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None, shift_labels=labels, ignore_index=-100)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("queries", [9, 20])
def test_cross_attention_over_a_padded_encoder_mask(device, grad, queries):
    # a non-causal module with another sequence's keys (BART's decoder cross-attention): every query row attends
    # its row's kept encoder tokens; the key mask says nothing of the queries (which were zeroed where their index
    # met a padded key column, whenever the varlen route ran: grad on, or more than 16 queries)
    q, k, v = _qkv(sq=queries, sk=12, hk=4, device=device)
    q.requires_grad_(grad)
    mask = torch.ones(2, 12, dtype=torch.bool, device=device)
    mask[1, 5:] = False
    with torch.set_grad_enabled(grad):
        out, _ = fa_amd_attention_forward(FakeAttentionModule(is_causal=False), q, k, v, mask)
    bias = torch.zeros(2, 1, 1, 12, dtype=torch.float64, device=device).masked_fill(~mask[:, None, None, :],
                                                                                    float("-inf"))
    ref = torch.softmax(q.detach().double() @ k.double().transpose(-1, -2) * 16 ** -0.5 + bias, -1) @ v.double()
    torch.testing.assert_close(out.detach().double(), ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_sliding_window_over_a_mask_with_gaps_needs_no_backward(device):
    # a cached prefix, then a left-padded chunk: the decode kernel (no grad) counts the window in cache slots as
    # eager does; where a backward is needed the varlen route would pack the gap away and widen the window, so
    # it refuses
    window, prefix, new = 3, 4, 6
    mask = torch.tensor([[1] * prefix + [0, 0] + [1] * (new - 2)], dtype=torch.bool, device=device)
    q, k, v = _qkv(b=1, hq=2, hk=2, sq=new, sk=prefix + new, d=8, device=device)
    qpos = torch.arange(prefix, prefix + new, device=device)[:, None]
    kpos = torch.arange(prefix + new, device=device)[None, :]
    allowed = (kpos <= qpos) & (kpos > qpos - window) & mask[0][None, :]
    bias = torch.zeros(new, prefix + new, dtype=torch.float64, device=device).masked_fill(~allowed, float("-inf"))
    ref = (torch.softmax(q.double() @ k.double().transpose(-1, -2) * 8 ** -0.5 + bias, -1) @ v.double())
    real = mask[0, prefix:]
    out, _ = fa_amd_attention_forward(FakeAttentionModule(), q, k, v, mask, sliding_window=window)
    torch.testing.assert_close(out[0, real].double(), ref.transpose(1, 2)[0, real], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sliding window over a padding mask with gaps"):
        fa_amd_attention_forward(FakeAttentionModule(), q.requires_grad_(), k, v, mask, sliding_window=window)


def test_bad_masks_and_shapes_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="2D"):
        fa_amd_attention_forward(FakeAttentionModule(), q, k, v, torch.zeros(2, 1, 9, 9))
    with pytest.raises(ValueError, match="4D"):
        fa_amd_attention_forward(FakeAttentionModule(), q[0], k, v, None)
    with pytest.raises(ValueError, match="zero-sized"):
        fa_amd_attention_forward(FakeAttentionModule(), q[:, :, :0], k, v, None)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        fa_amd_attention_forward(
            FakeAttentionModule(), q[:1], k[:1], v[:1], None, cu_seq_lens_q=torch.tensor([0, 9]), max_length_q=9
        )


# --------------------------------------------------------------------------- patching


def test_patch_peft_wrapped_model_and_wrong_family(device):
    peft = pytest.importorskip("peft")
    from fa_amd.integrations.monkey_patch import (
        apply_fa_amd,
        apply_fa_amd_to_mistral,
        revert_fa_amd_patches,
    )

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.set_attn_implementation("eager")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    try:
        assert apply_fa_amd(lora) is lora
        assert lora.get_base_model().config._attn_implementation == "fa_amd"
        import transformers.models.llama.modeling_llama as modeling

        assert modeling.apply_rotary_pos_emb.__module__ == "fa_amd.integrations.monkey_patch"
        with pytest.raises(TypeError, match="MistralPreTrainedModel"):
            apply_fa_amd_to_mistral(lora)
        with pytest.raises(TypeError, match="PreTrainedModel"):
            apply_fa_amd(torch.nn.Linear(2, 2))
    finally:
        revert_fa_amd_patches()


# --------------------------------------------------------------------------- flash_attention_2 routing


def test_flash_attn_with_kvcache_shim_matches_reference(device):
    from fa_amd.integrations.flash_attn_shim import flash_attn_with_kvcache

    torch.manual_seed(0)
    b, hq, hk, d, cache_len = 2, 4, 2, 16, 12
    k_cache = torch.zeros(b, cache_len, hk, d, device=device)
    v_cache = torch.zeros(b, cache_len, hk, d, device=device)
    lengths = torch.tensor([5, 8], dtype=torch.int32, device=device)
    for row, n in enumerate(lengths.tolist()):
        k_cache[row, :n] = torch.randn(n, hk, d)
        v_cache[row, :n] = torch.randn(n, hk, d)
    q = torch.randn(b, 2, hq, d, device=device)
    k_new = torch.randn(b, 2, hk, d, device=device)
    v_new = torch.randn(b, 2, hk, d, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(k_cache[row, n : n + 2], k_new[row])
        ref, _ = attention_ref(q[row : row + 1], k_cache[row : row + 1, : n + 2], v_cache[row : row + 1, : n + 2],
                               causal=True)
        torch.testing.assert_close(out[row : row + 1].double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, block_table=torch.zeros(1))


def test_route_flash_attention_2_end_to_end():
    """In a fresh interpreter (the routing is process-global): no flash-attn installed,
    yet flash_attention_2 models and `import flash_attn` run on fa_amd."""
    code = textwrap.dedent(
        """
        import importlib.metadata, importlib.util, torch
        assert importlib.util.find_spec("flash_attn") is None, "test needs a machine without flash-attn"
        import fa_amd
        fa_amd.integrations.route_flash_attention_2()
        fa_amd.integrations.route_flash_attention_2()  # idempotent

        # the package, its metadata and submodules
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
        from flash_attn.bert_padding import pad_input, unpad_input, index_first_axis
        from flash_attn.flash_attn_interface import flash_attn_varlen_func as f2
        assert flash_attn_func is fa_amd.flash_attn_func and f2 is fa_amd.flash_attn_varlen_func
        assert importlib.util.find_spec("flash_attn") is not None
        assert importlib.metadata.version("flash_attn") == flash_attn.__version__
        assert "flash-attn" in importlib.metadata.packages_distributions()["flash_attn"]

        # transformers' own FA2 loader resolves to the shim
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
        (fn, varlen_fn, kv_fn, pad_fn, unpad_fn), _ = lazy_import_flash_attention("flash_attention_2")
        assert fn is fa_amd.flash_attn_func and unpad_fn is unpad_input

        # transformers' own probe sees flash-attn 2 wherever fa_amd runs (a GPU, or the interpreter here)
        from transformers.utils import is_flash_attn_2_available
        assert is_flash_attn_2_available()
        from flash_attn.layers.rotary import apply_rotary_emb, RotaryEmbedding
        from flash_attn.ops.triton.layer_norm import rms_norm_fn
        from flash_attn.losses.cross_entropy import CrossEntropyLoss
        device = "cuda" if torch.cuda.is_available() else "cpu"

        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2").eval().to(device)
        assert model.config._attn_implementation == "flash_attention_2"
        ids = torch.randint(3, 64, (2, 10), device=device); mask = torch.ones_like(ids); mask[0, :3] = 0
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).logits
            model.set_attn_implementation("eager")
            ref = model(input_ids=ids, attention_mask=mask).logits
            model.set_attn_implementation("flash_attention_2")
            again = model(input_ids=ids, attention_mask=mask).logits
        keep = mask.bool()
        torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(again, out)
        print("routed-ok")
        """
    )
    # conftest.py put TRITON_INTERPRET=1 in os.environ when there is no GPU; the child inherits it
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0 and "routed-ok" in result.stdout, (result.stdout + result.stderr)[-4000:]


def test_route_rejects_unsupported_transformers(monkeypatch):
    from fa_amd.integrations import flash_attn_shim

    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.0")
    monkeypatch.setattr(flash_attn_shim, "_patched_transformers", False)
    with pytest.raises(ImportError, match="found transformers 6.0.0"):
        flash_attn_shim._patch_transformers_fa2()


# --------------------------------------------------------------------------- mask function


def test_mask_function_never_builds_4d_masks():
    from fa_amd.integrations.hf_attention import fa_amd_attention_mask

    mask = torch.ones(2, 10, dtype=torch.bool)
    assert fa_amd_attention_mask(2, 10, 10, attention_mask=mask) is None  # nothing padded
    mask[0, :3] = False
    out = fa_amd_attention_mask(2, 10, 10, attention_mask=mask)
    assert out.shape == (2, 10) and torch.equal(out, mask)
    # sliding-window cache: keep the last kv_length columns (the left padding falls out of the window)
    assert fa_amd_attention_mask(2, 1, 4, q_offset=9, kv_offset=6, attention_mask=mask) is None
    assert fa_amd_attention_mask(2, 1, 8, q_offset=9, kv_offset=2, attention_mask=mask).shape == (2, 8)
    # dynamic cache without padding: no mask
    assert fa_amd_attention_mask(2, 1, 10, q_offset=9) is None
    # dynamic cache, a decode step with a left-padded (int) generate() mask: the mask itself, as bool
    step = fa_amd_attention_mask(2, 1, 10, q_offset=9, attention_mask=mask.long())
    assert step.dtype == torch.bool and torch.equal(step, mask)
    assert fa_amd_attention_mask(2, 1, 10, q_offset=9, attention_mask=torch.ones(2, 10, dtype=torch.long)) is None
    # static cache without padding: the whole buffer, its unfilled tail marked as padding (static shape)
    # (int32 where such a tail exists, each kept slot its distance to where the queries end, plus one)
    static = fa_amd_attention_mask(2, 1, 32, q_offset=torch.tensor(5), device="cpu")
    assert static.shape == (2, 32) and static.dtype == torch.int32
    assert torch.equal(static[:, :6], (7 - torch.arange(6)).expand(2, 6).int()) and not static[:, 6:].any()
    static_prefill = fa_amd_attention_mask(2, 4, 32, q_offset=0, device="cpu")
    assert static_prefill.shape == (2, 32) and static_prefill.bool().sum().item() == 8
    # static cache with a left-padded 2D mask covering the tokens seen so far
    padded = fa_amd_attention_mask(2, 1, 16, q_offset=torch.tensor(9), attention_mask=mask)
    assert padded.shape == (2, 16) and torch.equal(padded[:, :10].bool(), mask) and not padded[:, 10:].any()
    assert torch.equal(padded[:, :10], (mask * (11 - torch.arange(10))).int())
    # cross-attention (bidirectional, more keys than queries): no mask
    assert fa_amd_attention_mask(2, 3, 10, allow_is_bidirectional_skip=True) is None


@pytest.mark.parametrize("compiled", [False, True])
def test_rows_packed_by_position_ids_at_batch_2_match_eager(device, compiled):
    """Two rows, each packing two sequences marked by restarting position_ids and no mask (a training forward:
    use_cache=False): fa_amd splits every row's sequences as eager does -- loss and gradients (audit
    2026-11-28: only batch-1 rows were split, so these attended across their sequences, gradients off by up to
    160 %); under torch.compile the by-positions op reads the rows' boundaries inside."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    models = _eager_and_fa_amd(LlamaForCausalLM, config, device)
    ids = torch.randint(0, 128, (2, 12), device=device)
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(8)) + list(range(4))], device=device)
    labels = ids.clone()
    labels[0, 5] = labels[1, 8] = -100  # (no label across a boundary)
    losses, grads = {}, {}
    for impl, model in models.items():
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled and impl == "fa_amd" \
            else model
        loss = forward(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
        loss.backward()
        losses[impl] = loss.item()
        grads[impl] = {name: p.grad for name, p in model.named_parameters()}
    torch._dynamo.reset()
    assert losses["fa_amd"] == pytest.approx(losses["eager"], rel=1e-5)
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads["fa_amd"][name], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("module_causal", [None, True])
def test_bidirectional_or_mask_models_match_eager(device, module_causal):
    """Gemma 3 with use_bidirectional_attention (EmbeddingGemma) opens its causal masks with an or_mask_function:
    every key on full layers, |query - key| < W on sliding ones.  fa_amd probes the composed mask function and runs
    that pattern (audit 2026-11-29: the mask builder refused the model).  The mask decides, as in eager: with the
    modules' is_causal forced on (Step3p7's text model sets it while its masks are bidirectional) the result is
    the same.  Padded and unpadded, loss-free outputs and gradients against eager; a cache is refused clearly."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=9,
                              use_bidirectional_attention=True, max_position_embeddings=64,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert config.sliding_window == 5  # (halved by the config: 13 tokens see a window on the sliding layers)
    models = _eager_and_fa_amd(Gemma3TextModel, config, device)
    if module_causal:
        for model in models.values():
            for layer in model.layers:
                layer.self_attn.is_causal = True
    ids = torch.randint(0, 97, (2, 13), device=device)
    padded = torch.ones(2, 13, dtype=torch.long, device=device)
    padded[1, :4] = 0
    for mask in (None, padded):
        outs, grads = {}, {}
        for impl, model in models.items():
            model.zero_grad()
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
            kept = 1.0 if mask is None else mask[..., None]
            (out * weights * kept).sum().backward()
            outs[impl] = out if mask is None else out[mask.bool()]
            grads[impl] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        torch.testing.assert_close(outs["fa_amd"], outs["eager"], atol=2e-4, rtol=1e-4)
        for name, grad in grads["eager"].items():
            torch.testing.assert_close(grads["fa_amd"][name], grad, atol=2e-4, rtol=1e-3)
    with torch.no_grad():
        cache = models["fa_amd"](input_ids=ids[:, :-1], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="bidirectional mask .* only without a KV cache"):
            models["fa_amd"](input_ids=ids[:, -1:], past_key_values=cache)


def test_bidirectional_window_probe():
    """The probe names a full or a symmetric window only; anything else (causal parts, an asymmetric or
    batch-dependent pattern, a function that is not index-based) is refused."""
    mu = pytest.importorskip("transformers.masking_utils")
    probe = hf_attention._probed_bidirectional_window
    args = (2, 11, 11, 0, 0, "cpu")
    assert probe(mu.or_masks(mu.causal_mask_function, lambda *a: torch.tensor(True)), *args) == (-1, -1)
    window = mu.sliding_window_causal_mask_function(4)
    assert probe(mu.or_masks(window, lambda b, h, q, k: (q - k).abs() < 4), *args) == (3, 3)
    assert probe(mu.or_masks(window, lambda b, h, q, k: (q - k).abs() < 40), *args) == (-1, -1)
    assert probe(mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: (q - k).abs() < 4), *args) is None
    assert probe(mu.causal_mask_function, *args) is None
    assert probe(mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k - q < 3), *args) is None
    assert probe(lambda b, h, q, k: ((q - k).abs() < 3) | (b == 1), *args) is None
    assert probe(lambda b, h, q, k: q.item() >= 0, *args) is None
    assert probe(lambda b, h, q, k: k < 0, *args) is None


@pytest.mark.parametrize("layout", ["shared", "jumps"])
def test_packed_positions_follow_eagers_rule(device, layout):
    """Eager's packed masks (find_packed_sequence_indices) start a sequence wherever a position is not its
    predecessor's plus one, and expand (1, length) positions over the batch.  Audit 2026-11-29: fa_amd ignored
    shared (1, length) packed positions at batch 2 (every row attended across its sequences) and did not split at
    jumps (0, 1, 2, 9, 10, ...: a restart to a value above the row's minimum)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    models = _eager_and_fa_amd(LlamaForCausalLM, config, device)
    ids = torch.randint(0, 128, (2, 12), device=device)
    if layout == "shared":
        positions = torch.tensor([list(range(5)) + list(range(7))], device=device)
    else:
        positions = torch.tensor([[0, 1, 2, 9, 10, 11, 12, 3, 4, 5, 6, 7], list(range(4)) + list(range(20, 28))],
                                 device=device)
    logits, grads = {}, {}
    for impl, model in models.items():
        out = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        out.square().mean().backward()
        logits[impl] = out
        grads[impl] = {name: p.grad for name, p in model.named_parameters()}
    torch.testing.assert_close(logits["fa_amd"], logits["eager"], atol=1e-5, rtol=1e-4)
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads["fa_amd"][name], grad, atol=1e-5, rtol=1e-4)
    cu, longest = cu_seqlens_from_position_ids(positions.expand(2, -1))
    expected = {"shared": ([0, 5, 12, 17, 24], 7), "jumps": ([0, 3, 7, 12, 16, 24], 8)}[layout]
    assert (cu.tolist(), longest) == expected


def test_bidirectional_or_mask_model_under_torch_compile(device):
    """Traced, the mask builder does not probe (no memo either): Gemma 3's modules are non-causal with the same
    window, so the compiled model matches eager too (fullgraph, padded and unpadded)."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=9,
                              use_bidirectional_attention=True, max_position_embeddings=64,
                              layer_types=["sliding_attention", "full_attention"])
    models = _eager_and_fa_amd(Gemma3TextModel, config, device)
    compiled = torch.compile(models["fa_amd"], backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 97, (2, 13), device=device)
    padded = torch.ones(2, 13, dtype=torch.long, device=device)
    padded[1, :4] = 0
    with torch.no_grad():
        for mask in (None, padded):
            keep = torch.ones(2, 13, dtype=torch.bool, device=device) if mask is None else mask.bool()
            ref = models["eager"](input_ids=ids, attention_mask=mask).last_hidden_state
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got[keep], ref[keep], atol=2e-4, rtol=1e-4)
    torch._dynamo.reset()


def test_head_dim_past_the_kernels_names_the_way_out():
    """Gemma 4's global layers use head dim 512, past every flash kernel's 256: the HF call says so and points to
    sdpa (the kernels' own message named only the range)."""
    q = torch.randn(1, 2, 5, 512)
    k = v = torch.randn(1, 1, 5, 512)
    with pytest.raises(ValueError, match="head dim 512.*up to 256.*attn_implementation='sdpa'"):
        fa_amd_attention_forward(FakeAttentionModule(), q, k, v, None)
