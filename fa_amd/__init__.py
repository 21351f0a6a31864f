"""fa_amd: FlashAttention-2 in portable Triton for AMD Instinct / RDNA (and NVIDIA) GPUs.

    import fa_amd                      # also registers attn_implementation="fa_amd" in Transformers
                                       # (when Transformers' modeling code loads, before or after)
    out = fa_amd.flash_attn_func(q, k, v, causal=True)
    with fa_amd.sdpa_route():          # opt-in: F.scaled_dot_product_attention runs on fa_amd
        ...

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
    flash_attn_with_kvcache,
)
from .sdpa import disable_sdpa_route, enable_sdpa_route, sdpa_route, sdpa_route_enabled
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
    "flash_attn_with_kvcache",
    "sdpa_route",
    "enable_sdpa_route",
    "disable_sdpa_route",
    "sdpa_route_enabled",
    "flash_attn_fp8_func",
    "flash_attn_qkvpacked_fp8_func",
    "flash_attn_varlen_fp8_func",
    "flash_attn_varlen_qkvpacked_fp8_func",
    "__version__",
]


def _register_transformers():
    """Register "fa_amd" with Transformers when it is installed (no-op otherwise)."""
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
from .import_hooks import when_imported  # noqa: E402

import importlib.util  # noqa: E402


def _load_checkout_integrations():
    """fa_amd.integrations from a source checkout that is not installed (or whose editable install
    failed): integrations/ sits beside fa_amd/ there (pyproject's package-dir maps it on install)."""
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "integrations"
    if not (folder / "__init__.py").is_file():
        raise ImportError("fa_amd.integrations is not installed and no integrations/ folder sits beside fa_amd/")
    spec = importlib.util.spec_from_file_location(f"{__name__}.integrations", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


# `fa_amd.integrations.route_flash_attention_2()` works after a plain `import fa_amd` (it imports no HF code)
if importlib.util.find_spec(f"{__name__}.integrations") is not None:
    from . import integrations  # noqa: E402,F401
else:
    try:
        integrations = _load_checkout_integrations()
    except ImportError:  # a build without integrations: the kernel API still works
        pass

# Registration imports Transformers' modeling code (seconds on a small CPU), so it waits until a
# program loads that code itself: at once if it already has, else the moment it does. Every model
# class, AttentionInterface and the mask functions live behind these two modules, so
# attn_implementation="fa_amd" works whatever the import order.
TRANSFORMERS_TRIGGER_MODULES = ("transformers.modeling_utils", "transformers.masking_utils")
when_imported(TRANSFORMERS_TRIGGER_MODULES, _register_transformers)
