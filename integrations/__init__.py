"""Framework integrations of fa_amd (importable as ``fa_amd.integrations``).

* :func:`register` adds the attention implementation ``"fa_amd"`` to
  Transformers (``import fa_amd`` calls it when Transformers is installed).
* ``apply_fa_amd_to_<family>`` (llama, mistral, qwen2, qwen3, gemma2, gemma3,
  phi3, gpt_oss) patch models Liger-style: fused rotary + fa_amd attention;
  :func:`apply_fa_amd` picks the family from ``config.model_type``.
* :func:`route_flash_attention_2` makes code that hard-codes
  ``attn_implementation="flash_attention_2"`` or ``import flash_attn`` run on
  fa_amd on machines without flash-attn.

Nothing here imports Transformers at import time.
"""
from __future__ import annotations

ATTENTION_NAME = "fa_amd"
MIN_TRANSFORMERS_VERSION = "5.0.0"

_registered = False


def _transformers_interfaces():
    """(AttentionInterface, AttentionMaskInterface), or a clear ImportError naming the version."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "fa_amd's Transformers integration needs transformers>=5.0 (pip install 'fa-amd[hf]')"
        ) from exc
    from packaging.version import Version

    found = getattr(transformers, "__version__", "unknown")
    try:
        too_old = Version(found) < Version(MIN_TRANSFORMERS_VERSION)
    except Exception:
        too_old = False
    attention_interface = getattr(transformers, "AttentionInterface", None)
    mask_interface = None
    try:
        from transformers.masking_utils import AttentionMaskInterface as mask_interface  # noqa: N813
        from transformers.masking_utils import flash_attention_mask  # noqa: F401
    except ImportError:
        mask_interface = None
    if too_old or attention_interface is None or mask_interface is None:
        raise ImportError(
            f"fa_amd needs transformers>={MIN_TRANSFORMERS_VERSION} (with AttentionInterface, "
            f"AttentionMaskInterface and masking_utils.flash_attention_mask); found transformers {found}. "
            "Upgrade with: pip install -U 'transformers>=5.0'"
        )
    return attention_interface, mask_interface


def register() -> None:
    """Register ``"fa_amd"`` with Transformers' attention and attention-mask interfaces.

    Cheap and idempotent.  Both registrations are needed: without the mask entry
    Transformers 5.x builds no mask for an unknown implementation, which
    silently drops padding.
    """
    global _registered
    if _registered:
        return
    attention_interface, mask_interface = _transformers_interfaces()
    from .hf_attention import fa_amd_attention_forward, fa_amd_attention_mask

    attention_interface.register(ATTENTION_NAME, fa_amd_attention_forward)
    mask_interface.register(ATTENTION_NAME, fa_amd_attention_mask)
    _registered = True


_PATCHES = ("apply_fa_amd", "apply_fa_amd_to_llama", "apply_fa_amd_to_mistral", "apply_fa_amd_to_qwen2",
            "apply_fa_amd_to_qwen3", "apply_fa_amd_to_gemma2", "apply_fa_amd_to_gemma3", "apply_fa_amd_to_phi3",
            "apply_fa_amd_to_gpt_oss")


def __getattr__(name):
    # Lazy re-exports keep `import fa_amd` free of transformers/peft imports.
    if name in _PATCHES:
        from . import monkey_patch

        return getattr(monkey_patch, name)
    if name in ("route_flash_attention_2", "install_flash_attn_shim"):
        from . import flash_attn_shim

        return getattr(flash_attn_shim, name)
    if name in ("fa_amd_attention_forward", "fa_amd_attention_mask"):
        from . import hf_attention

        return getattr(hf_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTENTION_NAME",
    "register",
    *_PATCHES,
    "route_flash_attention_2",
    "install_flash_attn_shim",
    "fa_amd_attention_forward",
    "fa_amd_attention_mask",
]
