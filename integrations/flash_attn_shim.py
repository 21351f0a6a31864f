"""Route ``flash_attention_2`` / ``import flash_attn`` to fa_amd.

Many training stacks hard-code ``attn_implementation="flash_attention_2"`` or
``from flash_attn import flash_attn_varlen_func``.  On a machine without the
flash-attn package (typical on ROCm)::

    import fa_amd
    fa_amd.integrations.route_flash_attention_2()

does two things:

1. installs a ``flash_attn`` package backed by fa_amd: an import hook (so
   ``importlib.util.find_spec("flash_attn")`` and ``import flash_attn.bert_padding``
   work) plus package metadata for a ``flash-attn`` distribution (so
   ``importlib.metadata.version("flash_attn")`` and Transformers'
   ``is_flash_attn_2_available()`` see it on a GPU machine).  Skipped when a
   real flash-attn is importable.
2. points Transformers' ``"flash_attention_2"`` at fa_amd's attention function
   and makes its FA2 dispatch checks accept fa_amd (private Transformers
   internals, kept in ``_patch_transformers_fa2`` with a version check).
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import types
from typing import Optional

import torch

# A flash-attn 2.x version new enough for every feature check in Transformers
# (softcap >= 2.6, window >= 2.3, 5-tuple unpad_input >= 2.6.3); the local
# label says who really answers.
SHIM_FLASH_ATTN_VERSION = "2.8.3+fa_amd"
SHIM_DISTRIBUTION_NAME = "flash-attn"
_SHIM_MARKER = "__fa_amd_shim__"
_TESTED_TRANSFORMERS_MAJOR = 5


# --------------------------------------------------------------------------- bert_padding


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x (total, ...) -> x[indices] (flash_attn.bert_padding semantics)."""
    return x[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    out[indices] = values
    return out


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: Optional[torch.Tensor] = None):
    """(b, s, ...) + keep-mask (b, s) -> (tokens, indices, cu_seqlens, max_seqlen, used_seqlens)."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen, used_seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(tokens, ...) -> (b, s, ...) with zeros where nothing was kept."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])


# --------------------------------------------------------------------------- kv-cache attention


# The real decode entry point (split-KV kernel, paged block_table, append + rotary in place): the
# shim package serves fa_amd's own function, whose full flash-attn signature Transformers inspects to
# decide which kwargs (block_table, cache_seqlens, softcap, ...) it may pass.
from fa_amd.kvcache import flash_attn_with_kvcache  # noqa: E402


# --------------------------------------------------------------------------- the shim package


def _build_modules() -> dict:
    import fa_amd

    api = {
        name: getattr(fa_amd, name)
        for name in (
            "flash_attn_func",
            "flash_attn_varlen_func",
            "flash_attn_qkvpacked_func",
            "flash_attn_kvpacked_func",
            "flash_attn_varlen_qkvpacked_func",
            "flash_attn_varlen_kvpacked_func",
        )
        if hasattr(fa_amd, name)
    }
    api["flash_attn_with_kvcache"] = flash_attn_with_kvcache

    def make(name: str, is_package: bool, attrs: dict) -> types.ModuleType:
        module = types.ModuleType(name, f"fa_amd stand-in for {name} (see fa_amd.integrations.flash_attn_shim)")
        module.__spec__ = importlib.machinery.ModuleSpec(name, _FINDER, is_package=is_package)
        module.__loader__ = _FINDER
        module.__file__ = __file__
        if is_package:
            module.__path__ = []
            module.__spec__.submodule_search_locations = []
        setattr(module, _SHIM_MARKER, True)
        for key, value in attrs.items():
            setattr(module, key, value)
        return module

    from . import flash_attn_compat as compat

    padding = dict(
        pad_input=pad_input,
        unpad_input=unpad_input,
        index_first_axis=index_first_axis,
        index_put_first_axis=index_put_first_axis,
        unpad_input_for_concatenated_sequences=compat.unpad_input_for_concatenated_sequences,
    )
    # name -> (is a package, attributes); every parent package is listed before its children
    layout = {
        "flash_attn": (True, dict(api, __version__=SHIM_FLASH_ATTN_VERSION)),
        "flash_attn.flash_attn_interface": (False, dict(api, **compat.PRIVATE_INTERFACE)),
        "flash_attn.bert_padding": (False, padding),
        "flash_attn.layers": (True, {}),
        "flash_attn.layers.rotary": (False, compat.ROTARY_LAYERS),
        "flash_attn.ops": (True, {}),
        "flash_attn.ops.activations": (False, compat.ACTIVATIONS),
        "flash_attn.ops.layer_norm": (False, compat.LEGACY_LAYER_NORM),
        "flash_attn.ops.rms_norm": (False, compat.LEGACY_RMS_NORM),
        "flash_attn.ops.triton": (True, {}),
        "flash_attn.ops.triton.rotary": (False, compat.TRITON_ROTARY),
        "flash_attn.ops.triton.layer_norm": (False, compat.TRITON_LAYER_NORM),
        "flash_attn.ops.triton.cross_entropy": (False, compat.TRITON_CROSS_ENTROPY),
        "flash_attn.losses": (True, {}),
        "flash_attn.losses.cross_entropy": (False, compat.LOSSES_CROSS_ENTROPY),
    }
    modules = {name: make(name, is_package, attrs) for name, (is_package, attrs) in layout.items()}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


class _ShimDistribution(importlib.metadata.Distribution):
    def read_text(self, filename):
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {SHIM_DISTRIBUTION_NAME}\n"
                f"Version: {SHIM_FLASH_ATTN_VERSION}\n"
                "Summary: flash_attn API served by fa_amd (Triton)\n"
            )
        if filename == "top_level.txt":
            return "flash_attn\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the flash_attn shim modules and their distribution metadata."""

    def __init__(self):
        self.modules: dict = {}

    # importlib.abc.MetaPathFinder
    def find_spec(self, fullname, path=None, target=None):
        module = self.modules.get(fullname)
        return None if module is None else module.__spec__

    # importlib.abc.Loader
    def create_module(self, spec):
        return self.modules[spec.name]

    def exec_module(self, module):
        pass

    # importlib.metadata finder protocol
    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if not self.modules:
            return iter(())
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_").replace(".", "_") == "flash_attn":
            return iter((_ShimDistribution(),))
        return iter(())


