"""fa_amd as a Hugging Face Transformers attention backend.

Transformers calls ``fa_amd_attention_forward`` from every attention layer of a
model loaded with ``attn_implementation="fa_amd"``.  It receives q/k/v in the
(batch, heads, seq, head_dim) layout, K/V *not* repeated for GQA, plus whatever
the model threads through its ``**kwargs`` (position ids, packed-sequence
boundaries, ...).  It mirrors every path of Transformers' own flash-attention
backend:

* no mask, equal lengths           -> ``flash_attn_func``
* 2D padding mask (left or right)  -> unpad, ``flash_attn_varlen_func``, pad back
* ``cu_seq_lens_q/k`` kwargs       -> packed (padding-free) varlen
* ``position_ids`` resets in a row  -> packed varlen, boundaries from the resets (any batch size)
* KV-cache decode (a cache holds earlier tokens, at most DECODE_MAX_QUERY_LEN new ones, no grad)
                                   -> the split-KV decode kernel over the cache (fa_amd.kvcache), with
                                      the padding mask's bounds (and holes) computed on the device
* continuous batching (a ``PagedAttentionCache`` in ``cache``) -> the cache's update, then
  ``flash_attn_with_kvcache`` with its block table (decode) or varlen over the gathered keys

The mask side (``fa_amd_attention_mask``) hands the attention a 2D padding mask
or ``None``; it never builds an O(s^2) 4D mask.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from fa_amd.kernels.decode import filed_plan, grown_plan, run_filed_plan
from fa_amd.interface import MAX_HEAD_DIM
from fa_amd.memo import memo_lookup, memo_per_tensor
from fa_amd.ops import packed_bounds_from_positions, packed_bounds_from_starts

logger = logging.getLogger(__name__)

# Keys a model may thread through **kwargs that do not change what attention
# computes (bookkeeping for caches, outputs and losses).
HARMLESS_KWARGS = frozenset(
    {
        "use_cache",
        "past_key_values",
        "past_key_value",
        "cache_position",
        "position_embeddings",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        "labels",
        "shift_labels",  # (Transformers' loss kwargs, passed down through **kwargs: context parallelism,
        "ignore_index",  # padding-free collators)
        "token_type_ids",
        "seq_idx",
        "layer_idx",
        "logits_to_keep",
    }
)

# Keys that change the attention result and that fa_amd cannot honour.  Passing
# any of them with a non-None value raises instead of silently computing
# something else.
UNSUPPORTED_KWARGS = {
    "position_bias": "an additive position bias",
    "head_mask": "a per-head mask",
    "indices": "sparse attention indices",
    "block_indices": "block-sparse attention indices",
}

# A forward with at most this many new tokens on top of a KV cache runs the split-KV decode kernel
# (its rows are (token, head-of-group) pairs; longer chunks are prefill work for the forward kernel).
DECODE_MAX_QUERY_LEN = 16
# Keyword arguments continuous batching threads through the model next to its `cache`; the cache's
# update reads (and rewrites) them.
_PAGED_BOOKKEEPING = ("read_index", "write_index", "logits_indices", "logits_processor_args")
# a decode-only batch's pages, for the kernel to append the new tokens into and attend over
_PAGED_DECODE = ("block_table", "k_cache", "v_cache")
_PAGED_NAMES = frozenset(_PAGED_BOOKKEEPING + _PAGED_DECODE)

_warned = set()


def _warn_once(key: str, message: str) -> None:
    # Logging is a side effect torch.compile would break the graph on; warn in eager runs only.
    if torch.compiler.is_compiling():
        return
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _kernels():
    # Imported lazily: fa_amd imports this package while it is itself importing.  (Called only on the
    # routes that use them: an import statement costs a few us of host time, and decode is host-bound.)
    from fa_amd import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


def _check_kwargs(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if value is None or name in HARMLESS_KWARGS:
            continue
        if name == "output_attentions":
            if value:
                _warn_once(
                    "output_attentions",
                    "fa_amd does not materialise attention probabilities; with output_attentions=True its "
                    "layers return no attention weights. Use attn_implementation='eager' to get them.",
                )
            continue
        if name in UNSUPPORTED_KWARGS:
            raise ValueError(
                f"fa_amd attention cannot honour `{name}` ({UNSUPPORTED_KWARGS[name]}); "
                "use attn_implementation='eager' or 'sdpa' for this model."
            )
        raise ValueError(
            f"fa_amd attention got the unexpected keyword argument `{name}` "
            f"(type {type(value).__name__}). It does not know whether `{name}` changes the "
            "attention result, so it refuses rather than ignoring it. If it is harmless, add it "
            "to fa_amd.integrations.hf_attention.HARMLESS_KWARGS."
        )


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> Optional[torch.dtype]:
    """The half dtype fp32 activations are cast to, as Transformers' flash backend does.

    fp32 q/k/v appear when autocast is on (cast to the autocast dtype) or when
    PEFT upcast norms in a half-precision model (cast back to the weights'
    dtype).  A plain fp32 model stays fp32, which fa_amd supports.
    """
    if query.dtype != torch.float32:
        return None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_is_quantized"):
        dtype = getattr(config, "dtype", None)
        return dtype if dtype in (torch.float16, torch.bfloat16) else None
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            dtype = layer.weight.dtype
            return dtype if dtype in (torch.float16, torch.bfloat16) else None
    return None


def _is_causal(module: torch.nn.Module, is_causal: Optional[bool]) -> bool:
    """The call's causality: Transformers' `is_causal` argument where given, else the module's (default True)."""
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def sliding_window_to_window_size(sliding_window: Optional[int], causal: bool, key_length: int):
    """Transformers' ``sliding_window`` (total window, current token included) -> flash (left, right).

    Transformers' flash backend passes ``(W - 1, W - 1)`` with ``causal`` and only
    when the keys are longer than the window; with ``causal`` flash-attn clamps
    the right side to 0, so we pass the equivalent ``(W - 1, 0)`` directly.
    Non-causal (encoder) sliding windows are symmetric: ``(W - 1, W - 1)``.
    """
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _as_int(value, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a python int or a one-element tensor, got shape {tuple(value.shape)}")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _as_cu_seqlens(cu: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        cu = torch.as_tensor(cu)
    if cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1D tensor of batch + 1 offsets, got shape {tuple(cu.shape)}")
    if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer offsets, got {cu.dtype}")
    return cu.to(device=device, dtype=torch.int32)


def _packed_bounds(name: str, cu, max_name: str, max_length, tokens: int, query: torch.Tensor):
    """(cu_seqlens int32, max_seqlen int) from packed-sequence kwargs, checked under the names the
    caller used (cu_seq_lens_q, max_length_q): starts at 0, non-decreasing, at most `tokens`, no
    segment longer than max_length.  Tokens past the last boundary belong to no sequence (static
    buffers): their attention output is 0, as in fa_amd's varlen functions."""
    from fa_amd.interface import check_cu_seqlens

    cu = _as_cu_seqlens(cu, name, query.device)
    max_seqlen = _as_int(max_length, max_name)
    return check_cu_seqlens(name, cu, tokens, max_seqlen, max_name, query), max_seqlen


def check_padding_mask(attention_mask: Optional[torch.Tensor], batch_size: int,
                       query_length: Optional[int] = None, key_length: Optional[int] = None) -> None:
    """A 2D padding mask must be (batch, key length); for causal self-attention (query_length
    given) the key length covers at least the query tokens (more with a cache: past + new
    tokens), and at most key_length (when given: every key there is).  Anything else raises, naming
    attention_mask: a wrong-batch, too-short or too-wide mask must never be cropped, broadcast or
    dropped silently."""
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        return
    if attention_mask.shape[0] != batch_size:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but the input has batch size {batch_size}; "
            f"a 2D attention_mask must be (batch, key length)")
    if query_length is not None and attention_mask.shape[1] < query_length:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}: {attention_mask.shape[1]} key positions for "
            f"{query_length} input tokens; a 2D attention_mask must be (batch, key length), the key length "
            f"covering every input token (plus the cached ones)")
    if key_length is not None and attention_mask.shape[1] > key_length:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}: {attention_mask.shape[1]} key positions for "
            f"{key_length} tokens (cached + input); a 2D attention_mask must be (batch, key length). (In "
            f"generate() this means Transformers sized the mask from a cache layer holding fewer tokens than the "
            f"mask covers: a hybrid model whose first layer keeps no KV cache, e.g. MiniMax's linear attention; "
            f"use attn_implementation='sdpa' or 'eager' to generate with padding there)")


