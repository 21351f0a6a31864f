"""The SDPA route: `torch.nn.functional.scaled_dot_product_attention` served by fa_amd (opt-in).

    import fa_amd
    with fa_amd.sdpa_route():                      # scoped
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    fa_amd.enable_sdpa_route()                     # process-wide, until fa_amd.disable_sdpa_route()

PyTorch's ROCm SDPA has no flash kernel on MI100 (gfx908) and many RDNA parts, and every library
that calls SDPA directly (diffusers, timm, torchtune, custom models) never reaches fa_amd's own API.
Inside the route, the calls fa_amd can serve run on its kernels and give SDPA's answer and
gradients; every other call goes to torch unchanged (each reason logged once, at debug level, on
the "fa_amd.sdpa" logger).  Nothing changes outside the route; importing fa_amd turns nothing on.

Served: query (..., Hq, L, E), key/value (..., Hk, S, E|Ev) with the same leading dims, any strides
with a contiguous last dim (else one copy); fp16 / bf16 / fp32; E, Ev <= 256 (a smaller value
head dim is zero-padded); no mask, or a boolean mask that is all True or exactly SDPA's causal
mask; `is_causal`; `scale`; `enable_gqa` (Hq a multiple of Hk, K/V never repeated); `dropout_p`
(fa_amd's Philox RNG, seeded from torch's generator: same distribution as SDPA's, not the same
bits).  SDPA's `is_causal` is aligned to the TOP-LEFT corner when L != S (row i sees keys 0..i),
unlike flash-attn's bottom-right: with L > S it becomes the window (-1, L - S), with L < S the keys
past L (which no row sees) are dropped and the rest is square.  Under
torch.are_deterministic_algorithms_enabled() the backward is bitwise reproducible.
fa_amd stands in for SDPA's flash backend: where that is switched off (`sdpa_kernel` without
FLASH_ATTENTION, `torch.backends.cuda.enable_flash_sdp(False)`) calls go to torch, as they do for
everything it cannot serve: float masks, other boolean masks (under torch.compile every
mask: its contents cannot be read while tracing), fp64, head dims > 256, nested or other tensor
subclasses, torch.func transforms, broadcast batch dims, empty inputs, CPU tensors (unless
TRITON_INTERPRET=1).

How: a Python kernel for aten::scaled_dot_product_attention registered with the dispatcher (its
CUDA and AutogradCUDA keys; CPU ones too under the interpreter), so the route sees every call,
including code that bound `scaled_dot_product_attention` before the route began, and torch.compile
traces through it (fa_amd's custom ops land in the graph).  A graph keeps what it was compiled
with: compile inside the route (or after enable_sdpa_route()); `torch.compiler.reset()` recompiles.
Where torch has the official registry for flash implementations (`torch.nn.attention.
register_flash_attention_impl`, torch >= 2.10; feature-detected), importing fa_amd registers "fa_amd"
there (which activates nothing), and the
route also activates it (restoring the previous one after): fa_amd then serves
aten::_scaled_dot_product_flash_attention and its backward, the kernels SDPA's flash backend calls
(e.g. from nn.MultiheadAttention's fast path).  `torch.nn.attention.activate_flash_attention_impl(
"fa_amd")` turns on that part alone.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import warnings
from typing import Optional

import torch

from . import interface, ops
from .arch import INTERPRET
from .memo import memo_per_tensor
from .ops import _gradients, _traced
from .kernels.forward import attention_forward

__all__ = ["sdpa_route", "enable_sdpa_route", "disable_sdpa_route", "sdpa_route_enabled"]

logger = logging.getLogger(__name__)

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_HAS_ENABLE_GQA = any(a.name == "enable_gqa" for a in _SDPA._schema.arguments)
FLASH_IMPL_NAME = "fa_amd"

_lock = threading.RLock()
_scopes = 0  # open sdpa_route() blocks
_global = False  # enable_sdpa_route() without disable_sdpa_route()
_library = None  # the dispatcher registrations while the route is on
_flash_undo = None  # how to undo the flash-impl activation the route made
_logged = set()


# --------------------------------------------------------------------------- turning it on and off

@contextlib.contextmanager
def sdpa_route():
    """Within this block, F.scaled_dot_product_attention runs on fa_amd where it can (nests; thread-safe;
    the route is process-wide while any block is open or enable_sdpa_route() is in force)."""
    global _scopes
    with _lock:
        _scopes += 1
        _update()
    try:
        yield
    finally:
        with _lock:
            _scopes -= 1
            _update()


def enable_sdpa_route() -> None:
    """Route F.scaled_dot_product_attention to fa_amd process-wide, until disable_sdpa_route()."""
    global _global
    with _lock:
        _global = True
        _update()


def disable_sdpa_route() -> None:
    """Undo enable_sdpa_route() (open sdpa_route() blocks keep the route until they exit)."""
    global _global
    with _lock:
        _global = False
        _update()


def sdpa_route_enabled() -> bool:
    """Whether SDPA calls are being routed to fa_amd now."""
    return _library is not None


def _dispatch_keys():
    # GPU tensors (CUDA and ROCm alike) dispatch on the CUDA keys; CPU tensors only reach fa_amd's
    # kernels through Triton's interpreter
    return ("CUDA", "CPU") if INTERPRET else ("CUDA",)


def _update():
    global _library, _flash_undo
    want = _global or _scopes > 0
    if want and _library is None:
        lib = torch.library.Library("aten", "IMPL")
        for key in _dispatch_keys():
            # Autograd<key>: the route's own autograd (fa_amd's); <key>: inference_mode and
            # below-autograd calls
            lib.impl("scaled_dot_product_attention", _routed_sdpa, "Autograd" + key)
            lib.impl("scaled_dot_product_attention", _routed_sdpa, key)
        _library = lib
        _flash_undo = _activate_flash_impl()
    elif not want and _library is not None:
        _destroy(_library)
        _library = None
        _restore_flash_impl(_flash_undo)
        _flash_undo = None
    else:
        return
    _clear_dispatch_caches()


def _clear_dispatch_caches():
    """Forget what the Python dispatcher (torch.compile's tracing) cached for the ops the route changes: a
    choice cached with the route on (or off) outlives the switch otherwise -- after torch.compiler.reset() a
    model compiled outside the route kept the route's kernel without its autograd (no gradients before the
    attention), and one compiled inside it kept torch's own kernel."""
    for name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_backward"):
        overload = getattr(getattr(torch.ops.aten, name, None), "default", None)
        cache = getattr(overload, "_dispatch_cache", None)
        if isinstance(cache, dict):
            cache.clear()


