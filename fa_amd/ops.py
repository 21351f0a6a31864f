"""The attention op: torch.library custom ops around the Triton launchers (with
fake implementations and autograd registration) for torch.compile, and one
autograd.Function over the same functions for eager mode; `attention` picks.

Why custom ops: torch.compile then sees one opaque node per direction with exact
fake shapes (no graph breaks, no attempt to trace Triton internals).
Why not only custom ops: in eager mode their Python dispatch (argument
defaults, alias checks, the generated autograd wrapper) cost more host time than
the launches themselves; on the lent H100 one forward+backward at (16, 1024, 16,
128) took ~1.9 ms of host time through the op and ~1.1 ms through the plain
autograd.Function, against ~1.1 ms of GPU time, so small and mid-sized calls
were bound by the CPU (docs/TUNING_NOTES.md v6).  Both paths run the same
`attention_forward` / `_gradients`, save the same tensors, and CUDA graphs
capture either.

Double backward (a gradient of these gradients, e.g. a gradient penalty through
torch.autograd.grad(..., create_graph=True)) is not supported, as in flash-attn:
the backward is once-differentiable.  Under create_graph the gradients stay on
the graph through a node whose own backward raises a RuntimeError that says so
(PyTorch's once_differentiable convention, with fa_amd's message), on the eager
path and the custom-op path alike; used as plain values they are fine.

Arguments arrive already validated and normalized by fa_amd.interface:
window (-1 = unbounded, causal already folded into window_right=0), a float
softmax_scale, and `rng_state` (int64[2] on the device, drawn from torch's
generator by the caller) when dropout_p > 0.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

from .kernels.backward import attention_backward
from .kernels.forward import attention_forward
from .kernels.launch import with_int32_row_offsets


def last_dim_contiguous(x: Optional[Tensor]) -> Optional[Tensor]:
    """x, copied where its last dim is not unit-stride (q/k/v/out/dout: the kernels take any other strides;
    cu_seqlens: 1-D, so then contiguous); None stays None."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def check_cu_seqlens_pair(cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor]) -> None:
    """The kernels index both cu_seqlens by the same sequence number: a shorter one would be read past its end
    (fa_amd.interface checks this; the public ops are also called directly, e.g. by flash_attn_interface's
    stand-ins).  Shapes only: no device sync."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen) or both be None (dense)")
    if cu_seqlens_q is not None and (cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be 1-D with the same length (batch+1), got shapes "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")


@torch.library.custom_op("fa_amd::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[Tensor], rng_state: Optional[Tensor], return_probs: bool, deterministic: bool,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    # (the op is public: torch.ops.fa_amd.attention_fwd, flash_attn_interface._flash_attn_forward's stand-in)
    check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
    q, k, v, cu_seqlens_q, cu_seqlens_k = (last_dim_contiguous(x) for x in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                             return_probs, sinks)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state, return_probs,
                        deterministic, sinks=None):
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        hq = q.shape[1]
        lse = q.new_empty((hq, q.shape[0]), dtype=torch.float32)
    else:
        batch, seqlen_q, hq = q.shape[0], q.shape[1], q.shape[2]
        lse = q.new_empty((batch, hq, seqlen_q), dtype=torch.float32)
    probs = q.new_empty((batch, hq, max_seqlen_q, max_seqlen_k) if return_probs else (0,))
    return q.new_empty(q.shape), lse, probs


@torch.library.custom_op("fa_amd::attention_bwd", mutates_args=())
def attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[Tensor], rng_state: Optional[Tensor], deterministic: bool,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # (public: torch.ops.fa_amd.attention_bwd, flash_attn_interface._flash_attn_backward's stand-in)
    softmax_lse = check_backward_tensors(dout, q, out, softmax_lse, cu_seqlens_q is not None)
    return _backward_impl(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                          deterministic, sinks)


def check_backward_tensors(dout: Tensor, q: Tensor, out: Tensor, softmax_lse: Tensor, varlen: bool) -> Tensor:
    """dout, out and softmax_lse of a caller's backward against q, as flash-attn checks them: the kernels read
    lse rows (and write its delta twin, made in lse's shape) per query row, so a shorter lse would be read and
    written past its end.  Returns softmax_lse with contiguous rows (the kernels read lse and delta with one set
    of strides)."""
    for name, x in (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share one device")
    for name, x in (("dout", dout), ("out", out)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    want = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if softmax_lse.dtype != torch.float32:
        raise TypeError(f"softmax_lse must be float32 (the forward's), got {softmax_lse.dtype}")
    if tuple(softmax_lse.shape) != want:
        layout = "(nheads, total_q)" if varlen else "(batch, nheads, seqlen_q)"
        raise ValueError(f"softmax_lse must have shape {layout} = {want}, got {tuple(softmax_lse.shape)}")
    return softmax_lse if softmax_lse.is_contiguous() else softmax_lse.contiguous()


def _gradients(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
               deterministic, sinks=None):
    """(dq, dk, dv), and dsinks when there are sinks."""
    # the kernels read every row with unit stride on the head dim; q/k/v/out may arrive strided there through
    # the public op (torch.ops.fa_amd.attention_bwd, flash_attn_interface._flash_attn_backward's stand-in)
    check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
    dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k = (
        last_dim_contiguous(x) for x in (dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k))
    dout = with_int32_row_offsets("dout", dout, max_seqlen_q, cu_seqlens_q is not None)
    return attention_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap,
                              alibi_slopes, rng_state, deterministic, sinks)


def _backward_impl(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                   deterministic, sinks=None):
    """(dq, dk, dv, dsinks): the op's fixed outputs; dsinks is an empty fp32 tensor when there are no sinks."""
    grads = _gradients(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                       deterministic, sinks)
    return grads if sinks is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state,
                        deterministic, sinks=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks_fake(q, sinks)


def _dsinks_fake(q, sinks):
    """The backward ops' dsinks: fp32 whatever the sinks' dtype (the kernels accumulate and write it in fp32;
    a fake in the sinks' dtype let inductor read the fp32 buffer as fp16 / bf16 in the ops that follow),
    empty without sinks."""
    shape = sinks.shape if sinks is not None else (0,)
    return q.new_empty(shape, dtype=torch.float32)


DOUBLE_BACKWARD_ERROR = (
    "fa_amd attention does not support double backward (differentiating its gradients again, e.g. a "
    "gradient penalty after torch.autograd.grad(..., create_graph=True)): its backward is once-differentiable, "
    "as in flash-attn. Use attn_implementation='eager' or 'sdpa' (or fa_amd.reference.attention_ref) for the "
    "second-order term.")


def _double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


# the custom-op path (torch.compile, or torch.ops.fa_amd.* called directly): the backward op's own
# gradient is an error, never a silent zero
attention_bwd.register_autograd(_double_backward, setup_context=lambda ctx, inputs, output: None)


class _OnceDifferentiableGrads(torch.autograd.Function):
    """The eager backward under create_graph=True: the same gradients, attached to the graph
    through this node, whose backward raises instead of treating them as constants."""

    @staticmethod
    def forward(ctx, dout, q, k, v, out, lse, *rest):
        return _backward_impl(dout, q, k, v, out, lse, *rest)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
     window_left, window_right, softcap, alibi_slopes, rng_state, _return_probs, deterministic) = inputs[:16]
    sinks = inputs[16] if len(inputs) > 16 else None
    ctx.num_inputs = len(inputs)
    out, lse, _probs = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, sinks)
    ctx.params = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap,
                  deterministic)
    ctx.mark_non_differentiable(lse, _probs)


