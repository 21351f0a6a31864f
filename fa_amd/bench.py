"""Attention benchmark: fa_amd vs the peers available in this process.

    fa-amd bench                         # full sweep (GPU)
    fa-amd bench --quick --out bench_out
    fa-amd bench --from-json bench_out/results.json --markdown docs/PERFORMANCE.md
    TRITON_INTERPRET=1 fa-amd bench --smoke     # tiny CPU run (CI)
    fa-amd bench --only sdpa-route              # the SDPA route row alone

Shapes: head dim 64/128/256, causal and not, seqlen 512..16k holding
batch*seqlen = 16k tokens and nheads*headdim = 2048 (d96 / d192 at 1k, 4k, 16k:
2048 // d heads); GQA rows (16 q / 4 kv heads, d128); varlen rows (16k tokens
packed from 17 documents, causal, d128).  The report adds fa_amd / cuDNN ratios.
FLOPs: forward 4*b*h*sq*sk*d (halved for causal; varlen sums over documents),
forward+backward = 3.5x forward.  Each method is timed with CUDA events after
an L2 flush (triton.testing.do_bench's method), on random inputs, in
interleaved rounds with its peers (ROUNDS), each begun with ~ROUND_WARM_MS of the
method's own untimed calls; the median round is reported.
Peak memory is that of one forward+backward, beside plain PyTorch ("eager").
Then the SDPA route row: a model that calls F.scaled_dot_product_attention itself, timed as torch
runs it, with SDPA's math backend, and inside fa_amd.sdpa_route() (--no-sdpa-route skips it;
--only sdpa-route runs it alone).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
# head dims between the table rows (Phi-3's 96, 192): padded to the next row's kernels; fewer lengths
BETWEEN_HEAD_DIMS = (96, 192)
BETWEEN_SEQLENS = (1024, 4096, 16384)
# 17 documents, 64..2048 tokens each, 16384 in total (a packed pre-training batch)
VARLEN_DOCS = (64, 2048, 512, 1536, 128, 2048, 768, 256, 2048, 1024, 96, 1408, 160, 2048, 352, 1024, 864)
assert sum(VARLEN_DOCS) == TOKENS and len(VARLEN_DOCS) == 17
# eager attention materializes (b, h, sq, sk) scores several times over (scores,
# probs, their grads): it is skipped, not run out of memory, past this share
# of the GPU's memory
EAGER_MAX_MEMORY_FRACTION = 0.4
METHODS = ("fa_amd", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex", "flash_attn", "eager")


@dataclass
class Shape:
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    doc_lens: Optional[List[int]] = None  # varlen: packed documents (batch is 1)

    @property
    def kind(self) -> str:
        return "varlen" if self.doc_lens else ("gqa" if self.heads_q != self.heads_kv else "dense")

    @property
    def label(self) -> str:
        c = "causal" if self.causal else "full"
        if self.doc_lens:
            return f"varlen {len(self.doc_lens)} docs, {sum(self.doc_lens)} tok, h{self.heads_q}, d{self.head_dim}, {c}"
        heads = f"h{self.heads_q}" + (f"/kv{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        return f"b{self.batch} s{self.seqlen} {heads} d{self.head_dim} {c}"

    def fwd_flops(self) -> float:
        lens = self.doc_lens or [self.seqlen] * self.batch
        pairs = sum(n * n for n in lens)
        flops = 4.0 * pairs * self.heads_q * self.head_dim
        return flops / 2 if self.causal else flops


@dataclass
class Result:
    shape: Dict
    label: str
    kind: str
    method: str
    mode: str  # "fwd" | "fwd+bwd"
    ms: Optional[float] = None
    tflops: Optional[float] = None
    peak_mib: Optional[float] = None  # fwd+bwd only
    note: str = ""
    # --host-time, fwd+bwd only: CPU time to issue one call (no sync), and the GPU time of one call
    # replayed from a CUDA graph (no host work at all); host_ms >= graph_ms means the row measured the CPU
    host_ms: Optional[float] = None
    graph_ms: Optional[float] = None
    rounds_ms: Optional[List[float]] = None  # each round's median call; ms is their median


def shapes(quick: bool = False, smoke: bool = False, head_dims: Optional[List[int]] = None,
           seqlens: Optional[List[int]] = None) -> List[Shape]:
    """Benchmark rows; `head_dims` keeps only those dense rows (the d128 GQA and
    varlen rows come with 128), `seqlens` only the dense rows of those sequence lengths
    (no GQA / varlen rows then), so a long run can be split and merged later."""
    if smoke:
        return [Shape(1, 64, 2, 2, 32, False), Shape(1, 64, 2, 1, 32, True),
                Shape(1, 96, 2, 2, 32, True, doc_lens=[16, 48, 32])]
    dims, row_seqlens = ((128,), (1024, 4096)) if quick else (HEAD_DIMS, SEQLENS)
    dims = [d for d in dims if head_dims is None or d in head_dims]
    out = [Shape(TOKENS // s, s, HIDDEN // d, HIDDEN // d, d, causal)
           for d in dims for causal in (False, True) for s in row_seqlens]
    if not quick:
        out += [Shape(TOKENS // s, s, HIDDEN // d, HIDDEN // d, d, causal) for d in BETWEEN_HEAD_DIMS
                if head_dims is None or d in head_dims for causal in (False, True) for s in BETWEEN_SEQLENS]
    if seqlens is not None:
        return [shape for shape in out if shape.seqlen in seqlens]
    if 128 in dims:
        gqa_seqlens = (4096,) if quick else (2048, 8192)
        out += [Shape(TOKENS // s, s, 16, 4, 128, causal) for s in gqa_seqlens for causal in (False, True)]
        out.append(Shape(1, max(VARLEN_DOCS), 16, 16, 128, True, doc_lens=list(VARLEN_DOCS)))
    return out


# --------------------------------------------------------------------------- methods
# Each maker returns (fn(q, k, v) -> out, layout) or raises Unavailable(reason).
# layout "bshd" = (batch, seq, heads, dim) like flash-attn, "bhsd" like SDPA;
# varlen inputs are (total_tokens, heads, dim) for "thd" and (1, heads, total, dim) for flex.

class Unavailable(Exception):
    pass


def _is_rocm() -> bool:
    return torch.version.hip is not None


def _cu_seqlens(shape: Shape, device):
    lens = torch.tensor([0] + list(shape.doc_lens), device=device, dtype=torch.int32)
    return lens.cumsum(0, dtype=torch.int32)


def make_fa_amd(shape: Shape, device):
    import fa_amd

    if shape.doc_lens:
        cu = _cu_seqlens(shape, device)
        m = max(shape.doc_lens)
        return (lambda q, k, v: fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=shape.causal)), "thd"
    return (lambda q, k, v: fa_amd.flash_attn_func(q, k, v, causal=shape.causal)), "bshd"


def make_flash_attn(shape: Shape, device):
    try:
        import flash_attn
    except Exception as exc:
        raise Unavailable(f"flash_attn not importable ({type(exc).__name__})")
    if shape.doc_lens:
        cu = _cu_seqlens(shape, device)
        m = max(shape.doc_lens)
        return (lambda q, k, v: flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=shape.causal)), "thd"
    return (lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=shape.causal)), "bshd"


def _sdpa_backend_runs_on_cpu(backend) -> bool:
    """Whether torch's SDPA has a CPU kernel for `backend` (else a call raises "No viable backend ...
    turning off both the math kernel and the fused kernels", which reads like a setup mistake)."""
    import warnings

    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    q = torch.zeros(1, 1, 16, 16)
    try:
        with warnings.catch_warnings(), sdpa_kernel(backend):
            warnings.simplefilter("ignore")  # torch's "... kernel not used because" lines
            F.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