def _destroy(lib):
    # Library._destroy is how torch's own scoped registrations end; dropping the last reference does
    # the same through its finalizer
    destroy = getattr(lib, "_destroy", None)
    if destroy is not None:
        destroy()


# --------------------------------------------------------------------------- the routed SDPA

def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                 enable_gqa=False):
    """aten::scaled_dot_product_attention while the route is on: fa_amd where it can, else torch's own."""
    why_not = _unservable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if why_not is None:
        return _sdpa_on_fa_amd(query, key, value, attn_mask, dropout_p, is_causal, scale)
    _log_once(why_not)
    extra = {"enable_gqa": enable_gqa} if _HAS_ENABLE_GQA else {}
    # SDPA's own implementation (its CompositeImplicitAutograd kernel): backend choice, autograd, errors
    return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.debug("fa_amd SDPA route: %s; this call (and any like it) goes to torch's SDPA unchanged", reason)


def _plain_or_traced(t) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return True
    # torch.compile's tracing tensors: the route emits fa_amd's custom ops for them
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def _functorch_active() -> bool:
    # torch.func wraps tensors in its own layers; fa_amd's autograd.Function does not support them
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _unservable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Optional[str]:
    """Why fa_amd cannot serve this call (a short, stable reason), or None."""
    tensors = (query, key, value)
    if not torch.backends.cuda.flash_sdp_enabled():
        return "SDPA's flash backend is disabled (sdpa_kernel without FLASH_ATTENTION, or enable_flash_sdp(False))"
    if not all(isinstance(t, torch.Tensor) and _plain_or_traced(t) and not t.is_nested for t in tensors):
        return "nested or subclassed tensors"
    if _functorch_active():
        return "a torch.func transform (grad, vmap, jacrev, ...)"
    if ops.forward_tangent_of(*tensors) is not None:
        return "forward-mode AD (dual tensors): fa_amd's kernels have no jvp"
    if query.dtype not in interface.SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype}/{key.dtype}/{value.dtype}"
    device = query.device
    if key.device != device or value.device != device:
        return "inputs on different devices"
    if not (device.type == "cuda" or (device.type == "cpu" and INTERPRET)):
        return f"{device.type} tensors"
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return "inputs of rank < 3 or of different ranks"
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        return "batch dims that differ (broadcast)"
    hq, seqlen_q, head_dim = query.shape[-3:]
    hk, seqlen_k, _ = key.shape[-3:]
    if key.shape[-1] != head_dim or value.shape[-3:-1] != key.shape[-3:-1]:
        return "mismatched query/key/value shapes"
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        return "query heads != key heads (without enable_gqa, or not a multiple)"
    if max(head_dim, value.shape[-1]) > interface.MAX_HEAD_DIM:
        return f"head dim > {interface.MAX_HEAD_DIM}"
    if any(t.numel() == 0 for t in tensors):
        return "empty inputs"
    if math.prod(query.shape[:-3]) > interface.MAX_GRID_YZ or hq > interface.MAX_GRID_YZ:
        return f"batch or heads > {interface.MAX_GRID_YZ}"
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        return "dropout_p outside [0, 1)"
    if scale is not None and not (math.isfinite(scale) and abs(scale) <= interface.MAX_SOFTMAX_SCALE):
        return f"a non-finite scale or |scale| > {interface.MAX_SOFTMAX_SCALE:.0e} (the kernels' float32 scores)"
    if attn_mask is not None:
        if is_causal:
            return "attn_mask together with is_causal"
        if _mask_kind(attn_mask, query, seqlen_k) is None:
            return f"a {'float' if attn_mask.is_floating_point() else attn_mask.dtype} attn_mask fa_amd cannot express"
    return None