def _segments(mask: torch.Tensor):
    """How a padded (b, L) batch becomes varlen segments, with no device->host sync.

    Each row becomes two segments: its kept tokens (in order), then its padded ones.  Every
    token belongs to a segment, so the kernels write every output row and padded rows get
    exactly zero gradients (their outputs are zeroed, so their dout is 0); shapes never depend
    on the data (max_seqlen is L), which is what torch.compile and CUDA graphs need.
    Returns (rows, cols) gather indices in packed order, the inverse permutation, cu_seqlens
    int32 (2b + 1,) and the keep-mask.
    """
    batch, length = mask.shape
    flat = mask.reshape(-1)
    row = torch.arange(batch, device=mask.device).repeat_interleave(length)
    # sort key: row, then kept before padded; stable, so positions keep their order
    order = torch.argsort(row * 2 + (~flat).to(row.dtype), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=mask.device))
    kept = mask.sum(-1, dtype=torch.int32)
    lengths = torch.stack([kept, length - kept], dim=-1).reshape(-1)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    # a copy: memo_per_tensor's entry must not keep its key (the caller's mask) alive
    return order // length, order % length, inverse, cu_seqlens, mask.clone()


def _query_ends(mask: torch.Tensor) -> torch.Tensor:
    """Per row, one past the key column of the newest query token, int32 (no sync).

    The queries are the newest tokens, so they end the keys (flash-attn's convention, Transformers'
    `attention_mask[:, -query_length:]`) -- padded or not: a right-padded chunk's real tokens sit
    before its padding.  The exception is fa_amd's own int32 mask for a cache whose tail may be
    unfilled (a static cache hands over its whole buffer): there every kept column c holds
    end - c + 1 >= 2 (fa_amd_attention_mask), so any kept column of a row says where its queries end,
    also when the newest slots are padding in every row.  (Nonzero is kept: the bool conversion Transformers applies
    to a mask it hands back keeps the keys.  A 0 / 1 int32 mask has no such column: the convention above.)"""
    length = mask.shape[1]
    if mask.dtype != torch.int32:
        return torch.full((mask.shape[0],), length, dtype=torch.int32, device=mask.device)
    index = torch.arange(length, device=mask.device, dtype=torch.int32)
    ends = ((mask >= 2) * (mask + index - 1)).amax(-1)
    return torch.where(ends > 0, ends, length).to(torch.int32)


def _refuse_window_over_gaps(attention_mask: torch.Tensor, mask: torch.Tensor) -> None:
    """A ValueError for a sliding window over a padding mask with gaps (kept keys, padding, kept keys again in a
    row: a cached prefix followed by a left-padded chunk, as prefix tuning makes): the varlen route packs the kept
    keys, which shortens the distances the window counts, and the decode kernel that keeps them takes no backward.
    One device->host read per mask (memoized: every layer passes the same one); not under torch.compile."""
    def has_gaps(_):
        index = torch.arange(mask.shape[1], device=mask.device)
        first = torch.where(mask, index, mask.shape[1]).amin(-1)
        last = torch.where(mask, index, -1).amax(-1)
        return bool(((last - first + 1).clamp(min=0) != mask.sum(-1)).any())

    if memo_per_tensor(attention_mask, "window_gaps", has_gaps):
        raise ValueError(
            "fa_amd: a sliding window over a padding mask with gaps (kept keys, then padding, then kept keys in "
            "one row, e.g. a cached prefix followed by a left-padded chunk) cannot be computed exactly where a "
            "backward is needed: pad on the right there, or use attn_implementation='sdpa' for such batches")