_FINDER = _ShimFinder()


def _real_flash_attn_present() -> bool:
    module = sys.modules.get("flash_attn")
    if module is not None:
        return not getattr(module, _SHIM_MARKER, False)
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
        try:
            return importlib.util.find_spec("flash_attn") is not None
        finally:
            sys.meta_path.insert(0, _FINDER)
    return importlib.util.find_spec("flash_attn") is not None


def install_flash_attn_shim() -> bool:
    """Make ``import flash_attn`` resolve to fa_amd.  Returns False if a real flash-attn is installed.

    Also makes Transformers' ``is_flash_attn_2_available()`` answer True wherever fa_amd runs (a
    GPU, or the Triton interpreter), now or when Transformers is imported later.
    """
    if _real_flash_attn_present():
        return False
    if not _FINDER.modules:
        _FINDER.modules.update(_build_modules())
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    sys.modules.update(_FINDER.modules)
    importlib.invalidate_caches()
    _clear_transformers_availability_caches()
    from fa_amd.import_hooks import when_imported

    when_imported(("transformers.utils.import_utils",), _patch_fa2_availability)
    return True


def uninstall_flash_attn_shim() -> None:
    """Remove the shim modules, import hook and metadata (mainly for tests)."""
    for name in list(_FINDER.modules):
        if sys.modules.get(name) is _FINDER.modules[name]:
            del sys.modules[name]
    _FINDER.modules.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _restore_fa2_availability()
    _clear_transformers_availability_caches()


# (module, attribute) -> the original is_flash_attn_2_available that our wrapper replaced there
_availability_originals: dict = {}


def _patch_fa2_availability() -> None:
    """Wrap Transformers' is_flash_attn_2_available so the stand-in counts wherever fa_amd runs.

    Transformers asks for CUDA (or MLU/MUSA) besides the package, so on ROCm-less CPUs running the
    interpreter the stand-in would never count.  Every loaded Transformers module that imported the
    function gets the wrapper; modules imported later pick it up from import_utils.
    """
    if not _FINDER.modules:
        return
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_flash_attn_2_available", None)
    if original is None or getattr(original, "_fa_amd_wrapper", False):
        return

    @functools.wraps(original)
    def is_flash_attn_2_available(*args, **kwargs):
        return (bool(_FINDER.modules) and _fa_amd_usable()) or original(*args, **kwargs)

    is_flash_attn_2_available._fa_amd_wrapper = True
    is_flash_attn_2_available._dynamo_marked_constant = True  # as Transformers marks the original
    for name, module in list(sys.modules.items()):
        if (name == "transformers" or name.startswith("transformers.")) and module is not None \
                and module.__dict__.get("is_flash_attn_2_available") is original:
            _availability_originals[(module, "is_flash_attn_2_available")] = original
            setattr(module, "is_flash_attn_2_available", is_flash_attn_2_available)


def _restore_fa2_availability() -> None:
    for (module, attr), original in _availability_originals.items():
        if getattr(getattr(module, attr, None), "_fa_amd_wrapper", False):
            setattr(module, attr, original)
    _availability_originals.clear()