def _mask_kind(mask, query, seqlen_k) -> Optional[str]:
    """"none" (all True), "causal" (exactly SDPA's top-left causal mask), or None (anything else,
    any non-boolean mask, and every mask while tracing: its values cannot be read then)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.device != query.device:
        return None
    full = (*query.shape[:-1], seqlen_k)
    if mask.dim() > len(full) or not _plain_or_traced(mask) or mask.is_nested:
        return None
    try:
        if torch.broadcast_shapes(mask.shape, full) != torch.Size(full):
            return None
    except RuntimeError:
        return None
    if torch.compiler.is_compiling() or _traced(mask):
        return None
    # one device->host sync per mask tensor (every layer of a model passes the same one)
    return memo_per_tensor(mask, ("sdpa_mask_kind", full[-2], seqlen_k),
                           lambda m: _classify_mask(m, full[-2], seqlen_k))


def _classify_mask(mask, seqlen_q, seqlen_k) -> Optional[str]:
    checks = [mask.all()]
    if mask.dim() >= 2 and mask.shape[-2] == seqlen_q:
        causal = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device).tril()
        checks.append((mask == causal).all())
    flags = torch.stack(checks).tolist()
    if flags[0]:
        return "none"
    return "causal" if len(flags) > 1 and flags[1] else None


def _sdpa_on_fa_amd(query, key, value, attn_mask, dropout_p, is_causal, scale):
    hq, seqlen_q, head_dim = query.shape[-3:]
    hk, seqlen_k, _ = key.shape[-3:]
    v_dim = value.shape[-1]
    if attn_mask is not None:  # a mask fa_amd can express (checked): all True, or SDPA's causal one
        is_causal = _mask_kind(attn_mask, query, seqlen_k) == "causal"
    if scale is None:
        scale = head_dim ** -0.5
    # (..., H, L, E) -> flash layout (B, L, H, E): views, no copies for 4-D inputs
    q, k, v = (x if x.dim() == 4 else x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    width = max(head_dim, v_dim)
    if v_dim < width:  # a smaller value head dim: zero columns, cropped from the output
        v = torch.nn.functional.pad(v, (0, width - v_dim))
    elif head_dim < width:  # a larger one: zero q/k columns leave q.k unchanged
        q = torch.nn.functional.pad(q, (0, width - head_dim))
        k = torch.nn.functional.pad(k, (0, width - head_dim))
    causal, window = False, (-1, -1)
    if is_causal:  # SDPA's causal is top-left aligned: row i sees keys 0..i
        if seqlen_q == seqlen_k:
            causal = True
        elif seqlen_q > seqlen_k:  # col - row <= 0  <=>  rel (bottom-right) <= seqlen_q - seqlen_k
            window = (-1, seqlen_q - seqlen_k)
        else:  # keys past seqlen_q are seen by no row
            k, v = k[:, :seqlen_q], v[:, :seqlen_q]
            causal = True
    # (the window literally: (-1, seqlen_q - seqlen_k) may pass seqlen_k, where flash-attn's rule would drop it)
    out = interface.dense_attention(q, k, v, float(dropout_p), float(scale), causal, window, 0.0, None,
                                    torch.are_deterministic_algorithms_enabled(), False, None, None,
                                    flash_window_rule=False)
    if width != v_dim:
        out = out[..., :v_dim]
    out = out.transpose(1, 2)
    if query.is_contiguous() and not out.is_contiguous():
        # torch's SDPA gives the output the query's layout (its kernels' meta: empty_like(query)), and code may
        # .view() it; a model's transposed (B, L, H, E) query already has the layout the kernel wrote: no copy
        out = out.contiguous()
    return out if query.dim() == 4 else out.reshape(*query.shape[:-1], v_dim)


# --------------------------------------------------------------------------- torch's flash-impl registry

class _FlashHandle:
    """What register_fn returns to torch's registry: remove() withdraws fa_amd's kernels."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            _destroy(self.library)
            self.library = None


