"""Per-tensor memo: compute something about a tensor once per (object, version).

Every layer of a model passes the same position_ids / padding mask /
cu_seqlens tensor; what is derived from it (packed boundaries, validation)
costs a device->host sync, so it is done once per forward instead of once per
layer.  In-place writes bump the tensor's version and invalidate the entry;
nothing is memoized while torch.compile traces.

What the version counter does not see: a write through an alias outside autograd's
bookkeeping (a numpy view of a CPU tensor, DLPack, `.data`).  For CPU tensors -- where
numpy views are the common way to do that, and reading costs no device sync -- the
entry keeps a copy of the contents and is recomputed when they differ.  For GPU tensors
the memo trusts the version counter (comparing would cost the sync it saves); nothing
memory-safety-critical rests on it (the kernels clamp every varlen segment themselves).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Tuple

import torch

_MAX_ENTRIES = 256
_entries: Dict[Tuple[int, Hashable], Tuple[weakref.ref, int, Any, Any]] = {}


def _hit(tensor: torch.Tensor, tag: Hashable):
    """The live entry for this tensor at its current version under `tag` (a 1-tuple of its value), or None."""
    hit = _entries.get((id(tensor), tag))
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version and (
            hit[3] is None or torch.equal(hit[3], tensor)):
        return (hit[2],)
    return None


def memo_lookup(tensor: torch.Tensor, tag: Hashable) -> Any:
    """What memo_per_tensor remembered for this tensor at its current version under `tag`, or None (nothing is
    computed or stored)."""
    if torch.compiler.is_compiling():
        return None
    hit = _hit(tensor, tag)
    return None if hit is None else hit[0]


def memo_per_tensor(tensor: torch.Tensor, tag: Hashable, compute: Callable[[torch.Tensor], Any]) -> Any:
    """compute(tensor), remembered for this tensor object at its current version (per tag)."""
    if torch.compiler.is_compiling():
        return compute(tensor)
    key = (id(tensor), tag)
    hit = _hit(tensor, tag)
    if hit is not None:
        return hit[0]
    value = compute(tensor)
    if len(_entries) >= _MAX_ENTRIES:
        _entries.clear()
    # the entry (and the tensors it may hold, e.g. cu_seqlens) goes when the key tensor does
    snapshot = tensor.detach().clone() if tensor.device.type == "cpu" else None  # see the module docstring
    # (the callback holds the dict itself: at interpreter exit the module's globals may be gone already)
    _entries[key] = (weakref.ref(tensor, lambda _ref, key=key, entries=_entries: entries.pop(key, None)),
                     tensor._version, value, snapshot)
    return value