def _query_columns(mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """The keep-mask of the queries when they are fewer than the keys (decode, chunked prefill): the
    query_length columns that end at each row's _query_ends."""
    cols = _query_ends(mask)[:, None] - query_length + torch.arange(query_length, device=mask.device)[None, :]
    return mask.to(torch.bool).gather(1, cols.clamp(min=0)) & (cols >= 0)


def _pack(x: torch.Tensor, segments) -> torch.Tensor:
    # (b, L, h, d) with any strides -> (b * L, h, d) in segment order: one gather, autograd-aware
    rows, cols = segments[:2]
    return x[rows, cols]


def _unpack(out: torch.Tensor, segments, batch: int, length: int) -> torch.Tensor:
    # (b * L, h, d) in segment order -> (b, L, h, d), zeros on padded slots (as flash-attn's pad_input)
    inverse, keep = segments[2], segments[4]
    out = out[inverse].view(batch, length, *out.shape[1:])
    return torch.where(keep.view(batch, length, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))


# packed-sequence boundaries from restarting position ids: (cu_seqlens int32, max_seqlen)
cu_seqlens_from_position_ids = packed_bounds_from_positions


def _is_packed(position_ids: Optional[torch.Tensor], batch_size: int) -> bool:
    """True when a row holds several sequences: a position is not its predecessor's plus one somewhere (a restart
    or a jump), Transformers' rule for packed masks (ops.packed_bounds_from_positions).  position_ids is (batch,
    length) or (1, length), which then holds for every row, as eager expands it (audit 2026-11-29: fa_amd ignored
    shared packed positions at batch > 1, and split at restarts to the row's minimum only, not at jumps).  Eager
    and sdpa split packed rows at any batch size (audit 2026-11-28)."""
    if position_ids is None or position_ids.shape[-1] == 1 or position_ids.dim() != 2 \
            or position_ids.shape[0] not in (1, batch_size) or torch.compiler.is_compiling():
        return False  # (traced: fa_amd_attention_forward's by-positions op reads (batch, length) positions)
    # every layer asks about the same position_ids: one device->host sync per forward
    return memo_per_tensor(position_ids, "is_packed", _positions_restart)


def _positions_restart(position_ids: torch.Tensor) -> bool:
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    return bool((rows[:, 1:] - rows[:, :-1] != 1).any())


def fa_amd_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_ids: Optional[torch.Tensor] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    max_length_q=None,
    max_length_k=None,
    deterministic: Optional[bool] = None,
    **kwargs,
):
    """Attention for Transformers models: q (b, hq, sq, d), k/v (b, hk, sk, d) -> ((b, sq, hq, d), None).

    Learnable attention sinks (gpt-oss passes ``s_aux``; ``sinks`` is accepted too) go to the kernels.
    """
    step_key = grow_key = None
    if attention_mask is None and cu_seq_lens_q is None and cu_seq_lens_k is None:
        step_key = _decode_step_key(module, query, key, value, dropout, scaling, sliding_window, softcap, is_causal,
                                    kwargs)
        if step_key is not None:
            plan = filed_plan(step_key)
            # a dynamic cache's first layer of a step: the cache grew by a key (a grow key's plan is a decode
            # kernel's, which only calls with more keys than queries take: _takes_decode_kernel)
            if plan is None and key.shape[2] > query.shape[2]:
                grow_key = _decode_grow_key(step_key, query, key, value, sliding_window)
                plan = grown_plan(grow_key, query, key.transpose(1, 2), value.transpose(1, 2), step_key)
            if plan is not None:
                return _planned_decode_step(query, key, value, plan), None
    # to the kernels under the caller's name (the errors then name it too)
    sink_kwargs = {name: kwargs.pop(name) for name in ("s_aux", "sinks") if kwargs.get(name) is not None}
    cache = kwargs.pop("cache", None)
    # continuous batching: a paged cache that the attention updates itself (`cache`, whose update takes the
    # kwargs: Transformers 5.20-5.23), or one the attention module updated before calling (its bookkeeping
    # kwargs, 5.24 and later).
    # (Up to 5.19 continuous batching calls Transformers' own paged function, which reaches fa_amd through the
    # flash_attn stand-in instead.)
    # (a set test first: the common call has none of these names, and decode calls are host-bound)
    if cache is not None or (not _PAGED_NAMES.isdisjoint(kwargs)
                             and any(kwargs.get(name) is not None for name in _PAGED_NAMES)):
        return _paged_cache_attention(module, query, key, value, attention_mask, cache, scaling, sliding_window,
                                      softcap, is_causal, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                                      kwargs, sink_kwargs)
    _check_kwargs(kwargs)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4D (batch, heads, seq, head_dim) tensor, got {getattr(t, 'shape', t)}")
        if 0 in t.shape:
            raise ValueError(f"{name} has a zero-sized dimension {tuple(t.shape)}; fa_amd needs non-empty inputs")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"this model's attention layer {getattr(module, 'layer_idx', '')} has head dim {query.shape[-1]}; fa_amd's "
            f"kernels take head dims up to {MAX_HEAD_DIM}, as flash-attn's do (e.g. Gemma 4's global layers use "
            f"512): use attn_implementation='sdpa' for this model")
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        # the model's rotary broadcasts q and k over the batch of position_ids; v keeps the input's
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[0] != value.shape[0]:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} but the input has batch size "
                             f"{value.shape[0]}; position_ids must be (batch, sequence length) or (1, sequence length)")
        raise ValueError(f"query, key and value must share the batch size, got {query.shape[0]}, {key.shape[0]} and "
                         f"{value.shape[0]}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2):
        raise ValueError(
            "attention_mask must be a 2D (batch, key length) padding mask or None for fa_amd, got "
            f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}. A 4D mask means the model was "
            "given a custom mask or the 'fa_amd' mask function is not registered (call fa_amd.integrations.register())."
        )

    batch_size, _, query_length, head_dim = query.shape
    # flash layout: (b, s, h, d)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    # MLA-style models have a smaller value head dim: pad V up and crop the output.
    v_head_dim = value.shape[-1]
    if v_head_dim > head_dim:
        raise ValueError(f"value head dim {v_head_dim} exceeds the query/key head dim {head_dim}")
    if v_head_dim != head_dim:
        value = torch.nn.functional.pad(value, [0, head_dim - v_head_dim])

    target_dtype = _target_dtype(query, module)
    if target_dtype is not None:
        _warn_once("upcast", f"fa_amd: casting fp32 attention inputs to {target_dtype} (autocast / PEFT upcast).")
        query, key, value = query.to(target_dtype), key.to(target_dtype), value.to(target_dtype)
    elif key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)

    causal = _is_causal(module, is_causal)
    window_size = sliding_window_to_window_size(sliding_window, causal, key.shape[1])
    tagged = memo_lookup(attention_mask, _MASK_SPEC) if attention_mask is not None else None
    packed_ids = None
    if tagged is not None:
        # what the model's mask function says (fa_amd_attention_mask read it): it decides, as in eager
        (mask_causal, mask_window, packed_ids), all_kept = tagged
        causal = causal if mask_causal is None else mask_causal
        window_size = mask_window if mask_window is not None else (-1, -1)
        if all_kept:
            attention_mask = None  # nothing padded: the dense kernel (or the packed sequences)
    # Dropout only while training, exactly like eager's F.dropout(training=module.training).
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    common = dict(
        dropout_p=dropout_p,
        softmax_scale=scaling,
        causal=causal,
        window_size=window_size,
        softcap=0.0 if softcap is None else float(softcap),
        deterministic=bool(deterministic) if deterministic is not None else False,
    )
    common.update(sink_kwargs)

    # (a sliding window over a padded cache: the decode kernel's window counts cache slots, as eager does; the
    # varlen route packs the kept keys, so gaps in the mask (a left-padded chunk after the cache) would shrink it)
    windowed = window_size[0] >= 0 and attention_mask is not None
    if _takes_decode_kernel(query, key, value, dropout_p, cu_seq_lens_q, cu_seq_lens_k, any_length=windowed):
        out = _decode_attention(query, key, value, attention_mask, common, step_key, grow_key)
        return (out if v_head_dim == head_dim else out[..., :v_head_dim]), None
    flash_attn_func, flash_attn_varlen_func = _kernels()
    if attention_mask is not None:
        out = _padded_attention(flash_attn_varlen_func, query, key, value, attention_mask, common)
    elif cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if any(x is None for x in (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)):
            raise ValueError(
                "packed sequences need all of cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k"
            )
        # checked here under the kwargs' own names (the varlen call would say cu_seqlens_q)
        cu_q, max_q = _packed_bounds("cu_seq_lens_q", cu_seq_lens_q, "max_length_q", max_length_q,
                                     batch_size * query_length, query)
        if cu_seq_lens_k is cu_seq_lens_q:
            cu_k = cu_q
            max_k = _as_int(max_length_k, "max_length_k")
        else:
            cu_k, max_k = _packed_bounds("cu_seq_lens_k", cu_seq_lens_k, "max_length_k", max_length_k,
                                         key.shape[0] * key.shape[1], query)
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k must have the same length (sequences + 1), got "
                             f"{cu_q.numel()} and {cu_k.numel()}")
        out = flash_attn_varlen_func(
            query.reshape(-1, *query.shape[2:]),
            key.reshape(-1, *key.shape[2:]),
            value.reshape(-1, *value.shape[2:]),
            cu_q,
            cu_k,
            max_q,
            max_k,
            **common,
        )
        out = out.view(batch_size, -1, *out.shape[-2:])
    elif (torch.compiler.is_compiling() and position_ids is not None and position_ids.dim() == 2
          and position_ids.shape[0] == batch_size and position_ids.shape[-1] > 1 and key.shape[1] == query_length):
        # traced: whether the positions restart is data (a graph break); the op reads it inside.  ((1, length)
        # positions at batch > 1 stay on the dense kernel here: that is how Transformers hands every unpacked
        # batch its positions, and the op's read would cost each layer a sync)
        _check_packed_positions(position_ids, batch_size, query_length)
        out = _attention_by_positions(query, key, value, position_ids, common)
    elif packed_ids is not None or (key.shape[1] == query_length and _is_packed(position_ids, batch_size)):
        if packed_ids is not None:  # the mask's packed sequences (their position_ids may not reach this call)
            cu_seqlens, max_seqlen = memo_per_tensor(packed_ids, ("packed_ids_bounds", batch_size),
                                                     lambda ids: _bounds_from_sequence_ids(ids, batch_size))
        else:
            _check_packed_positions(position_ids.expand(batch_size, -1), batch_size, query_length)
            # same position_ids in every layer: find the boundaries (a device->host sync) once per forward
            cu_seqlens, max_seqlen = memo_per_tensor(
                position_ids, ("packed_bounds", batch_size),
                lambda p: cu_seqlens_from_position_ids(p.expand(batch_size, -1)))
        out = flash_attn_varlen_func(
            query.reshape(-1, *query.shape[2:]),
            key.reshape(-1, *key.shape[2:]),
            value.reshape(-1, *value.shape[2:]),
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            **common,
        )
        out = out.view(batch_size, -1, *out.shape[-2:])
    else:
        out = flash_attn_func(query, key, value, **common)

    if isinstance(out, tuple):
        out = out[0]
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _bounds_from_sequence_ids(ids: torch.Tensor, batch_size: int):
    """(cu_seqlens, max_seqlen) of Transformers' packed-sequence ids (batch, length): a sequence starts at each row's
    first token and wherever the id changes."""
    rows = ids.expand(batch_size, -1)
    return packed_bounds_from_starts(rows[:, 1:] != rows[:, :-1])


