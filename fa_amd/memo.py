"""Per-tensor memo: compute something about a tensor once per (object, version).

Every layer of a model passes the same position_ids / padding mask /
cu_seqlens tensor; what is derived from it (packed boundaries, validation)
costs a device->host sync, so it is done once per forward instead of once per
layer.  In-place writes bump the tensor's version and invalidate the entry;
nothing is memoized while torch.compile traces.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Tuple

import torch

_MAX_ENTRIES = 256
_entries: Dict[Tuple[int, Hashable], Tuple[weakref.ref, int, Any]] = {}


def memo_per_tensor(tensor: torch.Tensor, tag: Hashable, compute: Callable[[torch.Tensor], Any]) -> Any:
    """compute(tensor), remembered for this tensor object at its current version (per tag)."""
    if torch.compiler.is_compiling():
        return compute(tensor)
    key = (id(tensor), tag)
    hit = _entries.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        return hit[2]
    value = compute(tensor)
    if len(_entries) >= _MAX_ENTRIES:
        _entries.clear()
    # the entry (and the tensors it may hold, e.g. cu_seqlens) goes when the key tensor does
    _entries[key] = (weakref.ref(tensor, lambda _ref, key=key: _entries.pop(key, None)), tensor._version, value)
    return value