def register_flash_impl() -> None:
    """Register "fa_amd" in torch's flash-implementation registry (torch >= 2.10; a no-op before):
    `torch.nn.attention.activate_flash_attention_impl("fa_amd")` then makes SDPA's flash backend
    call fa_amd's kernels.  Registration activates nothing (import fa_amd calls this)."""
    attention = torch.nn.attention
    if hasattr(attention, "register_flash_attention_impl"):
        attention.register_flash_attention_impl(FLASH_IMPL_NAME, register_fn=_register_flash_kernels)


def _register_flash_kernels() -> _FlashHandle:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for key in _dispatch_keys():
            lib.impl("_scaled_dot_product_flash_attention", _flash_forward, key)
            lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, key)
    return _FlashHandle(lib)


def _activate_flash_impl():
    """Activate fa_amd's flash kernels for the route; returns what _restore_flash_impl needs."""
    attention = torch.nn.attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        return None  # this torch has no registry
    if not hasattr(attention, "restore_flash_attention_impl"):
        # an early registry (no restore_flash_attention_impl) cannot undo an activation: register the kernels directly
        # (the dispatcher restores whatever was there when they are withdrawn)
        return ("handle", _register_flash_kernels())
    previous = attention.current_flash_attention_impl()
    if previous == FLASH_IMPL_NAME:
        return None  # the user activated it: theirs to undo
    register_flash_impl()
    attention.activate_flash_attention_impl(FLASH_IMPL_NAME)
    return ("registry", previous)