def _check_packed_positions(position_ids: torch.Tensor, batch_size: int, query_length: int) -> None:
    if tuple(position_ids.shape) != (batch_size, query_length):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)} but the input has {query_length} tokens per row "
            f"({batch_size} rows); packed sequences need one position per token (positions restarting at each "
            "sequence)")


def _attention_by_positions(query, key, value, position_ids, common):
    """(b, L, h, d) rows that may pack several sequences each (positions restarting), under torch.compile:
    fa_amd::attention_fwd_by_positions finds the sequences inside the op (eagerly, _is_packed reads them
    once per forward instead)."""
    from fa_amd import interface

    batch, length, hq, d = query.shape
    dropout_p, scale, left, right, softcap = interface._normalize_scalars(
        d, common["dropout_p"], common["softmax_scale"], common["causal"], common["window_size"], common["softcap"],
        common["deterministic"], False)
    q, k, v = (interface._last_dim_contiguous(x.reshape(-1, *x.shape[2:])) for x in (query, key, value))
    interface._check_qkv(q, k, v, varlen=True)
    sinks = interface._check_sinks(common.get("sinks"), common.get("s_aux"), q, hq)
    out, _ = torch.ops.fa_amd.attention_fwd_by_positions(
        q, k, v, position_ids, dropout_p, scale, left, right, softcap,
        interface._rng_state(dropout_p, q.device), common["deterministic"], *((sinks,) if sinks is not None else ()))
    return out.view(batch, length, hq, d)


def _takes_decode_kernel(query, key, value, dropout_p, cu_seq_lens_q, cu_seq_lens_k, any_length=False) -> bool:
    """A KV cache holds earlier tokens (more keys than queries), the new tokens are few (or `any_length`),
    and nothing needs a backward (the decode kernel is forward-only): (b, s, h, d) layout."""
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None or dropout_p > 0.0:
        return False
    if (query.shape[1] > DECODE_MAX_QUERY_LEN and not any_length) or key.shape[1] <= query.shape[1]:
        return False
    return not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))