def _backward_with(bwd, ctx, dout, round_trip=None, forward=None):
    """The gradients from the saved tensors by `bwd`; round_trip(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) -> (q, k, v) replaces the saved q, k, v first (fa_amd.fp8: the values its FP8 forward used), and
    `forward` (attention_fwd's arguments and outputs) then recomputes out and lse from them (fa_amd.fp8: why)."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, sinks = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap,
     deterministic) = ctx.params
    if round_trip is not None:
        q, k, v = round_trip(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if forward is not None:  # (the same rng_state: the same dropout mask)
        out, lse, _ = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state, False,
                              deterministic, sinks)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # create_graph=True: the saved out tied bwd's node (_OnceDifferentiableGrads) to the graph, so that a
            # second backward raises there; the recomputed out is no part of it, so it ties the node instead
            out.requires_grad_()
    # (dq, dk, dv) or (dq, dk, dv, dsinks): the op always gives four, the eager _gradients three without sinks
    grads = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, window_left, window_right, softcap, alibi_slopes, rng_state, deterministic, sinks)
    return (tuple(grads[:3]) + (None,) * 13 + (grads[3] if sinks is not None else None,))[:ctx.num_inputs]


def _backward(ctx, dout, _dlse, _dprobs):
    # the op, not the function: a compiled graph's backward must see an opaque node too
    return _backward_with(torch.ops.fa_amd.attention_bwd, ctx, dout)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The custom op's forward and backward without its dispatch (eager mode only).  Takes
    (q, k, v, sinks or None, rest), rest = attention_fwd's arguments 4..16 as one tuple: the autograd
    machinery then handles 5 inputs and gradients instead of 16-17 (~25 us less host time per
    forward+backward on a 2-core CI CPU, kernels stubbed; docs/TUNING_NOTES.md v9)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, rest):
        # rest[-1], `deterministic`, is for the backward
        inputs = (q, k, v, *rest) + ((sinks,) if sinks is not None else ())
        output = attention_forward(*inputs[:15], *inputs[16:])
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # the backward ignores the lse / probs grads: no zero tensors
        return output

    @staticmethod
    def backward(ctx, dout, _dlse, _dprobs):
        if dout is None:  # only lse / probs were used: no gradient flows to q, k, v (or sinks)
            return None, None, None, None, None
        if torch.compiler.is_compiling():
            # compiled autograd traces this backward of an eager forward: the op (whose fake the tracer runs;
            # the launchers cannot take fake tensors), as fa_amd.fp8's backward does
            bwd = torch.ops.fa_amd.attention_bwd
        # create_graph=True: the gradients must not pass for constants (their backward raises)
        elif torch.is_grad_enabled():
            bwd = _OnceDifferentiableGrads.apply
        else:
            bwd = _gradients
        grads = _backward_with(bwd, ctx, dout)
        return grads[0], grads[1], grads[2], (grads[16] if ctx.num_inputs > 16 else None), None


# ----------------------------------------------------------------- packed sequences marked by position ids
# One row holding several sequences whose position ids restart (Transformers' DataCollatorWithFlattening with
# no cu_seq_lens kwargs): where they restart is data, read on the host.  Eagerly the caller reads it once per
# forward (memoized); under torch.compile that read would be a graph break, so these ops take the position
# ids themselves and read the boundaries inside, where the tracer does not look.


def packed_bounds_from_positions(position_ids: Tensor):
    """(cu_seqlens int32, max_seqlen Python int) of packed sequences from position ids, over the rows' tokens one
    after another: a sequence starts at each row's first token and wherever a position is not its predecessor's
    plus one -- Transformers' rule for packed masks (masking_utils.find_packed_sequence_indices), so a restart
    (DataCollatorWithFlattening's 0..n0-1, 0..n1-1, ...) or a jump (0, 1, 2, 10, 11) opens one.  position_ids:
    (rows, length), or 1-D for one row.  A device->host sync: the Transformers glue memoizes it per forward, these
    ops run it inside."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    return packed_bounds_from_starts(rows[:, 1:] - rows[:, :-1] != 1)


def packed_bounds_from_starts(opens: Tensor):
    """(cu_seqlens int32, max_seqlen Python int) of the sequences in rows of tokens laid one after another, where
    opens (rows, length - 1) marks each token after a row's first that starts a sequence (every row's first token
    does).  A device->host sync."""
    is_start = torch.ones(opens.shape[0], opens.shape[1] + 1, dtype=torch.bool, device=opens.device)
    is_start[:, 1:] = opens
    starts = is_start.reshape(-1).nonzero().view(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([is_start.numel()], dtype=torch.int32, device=opens.device)])
    return cu, int(cu.diff().max().item())