def _sdpa_maker(backend_name: str):
    def make(shape: Shape, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

        if backend_name == "CUDNN_ATTENTION" and (_is_rocm() or device == "cpu"):
            raise Unavailable("the cuDNN SDPA backend is NVIDIA-only")
        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise Unavailable(f"this torch has no SDPBackend.{backend_name}")
        if device == "cpu" and not _sdpa_backend_runs_on_cpu(backend):
            raise Unavailable(f"torch {torch.__version__} has no CPU kernel for SDPBackend.{backend_name}")
        if shape.doc_lens:
            raise Unavailable("SDPA has no varlen entry point (would need padding)")
        gqa = shape.heads_q != shape.heads_kv

        def fn(q, k, v):
            with sdpa_kernel(backend):
                if gqa:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        return fn, "bhsd"

    return make


def make_flex(shape: Shape, device):
    if device == "cpu":
        raise Unavailable("FlexAttention compile skipped on CPU")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as exc:
        raise Unavailable(f"no FlexAttention in torch {torch.__version__} ({type(exc).__name__})")
    # a fresh compile per shape: otherwise dynamo recompiles into a dynamic-shape
    # graph (or hits the recompile limit and falls back to the eager path)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention)
    if shape.doc_lens:
        doc_id = torch.repeat_interleave(torch.arange(len(shape.doc_lens), device=device),
                                         torch.tensor(shape.doc_lens, device=device))
        causal = shape.causal

        def mask_mod(b, h, q_idx, kv_idx):
            same = doc_id[q_idx] == doc_id[kv_idx]
            return (same & (q_idx >= kv_idx)) if causal else same

        total = sum(shape.doc_lens)
        block_mask = create_block_mask(mask_mod, 1, None, total, total, device=device)
    elif shape.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                       shape.seqlen, shape.seqlen, device=device)
    else:
        block_mask = None
    gqa = shape.heads_q != shape.heads_kv
    return (lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)), "bhsd"


def eager_attention(q, k, v, causal: bool):
    """Plain PyTorch attention in the inputs' dtype; (b, h, s, d) layout."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def make_eager(shape: Shape, device):
    if shape.doc_lens:
        raise Unavailable("eager varlen not benchmarked (a per-document loop is not a fair baseline)")
    score_bytes = shape.batch * shape.heads_q * shape.seqlen ** 2 * 4
    if device != "cpu":
        budget = EAGER_MAX_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
        if 4 * score_bytes > budget:
            raise Unavailable(f"skipped: needs ~{4 * score_bytes / 2**30:.0f} GiB for scores and their grads "
                              f"(> {EAGER_MAX_MEMORY_FRACTION:.0%} of GPU memory)")
    return (lambda q, k, v: eager_attention(q, k, v, shape.causal)), "bhsd"


MAKERS: Dict[str, Callable] = {
    "fa_amd": make_fa_amd,
    "sdpa_flash": _sdpa_maker("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa_maker("EFFICIENT_ATTENTION"),
    "sdpa_cudnn": _sdpa_maker("CUDNN_ATTENTION"),
    "flex": make_flex,
    "flash_attn": make_flash_attn,
    "eager": make_eager,
}


# --------------------------------------------------------------------------- FP8 rows (--fp8)
# fa_amd's FP8 forward (fa_amd.fp8) beside its own bf16 forward and the FP8 attention torch offers,
# in the same interleaved rounds.  Target (issue 18): the FP8 forward >= 1.5x fa_amd's bf16 forward
# at d128, seqlen >= 4k, on the H100.
#   fa_amd_fp8       FA3-style FP8 inputs: q, k, v quantised once outside the timing (per (batch, KV
#                    head) amax scales), V laid out as the arch's kernel reads it; forward only
#   fa_amd_fp8_func  flash_attn_fp8_func on the bf16 inputs: quantisation + FP8 forward, and its
#                    high-precision backward
#   sdpa_cudnn_fp8   torch SDPA with float8 inputs on the cuDNN backend, where this torch takes them
FP8_METHODS = ("fa_amd_fp8", "fa_amd_fp8_func", "sdpa_cudnn_fp8")
# FP8 inputs have no backward: these get forward rows only (not a fwd+bwd row that reads "forward only")
FORWARD_ONLY_METHODS = ("fa_amd_fp8", "sdpa_cudnn_fp8")
FP8_DEFAULT_METHODS = ("fa_amd", "sdpa_cudnn", "flash_attn") + FP8_METHODS


def fp8_shapes(quick: bool = False, smoke: bool = False) -> List[Shape]:
    """d128 rows of the --fp8 run (dense and GQA, causal and not), TOKENS tokens each."""
    if smoke:
        return [Shape(1, 48, 2, 2, 32, False), Shape(1, 40, 4, 2, 32, True)]
    seqlens = (4096, 8192) if quick else (1024, 2048, 4096, 8192, 16384)
    out = [Shape(TOKENS // s, s, HIDDEN // 128, HIDDEN // 128, 128, causal) for causal in (False, True)
           for s in seqlens]
    return out + [Shape(TOKENS // 4096, 4096, 16, 4, 128, causal) for causal in (False, True)]


def _fp8_type(device):
    from .fp8 import fp8_dtypes

    try:
        return fp8_dtypes(torch.empty(0, device=device))[0]
    except ValueError as exc:
        raise Unavailable(str(exc))


def _once_per_inputs(convert):
    """fn(q, k, v) -> convert(q, k, v), computed on the first call with these tensors and reused
    (conversions stay out of the timed calls)."""
    cache = {}

    def get(q, k, v):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in cache:
            cache.clear()
            cache[key] = convert(q, k, v)
        return cache[key]

    return get


def fp8_inputs(q, k, v, fp8_dtype=None):
    """Dense bshd q, k, v as FA3-style FP8 inputs: (q8, k8, v8, {q_descale, k_descale, v_descale}), the
    descales per (batch, KV head) and V in the layout the forward reads on this arch (no copy per call)."""
    from .arch import arch_for
    from .fp8 import quantize_fp8, token_major_copy
    from .tuning import fp8_v_token_major

    fp8_dtype = fp8_dtype or _fp8_type(q.device)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    # FA3's q_descale is per (batch, KV head): one scale for each query-head group
    q8, q_descale = quantize_fp8(q.reshape(b, s, hk, (hq // hk) * d), fp8_dtype)
    k8, k_descale = quantize_fp8(k, fp8_dtype)
    v8, v_descale = quantize_fp8(v, fp8_dtype)
    if fp8_v_token_major(arch_for(v8)):
        v8 = token_major_copy(v8)
    return q8.reshape(q.shape), k8, v8, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def make_fa_amd_fp8(shape: Shape, device):
    import fa_amd

    if shape.doc_lens:
        raise Unavailable("FP8 rows are dense")
    fp8_dtype = _fp8_type(device)
    inputs = _once_per_inputs(lambda q, k, v: fp8_inputs(q, k, v, fp8_dtype))

    def fn(q, k, v):
        if torch.is_grad_enabled():
            raise RuntimeError("forward only: FP8 inputs have no backward (the fa_amd_fp8_func row has one)")
        q8, k8, v8, descales = inputs(q, k, v)
        return fa_amd.flash_attn_func(q8, k8, v8, causal=shape.causal, **descales)

    return fn, "bshd"


def make_fa_amd_fp8_func(shape: Shape, device):
    import fa_amd

    if shape.doc_lens:
        raise Unavailable("FP8 rows are dense")
    _fp8_type(device)
    return (lambda q, k, v: fa_amd.flash_attn_fp8_func(q, k, v, causal=shape.causal)), "bshd"


def make_sdpa_cudnn_fp8(shape: Shape, device):
    import torch.nn.functional as F

    if shape.doc_lens:
        raise Unavailable("FP8 rows are dense")
    if device == "cpu" or _is_rocm():
        raise Unavailable("the cuDNN SDPA backend is NVIDIA-only")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    if backend is None:
        raise Unavailable(f"torch {torch.__version__} has no SDPBackend.CUDNN_ATTENTION")
    fp8_dtype = torch.float8_e4m3fn
    probe = torch.randn(1, 2, 128, 128, device=device).to(fp8_dtype)
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(probe, probe, probe)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise Unavailable(f"torch {torch.__version__} SDPA (cuDNN backend) does not take {fp8_dtype} inputs "
                          f"({type(exc).__name__}: {reason})")
    inputs = _once_per_inputs(lambda q, k, v: tuple(x.detach().to(fp8_dtype) for x in (q, k, v)))
    gqa = shape.heads_q != shape.heads_kv

    def fn(q, k, v):
        if torch.is_grad_enabled():
            raise RuntimeError("forward only: FP8 inputs")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*inputs(q, k, v), is_causal=shape.causal, enable_gqa=gqa)

    return fn, "bhsd"


MAKERS.update(fa_amd_fp8=make_fa_amd_fp8, fa_amd_fp8_func=make_fa_amd_fp8_func, sdpa_cudnn_fp8=make_sdpa_cudnn_fp8)


def fp8_speedup_lines(results: List["Result"]) -> List[str]:
    """Forward speed of the FP8 rows over fa_amd's bf16 forward, per shape (empty without FP8 rows)."""
    idx = {(r.label, r.method): r for r in results if r.mode == "fwd" and r.ms is not None}
    lines = []
    for label in dict.fromkeys(r.label for r in results):
        base = idx.get((label, "fa_amd"))
        cells = [f"{m} {base.ms / idx[(label, m)].ms:.2f}x" for m in FP8_METHODS if base and (label, m) in idx]
        if cells:
            lines.append(f"- {label}: " + ", ".join(cells))
    return (["\n### FP8 forward vs fa_amd bf16 forward (speedup)\n"] + lines) if lines else []