def _decode_bounds(mask: torch.Tensor):
    """(first kept key, end of the queries' keys, per-key mask or None) per row of a 2D padding mask, on
    the device (no sync).  The kernel attends keys [first, end), the queries ending at `end` (_query_ends);
    the per-key mask also drops holes (a right-padded chunk's padding, or gaps in a hand-made mask; a
    left-padded generate() mask has none); masks the "fa_amd" mask function built itself for a static
    cache without padding (a filled prefix) are hole-free and need none."""
    keep = mask.to(torch.bool)
    length = keep.shape[1]
    index = torch.arange(1, length + 1, device=keep.device, dtype=torch.int32)
    end = _query_ends(mask)
    # first kept key = length - max over kept keys of (length - key): int32 products and max only (a
    # where(keep, index - 1, length).amin() made inductor's reduction carry int32 into an int64 loop value,
    # which Triton refuses to compile: generate() with a static cache under torch.compile, torch 2.11)
    start = torch.minimum(length - (keep * index.flip(0)).amax(-1).to(torch.int32), end)
    hole_free = memo_per_tensor(mask, _FILL_MASK, lambda _: False)
    return start, end, None if hole_free else keep.to(torch.uint8)  # (a bool view does not lower in inductor)


# memo tag of the masks fa_amd_attention_mask builds for a static cache (a filled prefix, no holes)
_FILL_MASK = "fa_amd_fill_mask"


def _decode_attention(query, key, value, attention_mask, common, step_key=None, grow_key=None):
    """The new tokens' attention over the cache (flash layout), by the split-KV decode kernel; its plan is also
    filed under `step_key` (_decode_step_key), and its capacity-free structure under `grow_key` (_decode_grow_key),
    where those are given."""
    from fa_amd.kvcache import decode_attention

    start = end = key_mask = None
    if attention_mask is not None:
        if attention_mask.shape[0] != query.shape[0]:
            raise ValueError(f"attention_mask batch {attention_mask.shape[0]} does not match the query batch "
                             f"{query.shape[0]}")
        length = attention_mask.shape[1]
        if key.shape[1] > length:  # a static cache hands over its whole buffer
            key, value = key[:, :length], value[:, :length]
        elif key.shape[1] < length:
            raise ValueError(f"attention_mask covers {length} keys but only {key.shape[1]} were given")
        # every layer gets the same mask object: its bounds are computed once per forward
        start, end, key_mask = memo_per_tensor(attention_mask, ("decode_bounds", str(query.device)), _decode_bounds)
    if key.stride(-1) != 1 or value.stride(-1) != 1:  # the kernel reads head dims contiguously
        key, value = key.contiguous(), value.contiguous()
    left, right = common["window_size"]
    if common["causal"]:
        right = 0
    scale = common["softmax_scale"]
    sinks = _sinks(common.get("sinks"), common.get("s_aux"), query)
    out, _ = decode_attention(query, key, value, query.shape[-1] ** -0.5 if scale is None else float(scale), left,
                              right, common["softcap"], cache_seqlens=end, cache_leftpad=start, key_mask=key_mask,
                              sinks=sinks, need_lse=False, alias_key=step_key if sinks is None else None,
                              grow_key=grow_key if sinks is None and attention_mask is None else None)
    return out


def _decode_step_key(module, query, key, value, dropout, scaling, sliding_window, softcap, is_causal, kwargs):
    """The key a plain decode step's launch plan is filed under (kernels/decode.decode_forward's alias_key), or
    None where the call is not one: generate()'s steps without a padding mask, sinks, paged cache, dtype casts,
    padded V, gradients or tracing.  The full path of the first call of a structure checks it and files the plan;
    the key holds everything that path derives the launch from (shapes and strides of the (batch, heads, seq,
    head_dim) tensors, which fix those of its flash-layout views, dtype, device, scale, window, softcap,
    causality), so a later call with the same key takes _planned_decode_step."""
    if torch.compiler.is_compiling() or (kwargs and not HARMLESS_KWARGS.issuperset(kwargs)):
        return None  # (traced calls take the custom ops; sinks, a paged cache, anything else: the full path)
    dtype = query.dtype
    if (dtype is torch.float32 or key.dtype is not dtype or value.dtype is not dtype or query.ndim != 4
            or value.shape[-1] != query.shape[-1] or key.stride(-1) != 1 or value.stride(-1) != 1
            or (dropout and getattr(module, "training", False))):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    causal = _is_causal(module, is_causal)
    # (the last item holds what does not follow the key length: _decode_grow_key keeps it)
    return ("hf decode step", query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
            (dtype, query.get_device(), key.get_device(), scaling, sliding_window, softcap, causal))


def _decode_grow_key(step_key, query, key, value, sliding_window):
    """A decode step's key without the key length (and the strides that follow it), for a call whose step key has
    no filed plan yet: Transformers' dynamic cache hands over one more key each step, so each step's first layer
    misses.  The full path files its structure under this key (decode_forward's grow_key), and a later step finds
    its plan through decode.grown_plan without the glue.  The window the full path derives from the key length
    (sliding_window_to_window_size) is part of it."""
    fixed = step_key[-1]
    causal = fixed[-1]
    return ("hf decode grow", query.shape, query.stride(), key.shape[:2], key.shape[3], value.shape[:2],
            value.shape[3], fixed, sliding_window_to_window_size(sliding_window, causal, key.shape[2]))


def _planned_decode_step(query, key, value, plan):
    """fa_amd_attention_forward's decode route for a call whose plan is filed under its step key
    (_decode_step_key): the plan's launch, without the glue that derived it (its checks passed for this
    structure; nothing in it depends on tensor values).  The (batch, heads, seq, head_dim) tensors go in as
    they are: the plan holds the strides of their flash-layout views, and a launch reads only a tensor's
    storage, which a view shares (three transposes were ~3 us of a ~10 us step on the host)."""
    return run_filed_plan(plan, query, key, value)[0]


def _sinks(sinks, s_aux, query):
    """Learnable sinks (gpt-oss's s_aux) as the kernels take them: fp32 (heads,), checked; or None."""
    if sinks is None and s_aux is None:
        return None
    from fa_amd.interface import _check_sinks

    return _check_sinks(sinks, s_aux, query, query.shape[-2])