@torch.library.custom_op("fa_amd::attention_fwd_by_positions", mutates_args=())
def attention_fwd_by_positions(
    q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor,
    dropout_p: float, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    rng_state: Optional[Tensor], deterministic: bool, sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of varlen q, k, v (total, heads, d): the rows' tokens one after another, packed as
    position_ids (rows, length) say (packed_bounds_from_positions)."""
    cu, longest = packed_bounds_from_positions(position_ids)
    out, lse, _ = attention_forward(q, k, v, cu, cu, longest, longest, dropout_p, softmax_scale, window_left,
                                    window_right, softcap, None, rng_state, False, sinks)
    return out, lse


@attention_fwd_by_positions.register_fake
def _attention_fwd_by_positions_fake(q, k, v, position_ids, dropout_p, softmax_scale, window_left, window_right,
                                     softcap, rng_state, deterministic, sinks=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fa_amd::attention_bwd_by_positions", mutates_args=())
def attention_bwd_by_positions(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, position_ids: Tensor,
    dropout_p: float, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    rng_state: Optional[Tensor], deterministic: bool, sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    cu, longest = packed_bounds_from_positions(position_ids)
    return _backward_impl(dout, q, k, v, out, softmax_lse, cu, cu, longest, longest, dropout_p, softmax_scale,
                          window_left, window_right, softcap, None, rng_state, deterministic, sinks)


@attention_bwd_by_positions.register_fake
def _attention_bwd_by_positions_fake(dout, q, k, v, out, softmax_lse, position_ids, dropout_p, softmax_scale,
                                     window_left, window_right, softcap, rng_state, deterministic, sinks=None):
    dsinks = _dsinks_fake(q, sinks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_by_positions(ctx, inputs, output):
    q, k, v, position_ids, *params = inputs[:11]
    rng_state = params[5]
    sinks = inputs[11] if len(inputs) > 11 else None
    out, lse = output
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(q, k, v, out, lse, position_ids, rng_state, sinks)
    ctx.params = (*params[:5], params[6])  # dropout_p, scale, left, right, softcap, deterministic
    ctx.mark_non_differentiable(lse)


def _backward_by_positions(ctx, dout, _dlse):
    q, k, v, out, lse, position_ids, rng_state, sinks = ctx.saved_tensors
    dropout_p, scale, left, right, softcap, deterministic = ctx.params
    dq, dk, dv, dsinks = torch.ops.fa_amd.attention_bwd_by_positions(
        dout.contiguous(), q, k, v, out, lse, position_ids, dropout_p, scale, left, right, softcap, rng_state,
        deterministic, sinks)
    return (dq, dk, dv) + (None,) * 8 + ((dsinks if sinks is not None else None),)[:ctx.num_inputs - 11]


attention_fwd_by_positions.register_autograd(_backward_by_positions, setup_context=_setup_by_positions)
attention_bwd_by_positions.register_autograd(_double_backward, setup_context=lambda ctx, inputs, output: None)


def forward_level_open() -> bool:
    """Whether a torch.autograd.forward_ad dual level is open (else no tensor carries a tangent: the common case)."""
    return forward_ad._current_level >= 0


def forward_tangent_of(*tensors) -> Optional[int]:
    """The position of the first tensor carrying a forward-mode AD tangent (torch.autograd.forward_ad dual
    tensors), or None.  The kernels have no jvp: such a tangent would be dropped silently."""
    if not forward_level_open():
        return None
    for i, t in enumerate(tensors):
        if isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            return i
    return None


def refuse_forward_tangents(what: str, **tensors) -> None:
    """NotImplementedError naming the first argument that carries a forward-mode AD tangent (as torch's
    flash SDPA kernel refuses them)."""
    at = forward_tangent_of(*tensors.values())
    if at is not None:
        raise NotImplementedError(
            f"{what} has no forward-mode AD (jvp), but {list(tensors)[at]} carries a tangent "
            f"(torch.autograd.forward_ad); use torch's SDPA math backend for forward-mode AD")


def attention(*inputs):
    """(out, softmax_lse, probs) for attention_fwd's arguments (the 17th, `sinks`, optional),
    differentiable in q, k, v (and sinks): the custom op while torch.compile (or another tracer:
    tensor subclasses, dispatch modes) traces, the autograd.Function otherwise."""
    q, k, v = inputs[:3]
    if torch.compiler.is_compiling() or _traced(q):
        return torch.ops.fa_amd.attention_fwd(*inputs)
    sinks = inputs[16] if len(inputs) > 16 else None
    refuse_forward_tangents("fa_amd attention", q=q, k=k, v=v, sinks=sinks)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (sinks is not None and sinks.requires_grad))):
        return attention_forward(*inputs[:15], *inputs[16:])  # inference: nothing to save, no autograd node
    return EagerAttention.apply(q, k, v, sinks, inputs[3:16])


def _traced(q: Tensor) -> bool:
    """q is a tracer's tensor (FakeTensor, FunctionalTensor, ...) or a dispatch mode is active: code that
    runs under a tracer without being traced by dynamo itself (e.g. fa_amd.sdpa's dispatcher kernel
    during AOTAutograd) must emit the custom op, whose fake implementation the tracer can run."""
    return (type(q) is not Tensor and type(q) is not torch.nn.Parameter) or torch._C._len_torch_dispatch_stack() > 0
