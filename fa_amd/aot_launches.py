"""The launches the AOT check (fa_amd.aot) builds: what the launchers really launch.

Each job runs the real launcher (attention_forward, attention_backward, the rotary launcher) on a
small CPU Problem with the job's dtype, head dim and features, as if on the target GPU (its arch,
its default table entries as the installed Triton resolves them, tuned tables ignored), with a
recording stand-in for the launcher module's @triton.jit kernels; `launch_call` returns the
recorded `kernel[grid](*args, **kwargs)` call, which fa_amd.aot compiles.

Adding a kernel (or a launch route of one): write a `_run_*` function that calls its launcher
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
    # every feature, short: the "short" override's own causal case (e.g. sm90's dK/dV DKDV_ONE_MASKED_LOOP)
    "short_causal": dict(GROUP=2, **ALL_FLAGS),
    # "all" with the GQA group split over dK/dV programs (kernels.backward.dkdv_heads_per_program):
    # fp32 partial (or atomically summed) dK/dV buffers; dK/dV kernels only
    "split": dict(GROUP=2, SPLIT=True, **ALL_FLAGS),
    # dense and causal at SHORT_SEQLEN_K keys, lengths whole blocks of every tile: the whole-block kernels
    # (EVEN_QK) of the families tables.EVEN_QK_FAMILIES lists -- forward, and the short masked backward; elsewhere
    # the same launch with its bounds.  The attention kernels only (WHOLE_KERNELS)
    "whole_causal": dict(GROUP=2, HAS_RIGHT=True),
    # the other routes into the decode kernels (DECODE_LAUNCHES below); decode kernels only
    "dense": dict(GROUP=2, IS_SOFTCAP=True, HAS_ALIBI=True, HAS_LEFT=True, HAS_RIGHT=True),
    "varlen": dict(GROUP=2, IS_VARLEN=True, IS_SOFTCAP=True, HAS_ALIBI=True, HAS_LEFT=True, HAS_RIGHT=True),
    "masked": dict(GROUP=2, IS_SOFTCAP=True, HAS_LEFT=True, HAS_RIGHT=True),
}
DECODE_ONLY_VARIANTS = ("dense", "varlen", "masked")
SHORT_VARIANTS = ("short", "short_causal")
WHOLE_VARIANTS = ("whole_causal",)
WHOLE_KERNELS = ("fwd", "dkdv", "dkdv_atomic", "dkdv_fused", "dq")

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
                   f.get("HAS_DROPOUT", False), job.variant in SHORT_VARIANTS + WHOLE_VARIANTS, f.get("SPLIT", False),
                   job.variant)


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
    entry its tiles come from (None: a fixed launch; "decode", "merge", "append": the entries of
    tables.DECODE_TABLES)."""
    module: str
    kernel_fn: str
    run: Callable
    run_kwargs: Dict = field(default_factory=dict)
    hooks: Dict = field(default_factory=dict)
    table_kernel: Optional[str] = None
    # other fa_amd.kernels modules the launcher may launch from (their kernels are recorded too, not run)
    also_records: tuple = ()