def _paged_cache_attention(module, query, key, value, attention_mask, cache, scaling, sliding_window, softcap,
                           is_causal, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, kwargs, sink_kwargs):
    """Continuous batching (``generate_batch``, ``transformers serve``): the PagedAttentionCache writes
    the new keys/values (or, on a decode-only batch with a block table, hands over its pages), then
    fa_amd attends: ``flash_attn_with_kvcache`` over the pages, or varlen over the gathered keys.
    `cache` None: the attention module already ran the cache's update (Transformers 5.24 and later), which
    left the per-layer cu_seq_lens_k / max_length_k (and the pages) in the kwargs."""
    state = {name: kwargs.pop(name) for name in _PAGED_BOOKKEEPING + _PAGED_DECODE if name in kwargs}
    _check_kwargs(kwargs)
    if cache is not None:
        from transformers.generation.continuous_batching import PagedAttentionCache

        if not isinstance(cache, PagedAttentionCache):
            raise ValueError(f"fa_amd attention got `cache` of type {type(cache).__name__}; only Transformers' "
                             "PagedAttentionCache (continuous batching) is understood there")
    elif state.get("block_table") is not None and (state.get("k_cache") is None or state.get("v_cache") is None):
        raise ValueError("fa_amd attention got a block_table without the paged k_cache and v_cache it indexes")
    if attention_mask is not None:
        raise ValueError("continuous batching with fa_amd runs unmasked varlen attention; got an attention_mask "
                         "(is the model registered as a flash implementation?)")
    if cu_seq_lens_q is None or cu_seq_lens_k is None or max_length_q is None or max_length_k is None:
        raise ValueError("a PagedAttentionCache needs cu_seq_lens_q/k and max_length_q/k")
    state.update(cu_seq_lens_k=cu_seq_lens_k, max_length_k=max_length_k)
    if cache is not None:
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=state)
    cu_k, max_k = state["cu_seq_lens_k"], _as_int(state["max_length_k"], "max_length_k")
    hq, d = query.shape[1], query.shape[-1]
    # flash layout of the packed batch: (tokens, heads, d)
    query, key, value = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    target_dtype = _target_dtype(query, module)
    if target_dtype is not None:
        query = query.to(target_dtype)
    causal = _is_causal(module, is_causal)
    left, right = sliding_window_to_window_size(sliding_window, causal, max_k)
    if causal:
        right = 0
    scale = d ** -0.5 if scaling is None else float(scaling)
    softcap = 0.0 if softcap is None else float(softcap)
    if state.get("block_table") is not None:
        # decode-only batch: one new token per sequence, appended into its pages by the kernel
        from fa_amd.kvcache import append_and_attend

        n = query.shape[0]
        cache_seqlens = (cu_k[1:n + 1] - cu_k[:n] - 1).to(torch.int32)
        out = append_and_attend(query[:, None], state["k_cache"], state["v_cache"], key[:, None].to(query.dtype),
                                value[:, None].to(query.dtype), scale, left, right, softcap, cache_seqlens,
                                state["block_table"],
                                _sinks(sink_kwargs.get("sinks"), sink_kwargs.get("s_aux"), query))
    else:
        _, flash_attn_varlen_func = _kernels()
        out = flash_attn_varlen_func(query, key.to(query.dtype), value.to(query.dtype),
                                     _as_cu_seqlens(cu_seq_lens_q, "cu_seq_lens_q", query.device),
                                     _as_cu_seqlens(cu_k, "cu_seq_lens_k", query.device),
                                     _as_int(max_length_q, "max_length_q"), max_k, softmax_scale=scale, causal=causal,
                                     window_size=(left, right), softcap=softcap, **sink_kwargs)
    return out.reshape(1, -1, hq, d), None


def _padded_attention(flash_attn_varlen_func, query, key, value, attention_mask, common):
    """Attention of a padded batch: varlen over per-row kept / padded segments (see ``_segments``)."""
    batch_size, query_length = query.shape[:2]
    # self-attention: the queries are the last query_length mask columns (below)
    check_padding_mask(attention_mask, batch_size, query_length if common["causal"] else None)
    raw = attention_mask.to(device=query.device)
    mask = raw.to(torch.bool)
    # A cache buffer longer than the mask (another mask builder's static-cache mask): its tail is unused.
    if key.shape[1] > mask.shape[1]:
        key, value = key[:, : mask.shape[1]], value[:, : mask.shape[1]]
    elif key.shape[1] < mask.shape[1]:
        raise ValueError(f"attention_mask covers {mask.shape[1]} keys but only {key.shape[1]} were given")
    key_length = key.shape[1]
    # every layer gets the same mask object: its segments are built once per forward
    device = str(query.device)
    seg_k = memo_per_tensor(attention_mask, ("segments", device), lambda _: _segments(mask))
    if common["window_size"][0] >= 0 and not torch.compiler.is_compiling():
        _refuse_window_over_gaps(attention_mask, mask)
    if query_length == key_length:
        seg_q = seg_k
    elif not common["causal"]:
        # cross-attention (the keys are another sequence's: an encoder's, padded by its own mask): every query
        # row is the caller's, so all of them attend the kept keys, as eager computes them
        seg_q = memo_per_tensor(attention_mask, ("all_queries", batch_size, query_length, device),
                                lambda _: _segments(torch.ones(batch_size, query_length, dtype=torch.bool,
                                                               device=query.device)))
    else:
        # self-attention over a cache: the queries are the last query_length columns of each row
        seg_q = memo_per_tensor(attention_mask, ("query_segments", query_length, device),
                                lambda _: _segments(_query_columns(raw, query_length)))
    out = flash_attn_varlen_func(
        _pack(query, seg_q),
        _pack(key, seg_k),
        _pack(value, seg_k),
        seg_q[3],
        seg_k[3],
        query_length,
        key_length,
        **common,
    )
    if isinstance(out, tuple):
        out = out[0]
    return _unpack(out, seg_q, batch_size, query_length)


# The pieces of Transformers' mask functions (transformers.masking_utils, by qualified name) that fa_amd's kernels
# compute themselves: causal / bidirectional, sliding windows, padding, packed sequences, and the wrappers that
# intersect or shift them.  Anything else -- chunked attention (chunked_overlay), bidirectional blocks
# (blockwise_overlay), a union (or_masks), a model's own overlay -- changes which keys a query sees.
_MASK_PARTS_COMPUTED = ("causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay.",
                        "sliding_window_bidirectional_overlay.", "padding_mask_function.",
                        "packed_sequence_mask_function.", "and_masks.", "remap_positions_for_packed_sequence.",
                        "add_offsets_to_mask_function.")


def _mask_part_not_computed(mask_function) -> Optional[str]:
    """The name of the first piece of a Transformers mask function (walked through the closures of its
    wrappers: _mask_parts) that fa_amd does not compute, or None."""
    for part, depth in _mask_parts(mask_function):
        module = getattr(part, "__module__", None) or ""
        name = getattr(part, "__qualname__", None) or type(part).__name__
        if module != "transformers.masking_utils" or not name.startswith(_MASK_PARTS_COMPUTED) or depth > 16:
            return f"{module}.{name}" if module else name
    return None