def _restore_flash_impl(undo) -> None:
    if undo is None:
        return
    kind, value = undo
    if kind == "handle":
        value.remove()
        return
    attention = torch.nn.attention
    if attention.current_flash_attention_impl() != FLASH_IMPL_NAME:
        return  # changed by someone else meanwhile: leave it
    if value is None:
        attention.restore_flash_attention_impl()
    else:
        attention.activate_flash_attention_impl(value)


def _flash_layout(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)  # (B, H, L, D) <-> (B, L, H, D)


def _rng_for_meta(rng_state, like):
    """fa_amd's int64 (seed, offset) in the seed / offset tensors torch's meta function promises:
    uint64 (2,) + uint64 () on CUDA builds, int64 () + int64 () on ROCm ones (torch's old layout)."""
    if torch.version.hip is not None:
        if rng_state is None:
            return like.new_zeros((), dtype=torch.int64), like.new_zeros((), dtype=torch.int64)
        return rng_state[0].clone(), rng_state[1].clone()
    seed = rng_state if rng_state is not None else like.new_zeros((2,), dtype=torch.int64)
    return seed.view(torch.uint64), like.new_zeros((), dtype=torch.int64).view(torch.uint64)


def _rng_from_meta(seed, offset):
    if seed.numel() == 2:
        return seed.view(torch.int64)
    return torch.stack([seed.reshape(()), offset.reshape(())]).to(torch.int64)


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on fa_amd: (B, H, L, D) inputs; causal bottom-right
    aligned, as the flash-attn 2 kernel it replaces (SDPA picks flash for causal only when L == S)."""
    if return_debug_mask:
        raise RuntimeError("fa_amd's flash implementation does not return the debug attention mask; "
                           "torch.nn.attention.restore_flash_attention_impl() brings torch's own back")
    q, k, v = _flash_layout(query, key, value)
    interface._check_qkv(q, k, v, varlen=False)
    dropout_p, scale, left, right, _ = interface._normalize_scalars(
        q.shape[-1], dropout_p, scale, is_causal, (-1, -1), 0.0, False, False)
    q, k, v = (interface._last_dim_contiguous(x) for x in (q, k, v))
    q, k, v = interface._fit_int32_offsets(q, k, v, q.shape[1], k.shape[1], False, False)
    rng_state = interface._rng_state(dropout_p, q.device)
    out, lse, _ = attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, scale, left, right, 0.0,
                                    None, rng_state, False)
    out = out.transpose(1, 2)
    promised = torch.empty_like(query, device="meta").stride()  # the meta function's layout
    if out.stride() != promised:
        out = torch.empty_like(query).copy_(out)
    seed, offset = _rng_for_meta(rng_state, query)
    debug_mask = query.new_empty((0,))
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, philox_seed, philox_offset, *, scale=None):
    q, k, v, o, do = _flash_layout(query, key, value, out, grad_out)
    dropout_p, scale, left, right, _ = interface._normalize_scalars(
        q.shape[-1], dropout_p, scale, is_causal, (-1, -1), 0.0, False, False)
    q, k, v = (interface._last_dim_contiguous(x) for x in (q, k, v))
    rng_state = _rng_from_meta(philox_seed, philox_offset) if dropout_p > 0 else None
    dq, dk, dv = _gradients(do, q, k, v, interface._last_dim_contiguous(o), logsumexp.contiguous(), None, None,
                            q.shape[1], k.shape[1], dropout_p, scale, left, right, 0.0, None, rng_state,
                            torch.are_deterministic_algorithms_enabled())
    return _flash_layout(dq, dk, dv)


register_flash_impl()
