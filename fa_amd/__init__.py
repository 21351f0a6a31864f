"""fa_amd: FlashAttention-2 in portable Triton for AMD Instinct / RDNA (and NVIDIA) GPUs.

    import fa_amd                      # also registers attn_implementation="fa_amd" in Transformers
    out = fa_amd.flash_attn_func(q, k, v, causal=True)

Without a GPU, set TRITON_INTERPRET=1 before this import to run the kernels
through Triton's interpreter (slow; for tests and smoke runs).
"""
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .fp8 import (
    flash_attn_fp8_func,
    flash_attn_qkvpacked_fp8_func,
    flash_attn_varlen_fp8_func,
    flash_attn_varlen_qkvpacked_fp8_func,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_fp8_func",
    "flash_attn_qkvpacked_fp8_func",
    "flash_attn_varlen_fp8_func",
    "flash_attn_varlen_qkvpacked_fp8_func",
    "__version__",
]


def _register_transformers():
    """Register "fa_amd" with Transformers when it is installed (no-op otherwise)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    try:
        from .integrations import register
    except ImportError:  # integrations not installed alongside (e.g. a bare source checkout)
        return
    try:
        register()
    except ImportError as err:
        # an incompatible transformers must not break the kernel API; say why "fa_amd" is missing
        import warnings

        warnings.warn(str(err), stacklevel=2)


# installs the tune-on-first-use hook of FA_AMD_AUTOTUNE=1 (the tuner sits above the kernels)
from . import autotune  # noqa: E402,F401

_register_transformers()