# --------------------------------------------------------------------------- timing

def make_inputs(shape: Shape, layout: str, dtype, device, seed: int = 0):
    """Random (non-zero) q, k, v, dout in the method's layout, with requires_grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if shape.doc_lens:
        total = sum(shape.doc_lens)
        dims = {"thd": [(total, shape.heads_q, shape.head_dim), (total, shape.heads_kv, shape.head_dim)],
                "bhsd": [(1, shape.heads_q, total, shape.head_dim), (1, shape.heads_kv, total, shape.head_dim)]}[layout]
    elif layout == "bshd":
        dims = [(shape.batch, shape.seqlen, shape.heads_q, shape.head_dim),
                (shape.batch, shape.seqlen, shape.heads_kv, shape.head_dim)]
    else:
        dims = [(shape.batch, shape.heads_q, shape.seqlen, shape.head_dim),
                (shape.batch, shape.heads_kv, shape.seqlen, shape.head_dim)]
    q_shape, kv_shape = dims

    def rnd(s):
        return torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_(True)

    q, k, v = rnd(q_shape), rnd(kv_shape), rnd(kv_shape)
    dout = torch.randn(q_shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return q, k, v, dout


def time_ms(fn, grad_to_none=None, smoke: bool = False) -> float:
    """Median milliseconds: triton.testing.do_bench on a GPU, a few wall-clock reps on CPU."""
    if smoke or not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    import triton

    fn()  # warm-up (compiles)
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def peak_memory_mib(fn) -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _clear_grads(tensors):
    """The next backward assigns these gradients instead of adding to them (no extra add kernels)."""
    for t in tensors:
        t.grad = None


def host_ms_per_call(fn, grad_to_none, calls: int = 20) -> float:
    """Host milliseconds to issue one call: `calls` back to back with no synchronization in between."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        _clear_grads(grad_to_none)
        fn()
    elapsed = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 1e3 * elapsed / calls


def best_host_us(fn, calls: int, runs: int = 5, warmup: int = 50) -> float:
    """Host microseconds to issue one call of `fn`: the best of `runs` runs of `calls` calls back to back
    (no synchronization inside a run; one after each, so queued work does not pile up across runs)."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        sync()
    return best


def cuda_graph(fn, warmup: int = 1) -> "torch.cuda.CUDAGraph":
    """fn's launches captured in a CUDA graph, after `warmup` calls on a side stream (as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(fn, grad_to_none) -> Optional[float]:
    """GPU milliseconds of one call captured in a CUDA graph and replayed (None where it cannot be captured)."""
    if not torch.cuda.is_available():
        return None
    import triton

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                _clear_grads(grad_to_none)
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        _clear_grads(grad_to_none)
        with torch.cuda.graph(graph):
            fn()
        ms = float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))
    except Exception:  # a peer that cannot be captured (e.g. a host sync inside): no GPU-only time
        return None
    finally:
        _clear_grads(grad_to_none)
    return ms


# Every (method, mode) of a shape is timed in ROUNDS interleaved rounds of ROUND_REP_MS each and
# reports the median round: the peers of a row are measured at the same moments, so clock and
# thermal drift over a long run moves them together instead of favouring whichever ran in a
# cooler minute (one 100 ms do_bench per peer, back to back, swung the near-tie rows by 2-5 %
# between runs on the lent H100, docs/TUNING_NOTES.md v7).
ROUNDS = 3
ROUND_REP_MS = 30
MIN_CALLS_PER_ROUND = 8
MAX_ROUND_MS = 300
# Each round begins with ~ROUND_WARM_MS of the method's own calls, back to back and untimed (do_bench's warm-up,
# which the rounds had lost): a GPU at its power cap moves its clock over tens of ms, so a round that starts cold
# ran partly in the power state its predecessor left.  H200, 2026-11-29 (d128 b4 s4k h16 causal, us, fa_amd bf16 /
# FP8 forward): the same rounds read 595-620 / 419-431 without it, 655-661 / 407-412 with 60 ms of own calls first,
# and 667-705 / 422-443 over 0.15 s of back-to-back calls: without the warm-up the bf16 rounds ran ~10 % faster than
# that kernel sustains (TUNING_NOTES v44).
ROUND_WARM_MS = 50
MAX_WARM_CALLS = 256  # (host-bound short calls: the warm-up stays a few ms of host time; calls over ~2 ROUND_WARM_MS
# get none: gpu_round_ms's own warm call is the warm-up there)


@dataclass
class _Timed:
    """One (method, mode) of a shape under measurement."""
    base: Dict
    mode: str
    call: Callable
    grads: tuple
    rounds: List[float]
    note: str = ""
    calls: int = 1  # timed calls per round (set in round one)
    warm_calls: int = 0  # untimed calls that start each round beside gpu_round_ms's one (set in round one: ~ROUND_WARM_MS)
    flush: str = "zero"  # the L2 flush before each timed call (l2_flush)


def _failure_note(exc: Exception) -> str:
    reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return f"n/a: {type(exc).__name__}: {reason}"


def _prepare(method: str, shape: Shape, dtype, device) -> List[_Timed]:
    """The method's forward and forward+backward calls on fresh inputs (notes instead where it cannot run)."""
    base = dict(shape=asdict(shape), label=shape.label, kind=shape.kind, method=method)
    modes = ("fwd",) if method in FORWARD_ONLY_METHODS else ("fwd", "fwd+bwd")
    try:
        fn, layout = MAKERS[method](shape, device)
    except Unavailable as exc:
        return [_Timed(base, m, None, (), [], note=f"n/a: {exc}") for m in modes]
    q, k, v, dout = make_inputs(shape, layout, dtype, device)

    def fwd():
        with torch.no_grad():
            return fn(q, k, v)

    def fwd_bwd():
        out = fn(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)

    return [_Timed(base, m, fwd if m == "fwd" else fwd_bwd, (q, k, v), []) for m in modes]


