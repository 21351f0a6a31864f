"""Liger-style patching: fused Triton rotary + fa_amd attention, per model family.

Families: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and gpt-oss
(``apply_fa_amd_to_<family>``); ``apply_fa_amd(model)`` picks by ``config.model_type``.

Call before building a model (patches the modeling module, and makes "fa_amd"
the attention of models created afterwards unless they ask for another one)::

    from fa_amd.integrations import apply_fa_amd_to_llama
    apply_fa_amd_to_llama()
    model = AutoModelForCausalLM.from_pretrained(...)

or on an existing model, PEFT-wrapped or not::

    apply_fa_amd_to_llama(model)

The rotary patch replaces ``apply_rotary_pos_emb`` in the modeling module, so it
affects every model of that family in the process, like Liger's patches.
``revert_fa_amd_patches()`` undoes everything this module changed.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from . import ATTENTION_NAME, register

# (owner object, attribute name) -> original value, for revert_fa_amd_patches()
_originals: dict = {}


def _set_patched(owner, name: str, value) -> None:
    key = (owner, name)
    if key not in _originals:
        _originals[key] = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)


class _Missing:
    pass


_MISSING = _Missing()


def revert_fa_amd_patches() -> None:
    """Restore every module function / class attribute patched by this module.

    Models already switched to "fa_amd" keep it; call
    ``model.set_attn_implementation(...)`` to change them.
    """
    for (owner, name), original in list(_originals.items()):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _originals.clear()


def _fused_rotary_for(stock, half_tables: bool = False, partial: bool = False):
    """The fused stand-in for a modeling module's ``apply_rotary_pos_emb`` (`stock`), with its contract: the
    arguments after (q, k, cos, sin) bound by `stock`'s own signature (``unsqueeze_dim`` is the fifth in
    Transformers 5, ``position_ids`` was in 4.x); ``half_tables`` reads gpt-oss's tables of head_dim / 2
    frequencies; ``partial``: a ``cos`` narrower than the head dim rotates the leading features and passes
    the rest through (Phi-3's partial rotary) -- in other families `stock` gets the call, and rejects it
    as it always has."""
    import inspect

    from fa_amd.interface import SUPPORTED_DTYPES  # (the kernels' dtypes: the fused rotary's too)
    from fa_amd.kernels.rotary import hf_apply_rotary_pos_emb  # once, at patch time: this runs per layer call

    signature = inspect.signature(stock)

    def fused_apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = 1
        if args or kwargs:
            bound = signature.bind(q, k, cos, sin, *args, **kwargs)
            unsqueeze_dim = bound.arguments.get("unsqueeze_dim", 1)
        if (not half_tables and not partial and cos.shape[-1] != q.shape[-1]) or q.dtype not in SUPPORTED_DTYPES \
                or k.dtype not in SUPPORTED_DTYPES:
            # (the patch is per modeling module: a float64 reference model of the family takes it too)
            return stock(q, k, cos, sin, *args, **kwargs)
        return hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, half_tables=half_tables)

    fused_apply_rotary_pos_emb.__doc__ = (f"fa_amd's fused Triton rotary in place of {stock.__module__}."
                                          f"apply_rotary_pos_emb (same arguments).")
    fused_apply_rotary_pos_emb.fa_amd_stock = stock
    return fused_apply_rotary_pos_emb


def _unwrap_model(model):
    """The transformers PreTrainedModel inside PEFT / DDP / compile wrappers."""
    from transformers import PreTrainedModel

    seen = set()
    current = model
    while not isinstance(current, PreTrainedModel):
        if id(current) in seen:
            break
        seen.add(id(current))
        if hasattr(current, "get_base_model") and callable(current.get_base_model):  # peft.PeftModel
            current = current.get_base_model()
        elif hasattr(current, "_orig_mod"):  # torch.compile
            current = current._orig_mod
        elif hasattr(current, "module") and isinstance(current.module, torch.nn.Module):  # DDP / FSDP
            current = current.module
        elif hasattr(current, "model") and isinstance(current.model, torch.nn.Module):  # peft LoraModel
            current = current.model
        else:
            break
    if not isinstance(current, PreTrainedModel):
        raise TypeError(
            f"model must be a transformers PreTrainedModel (optionally PEFT/DDP/compile wrapped), "
            f"got {type(model).__name__}"
        )
    return current


def _default_to_fa_amd(pretrained_cls) -> None:
    """Models of this family built from now on default to "fa_amd" when no attention is requested.

    Wraps the (private) ``_check_and_adjust_attn_implementation`` that
    PreTrainedModel.__init__ runs on ``config._attn_implementation``; an explicit
    request ("eager", "sdpa", ...) is still honoured.
    """
    original = getattr(pretrained_cls, "_check_and_adjust_attn_implementation", None)
    if getattr(original, "_fa_amd_default", False):
        return
    if original is None:
        raise RuntimeError(
            "this transformers version has no PreTrainedModel._check_and_adjust_attn_implementation; "
            "pass attn_implementation='fa_amd' to from_pretrained/from_config instead"
        )

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation is None:
            attn_implementation = ATTENTION_NAME
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation._fa_amd_default = True
    _set_patched(pretrained_cls, "_check_and_adjust_attn_implementation", _check_and_adjust_attn_implementation)


def _apply(modeling_module_name: str, pretrained_cls_name: str, model, rope: bool, attention: bool,
           half_tables: bool = False, partial_rotary: bool = False):
    if not isinstance(rope, bool) or not isinstance(attention, bool):
        raise TypeError("rope and attention must be bools")
    register()
    modeling = importlib.import_module(modeling_module_name)
    pretrained_cls = getattr(modeling, pretrained_cls_name)
    base_model = None
    if model is not None:  # checked before anything is patched: a call that raises changes nothing
        base_model = _unwrap_model(model)
        if not isinstance(base_model, pretrained_cls):
            raise TypeError(
                f"model is a {type(base_model).__name__}, not a {pretrained_cls_name}; "
                "use the apply_fa_amd_to_* function of its family"
            )
    if rope:
        stock = getattr(modeling, "apply_rotary_pos_emb", None)
        if stock is None:
            raise RuntimeError(f"{modeling_module_name} has no apply_rotary_pos_emb to patch")
        stock = getattr(stock, "fa_amd_stock", stock)  # patched before: wrap the original again
        _set_patched(modeling, "apply_rotary_pos_emb", _fused_rotary_for(stock, half_tables, partial_rotary))

    if model is None:
        if attention:
            _default_to_fa_amd(pretrained_cls)
        return None

    if attention:
        base_model.set_attn_implementation(ATTENTION_NAME)
        if base_model.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"{type(base_model).__name__} refused attn_implementation='{ATTENTION_NAME}' "
                f"(kept '{base_model.config._attn_implementation}')"
            )
    return model


def apply_fa_amd_to_llama(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for Llama models.

    Args:
        model: an existing Llama model (plain, PEFT/LoRA, DDP or compile wrapped);
            None patches the modeling module before models are built.
        rope: swap ``apply_rotary_pos_emb`` for the fused Triton kernel.
        attention: use attention implementation "fa_amd".
    Returns the model (unchanged object) or None.
    """
    return _apply("transformers.models.llama.modeling_llama", "LlamaPreTrainedModel", model, rope, attention)


def apply_fa_amd_to_mistral(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention (with sliding window) for Mistral models.

    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.mistral.modeling_mistral", "MistralPreTrainedModel", model, rope, attention)


def apply_fa_amd_to_qwen2(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for Qwen2 models (plain rotate-half RoPE; the sliding
    window of ``use_sliding_window`` layers goes to the kernel).

    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.qwen2.modeling_qwen2", "Qwen2PreTrainedModel", model, rope, attention)


def apply_fa_amd_to_qwen3(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for Qwen3 models.

    Qwen3 RMS-normalizes q and k per head (``q_norm``/``k_norm``) *before* the rotary, so the
    fused kernel receives the normed tensors, as the original function does.
    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.qwen3.modeling_qwen3", "Qwen3PreTrainedModel", model, rope, attention)


def apply_fa_amd_to_gemma2(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for Gemma 2 models.

    Gemma 2 scales scores by ``query_pre_attn_scalar ** -0.5`` (not head_dim), soft-caps them
    (``attn_logit_softcapping``) and alternates sliding-window and global layers: all three reach
    fa_amd's kernel as its scale, softcap and window.  The final-logit softcap stays in the model.
    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.gemma2.modeling_gemma2", "Gemma2PreTrainedModel", model, rope, attention)


def apply_fa_amd_to_gemma3(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for Gemma 3 models (text; the multimodal model's text-only inputs --
    with images its attention mask adds bidirectional image-token blocks, which fa_amd's mask builder refuses).

    Gemma 3 normalizes q/k before the rotary (like Qwen3), keeps Gemma 2's scalar scaling and
    softcap option, and gives local (sliding) and global layers different rotary bases: each
    layer's cos/sin arrive already chosen, so one fused kernel serves both.
    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.gemma3.modeling_gemma3", "Gemma3PreTrainedModel", model, rope, attention)


def apply_fa_amd_to_phi3(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for Phi-3 models.

    Phi-3 projects q, k and v with one fused ``qkv_proj``: q and k reach the rotary as strided
    slices, which the kernel reads in place (no copy).  With ``partial_rotary_factor`` < 1 only
    the leading features of each head rotate; LongRoPE scaling is already in cos/sin.
    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.phi3.modeling_phi3", "Phi3PreTrainedModel", model, rope, attention,
                  partial_rotary=True)


def apply_fa_amd_to_gpt_oss(model: Optional[torch.nn.Module] = None, rope: bool = True, attention: bool = True):
    """Fused rotary and/or fa_amd attention for gpt-oss models.

    gpt-oss uses yarn rotary whose cos/sin hold head_dim / 2 frequencies (not duplicated halves)
    with the yarn attention factor folded in; the fused kernel reads those tables as they are.
    Its attention adds learnable sinks (``s_aux``), alternates sliding (128) and full layers and
    runs on fa_amd where fa_amd's attention takes sinks.
    Same arguments as :func:`apply_fa_amd_to_llama`.
    """
    return _apply("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssPreTrainedModel", model, rope, attention,
                  half_tables=True)


_FAMILIES = {
    "llama": apply_fa_amd_to_llama,
    "mistral": apply_fa_amd_to_mistral,
    "qwen2": apply_fa_amd_to_qwen2,
    "qwen3": apply_fa_amd_to_qwen3,
    "gemma2": apply_fa_amd_to_gemma2,
    "gemma3": apply_fa_amd_to_gemma3,
    "gemma3_text": apply_fa_amd_to_gemma3,
    "phi3": apply_fa_amd_to_phi3,
    "gpt_oss": apply_fa_amd_to_gpt_oss,
}


def apply_fa_amd(model: torch.nn.Module, rope: bool = True, attention: bool = True):
    """Pick the patch for ``model`` by its ``config.model_type`` (llama, mistral, qwen2, qwen3, gemma2,
    gemma3 / gemma3_text, phi3, gpt_oss)."""
    base_model = _unwrap_model(model)
    model_type = getattr(base_model.config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"no fa_amd patch for model_type {model_type!r} (supported: {sorted(_FAMILIES)}); "
            "attn_implementation='fa_amd' works for any model using Transformers' AttentionInterface"
        )
    return _FAMILIES[model_type](model, rope=rope, attention=attention)