def _clear_transformers_availability_caches() -> None:
    # Transformers caches package probes for the process lifetime.
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None:
        return
    for name in ("is_flash_attn_2_available", "is_flash_attn_greater_or_equal", "_package_distribution_mapping"):
        fn = getattr(utils, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


# --------------------------------------------------------------------------- transformers routing


def _fa_amd_usable() -> bool:
    """fa_amd runs on any GPU torch sees (ROCm and CUDA), or anywhere under TRITON_INTERPRET=1."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fa_amd_usable_check(*args, **kwargs) -> bool:
    return _fa_amd_usable()


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_patched_transformers = False


def _patch_transformers_fa2() -> None:
    """Point Transformers' "flash_attention_2" at fa_amd (private internals, version-checked).

    * AttentionInterface["flash_attention_2"] = fa_amd's attention function (public API).
      The mask side stays Transformers' own flash_attention_mask.
    * FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]: the availability / device checks
      that PreTrainedModel runs for "flash_attention_2" ask fa_amd instead of
      the flash-attn package (so the interpreter on CPU counts too).
    * modeling_flash_attention_utils.is_flash_attn_2_available: the FA2 loader
      that Transformers preloads at dispatch imports our shim instead of trying
      the Hub kernel fallback.
    """
    global _patched_transformers
    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    mfu = importlib.import_module("transformers.modeling_flash_attention_utils")
    matrix = getattr(mfu, "FLASH_ATTENTION_COMPATIBILITY_MATRIX", None)
    if version.major != _TESTED_TRANSFORMERS_MAJOR or not isinstance(matrix, dict) or 2 not in matrix \
            or not hasattr(mfu, "_lazy_imports"):
        raise ImportError(
            f"route_flash_attention_2() supports transformers {_TESTED_TRANSFORMERS_MAJOR}.x (tested on 5.23); "
            f"found transformers {transformers.__version__}. Use attn_implementation='fa_amd' instead."
        )
    from transformers import AttentionInterface

    from . import register
    from .hf_attention import fa_amd_attention_forward

    register()
    AttentionInterface.register("flash_attention_2", fa_amd_attention_forward)
    if _patched_transformers:
        return
    # Transformers' messages name these: `model.to(<name>)` for an available device, the list when none is, so
    # the CPU's entry says what makes it available
    cpu_name = "cpu" if _interpreter_on() else "cpu (with TRITON_INTERPRET=1 set before importing fa_amd)"
    supported_devices = ((torch.cuda.is_available, "cuda"), (_interpreter_on, cpu_name))
    entry = dict(matrix[2])
    entry.update(
        general_availability_check=_fa_amd_usable_check,
        pkg_availability_check=lambda *args, **kwargs: True,
        supported_devices=supported_devices,
        custom_supported_devices=(),
    )
    matrix[2] = entry
    mfu.is_flash_attn_2_available = _fa_amd_usable_check
    if getattr(mfu, "_loaded_implementation", None) == "flash_attention_2":
        mfu._loaded_implementation = None  # reload FA2 functions from the shim
    from fa_amd.import_hooks import when_imported

    for module_name, class_name in _SINK_MODEL_CLASSES:
        when_imported((module_name,), functools.partial(_list_fa2_as_compatible, module_name, class_name))
    _patched_transformers = True


# Model families whose `_compatible_flash_implementations` leaves "flash_attention_2" out because flash-attn 2
# has no learnable attention sinks (`s_aux`); Transformers then auto-corrects a "flash_attention_2" request to
# the list's first entry (a Hub kernel).  fa_amd's kernels take the sinks, and every path from the routed name
# hands them over (fa_amd's attention function; Transformers <= 5.19's paged function calls the stand-in's
# flash_attn_varlen_func / flash_attn_with_kvcache with `s_aux`), so the route lists "flash_attention_2" for
# them too (last: a request for another flash name still resolves as before).  Only families checked against
# eager (tests/test_gpt_oss.py) are here.
_SINK_MODEL_CLASSES = (("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssPreTrainedModel"),)


def _list_fa2_as_compatible(module_name: str, class_name: str) -> None:
    cls = getattr(sys.modules.get(module_name), class_name, None)
    listed = getattr(cls, "_compatible_flash_implementations", None)
    if cls is not None and listed is not None and "flash_attention_2" not in listed:
        cls._compatible_flash_implementations = [*listed, "flash_attention_2"]


def route_flash_attention_2(shim_flash_attn: bool = True) -> None:
    """Make ``attn_implementation="flash_attention_2"`` and ``import flash_attn`` use fa_amd.

    Call once, after ``import fa_amd`` and before building models.  Models
    already built with "flash_attention_2" also switch, since Transformers looks
    the implementation up by name on every forward.

    Args:
        shim_flash_attn: also install the ``flash_attn`` stand-in package (skipped
            automatically when a real flash-attn is installed).
    """
    if not isinstance(shim_flash_attn, bool):
        raise TypeError("shim_flash_attn must be a bool")
    if shim_flash_attn:
        install_flash_attn_shim()
    elif not _real_flash_attn_present() and "flash_attn" not in sys.modules:
        # Transformers' FA2 loader imports flash_attn at dispatch time; without a
        # package to import it would try the Hub, so the shim is required.
        raise ValueError("shim_flash_attn=False needs an importable flash_attn package")
    _patch_transformers_fa2()
