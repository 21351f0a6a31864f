"""The launches the AOT check (fa_amd.aot) builds: what the launchers really launch.

Each job runs the real launcher (attention_forward, attention_backward, the rotary launcher) on a
small CPU Problem with the job's dtype, head dim and features, as if on the target GPU (its arch,
its default table entries as the installed Triton resolves them, tuned tables ignored), with a
recording stand-in for the launcher module's @triton.jit kernels; `launch_call` returns the
recorded `kernel[grid](*args, **kwargs)` call, which fa_amd.aot compiles.

Adding a kernel (decode, an FP8 variant, ...): write a `_run_*` function that calls its launcher
on a Problem (or reuse one), and add one LAUNCHES entry naming the @triton.jit function to build
and the launcher switches to set; fa_amd.aot.builds says where it runs, if not everywhere.  Its
arguments, dtypes and launch options then come from the launcher itself.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

# target name -> (backend, arch passed to GPUTarget, warp size)
TARGETS = {
    "gfx908": ("hip", "gfx908", 64),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "gfx1100": ("hip", "gfx1100", 32),
    # RDNA parts that run the gfx1100 rows (tables.FAMILY_ALIASES): RDNA3 gfx1101/gfx1102, RDNA4 gfx1200/gfx1201
    "gfx1101": ("hip", "gfx1101", 32),
    "gfx1102": ("hip", "gfx1102", 32),
    "gfx1200": ("hip", "gfx1200", 32),
    "gfx1201": ("hip", "gfx1201", 32),
    "sm80": ("cuda", 80, 32),
    "sm90": ("cuda", 90, 32),
}
_DKDV_KERNELS = ("dkdv", "dkdv_atomic", "dkdv_fused")
ALL_FLAGS = dict(IS_VARLEN=True, IS_SOFTCAP=True, HAS_ALIBI=True, HAS_LEFT=True, HAS_RIGHT=True, HAS_DROPOUT=True)
# feature sets of the launches built (Problem reads them); "all" is the heaviest
VARIANTS = {
    "plain": dict(GROUP=1),
    "causal": dict(GROUP=1, HAS_RIGHT=True),
    "all": dict(GROUP=2, **ALL_FLAGS),
    # every feature but the right edge, with at most tables.SHORT_SEQLEN_K keys per row: the tile of
    # the entry's "short" override; built only for entries that have one
    "short": dict(GROUP=2, **{k: v for k, v in ALL_FLAGS.items() if k != "HAS_RIGHT"}),
    # "all" with the GQA group split over dK/dV programs (kernels.backward.dkdv_heads_per_program):
    # fp32 partial (or atomically summed) dK/dV buffers; dK/dV kernels only
    "split": dict(GROUP=2, SPLIT=True, **ALL_FLAGS),
}

@dataclass
class Problem:
    """The inputs of one launch: a small CPU problem with a job's dtype, head dim and features."""
    dtype: str
    head_dim: int
    group: int = 1  # query heads per KV head
    varlen: bool = False
    softcap: bool = False
    alibi: bool = False
    left: bool = False  # sliding window: left edge
    right: bool = False  # right edge (causal)
    dropout: bool = False
    short: bool = False  # at most tables.SHORT_SEQLEN_K keys per row
    split: bool = False  # GQA groups split over dK/dV programs
    variant: str = "plain"

    @classmethod
    def of(cls, job) -> "Problem":
        f = VARIANTS[job.variant]
        return cls(job.dtype, job.head_dim, f.get("GROUP", 1), f.get("IS_VARLEN", False), f.get("IS_SOFTCAP", False),
                   f.get("HAS_ALIBI", False), f.get("HAS_LEFT", False), f.get("HAS_RIGHT", False),
                   f.get("HAS_DROPOUT", False), job.variant == "short", f.get("SPLIT", False), job.variant)