# memo tag of the keep-masks fa_amd_attention_mask builds for calls without cached tokens whose mask function
# says more than padding: ((causal, window, packed ids), every key kept) (_tagged_keep_mask)
_MASK_SPEC = "fa_amd_mask_spec"
# a probe evaluates the model's mask function over at most this many (batch, query, key) points at a time
_PROBE_CHUNK = 1 << 24


def _probed_bidirectional_window(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, device):
    """The flash window (left, right) that a model's mask function (one with parts fa_amd does not compute, before
    padding) amounts to on this call's (query, key) positions, if it is bidirectional: every key ((-1, -1)), or
    the keys within W - 1 positions either side ((W - 1, W - 1)).  None when it is anything else (causal parts,
    chunks, blocks ...) or cannot be evaluated on index tensors.  The function is evaluated on every (batch,
    query, key) point of the call, in chunks of query rows: O(q_length * kv_length) element-wise work, once per
    forward and layer type."""
    if not all(isinstance(x, int) for x in (q_length, kv_length, q_offset, kv_offset)) or q_length < 1:
        return None
    device = torch.device(device)
    batch = torch.arange(batch_size, device=device)[:, None, None]
    head = torch.zeros((), dtype=torch.long, device=device)
    keys = kv_offset + torch.arange(kv_length, device=device)
    rows = max(1, _PROBE_CHUNK // max(1, batch_size * kv_length))
    widest = -1  # the largest |query - key| distance kept
    none_dropped = kv_length + q_length + abs(q_offset - kv_offset)  # past every distance of the call
    nearest_dropped = none_dropped  # the smallest distance dropped
    with torch.no_grad():
        for r0 in range(0, q_length, rows):
            queries = q_offset + torch.arange(r0, min(q_length, r0 + rows), device=device)
            try:
                kept = mask_function(batch, head, queries[None, :, None], keys[None, None, :])
                kept = torch.as_tensor(kept, device=device).to(torch.bool).expand(batch_size, len(queries), kv_length)
            except Exception:  # not index-based (Transformers then evaluates it by vmap): not probed
                return None
            distance = (queries[:, None] - keys[None, :]).abs().expand_as(kept)
            kept_max, dropped_min = torch.stack([torch.where(kept, distance, -1).amax(),
                                                 torch.where(kept, nearest_dropped, distance).amin()]).tolist()
            widest, nearest_dropped = max(widest, kept_max), min(nearest_dropped, dropped_min)
    if widest < 0:
        return None
    if nearest_dropped == none_dropped:
        return (-1, -1)
    if nearest_dropped != widest + 1:
        return None  # kept and dropped keys at the same distance: not a symmetric window
    return (widest, widest)


def _mask_parts(mask_function, depth: int = 0):
    """(piece, depth) for every callable piece of a Transformers mask function, the function itself first,
    walked through the closures of its wrappers (and_masks' tuple, remap / offset wrappers); nothing below
    depth 17."""
    yield mask_function, depth
    if depth > 16:
        return
    for cell in getattr(mask_function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for part in value if isinstance(value, (tuple, list)) else (value,):
            if callable(part) and not isinstance(part, (torch.Tensor, type)):
                yield from _mask_parts(part, depth + 1)


def _overlay_reach(overlay) -> Optional[Tuple[int, int]]:
    """(left, right): how many positions before and after a query a window overlay of Transformers keeps (-1: no
    bound), found by bisection on index tensors (the overlays compare position differences with W; whether
    inclusively is the Transformers version's business, so it is measured, not assumed).  None for an overlay
    that drops the query's own position (Qwen2-MoE builds a window-0 mask that no layer uses)."""
    far = 1 << 40
    query = torch.tensor(far + 1)

    def kept(delta):
        return bool(overlay(0, 0, query, query + delta))

    if not kept(0):
        return None
    reach = []
    for sign in (-1, 1):
        if kept(sign * far):
            reach.append(-1)
            continue
        low, high = 0, far  # kept(sign * low) holds (distance 0 is kept), kept(sign * high) does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if kept(sign * mid) else (low, mid)
        reach.append(low)
    return reach[0], reach[1]


def _mask_function_spec(mask_function):
    """What the known pieces of a Transformers mask function (_MASK_PARTS_COMPUTED) say beyond padding: (causal:
    True / False / None where neither piece is there, flash (left, right) window or None, the packed-sequence ids
    (batch, length) or None); None where a window cannot be read (the keep-mask then goes untagged)."""
    causal, window, packed = None, None, None
    for part, _ in _mask_parts(mask_function):
        name = getattr(part, "__qualname__", "")
        if name == "causal_mask_function":
            causal = True
        elif name == "bidirectional_mask_function":
            causal = False
        elif name.startswith(("sliding_window_overlay.", "sliding_window_bidirectional_overlay.")):
            reach = _overlay_reach(part)
            if reach is None:
                return None
            left, right = reach
            window = (left, right) if window is None else tuple(
                b if a < 0 else a if b < 0 else min(a, b) for a, b in zip(window, (left, right)))
        elif name.startswith("packed_sequence_mask_function."):
            packed = next(cell.cell_contents for cell in part.__closure__
                          if isinstance(cell.cell_contents, torch.Tensor))
    return causal, window, packed


def _tagged_keep_mask(attention_mask, batch_size, q_length, kv_length, spec, device):
    """The keep-mask of a call without cached tokens, tagged (memo) with what the model's mask function says:
    spec = (causal or None, flash window or None, packed-sequence ids or None).  The attention then follows it
    (the mask decides, as in eager), whatever the module passes or lacks: a window only in the mask (PhiMoE),
    an inclusive bidirectional window (T5Gemma's encoder, Gemma 4), a bidirectional one opened by an
    or_mask_function (Gemma 3 / EmbeddingGemma), packed sequences whose position_ids never reach the attention
    (Persimmon, GPTBigCode).  Every key kept: the attention takes the dense kernel, as for None."""
    check_padding_mask(attention_mask, batch_size, q_length, kv_length)
    keep = None if attention_mask is None else attention_mask != 0  # (a new tensor: the caller's never is tagged)
    return _tag(keep, keep is None or bool(keep.all()), batch_size, kv_length, spec, device)


def _tag(keep, all_kept, batch_size, kv_length, spec, device):
    """keep (a tensor of fa_amd's own, or None: every key kept) tagged with spec and whether every key is kept."""
    if keep is None:
        keep = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    memo_per_tensor(keep, _MASK_SPEC, lambda _: (spec, all_kept))
    return keep


def fa_amd_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Mask builder registered under "fa_amd": a 2D (batch, kv_length) keep-mask or None, never 4D.

    Column ``j`` is the key slot at position ``kv_offset + j`` (how Transformers lays out caches,
    sliding ones included).  A slot is kept when the padding mask keeps that position and, for
    decoder self-attention, when it is filled (position < ``q_offset + q_length``): a static cache
    hands over its whole buffer, and its unfilled tail is marked as padding, so shapes never depend on
    how full it is.  Where such a tail can exist the mask is int32, each kept column holding its distance to
    the queries' end plus one (_query_ends), else bool.  None (the dense path) when nothing is masked; under
    ``torch.compile`` that is decided from shapes only (no ``mask.all()``: no sync, no graph
    break), so a compiled padded batch always gets its mask.

    A call without cached tokens (training, a prefill, an encoder) gets a bool keep-mask tagged with what the
    mask function says beyond padding -- causality, a window, packed sequences (_tagged_keep_mask) -- and the
    attention follows it, as eager follows its mask.  Not under ``torch.compile``: there the module's arguments
    decide.
    """
    if mask_function is not None and not torch.compiler.is_compiling():
        fresh = (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
                 and kv_length == q_length)  # no cached tokens: training, a prefill, an encoder
        device = kwargs.get("device", "cpu")
        unsupported = _mask_part_not_computed(mask_function)
        if unsupported:
            # (e.g. Gemma3 / EmbeddingGemma with use_bidirectional_attention: an or_mask_function that opens the
            # causal mask into a full or a symmetric sliding-window one, which the kernels compute)
            window = _probed_bidirectional_window(mask_function, batch_size, q_length, kv_length, q_offset,
                                                  kv_offset, device)
            if window is None:
                raise ValueError(
                    f"fa_amd computes causal, bidirectional, sliding-window, padding and packed-sequence masks only; "
                    f"this model's mask adds another pattern ({unsupported}: e.g. chunked attention, bidirectional "
                    f"image-token blocks, or a custom or_mask_function / and_mask_function), which fa_amd would "
                    f"silently drop. Use attn_implementation='sdpa' or 'eager' for this model.")
            if not fresh:
                raise ValueError(
                    "fa_amd computes this model's bidirectional mask (its or_mask_function) only without a KV cache "
                    f"(got {q_length} queries at offset {q_offset} over {kv_length} keys at offset {kv_offset}); "
                    "use attn_implementation='sdpa' or 'eager' to run it over a cache")
            return _tagged_keep_mask(attention_mask, batch_size, q_length, kv_length, (False, window, None), device)
        spec = _mask_function_spec(mask_function)
        if fresh and spec is not None:
            return _tagged_keep_mask(attention_mask, batch_size, q_length, kv_length, spec, device)
        if spec is not None and spec[1] is not None and isinstance(q_length, int) and q_length > 1:
            # several new tokens over a cache (chunked prefill, assisted decoding) under a window: it reaches the
            # attention also where the module does not pass it (PhiMoE).  (One-token steps keep their untagged
            # None, the filed decode plans' path: there the sliding cache layers hold only the window's keys.)
            keep = _padding_keep_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs)
            # (a copy: the padding path may hand back the caller's own mask)
            return _tag(None if keep is None else keep.clone(), keep is None, batch_size, kv_length,
                        (None, spec[1], None), device)
    return _padding_keep_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs)


def _padding_keep_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs):
    """fa_amd_attention_mask's keep-mask from the padding mask and the cache's fill (see its docstring), or None."""
    # Only causal (decoder self-attention) masks can face a cache; a bidirectional call with more keys
    # than queries is cross-attention, whose keys are all filled.
    building_causal = "allow_is_bidirectional_skip" not in kwargs
    filled = q_offset + q_length  # a tensor with a static cache (Transformers avoids a sync there)
    # every key there is, where that is known: no cache, or one holding exactly the past + new tokens (wider masks
    # were read by their first columns, as Transformers' own builders do).  A static cache's buffer (kv_length past
    # the tokens) keeps taking wider masks: its own, handed back.
    all_keys = filled if (building_causal and not isinstance(filled, torch.Tensor)
                          and kv_offset + kv_length <= filled) else None
    # before Transformers' helper drops an all-ones mask: a wrong-shaped one must raise, not vanish
    check_padding_mask(attention_mask, batch_size, q_length if building_causal else None, all_keys)
    if attention_mask is None:
        if not building_causal:
            return None
        if not isinstance(filled, torch.Tensor) and kv_offset + kv_length <= filled:
            return None  # every slot filled: the dense path
    if (attention_mask is not None and not isinstance(filled, torch.Tensor) and kv_offset == 0
            and attention_mask.shape[-1] == kv_length and (not building_causal or filled >= kv_length)):
        # the padding mask covers exactly these keys and every slot is filled (generate() with a dynamic
        # cache, every step): it is the keep-mask itself -- one op instead of a gather and three compares
        if not torch.compiler.is_compiling() and bool(attention_mask.all()):
            return None
        return attention_mask.to(torch.bool)
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    if isinstance(filled, torch.Tensor):
        device = filled.device if attention_mask is None else device
        filled = filled.to(device)
    position = kv_offset + torch.arange(kv_length, device=device)
    if attention_mask is None:
        keep = (position < filled).expand(batch_size, kv_length)
    else:
        covered = attention_mask.shape[-1]
        # A padding mask covers positions [0, filled).  A narrower one ends at `filled` (Transformers aligns
        # masks at the right): the keep-mask this function built for a sliding layer, given back to it
        # (generate() builds a static cache's masks first, and a one-mask model like Mistral builds them
        # again from that), which must come out the same.  A wider one starts at 0 (a static cache's).
        start = 0
        if building_causal:
            start = (filled - covered).clamp(min=0) if isinstance(filled, torch.Tensor) else max(filled - covered, 0)
        column = position - start
        keep = attention_mask[:, column.clamp(0, covered - 1)].to(torch.bool) & (column >= 0) & (column < covered)
        if building_causal:
            keep = keep & (position < filled)
    if not torch.compiler.is_compiling() and bool(keep.all()):
        return None  # eager: nothing masked after all, the dense kernel is cheaper
    if building_causal and (isinstance(filled, torch.Tensor) or kv_offset + kv_length > filled):
        # slots past `filled` hold no token yet: each kept column holds how far the queries' end is from it
        # (plus one), so the attention knows where the queries end (_query_ends) also when the newest slots
        # are padding in every row (audit 2026-11-28: a marker on the newest slot alone was lost there)
        keep = keep.to(torch.int32) * (filled - position + 1).to(torch.int32)
    if attention_mask is None:
        # a static cache's filled prefix: no holes, so the decode kernel needs only its bounds
        memo_per_tensor(keep, _FILL_MASK, lambda _: True)
    return keep