_BWD = "backward.BWD_DQ_MODE"
LAUNCHES = {
    "fwd": Launch("forward", "attn_fwd_kernel", _run_forward, table_kernel="fwd"),
    "probs": Launch("forward", "attn_probs_kernel", _run_forward, dict(return_probs=True), table_kernel="fwd"),
    # (the fused route: a dQ launch of its own may compute delta itself, tables.BWD_DELTA_IN_DQ_FAMILIES)
    "preprocess": Launch("backward", "bwd_preprocess_kernel", _run_backward, hooks={_BWD: "fused"}),
    # deterministic=True with the dQ programs in their own launch (AMD; sm90 when not fusable)
    "dkdv": Launch("backward", "attn_bwd_dkdv_kernel", _run_backward, hooks={_BWD: "separate"}, table_kernel="dkdv"),
    "dq": Launch("backward", "attn_bwd_dq_kernel", _run_backward, hooks={_BWD: "separate"}, table_kernel="dq"),
    # deterministic=False (flash-attn's default) where the tables choose atomic dQ / fused dQ programs
    "dkdv_atomic": Launch("backward", "attn_bwd_dkdv_kernel", _run_backward, dict(deterministic=False),
                          {_BWD: "atomic"}, "dkdv_atomic"),
    "dkdv_fused": Launch("backward", "attn_bwd_dkdv_kernel", _run_backward, dict(deterministic=False),
                         {_BWD: "fused"}, "dkdv"),
    "rotary": Launch("rotary", "_rotary_kernel", _run_rotary),
    # the V NaN rule of masked forwards: the pass over V before the forward, or the fix-up launch after it
    # (tables.FWD_NAN_FIXUP_FAMILIES); fa_amd.aot.builds says which a target runs
    "nan_flags": Launch("forward", "v_nan_flags_kernel", _run_forward),
    "nan_fixup": Launch("forward", "v_nan_fixup_kernel", _run_forward),
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
#   round_trip_fp8  fp8_cast_kernel as their backward runs it: q, k or v through FP8 and back (fp8.fp8_round_trip)
#   nan_flags_fp8 the V NaN pass before a masked FP8 forward, on families not in tables.FWD_NAN_FIXUP_FAMILIES
#                 (none of the FP8 targets here: their FP8 forwards mark V's NaNs themselves, built as fwd_fp8)
# Variants: "plain", "causal" and "all" of the decode launches below (the same problems, with an FP8
# cache); the quantiser's: see _run_quantize_fp8.

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
    # FA3's descales: one per (batch, KV head) each, q's too (load_head_descales' Q_DESCALE_PER_KV_HEAD)
    descales = tuple(torch.ones(batch, k.shape[-2], dtype=torch.float32) for _ in range(3))
    forward.attention_forward(q, k, v, **a, return_probs=False, descales=descales,
                              out_dtype=getattr(torch, _TORCH_DTYPES[p.dtype]))


def _run_decode_fp8(p: Problem, q_fp8: bool = True):
    _run_decode(p, q_fp8=q_fp8, kv_fp8=True)


def _run_append_fp8(p: Problem):
    _run_append(p, kv_fp8=True)


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


def _run_round_trip_fp8(p: Problem):
    """The quantising functions' backward: V (dense, or varlen with "causal") through FP8 and back."""
    from . import fp8
    from .kernels import quantize

    a = _attention_inputs(Problem(p.dtype, p.head_dim, varlen=p.variant == "causal"))
    fp8.fp8_round_trip(a["v"], _fp8_dtype_of(quantize), a["cu_seqlens_k"], a["max_seqlen_k"])


FP8_LAUNCHES = {
    "fwd_fp8": Launch("forward", "attn_fwd_kernel", _run_forward_fp8, table_kernel="fwd"),
    # the FP8 forward's V NaN pass over its FP8 V (masked launches, families without the fix-up)
    "nan_flags_fp8": Launch("forward", "v_nan_flags_kernel", _run_forward_fp8),
    "decode_fp8": Launch("decode", "decode_kernel", _run_decode_fp8, table_kernel="decode"),
    "decode_fp8kv": Launch("decode", "decode_kernel", _run_decode_fp8, dict(q_fp8=False), table_kernel="decode"),
    "append_fp8": Launch("decode", "kv_append_kernel", _run_append_fp8, table_kernel="append"),
    "amax_fp8": Launch("quantize", "fp8_amax_kernel", _run_quantize_fp8),
    "cast_fp8": Launch("quantize", "fp8_cast_kernel", _run_quantize_fp8, dict(relayout=True)),
    "round_trip_fp8": Launch("quantize", "fp8_cast_kernel", _run_round_trip_fp8),
}


# --------------------------------------------------------------------------- decode launches (issue 14)
# The split-KV decode path (fa_amd/kernels/decode.py), recorded from its launchers decode_forward and
# kv_append with the arguments each public route gives them (fa_amd.kvcache: flash_attn_with_kvcache,
# flash_attn_varlen_func with block_table / seqused_k; the Transformers decode route of
# integrations/hf_attention.py), tiles from tables.DECODE_TABLES:
#   decode   decode_kernel: its "decode" entry, the "wide" override past DECODE_WIDE_ROWS rows per KV
#            head, the "fp32" one for fp32 inputs; on RELOAD_CHUNK rows (gfx1100) the launcher rotates
#            q first (the rotary kernel, recorded) and the kernel runs without ROTARY
#   merge    split_merge_kernel, after a split decode (the variants with key splits)
#   append   kv_append_kernel (the flash_attn_with_kvcache variants: "plain", "causal", "all", "dense")
# Variants (the FP8 kernels take "plain", "causal", "all"):
#   plain   dense cache, int cache_seqlens, one query token, MHA, 2 key splits (merge without sinks)
#   causal  dense cache, tensor cache_seqlens, causal, 17 query tokens appended and attending (chunked
#           prefill on a cache): more than DECODE_WIDE_ROWS rows, the "wide" tile; unsplit
#   all     paged cache, GQA 2, cache_leftpad, window, softcap, ALiBi, interleaved rotary per token,
#           sinks, 4 key splits (merge with sinks; the append: paged, rotary)
#   dense   flash_attn_with_kvcache's dense-cache features: cache_batch_idx, cache_leftpad, rotate-half
#           rotary per token, 2 query tokens appended (speculative decoding: the causal right edge is
#           live), GQA 2, window, softcap, ALiBi, sinks; unsplit (the sinks start the kernel's softmax)
#   varlen  flash_attn_varlen_func with block_table and seqused_k: varlen q (3 and 1 tokens), paged
#           keys of cu_seqlens_k lengths, GQA 2, causal, window, softcap, ALiBi, 4 key splits
#   masked  the Transformers decode route: a dense cache with cache_leftpad, a per-key mask (an
#           attention mask with holes), GQA 2, window, softcap, sinks, 2 key splits
_DECODE_SPLITS = {"plain": 2, "all": 4, "varlen": 4, "masked": 2}  # the others: unsplit


def _decode_inputs(p: Problem, q_fp8: bool = False, kv_fp8: bool = False) -> Dict[str, Any]:
    """decode_forward's arguments for the problem's variant (the block above): the job's dtype, or for
    an FP8 KV cache the target's FP8 type for the caches (and q when q_fp8), with their descales and an
    output in the job's dtype.  "seqlen_new": how many of the keys the call appended first (kv_append)."""
    import torch

    from .kernels import decode

    dtype = getattr(torch, _TORCH_DTYPES[p.dtype])
    fp8_dtype = _fp8_dtype_of(decode) if kv_fp8 else dtype
    v = p.variant
    batch, hk, d, cache = 2, 2, p.head_dim, 2048
    hq = hk * p.group
    seqlen_q = {"causal": 17, "dense": 2, "varlen": 3}.get(v, 1)
    kw = dict(softmax_scale=d ** -0.5, window_left=cache // 4 - 1 if p.left else -1,
              window_right=0 if p.right else -1, softcap=30.0 if p.softcap else 0.0,
              alibi_slopes=torch.rand(hq) if p.alibi else None, num_splits=_DECODE_SPLITS.get(v, 1))
    if kv_fp8:
        # (q, k, v) descales per (batch, KV head), read in place by the kernels; a high-precision q has none (a
        # ones view with strides 0, as fa_amd.fp8 passes it)
        q_descale = torch.ones(batch, hk) if q_fp8 else torch.ones(1).expand(batch, hk)
        kw.update(descale=(q_descale, torch.ones(batch, hk), torch.ones(batch, hk)), out_dtype=dtype)
    q_dtype = fp8_dtype if q_fp8 else dtype
    if v == "varlen":
        kw.update(q=torch.zeros(seqlen_q + 1, hq, d, dtype=q_dtype), max_seqlen_q=seqlen_q,
                  cu_seqlens_q=torch.tensor([0, seqlen_q, seqlen_q + 1], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, cache // 2, cache // 2 + 5], dtype=torch.int32),
                  seqused_k=torch.tensor([cache // 2, 5], dtype=torch.int32))
    else:
        kw["q"] = torch.zeros(batch, seqlen_q, hq, d, dtype=q_dtype)
    if v in ("all", "varlen"):
        page = 64
        kw.update(k_cache=torch.zeros(batch * cache // page, page, hk, d, dtype=fp8_dtype),
                  block_table=torch.arange(batch * cache // page, dtype=torch.int32).view(batch, -1))
    else:
        kw["k_cache"] = torch.zeros(batch + (v == "dense"), cache, hk, d, dtype=fp8_dtype)
    kw["v_cache"] = torch.zeros_like(kw["k_cache"])
    if v in ("all", "dense", "masked"):
        kw.update(cache_leftpad=torch.zeros(batch, dtype=torch.int32), sinks=torch.zeros(hq, dtype=torch.float32))
    if v in ("all", "dense"):  # flash-attn's (seqlen_ro, rotary_dim / 2) tables: partial rotary in "all"
        rot = d // 4 if v == "all" else d // 2
        kw.update(rotary_cos=torch.zeros(cache, rot), rotary_sin=torch.zeros(cache, rot),
                  rotary_interleaved=v == "all", rotary_per_token=True)
    if v == "dense":
        kw["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
    if v == "masked":
        kw["key_mask"] = torch.ones(batch, cache, dtype=torch.uint8)
    if v == "plain":
        kw.update(cache_seqlens_int=cache - 1, seqlen_new=1)
    elif v != "varlen":
        new = seqlen_q if v in ("causal", "dense") else 1 if v == "all" else 0
        kw.update(cache_seqlens=torch.full((batch,), cache // 2, dtype=torch.int32), seqlen_new=new)
    return kw


def _run_decode(p: Problem, q_fp8: bool = False, kv_fp8: bool = False):
    from .kernels import decode

    decode.decode_forward(**_decode_inputs(p, q_fp8, kv_fp8))


def _run_append(p: Problem, kv_fp8: bool = False):
    """kv_append as flash_attn_with_kvcache calls it (fa_amd.kvcache._append) before the variant's decode
    (rotary_interleaved: flash-attn's default, True, where the variant has no rotary)."""
    import torch

    from .kernels import decode
    from .tuning import get_decode_config

    kw = _decode_inputs(p, kv_fp8=kv_fp8)
    dtype = getattr(torch, _TORCH_DTYPES[p.dtype])
    batch, hk, d = 2, kw["k_cache"].shape[2], p.head_dim
    new = torch.zeros(batch, kw["seqlen_new"], hk, d, dtype=dtype)
    cfg = get_decode_config(decode.arch_for(None), decode.head_dim_padded(d), p.dtype == "fp32")["append"]
    decode.kv_append(new, torch.zeros_like(new), kw["k_cache"], kw["v_cache"], kw.get("cache_seqlens"),
                     kw.get("cache_seqlens_int"), kw.get("cache_batch_idx"), kw.get("block_table"),
                     kw.get("rotary_cos"), kw.get("rotary_sin"), kw.get("rotary_interleaved", True), cfg,
                     kw.get("descale"))


DECODE_LAUNCHES = {
    "decode": Launch("decode", "decode_kernel", _run_decode, table_kernel="decode", also_records=("rotary",)),
    "merge": Launch("decode", "split_merge_kernel", _run_decode, table_kernel="merge", also_records=("rotary",)),
    "append": Launch("decode", "kv_append_kernel", _run_append, table_kernel="append"),
}
# the variants each decode kernel is launched in (the FP8 ones: "plain", "causal", "all")
DECODE_VARIANTS = {
    "decode": ("plain", "causal", "all") + DECODE_ONLY_VARIANTS,
    "merge": ("plain", "all", "varlen"),  # (no sinks; sinks; varlen q's output without a batch axis)
    "append": ("plain", "causal", "all", "dense"),
}
LAUNCHES.update(FP8_LAUNCHES)
LAUNCHES.update(DECODE_LAUNCHES)


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
    modules = [importlib.import_module(f"fa_amd.kernels.{m}")
               for m in dict.fromkeys(("launch", "quantize", spec.module) + spec.also_records)]
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
            if k not in params or k in TILE_NAMES or k in KERNEL_SWITCHES}


# the tile constexprs a launch dict sets: query rows x keys (the attention kernels), new tokens (the
# cache append's BLOCK_T) and merged rows (the split merge's BLOCK_R) per program
TILE_NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_R")