_L2_FLUSH = []  # one 256 MB buffer that every timed call's L2 flush goes through
# L2 flushes before a timed call: "zero" zeroes the buffer (triton.testing.do_bench's method; it leaves
# up to an L2 of dirty lines, whose write-back the timed call then pays: ~50 MB, ~16 us at the H100's
# ~3 TB/s, charged to bandwidth-bound decode rows, .ci/decode_ab.py stage "flush"); "read" sums it
# (L2 left holding clean lines: the inputs still come from HBM, and nothing is written back); "none"
# leaves L2 as the previous call left it (for comparison, in .ci/decode_ab.py)
L2_FLUSHES = ("zero", "read", "none")


def l2_flush(mode: str = "zero"):
    """fn() that flushes the L2 by `mode` (L2_FLUSHES)."""
    if mode not in L2_FLUSHES:
        raise ValueError(f"unknown L2 flush {mode!r}; pick from {L2_FLUSHES}")
    if mode == "none":
        return lambda: None
    if not _L2_FLUSH:
        _L2_FLUSH.append(torch.zeros(64 * 2**20, dtype=torch.float32, device="cuda"))
    return _L2_FLUSH[0].zero_ if mode == "zero" else _L2_FLUSH[0].sum


def _calls_per_round(est_ms: float) -> int:
    """ROUND_REP_MS of calls, but at least MIN_CALLS_PER_ROUND (long rows: a median of a few calls,
    not of one) and at most ~MAX_ROUND_MS (the eager peer at long rows)."""
    calls = max(MIN_CALLS_PER_ROUND, round(ROUND_REP_MS / max(est_ms, 1e-3)))
    return max(1, min(calls, int(MAX_ROUND_MS / max(est_ms, 1e-3))))


def gpu_round_ms(fn, grads, calls: int, flush: str = "zero", before=None, warm: int = 1) -> float:
    """Median GPU milliseconds of `calls` calls, each after an L2 flush (`flush`: l2_flush), timed with
    CUDA events; `grads` are reset before each call so a backward assigns instead of accumulating.
    `before`: run untimed ahead of each call and its flush (e.g. the forward whose backward `fn` is).
    `warm`: untimed calls first, back to back (the bench's rounds: ROUND_WARM_MS of them)."""
    flush_l2 = l2_flush(flush)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for _ in range(warm):  # warm again after the other methods' rounds
        _clear_grads(grads)
        if before is not None:
            before()
        fn()
    for start, end in events:
        _clear_grads(grads)
        if before is not None:
            before()
        flush_l2()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


def interleaved_rounds_ms(timed: Dict, rounds: int, calls: int = 10) -> Dict:
    """{key: [one gpu_round_ms per round]} for {key: (fn, grads)}: every fn once to compile and warm, then
    `rounds` rounds in which each starts one key later (no fixed order favours a key)."""
    for fn, _ in timed.values():
        fn()
    times = {key: [] for key in timed}
    keys = list(timed)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(gpu_round_ms(timed[key][0], timed[key][1], calls))
    return times