_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _attention_inputs(p: Problem) -> Dict[str, Any]:
    """Arguments of attention_forward for the problem (as fa_amd.interface normalizes them).
    Lengths: 2 * SHORT_SEQLEN_K keys (2 * 1024, a typical training length), or SHORT_SEQLEN_K for
    "short" launches; varlen packs a second, ragged sequence."""
    import torch

    from .tuning import tables

    dtype = getattr(torch, _TORCH_DTYPES[p.dtype])
    seqlen = tables.SHORT_SEQLEN_K * (1 if p.short else 2)
    hk = 2
    hq = hk * p.group
    if p.varlen:
        lens = (seqlen, seqlen // 2 + 3)
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
        shape_q = (sum(lens), hq, p.head_dim)
    else:
        cu = None
        shape_q = (2, seqlen, hq, p.head_dim)
    q = torch.zeros(shape_q, dtype=dtype)
    k = torch.zeros(shape_q[:-2] + (hk, p.head_dim), dtype=dtype)
    return dict(q=q, k=k, v=torch.zeros_like(k), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen,
                max_seqlen_k=seqlen, dropout_p=0.1 if p.dropout else 0.0, softmax_scale=p.head_dim ** -0.5,
                window_left=seqlen // 4 - 1 if p.left else -1, window_right=0 if p.right else -1,
                softcap=30.0 if p.softcap else 0.0,
                alibi_slopes=torch.rand(hq, dtype=torch.float32) if p.alibi else None,
                rng_state=torch.tensor([1234, 5678], dtype=torch.int64) if p.dropout else None)


def _run_forward(p: Problem, return_probs: bool = False):
    from .kernels.forward import attention_forward

    attention_forward(**_attention_inputs(p), return_probs=return_probs)


def _run_backward(p: Problem, deterministic: bool = True):
    import torch

    from .kernels.backward import attention_backward

    a = _attention_inputs(p)
    q = a.pop("q")
    lse_shape = (q.shape[1], q.shape[0]) if p.varlen else (q.shape[0], q.shape[2], q.shape[1])
    attention_backward(dout=torch.zeros_like(q), q=q, out=torch.zeros_like(q), lse=torch.zeros(lse_shape),
                       deterministic=deterministic, **a)


def _run_rotary(p: Problem):
    """The fused RoPE kernel: rotate-half over the whole head ("plain"), or interleaved over part of
    it, backward (any other variant)."""
    import torch

    from .kernels.rotary import rotary_backward, rotary_forward

    dtype = getattr(torch, _TORCH_DTYPES[p.dtype])
    x = torch.zeros(2, 1024, 8, p.head_dim, dtype=dtype)
    plain = p.variant == "plain"
    cos = torch.zeros(1, 1024, p.head_dim if plain else p.head_dim // 2, dtype=dtype)
    if plain:
        rotary_forward(x, cos, cos)
    else:
        rotary_backward(x, cos, cos, interleaved=True)


@dataclass(frozen=True)
class Launch:
    """How the check gets one kernel's launch: `run(problem, **run_kwargs)` calls the real launcher;
    `kernel_fn` is the @triton.jit function (in fa_amd.kernels.<module>) whose call is built; `hooks`
    are launcher test switches ("module.NAME": value) set meanwhile; `table_kernel` the table
    entry its tiles come from (None: a fixed launch)."""
    module: str
    kernel_fn: str
    run: Callable
    run_kwargs: Dict = field(default_factory=dict)
    hooks: Dict = field(default_factory=dict)
    table_kernel: Optional[str] = None


_BWD = "backward.BWD_DQ_MODE"
LAUNCHES = {
    "fwd": Launch("forward", "attn_fwd_kernel", _run_forward, table_kernel="fwd"),
    "probs": Launch("forward", "attn_probs_kernel", _run_forward, dict(return_probs=True), table_kernel="fwd"),
    "preprocess": Launch("backward", "bwd_preprocess_kernel", _run_backward, hooks={_BWD: "separate"}),
    # deterministic=True with the dQ programs in their own launch (AMD; sm90 when not fusable)
    "dkdv": Launch("backward", "attn_bwd_dkdv_kernel", _run_backward, hooks={_BWD: "separate"}, table_kernel="dkdv"),
    "dq": Launch("backward", "attn_bwd_dq_kernel", _run_backward, hooks={_BWD: "separate"}, table_kernel="dq"),
    # deterministic=False (flash-attn's default) where the tables choose atomic dQ / fused dQ programs
    "dkdv_atomic": Launch("backward", "attn_bwd_dkdv_kernel", _run_backward, dict(deterministic=False),
                          {_BWD: "atomic"}, "dkdv_atomic"),
    "dkdv_fused": Launch("backward", "attn_bwd_dkdv_kernel", _run_backward, dict(deterministic=False),
                         {_BWD: "fused"}, "dkdv"),
    "rotary": Launch("rotary", "_rotary_kernel", _run_rotary),
}


# --------------------------------------------------------------------------- FP8 launches (issue 18)
# FP8 is a dtype path of the forward and decode kernels (fa_amd.fp8): the same @triton.jit functions
# built with the target's FP8 type (tables.FP8_DTYPES, first entry) for q, k, v / the KV cache, their
# descales and an output in the job's dtype.  Built only where the target has an FP8 dot and the
# installed triton reaches tables.FP8_MIN_TRITON (fa_amd.aot.builds).
#   fwd_fp8       attn_fwd_kernel, FA3-style FP8 q, k, v (V laid out as fa_amd.fp8 lays it out)
#   decode_fp8    decode_kernel, FP8 q over an FP8 KV cache (both products in FP8)
#   decode_fp8kv  decode_kernel, a job-dtype q over an FP8 KV cache (K, V widened in the kernel)
#   append_fp8    kv_append_kernel, job-dtype new k/v quantised into an FP8 cache
#   amax_fp8, cast_fp8  the quantising functions' two passes (kernels/quantize.py)
# Variants: "plain" dense cache, int cache_seqlens; "causal" tensor cache_seqlens, causal, 17 query
# tokens (chunked prefill on a cache: the "wide" tile); "all" paged cache, GQA 2, cache_leftpad,
# window, softcap, ALiBi, rotary, sinks and key splits (the decode kernels; the append takes the
# paged cache and rotary).

def _fp8_dtype_of(module):
    """The FP8 type of the target a launcher module runs as while recorded (its arch_for is the
    target's then: _as_on)."""
    import torch

    from .tuning import fp8_dtype_names

    return getattr(torch, fp8_dtype_names(module.arch_for(None))[0])


def _run_forward_fp8(p: Problem):
    import torch

    from . import fp8
    from .kernels import forward

    a = _attention_inputs(p)
    fp8_dtype = _fp8_dtype_of(forward)
    q, k, v = (a.pop(n).to(fp8_dtype) for n in "qkv")
    v = fp8._v_layout(v, p.varlen, forward.arch_for(None))
    batch = 2 if p.varlen else q.shape[0]
    descale = torch.ones(batch, q.shape[-2], 3, dtype=torch.float32)
    forward.attention_forward(q, k, v, **a, return_probs=False, descale=descale,
                              out_dtype=getattr(torch, _TORCH_DTYPES[p.dtype]))


def _decode_inputs(p: Problem, q_fp8: bool):
    """decode_forward's arguments for an FP8 KV cache (variants: the block above)."""
    import torch

    from .kernels import decode

    fp8_dtype = _fp8_dtype_of(decode)
    dtype = getattr(torch, _TORCH_DTYPES[p.dtype])
    everything = p.variant == "all"
    batch, hk, d, cache = 2, 2, p.head_dim, 2048
    hq = hk * p.group
    seqlen_q = 17 if p.variant == "causal" else 1  # "causal": more than DECODE_WIDE_ROWS rows, the wide tile
    q = torch.zeros(batch, seqlen_q, hq, d, dtype=fp8_dtype if q_fp8 else dtype)
    kw = dict(q=q, softmax_scale=d ** -0.5, window_left=cache // 4 - 1 if p.left else -1,
              window_right=0 if p.right else -1, softcap=30.0 if p.softcap else 0.0,
              alibi_slopes=torch.rand(hq) if p.alibi else None,
              descale=torch.ones(batch, hk, 3, dtype=torch.float32), out_dtype=dtype)
    if everything:
        page = 64
        kw.update(k_cache=torch.zeros(batch * cache // page, page, hk, d, dtype=fp8_dtype),
                  block_table=torch.arange(batch * cache // page, dtype=torch.int32).view(batch, -1),
                  cache_leftpad=torch.zeros(batch, dtype=torch.int32),
                  rotary_cos=torch.zeros(cache, d // 4), rotary_sin=torch.zeros(cache, d // 4),
                  rotary_interleaved=True, rotary_per_token=True, num_splits=4,
                  sinks=torch.zeros(hq, dtype=torch.float32))
    else:
        kw.update(k_cache=torch.zeros(batch, cache, hk, d, dtype=fp8_dtype))
    kw["v_cache"] = torch.zeros_like(kw["k_cache"])
    if p.variant == "plain":
        kw.update(cache_seqlens_int=cache - 1, seqlen_new=1)
    else:
        kw.update(cache_seqlens=torch.full((batch,), cache // 2, dtype=torch.int32), seqlen_new=1)
    return kw


def _run_decode_fp8(p: Problem, q_fp8: bool = True):
    from .kernels import decode

    decode.decode_forward(**_decode_inputs(p, q_fp8))


def _run_append_fp8(p: Problem):
    import torch

    from .kernels import decode
    from .tuning import get_decode_config

    kw = _decode_inputs(p, q_fp8=False)
    dtype = getattr(torch, _TORCH_DTYPES[p.dtype])
    batch, hk, d = 2, kw["k_cache"].shape[2], p.head_dim
    new = torch.zeros(batch, 1, hk, d, dtype=dtype)
    cfg = get_decode_config(decode.arch_for(None), decode.head_dim_padded(d), p.dtype == "fp32")["append"]
    decode.kv_append(new, torch.zeros_like(new), kw["k_cache"], kw["v_cache"], kw.get("cache_seqlens"),
                     kw.get("cache_seqlens_int"), None, kw.get("block_table"), kw.get("rotary_cos"),
                     kw.get("rotary_sin"), True, cfg, kw["descale"])


def _run_quantize_fp8(p: Problem, relayout: bool = False):
    """The quantising functions' quantisation (kernels/quantize.py) of a job-dtype tensor: "all" quantises
    V dense, token-major where the target's forward reads it so (the cast's transposing store), "causal"
    varlen (the tail row past cu_seqlens[-1]), "plain" dense in the usual layout -- or, with `relayout`
    on a token-major target, the unscaled cast that copies an FA3-style FP8 V token-major."""
    from . import fp8
    from .kernels import quantize

    a = _attention_inputs(Problem(p.dtype, p.head_dim, varlen=p.variant == "causal"))
    v, fp8_dtype = a["v"], _fp8_dtype_of(quantize)
    token_major = fp8._token_major(quantize.arch_for(None), False, v.shape[1], v.shape[-1])
    if relayout and token_major and p.variant == "plain":
        fp8.token_major_copy(v.to(fp8_dtype))
        return
    fp8.quantize_fp8(v, fp8_dtype, a["cu_seqlens_k"], token_major=token_major and p.variant == "all",
                     max_seqlen=a["max_seqlen_k"])


FP8_LAUNCHES = {
    "fwd_fp8": Launch("forward", "attn_fwd_kernel", _run_forward_fp8, table_kernel="fwd"),
    "decode_fp8": Launch("decode", "decode_kernel", _run_decode_fp8),
    "decode_fp8kv": Launch("decode", "decode_kernel", _run_decode_fp8, dict(q_fp8=False)),
    "append_fp8": Launch("decode", "kv_append_kernel", _run_append_fp8),
    "amax_fp8": Launch("quantize", "fp8_amax_kernel", _run_quantize_fp8),
    "cast_fp8": Launch("quantize", "fp8_cast_kernel", _run_quantize_fp8, dict(relayout=True)),
}
LAUNCHES.update(FP8_LAUNCHES)


@dataclass
class LaunchCall:
    """One recorded `kernel[grid](*args, **kwargs)`."""
    kernel: str
    grid: tuple
    args: tuple
    kwargs: Dict


class _Recorder:
    """Stand-in for a @triton.jit kernel: records its launches instead of running them."""

    def __init__(self, name: str, calls: List[LaunchCall]):
        self.__name__ = name
        self.fn = self  # launch() names kernels by kernel.fn.__name__
        self._calls = calls

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self._calls.append(LaunchCall(self.__name__, tuple(grid), args, kwargs))
        return record


def _arch_of(target: str):
    from .arch import Arch

    if target == "cpu":  # the interpreter's table family (tests compare its launches with the public API's)
        return Arch("interpreter", "cpu", 32)
    backend, arch, warp = TARGETS[target]
    return Arch(backend, target if backend == "hip" else f"sm{arch}", warp)


@contextlib.contextmanager
def _as_on(target: str, modules, hooks: Dict, calls: List[LaunchCall]):
    """The launcher modules as they run on `target`: its arch and default tables (tuned tables
    ignored), their @triton.jit kernels replaced by recorders, `hooks` set; all restored after."""
    from triton.runtime.jit import KernelInterface

    from .tuning import tuned_table

    arch = _arch_of(target)
    changes = [(tuned_table, "load_tuned_table", lambda: {}), (tuned_table, "first_use_hook", None)]
    for mod in modules:
        for name, value in list(vars(mod).items()):
            if isinstance(value, KernelInterface):
                changes.append((mod, name, _Recorder(name, calls)))
        changes += [(mod, "arch_for", lambda t: arch)] if hasattr(mod, "arch_for") else []
        changes += [(mod, "num_sms", lambda t: 1)] if hasattr(mod, "num_sms") else []
    for path, value in hooks.items():
        mod_name, name = path.split(".")
        changes.append((importlib.import_module(f"fa_amd.kernels.{mod_name}"), name, value))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def launch_call(job) -> LaunchCall:
    """The call the launcher makes of job.kernel's @triton.jit function for the job's problem on its
    target (with job.config's tiles and options instead of the table's, if given)."""
    spec = LAUNCHES[job.kernel]
    p = Problem.of(job)
    calls: List[LaunchCall] = []
    # (quantize: the FP8 forward's V relayout runs its cast kernel before the launch; recorded, not run)
    modules = [importlib.import_module(f"fa_amd.kernels.{m}") for m in dict.fromkeys(("launch", "quantize",
                                                                                        spec.module))]
    hooks = dict(spec.hooks)
    if job.kernel in _DKDV_KERNELS and p.group > 1:  # whole groups per dK/dV program, or one head ("split")
        hooks["backward.DKDV_HEADS_PER_PROGRAM"] = 1 if p.split else p.group
    with _as_on(job.target, modules, hooks, calls):
        spec.run(p, **spec.run_kwargs)
    mine = [c for c in calls if c.kernel == spec.kernel_fn]
    if len(mine) != 1:
        raise RuntimeError(f"{job.target} {job.kernel} {job.name}: the launcher made {len(mine)} calls of "
                           f"{spec.kernel_fn} (calls: {[c.kernel for c in calls]})")
    call = mine[0]
    if job.config is not None:
        call = _with_config(spec, call, job.config)
    return call


def _with_config(spec: Launch, call: LaunchCall, cfg: Dict) -> LaunchCall:
    """The call with an explicit launch dict's tiles, switches and options instead of the table's."""
    from .tuning.tables import KERNEL_SWITCHES

    params = set(_kernel(spec).arg_names)
    kwargs = {k: v for k, v in call.kwargs.items() if k in params and k not in ("BLOCK_M", "BLOCK_N")}
    kwargs.update(KERNEL_SWITCHES)
    kwargs.update(cfg)
    return LaunchCall(call.kernel, call.grid, call.args, kwargs)


def _kernel(spec: Launch):
    return getattr(importlib.import_module(f"fa_amd.kernels.{spec.module}"), spec.kernel_fn)


def launch_config(spec: Launch, call: LaunchCall) -> Dict:
    """The launch dict of a call: tiles, kernel switches and compiler options (not other arguments)."""
    from .tuning.tables import KERNEL_SWITCHES

    params = set(_kernel(spec).arg_names)
    return {k: v for k, v in call.kwargs.items()
            if k not in params or k in ("BLOCK_M", "BLOCK_N") or k in KERNEL_SWITCHES}


