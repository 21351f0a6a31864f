"""Post-import hooks: run a callback the moment a module finishes importing, without importing it.

``import fa_amd`` must not pay for Transformers (seconds on a small CPU), yet
``attn_implementation="fa_amd"`` has to work whatever the import order.  So the
registration waits for Transformers' modeling module: if it is already loaded
the callback runs at once, otherwise a finder on ``sys.meta_path`` wraps that
module's loader and runs the callback right after the module body executed.

Only the standard library is imported here.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable, Dict, List, Sequence

_lock = threading.RLock()
# module name -> callbacks waiting for it (a callback may wait on several names; it runs once)
_pending: Dict[str, List["_Hook"]] = {}
# hooks that came due while a watched module was still half-imported by an import whose loader the finder
# never wrapped (when_imported called from inside that import, e.g. a module it imports imports fa_amd):
# nothing fires at that import's end, so they fire at the next import the finder sees once it has ended
_deferred: List["_Hook"] = []


class _Hook:
    def __init__(self, names: Sequence[str], callback: Callable[[], None]):
        self.names = tuple(names)
        self.callback = callback
        self.fired = False

    def fire(self, just_loaded: str = "") -> None:
        with _lock:
            if self.fired:
                return
            # another watched module still half-imported (it imports the one just loaded): its own
            # completion fires the hook, once the callback can see both
            if any(_initializing(name) for name in self.names if name != just_loaded):
                if self not in _deferred:
                    _deferred.append(self)
                return
            self.fired = True
            for name in self.names:
                hooks = _pending.get(name)
                if hooks and self in hooks:
                    hooks.remove(self)
                    if not hooks:
                        del _pending[name]
        self.callback()


def _fire_deferred() -> None:
    """Fire the deferred hooks whose half-imported modules have finished importing (a hook whose import failed
    instead, leaving none of its modules loaded, just goes back to waiting in _pending)."""
    with _lock:
        done = [hook for hook in _deferred if hook.fired or not any(_initializing(name) for name in hook.names)]
        for hook in done:
            _deferred.remove(hook)
    for hook in done:
        if not hook.fired and any(sys.modules.get(name) is not None for name in hook.names):
            hook.fire()


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders and wraps the loader of a watched module."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if _deferred:
            _fire_deferred()
        if fullname not in _pending or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._busy.name = None
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module") or getattr(loader, "_fa_amd_wrapped", False):
            return spec
        exec_module = loader.exec_module

        def exec_then_fire(module):
            exec_module(module)  # a failed import raises here and fires nothing
            for hook in list(_pending.get(fullname, ())):
                hook.fire(just_loaded=fullname)

        # loaders of source files are one object per module, so patching the instance is local
        try:
            loader.exec_module = exec_then_fire
            loader._fa_amd_wrapped = True
        except AttributeError:  # a loader that refuses attributes: fall back to no hook
            return spec
        return spec


_FINDER = _PostImportFinder()


def when_imported(names: Sequence[str], callback: Callable[[], None]) -> None:
    """Run ``callback()`` once, as soon as any module in ``names`` has been imported.

    Runs it now if one of them is already in ``sys.modules``.
    """
    hook = _Hook(names, callback)
    if any(sys.modules.get(name) is not None and not _initializing(name) for name in names):
        hook.fire()
        if hook.fired:
            return
    with _lock:
        for name in names:
            _pending.setdefault(name, []).append(hook)
        # one of them is being imported right now (this call comes from inside that import): its loader ran
        # before the finder could wrap it, so only a later import notices that it has finished
        if any(_initializing(name) for name in names) and hook not in _deferred:
            _deferred.append(hook)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