def _time_round(timed: _Timed, smoke: bool, first: bool) -> None:
    if timed.call is None or timed.note:
        return
    try:
        if smoke or not torch.cuda.is_available():
            ms = time_ms(timed.call, grad_to_none=list(timed.grads), smoke=True)
        else:
            if first:  # compile, then a wall-clock estimate of one call sizes the rounds
                timed.call()
                torch.cuda.synchronize()
                start = time.perf_counter()
                _clear_grads(timed.grads)
                timed.call()
                torch.cuda.synchronize()
                est_ms = (time.perf_counter() - start) * 1e3
                timed.calls = _calls_per_round(est_ms)
                timed.warm_calls = min(MAX_WARM_CALLS, round(ROUND_WARM_MS / max(est_ms, 1e-3)))
            # (the method's own steady state first: ROUND_WARM_MS of calls)
            ms = gpu_round_ms(timed.call, timed.grads, timed.calls, timed.flush, warm=1 + timed.warm_calls)
        timed.rounds.append(ms)
    except Exception as exc:  # a peer that cannot run this shape: report, keep going
        timed.note = _failure_note(exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _result(timed: _Timed, shape: Shape, host_time: bool) -> Result:
    if timed.note or not timed.rounds:
        return Result(**timed.base, mode=timed.mode, note=timed.note or "n/a: not measured")
    ms = sorted(timed.rounds)[len(timed.rounds) // 2]
    mult = 1.0 if timed.mode == "fwd" else 3.5
    extra = {}
    try:
        if timed.mode == "fwd+bwd":
            _clear_grads(timed.grads)
            extra["peak_mib"] = peak_memory_mib(timed.call)
            if host_time:
                extra.update(host_ms=host_ms_per_call(timed.call, timed.grads),
                             graph_ms=graph_replay_ms(timed.call, timed.grads))
    except Exception as exc:
        return Result(**timed.base, mode=timed.mode, note=_failure_note(exc))
    return Result(**timed.base, mode=timed.mode, ms=ms, tflops=mult * shape.fwd_flops() / (ms * 1e-3) / 1e12,
                  rounds_ms=[round(t, 5) for t in timed.rounds], **extra)


def bench_shape(methods, shape: Shape, dtype, device, smoke: bool, host_time: bool = False,
                rounds: int = ROUNDS) -> List[Result]:
    """Every method on one shape: inputs prepared for all, then `rounds` rounds that time each
    (method, mode) in turn; each reports its median round."""
    groups = [_prepare(method, shape, dtype, device) for method in methods]
    for r in range(max(1, rounds)):
        # each round starts with another method: none is always first (or last) after the others
        for group in groups[r % len(groups):] + groups[:r % len(groups)]:
            for t in group:
                _time_round(t, smoke, first=r == 0)
    results = [_result(t, shape, host_time) for group in groups for t in group]
    del groups
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the shape's inputs are gone now; give the next one all memory
    return results


def bench_method(method: str, shape: Shape, dtype, device, smoke: bool, host_time: bool = False,
                 rounds: int = 1) -> List[Result]:
    """One method on one shape (forward, forward+backward)."""
    return bench_shape([method], shape, dtype, device, smoke, host_time, rounds)


# --------------------------------------------------------------------------- SDPA route row
# A model that calls F.scaled_dot_product_attention itself (as diffusers, timm, torchtune and custom
# models do): a stack of pre-norm causal attention blocks, timed as torch runs it, with torch's math
# backend (what SDPA falls back to where it has no flash kernel, e.g. MI100 / RDNA; every GPU can
# show it), and inside fa_amd.sdpa_route(); interleaved rounds, as the kernel rows.
SDPA_ROUTE_KIND = "sdpa_route"
SDPA_MODEL = dict(layers=4, batch=2, seqlen=4096, hidden=2048, heads=16)  # d128; attention ~1/3 of the FLOPs
SDPA_MODEL_SMOKE = dict(layers=1, batch=1, seqlen=16, hidden=32, heads=2)
SDPA_ROUTE_VARIANTS = ("torch", "torch math", "fa_amd route")


class SdpaBlock(torch.nn.Module):
    """Pre-norm causal self-attention block that calls F.scaled_dot_product_attention."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attn.transpose(1, 2).flatten(2))


def _sdpa_route_context(variant: str):
    import contextlib

    if variant == "fa_amd route":
        import fa_amd

        return fa_amd.sdpa_route()
    if variant == "torch math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def bench_sdpa_route(dtype, device, smoke: bool, rounds: int = ROUNDS, log=print) -> List[Result]:
    """The SDPA-calling model, forward and forward+backward, per variant (SDPA_ROUTE_VARIANTS)."""
    cfg = SDPA_MODEL_SMOKE if smoke else SDPA_MODEL
    gen = torch.Generator(device="cpu").manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[SdpaBlock(cfg["hidden"], cfg["heads"]) for _ in range(cfg["layers"])])
    model = model.to(device=device, dtype=dtype)
    x = torch.randn(cfg["batch"], cfg["seqlen"], cfg["hidden"], generator=gen).to(device=device, dtype=dtype)
    dout = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)
    params = tuple(model.parameters())
    label = (f"SDPA model: {cfg['layers']} x causal attention block, b{cfg['batch']} s{cfg['seqlen']} "
             f"h{cfg['heads']} d{cfg['hidden'] // cfg['heads']}")
    log(label)

    def fwd():
        with torch.no_grad():
            return model(x)

    def fwd_bwd():
        model(x).backward(dout)

    timed = {(v, m): _Timed(dict(shape=dict(cfg), label=label, kind=SDPA_ROUTE_KIND, method=v), m, call, params, [])
             for v in SDPA_ROUTE_VARIANTS for m, call in (("fwd", fwd), ("fwd+bwd", fwd_bwd))}
    for r in range(max(1, rounds)):
        order = SDPA_ROUTE_VARIANTS[r % 3:] + SDPA_ROUTE_VARIANTS[:r % 3]
        for variant in order:
            with _sdpa_route_context(variant):  # entered once per round: its own cost is not timed
                for mode in ("fwd", "fwd+bwd"):
                    _time_round(timed[(variant, mode)], smoke, first=r == 0)
    results = []
    for (variant, mode), t in timed.items():
        if t.note or not t.rounds:
            results.append(Result(**t.base, mode=mode, note=t.note or "n/a: not measured"))
            continue
        peak = None
        if mode == "fwd+bwd":
            with _sdpa_route_context(variant):
                _clear_grads(params)
                peak = peak_memory_mib(t.call)
        results.append(Result(**t.base, mode=mode, ms=sorted(t.rounds)[len(t.rounds) // 2], peak_mib=peak,
                              rounds_ms=[round(ms, 5) for ms in t.rounds]))
    _clear_grads(params)
    base = {(r.method, r.mode): r.ms for r in results}
    for r in results:
        if r.ms is not None and base.get(("torch", r.mode)):
            r.note = f"{base[('torch', r.mode)] / r.ms:.2f}x torch"
        shown = f"{r.ms:8.3f} ms  ({r.note})" if r.ms is not None else r.note
        log(f"  {r.method:15s} {r.mode:8s} {shown}")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def sdpa_route_table(results: List[Result]) -> List[str]:
    """Markdown lines for the SDPA route rows (empty when there are none)."""
    rows = [r for r in results if r.kind == SDPA_ROUTE_KIND]
    if not rows:
        return []
    idx = {(r.label, r.method, r.mode): r for r in rows}
    out = ["\n### An SDPA-calling model, without and with `fa_amd.sdpa_route()` (ms; speedup vs torch)\n",
           "torch: SDPA as torch picks its backend; torch math: SDPA's math backend (what GPUs without an SDPA "
           "flash kernel, e.g. MI100 / RDNA, fall back to); fa_amd route: the same model inside "
           "`fa_amd.sdpa_route()`.\n",
           "| model | mode | " + " | ".join(SDPA_ROUTE_VARIANTS) + " |", "|---" * (len(SDPA_ROUTE_VARIANTS) + 2) + "|"]
    for label in dict.fromkeys(r.label for r in rows):
        for mode in ("fwd", "fwd+bwd"):
            cells = []
            for v in SDPA_ROUTE_VARIANTS:
                r = idx.get((label, v, mode))
                if r is None or r.ms is None:
                    cells.append(r.note if r is not None and r.note else "n/a")
                else:
                    cells.append(f"{r.ms:.3f}" + (f" ({r.note})" if v != "torch" and r.note else ""))
            out.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
    return out


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# the error of a CPU run without the interpreter (prefill and decode / generate alike)
NO_INTERPRETER_ERROR = "error: on CPU set TRITON_INTERPRET=1 (fa_amd's kernels run through Triton's interpreter)"


def environment(device) -> Dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "interpreter": interpreter_on()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["runtime"] = f"ROCm {torch.version.hip}" if _is_rocm() else f"CUDA {torch.version.cuda}"
    else:
        env["gpu"] = "none (CPU, Triton interpreter)" if env["interpreter"] else "none (CPU, no Triton interpreter)"
    from .arch import device_arch

    arch = device_arch()
    env["arch"] = arch.name
    return env


def device_text(env: Dict) -> str:
    """'GPU (arch)' for a header; on CPU the gpu text alone (its arch is just "cpu")."""
    return env.get("gpu") if env.get("arch") == "cpu" else f"{env.get('gpu')} ({env.get('arch')})"


def run(methods, dtype, device, quick=False, smoke=False, log=print, head_dims=None, seqlens=None,
        host_time=False, rounds: int = ROUNDS, checkpoint: Optional[Callable] = None,
        sdpa_route: bool = True, fp8: bool = False, kernel_rows: bool = True) -> List[Result]:
    """Every shape (fp8: the FP8 rows'; none without `kernel_rows`), then the SDPA route row
    (`sdpa_route`); `checkpoint(results so far)` after each (a cut run keeps what it measured)."""
    results = []
    kernel_shapes = (fp8_shapes(quick, smoke) if fp8 else shapes(quick, smoke, head_dims, seqlens)) if kernel_rows else []
    for shape in kernel_shapes:
        if checkpoint is not None and results:
            checkpoint(results)
        log(f"{shape.label}")
        for r in bench_shape(methods, shape, dtype, device, smoke, host_time, rounds):
            results.append(r)
            shown = f"{r.tflops:7.1f} TFLOP/s  {r.ms:8.3f} ms" if r.ms is not None else r.note
            mem = f"  peak {r.peak_mib:.0f} MiB" if r.peak_mib is not None else ""
            spread = (f"  rounds {min(r.rounds_ms):.3f}..{max(r.rounds_ms):.3f}"
                      if r.rounds_ms and len(r.rounds_ms) > 1 else "")
            log(f"  {r.method:15s} {r.mode:8s} {shown}{mem}{spread}")
    if sdpa_route:
        if checkpoint is not None and results:
            checkpoint(results)
        results += bench_sdpa_route(dtype, device, smoke, rounds, log)
    return results


# --------------------------------------------------------------------------- reports

def _cell(r: Optional[Result]) -> str:
    if r is None:
        return ""
    if r.tflops is None:
        return "n/a"
    return f"{r.tflops:.0f}" if r.tflops >= 10 else f"{r.tflops:.2g}"


def _ratio(ours: Optional[Result], theirs: Optional[Result], used: set) -> str:
    if ours is None or theirs is None or not ours.tflops or not theirs.tflops:
        return _na("not run", used)
    return f"{ours.tflops / theirs.tflops:.2f}x"


# why a table cell says "n/a" (the TFLOP/s cells of failed or unavailable peers list theirs per method)
NA_REASONS = {
    "not run": "the method did not run this shape (its reason is listed below the tables)",
    "no GPU": "peak memory and CUDA-graph time come from the CUDA/ROCm allocator and graphs, so a run "
              "without a GPU (--smoke under TRITON_INTERPRET=1) does not measure them",
    "no graph": "the call could not be captured in a CUDA graph (e.g. it synchronizes with the host)",
}


def _na(key: str, used: set) -> str:
    used.add(key)
    return f"n/a ({key})"


def markdown_tables(results: List[Result]) -> str:
    route_lines = sdpa_route_table(results)
    results = [r for r in results if r.kind != SDPA_ROUTE_KIND]
    if not results:  # --only sdpa-route: no kernel tables to draw
        return "\n".join(route_lines)
    methods = [m for m in METHODS + FP8_METHODS if any(r.method == m for r in results)]
    # forward-only methods (FORWARD_ONLY_METHODS) have no column in the forward+backward tables
    bwd_methods = [m for m in methods if any(r.method == m and r.mode == "fwd+bwd" for r in results)]
    labels = list(dict.fromkeys(r.label for r in results))
    idx = {(r.label, r.method, r.mode): r for r in results}
    out = []
    why = set()  # the n/a reasons these tables used, explained under them
    # fa_amd's ratio to cuDNN (the rival SDPA picks on Hopper), where both ran
    ratio = "fa_amd" in methods and "sdpa_cudnn" in methods
    for mode in ("fwd", "fwd+bwd"):
        columns = methods if mode == "fwd" else bwd_methods
        out += [f"\n### {'Forward' if mode == 'fwd' else 'Forward + backward'} (TFLOP/s)\n",
                "| shape | " + " | ".join(columns) + (" | vs cuDNN" if ratio else "") + " |",
                "|---" * (len(columns) + 1 + ratio) + "|"]
        for label in labels:
            cells = [_cell(idx.get((label, m, mode))) for m in columns]
            if ratio:
                cells.append(_ratio(idx.get((label, "fa_amd", mode)), idx.get((label, "sdpa_cudnn", mode)), why))
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    # memory: fwd+bwd peak, relative to eager where eager ran
    out += ["\n### Peak memory of one forward + backward (MiB; x = relative to eager)\n",
            "| shape | " + " | ".join(bwd_methods) + " |", "|---" * (len(bwd_methods) + 1) + "|"]
    for label in labels:
        eager = idx.get((label, "eager", "fwd+bwd"))
        cells = []
        for m in bwd_methods:
            r = idx.get((label, m, "fwd+bwd"))
            if r is None or r.tflops is None:
                cells.append(_na("not run", why))
            elif r.peak_mib is None:
                cells.append(_na("no GPU", why))
            elif eager is not None and eager.peak_mib:
                cells.append(f"{r.peak_mib:.0f} ({r.peak_mib / eager.peak_mib:.2f}x)")
            else:
                cells.append(f"{r.peak_mib:.0f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(r.host_ms is not None for r in results):
        out += ["\n### Host vs GPU time of one forward + backward (ms: CPU time to issue it / GPU time from a "
                "CUDA graph replay; host >= GPU means that row measured the CPU)\n",
                "| shape | " + " | ".join(bwd_methods) + " |", "|---" * (len(bwd_methods) + 1) + "|"]
        for label in labels:
            cells = []
            for m in bwd_methods:
                r = idx.get((label, m, "fwd+bwd"))
                if r is None or r.host_ms is None:
                    cells.append(_na("not run", why))
                else:
                    graph = (f"{r.graph_ms:.3f}" if r.graph_ms is not None
                             else _na("no GPU" if r.peak_mib is None else "no graph", why))
                    cells.append(f"{r.host_ms:.3f} / " + graph)
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += fp8_speedup_lines(results)
    if why:
        out += ["\n" + "; ".join(f"n/a ({key}): {NA_REASONS[key]}" for key in sorted(why)) + "."]
    notes = sorted({f"{r.method}: {r.note[5:]}" for r in results if r.note.startswith("n/a")})
    if notes:
        out += ["\nn/a reasons (TFLOP/s cells):\n"] + [f"- {n}" for n in notes]
    return "\n".join(out + route_lines)


# the peers fa_amd is meant to beat (the other Triton / FA2-class kernels); cuDNN is the stretch goal
RIVALS = ("flex", "sdpa_flash", "flash_attn")


def trailing_rows(results: List[Result]) -> List[str]:
    """One line per (shape, mode) where a rival beat fa_amd in this run, with both numbers."""
    idx = {(r.label, r.method, r.mode): r for r in results if r.tflops is not None}
    lines = []
    for label in dict.fromkeys(r.label for r in results):
        for mode in ("fwd", "fwd+bwd"):
            ours = idx.get((label, "fa_amd", mode))
            if ours is None:
                continue
            ahead = [f"{m} {idx[(label, m, mode)].tflops:.0f}" for m in RIVALS
                     if (label, m, mode) in idx and idx[(label, m, mode)].tflops > ours.tflops]
            if ahead:
                lines.append(f"- {label}, {mode}: fa_amd {ours.tflops:.0f} < " + ", ".join(ahead))
    return lines


def _timing_sentence(payload: Dict) -> str:
    rounds = payload.get("rounds")
    if not rounds or rounds == 1:
        return "Times are triton.testing.do_bench medians."
    warm = payload.get("round_warm_ms")
    warm_text = f"after ~{warm} ms of the method's own untimed calls, " if warm else ""
    return (f"Times: per shape, every method's forward and forward+backward are timed in {rounds} interleaved "
            f"rounds (each round starts with another method) of {payload.get('round_ms', ROUND_REP_MS)} ms of calls, "
            f"{warm_text}at least {MIN_CALLS_PER_ROUND}, each after an L2 flush, with CUDA events (the method of "
            "triton.testing.do_bench); a round reports its median call and the table the median round.")


def markdown_doc(payload: Dict, plot_file: Optional[str] = None) -> str:
    env = payload["environment"]
    results = [Result(**r) for r in payload["results"]]
    trailing = trailing_rows(results)
    summary = (["\n### Where fa_amd trails a rival (" + ", ".join(RIVALS) + ")\n"]
               + (trailing or ["- nowhere in this run"]))
    figure = [f"\n![TFLOP/s per sequence length, dense rows]({plot_file})"] if plot_file else []
    return "\n".join([
        "# Performance", "",
        f"Measured by `fa-amd bench` on **{env.get('gpu')}** ({env.get('arch')}, {env.get('runtime', '')}), "
        f"torch {env['torch']}, triton {env['triton']}, dtype {payload['dtype']}, {env['date']}.", "",
        f"Dense rows hold batch x seqlen = {TOKENS} tokens and heads x head_dim = {HIDDEN} ({HIDDEN} // d heads "
        f"at d{' / d'.join(map(str, BETWEEN_HEAD_DIMS))}); GQA rows use 16 query "
        f"/ 4 KV heads at d128; the varlen row packs {len(VARLEN_DOCS)} documents of 64..2048 tokens "
        f"({TOKENS} tokens, causal). FLOPs: forward 4*b*h*sq*sk*d, halved for causal, summed per document for "
        "varlen; forward+backward counts 3.5x the forward. " + _timing_sentence(payload) + " "
        "Peers run in the same process: torch SDPA per backend, FlexAttention (torch.compile), flash_attn if "
        "installed, and eager PyTorch (skipped where its score matrices would not fit).", "",
        "Regenerate: `fa-amd bench --out bench_out --markdown docs/PERFORMANCE.md` (or "
        "`fa-amd bench --from-json bench_out/results.json --markdown docs/PERFORMANCE.md`).",
        markdown_tables(results), *summary, *figure, ""])


def write_plot(payload: Dict, results: List[Result], path: str) -> bool:
    """The TFLOP/s plot of this run at `path`; False (with a note) without matplotlib or dense rows."""
    env = payload["environment"]
    try:
        return plot(results, path, f"{env.get('gpu')} {payload['dtype']} torch {env['torch']} triton {env['triton']}")
    except ImportError:
        print("note: matplotlib not installed; no plot (pip install fa-amd[bench])")
        return False


def plot(results: List[Result], path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [r for r in results if r.kind == "dense" and r.tflops is not None]
    panels = sorted({(r.shape["head_dim"], r.shape["causal"]) for r in dense})
    if not panels:
        return False
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 6.5), squeeze=False)
    for col, (d, causal) in enumerate(panels):
        for row, mode in enumerate(("fwd", "fwd+bwd")):
            ax = axes[row][col]
            for method in METHODS + FP8_METHODS:
                pts = sorted((r.shape["seqlen"], r.tflops) for r in dense
                             if r.method == method and r.mode == mode and r.shape["head_dim"] == d
                             and r.shape["causal"] == causal)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} d{d} {'causal' if causal else 'full'}", fontsize=9)
            ax.set_xlabel("seqlen")
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser):
    parser.description = __doc__.split("\n\n")[0]
    parser.epilog = ("Cells read 'n/a (reason)': 'not run' (the method cannot run that shape; the reason is listed "
                     "under the tables), 'no GPU' (peak memory and CUDA-graph time need a CUDA/ROCm device, so "
                     "--smoke on CPU has none), 'no graph' (the call could not be captured in a CUDA graph).")
    parser.add_argument("--quick", action="store_true", help="a few rows (d128, two seqlens, one GQA, varlen)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (seqlen 64-96, d32), fa_amd + SDPA + eager, one round: a CPU check "
                             "that the bench runs (what CI does, under TRITON_INTERPRET=1); times are the "
                             "interpreter's and memory / graph cells read n/a (no GPU)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                        help="input dtype (default bf16; use fp16 on MI100 / gfx908)")
    parser.add_argument("--methods", nargs="+", choices=METHODS + FP8_METHODS, default=None,
                        help="methods to run (default: all; --smoke: fa_amd sdpa_flash eager); unavailable "
                             "ones print n/a with the reason")
    parser.add_argument("--fp8", action="store_true",
                        help="the FP8 rows instead: d128 shapes, fa_amd's FP8 forward (FA3-style inputs, and "
                             "flash_attn_fp8_func) vs its bf16 forward and torch's FP8 attention where it has one")
    parser.add_argument("--out", metavar="DIR", help="write results.json, bench.png and bench.md here (a run cut "
                                                     "short leaves results.partial.json)")
    parser.add_argument("--markdown", metavar="PATH", help="write a performance doc (e.g. docs/PERFORMANCE.md)")
    parser.add_argument("--host-time", action="store_true",
                        help="also measure, per forward+backward, the CPU time to issue one call and the GPU "
                             "time of one call replayed from a CUDA graph: says which rows are bound by the CPU")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"interleaved timing rounds per shape (default {ROUNDS}; 1 with --smoke); each "
                             f"(method, mode) reports its median round of {ROUND_REP_MS} ms of calls")
    parser.add_argument("--head-dims", nargs="+", type=int, choices=HEAD_DIMS + BETWEEN_HEAD_DIMS, default=None,
                        help="only these dense head dims (GQA and varlen rows come with 128); "
                             "to split a long run, then merge the parts with --from-json")
    parser.add_argument("--seqlens", nargs="+", type=int, choices=sorted(set(SEQLENS + BETWEEN_SEQLENS)),
                        default=None, help="only the dense rows of these sequence lengths (no GQA / varlen rows)")
    parser.add_argument("--no-sdpa-route", action="store_true",
                        help="skip the SDPA route row (a model calling F.scaled_dot_product_attention, timed as "
                             "torch runs it, with SDPA's math backend, and inside fa_amd.sdpa_route())")
    parser.add_argument("--only", choices=("sdpa-route",), default=None,
                        help="run only these rows: 'sdpa-route' times the SDPA route row alone (no kernel "
                             "shapes; --dtype and --rounds apply), the quick way to that number on a GPU")
    parser.add_argument("--from-json", metavar="PATH", nargs="+",
                        help="do not run; report results.json files from earlier runs (several: merged, "
                             "all from one GPU)")
    # decode side (fa_amd/bench_decode.py): run instead of the prefill rows when given
    parser.add_argument("--decode", action="store_true",
                        help="KV-cache decode rows instead: batch {1,8,64} x cache {2k,8k,32k,128k}, GQA 32/8, d128; "
                             "KV GB/s and us vs SDPA, FlexAttention, flash_attn")
    parser.add_argument("--generate", action="store_true",
                        help="HF generate() new tokens/s, fa_amd vs sdpa (Dynamic and Static cache), interleaved rounds")
    parser.add_argument("--generate-padded", action="store_true",
                        help="with --generate: a left-padded batch (prompts of different lengths in one batch)")
    parser.add_argument("--generate-rounds", type=int, default=None, metavar="N",
                        help="interleaved rounds of --generate (default: 7; 1 with --smoke): each is ~1 s of "
                             "host-bound work whose round-to-round spread is wider than the decode rows'")
    parser.add_argument("--decode-methods", nargs="+", choices=("fa_amd", "sdpa", "flex", "flash_attn"),
                        default=None, help="peers of the --decode rows (default: all)")
    parser.add_argument("--decode-rows", nargs="+", metavar="BxCACHE", default=None,
                        help="only these --decode rows, e.g. 1x2048 64x131072 (to split a long run)")
    parser.add_argument("--hbm-peak-gbs", type=float, default=None,
                        help="HBM peak of this GPU in GB/s for the --decode %% column (known GPUs: detected)")


def _read_json(path: str) -> Dict:
    with open(path) as f:
        return json.load(f)


def read_results_json(path: str) -> Dict:
    """An earlier run's results.json; ValueError (one line) if `path` is not JSON or JSON of another kind."""
    try:
        payload = _read_json(path)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})")
    what = "not a results.json of `fa-amd bench`"
    if not isinstance(payload, dict):
        raise ValueError(f"{what} (a JSON {type(payload).__name__}, not an object)")
    # the JSON files of the other commands, named so the user sees which they passed
    if "decode" in payload or "generate" in payload:
        what += " (it is a --decode / --generate decode.json)"
    elif "wall_seconds" in payload:
        what += " (it is a `fa-amd compile --json` file)"
    missing = [key for key in ("environment", "dtype", "results") if key not in payload]
    env = payload.get("environment")
    missing += [f"environment.{key}" for key in ("torch", "triton", "date") if isinstance(env, dict) and key not in env]
    if missing or not isinstance(env, dict):
        raise ValueError(f"{what}: no {', '.join(missing) or 'environment object'}")
    try:
        for row in payload["results"]:
            Result(**row)  # (the report builds these; a wrong row is a TypeError there)
    except TypeError as exc:
        raise ValueError(f"{what}: its results are not result rows ({exc})")
    return payload


def merge_payloads(payloads: List[Dict]) -> Dict:
    """One report from runs split by --head-dims: same GPU, software and dtype required."""
    first = payloads[0]
    for other in payloads[1:]:
        for key in ("gpu", "torch", "triton"):
            if other["environment"].get(key) != first["environment"].get(key):
                raise ValueError(f"parts differ in {key}: {first['environment'].get(key)} vs "
                                 f"{other['environment'].get(key)}")
        if other["dtype"] != first["dtype"]:
            raise ValueError(f"parts differ in dtype: {first['dtype']} vs {other['dtype']}")
    if len(payloads) == 1:
        return first
    env = dict(first["environment"])
    env["date"] = " .. ".join(sorted({p["environment"]["date"] for p in payloads}))
    return {"environment": env, "dtype": first["dtype"], "seconds": sum(p.get("seconds", 0.0) for p in payloads),
            "rounds": first.get("rounds"), "round_ms": first.get("round_ms"),
            "round_warm_ms": first.get("round_warm_ms"), "results": [r for p in payloads for r in p["results"]]}


def _given(args, *options) -> List[str]:
    """The options of `options` ("--name") set on the command line (not left at their None / False default)."""
    values = [getattr(args, opt[2:].replace("-", "_"), None) for opt in options]
    return [opt for opt, value in zip(options, values) if value is not None and value is not False]


def run_cli(args) -> int:
    # options that one side of the bench would silently ignore are errors
    decode_only = _given(args, "--decode-rows", "--decode-methods", "--hbm-peak-gbs")
    if decode_only and not getattr(args, "decode", False):
        print(f"error: {', '.join(decode_only)} {'applies' if len(decode_only) == 1 else 'apply'} to the decode rows: "
              f"{'it needs' if len(decode_only) == 1 else 'they need'} --decode", file=sys.stderr)
        return 2
    generate_only = _given(args, "--generate-padded", "--generate-rounds")
    if generate_only and not getattr(args, "generate", False):
        print(f"error: {', '.join(generate_only)} {'applies' if len(generate_only) == 1 else 'apply'} to the "
              f"generate() rows: {'it needs' if len(generate_only) == 1 else 'they need'} --generate", file=sys.stderr)
        return 2
    if getattr(args, "decode", False) or getattr(args, "generate", False):
        prefill_only = _given(args, "--only", "--quick", "--methods", "--fp8", "--host-time", "--head-dims",
                              "--seqlens", "--no-sdpa-route", "--from-json")
        if prefill_only:
            print(f"error: {', '.join(prefill_only)} {'picks' if len(prefill_only) == 1 else 'pick'} prefill-side "
                  f"rows; {'it does' if len(prefill_only) == 1 else 'they do'} not combine with --decode / --generate",
                  file=sys.stderr)
            return 2
        from . import bench_decode

        return bench_decode.run_cli(args)
    if args.from_json:
        payloads = []
        for path in args.from_json:
            try:
                payloads.append(read_results_json(path))
            except (OSError, ValueError) as exc:
                print(f"error: cannot use {path}: {exc}", file=sys.stderr)
                return 2
        try:
            payload = merge_payloads(payloads)
        except ValueError as exc:
            print(f"error: cannot use {' '.join(args.from_json)}: {exc}", file=sys.stderr)
            return 2
    else:
        route_only = args.only == "sdpa-route"
        if route_only and (args.no_sdpa_route or args.fp8 or args.methods or args.quick or args.head_dims
                           or args.seqlens or args.host_time):
            print("error: --only sdpa-route runs the SDPA route row alone; it takes --dtype, --rounds, --smoke, "
                  "--out and --markdown, not --no-sdpa-route, --fp8, --methods, --quick, --head-dims, --seqlens "
                  "or --host-time", file=sys.stderr)
            return 2
        picked = _given(args, "--head-dims", "--seqlens")
        own = "--smoke" if args.smoke else "--fp8" if args.fp8 else None
        if picked and own and not route_only:  # the smoke and FP8 rows are shapes of their own
            print(f"error: {' and '.join(picked)} {'picks' if len(picked) == 1 else 'pick'} rows of the prefill "
                  f"sweep; {own} runs its own shapes and does not take {'it' if len(picked) == 1 else 'them'}",
                  file=sys.stderr)
            return 2
        if picked and not own and not route_only and not shapes(args.quick, False, args.head_dims, args.seqlens):
            asked = " ".join(f"{opt} {' '.join(map(str, getattr(args, opt[2:].replace('-', '_'))))}" for opt in picked)
            print(f"error: no benchmark row matches {asked}{' with --quick' if args.quick else ''} (--quick runs "
                  f"d128 at seqlen 1024 and 4096; the d96 / d192 rows have seqlen "
                  f"{', '.join(map(str, BETWEEN_SEQLENS))})", file=sys.stderr)
            return 2
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and not args.smoke:
            print("error: no GPU found; `fa-amd bench` needs one (use --smoke with TRITON_INTERPRET=1 on CPU)",
                  file=sys.stderr)
            return 2
        if device == "cpu" and not interpreter_on():
            print(NO_INTERPRETER_ERROR, file=sys.stderr)
            return 2
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        methods = args.methods or (("fa_amd", "sdpa_flash", "eager") if args.smoke else METHODS)
        if args.fp8 and not args.methods:
            methods = FP8_DEFAULT_METHODS
        env = environment(device)
        print(f"fa-amd bench on {device_text(env)}, torch {env['torch']}, triton {env['triton']}, {args.dtype}")
        start = time.perf_counter()
        rounds = args.rounds if args.rounds is not None else (1 if args.smoke else ROUNDS)
        if rounds < 1:
            print(f"error: --rounds must be >= 1, got {rounds}", file=sys.stderr)
            return 2

        def payload_of(results):
            return {"environment": env, "dtype": args.dtype, "seconds": time.perf_counter() - start,
                    "rounds": rounds, "round_ms": ROUND_REP_MS,
                    "round_warm_ms": None if args.smoke else ROUND_WARM_MS, "results": [asdict(r) for r in results]}

        def checkpoint(results):  # results.partial.json: what a run cut short had measured
            with open(os.path.join(args.out, "results.partial.json"), "w") as f:
                json.dump(payload_of(results), f, indent=1)

        if args.out:
            os.makedirs(args.out, exist_ok=True)
        results = run(methods, dtype, device, quick=args.quick, smoke=args.smoke, head_dims=args.head_dims,
                      seqlens=args.seqlens,
                      host_time=args.host_time, rounds=rounds, checkpoint=checkpoint if args.out else None,
                      sdpa_route=not (args.no_sdpa_route or args.fp8), fp8=args.fp8, kernel_rows=not route_only)
        payload = payload_of(results)
        if args.out and os.path.exists(os.path.join(args.out, "results.partial.json")):
            os.remove(os.path.join(args.out, "results.partial.json"))
    results = [Result(**r) for r in payload["results"]]
    print(markdown_tables(results))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(payload, f, indent=1)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(markdown_doc(payload))
        if write_plot(payload, results, os.path.join(args.out, "bench.png")):
            print(f"plot: {os.path.join(args.out, 'bench.png')}")
        print(f"results: {args.out}/results.json, {args.out}/bench.md")
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        # the plot goes next to the doc (docs/PERFORMANCE.md -> docs/PERFORMANCE.png), linked from it
        plot_path = os.path.splitext(args.markdown)[0] + ".png"
        drawn = os.path.join(args.out, "bench.png") if args.out else None
        if drawn and os.path.exists(drawn):
            shutil.copyfile(drawn, plot_path)  # the same figure: draw it once
            plotted = True
        else:
            plotted = write_plot(payload, results, plot_path)
        with open(args.markdown, "w") as f:
            f.write(markdown_doc(payload, os.path.basename(plot_path) if plotted else None))
        print(f"wrote {args.markdown}" + (f" and {plot_path}" if plotted else ""))
    fa_rows = [r for r in results if r.method == "fa_amd"]
    if fa_rows and all(r.ms is None for r in fa_rows):
        print("error: every fa_amd measurement failed", file=sys.stderr)
        return 1
    route_rows = [r for r in results if r.kind == SDPA_ROUTE_KIND and r.method == "fa_amd route"]
    if getattr(args, "only", None) == "sdpa-route" and not any(r.ms is not None for r in route_rows):
        print("error: the fa_amd route measurement failed", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fa-amd bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
