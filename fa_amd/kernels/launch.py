"""Host-side launch plumbing shared by the attention launchers (forward.py, backward.py,
decode.py): shapes and strides, output allocation, runtime scalars and feature flags,
and `launch`, which shrinks a table config that does not fit the GPU instead of failing.
"""
import operator
import threading
import warnings

import torch
import triton
from triton.compiler import CompiledKernel
from triton.runtime.errors import OutOfResources


_LOG2E = 1.4426950408889634
_DROPOUT_BITS = 24
# Triton grids allow 65535 programs on axes 1 and 2 (heads, batch).
MAX_GRID_YZ = 65535
# Offsets inside one sequence are int32 in the kernels (row * row_stride + col),
# which keeps the address math of the hot loops 32-bit; the per-sequence and
# per-head bases are int64.  The entry points keep every tensor within this.
MAX_ROW_OFFSET = 2 ** 31 - 1


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (triton.cdiv is a constexpr-function object in recent
    Triton, ~2 us a call: the launchers call this several times per step)."""
    return -(-a // b)


def row_offsets_fit(rows: int, row_stride: int, width: int) -> bool:
    """Whether `rows` rows of `width` elements, `row_stride` apart, stay within int32 offsets."""
    return rows <= 0 or (rows - 1) * row_stride + width - 1 <= MAX_ROW_OFFSET


def with_int32_row_offsets(name: str, x: torch.Tensor, rows: int, varlen: bool) -> torch.Tensor:
    """x, or a contiguous copy of it (with a warning) where its token stride would overflow int32 offsets
    (e.g. a slice of a wide fused qkv tensor at a long sequence length)."""
    row_stride = x.stride(0 if varlen else 1)
    if row_offsets_fit(rows, row_stride, x.shape[-1]):
        return x
    warnings.warn(f"fa_amd: {name} has a token stride of {row_stride} elements, too large for the kernels' 32-bit "
                  f"offsets over {rows} tokens; using a contiguous copy of {name} (extra memory and time).",
                  stacklevel=3)
    return x.contiguous()


# Tests set this so every output starts as NaN: an element a kernel forgets to
# write then fails the comparison instead of passing on leftover memory.
POISON_OUTPUTS = False


def new_output(like: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    out = like.new_empty(shape, dtype=dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain int math (triton.next_power_of_2 is a
    constexpr-function object in recent Triton, several microseconds a call)."""
    return 1 << (n - 1).bit_length()


# FP8 dots take K >= 32 (NVIDIA's fp8 mma / wgmma are k32: Triton rejects a 16-deep fp8 dot on
# sm90, checked with the AOT compiler), so FP8 launches pad the head dim to at least 32
FP8_MIN_D_PAD = 32


def head_scan_grid(cfg, d_pad: int, longest: int, max_splits: int = None, heads: int = 1):
    """(tokens per block, programs per (sequence, head)) of a memory-bound pass over every (sequence,
    head)'s tokens, for sequences of at most `longest` tokens and `heads` (sequence, head) pairs: blocks
    of cfg["BLOCK_ELEMENTS"] elements (tokens x d_pad), at most cfg["MAX_SPLITS"] (and `max_splits`)
    programs, each walking every splits-th block; with cfg["PROGRAMS"], only as many splits as bring
    the whole grid to that many programs (the FP8 amax / cast passes, the V NaN flags)."""
    block_t = max(1, min(next_power_of_2(max(longest, 1)), cfg["BLOCK_ELEMENTS"] // d_pad))
    most = cfg["MAX_SPLITS"] if max_splits is None else min(cfg["MAX_SPLITS"], max_splits)
    if "PROGRAMS" in cfg:
        most = min(most, -(-cfg["PROGRAMS"] // max(heads, 1)))
    return block_t, max(1, min(most, -(-longest // block_t)))


def head_dim_padded(head_dim: int, fp8: bool = False) -> int:
    return max(FP8_MIN_D_PAD if fp8 else 16, next_power_of_2(head_dim))


def row_strides(x: torch.Tensor, varlen: bool):
    """(batch, token, head) strides; varlen tensors have no batch axis."""
    s = x.stride()  # one call: the launchers ask for ~15 tensors' strides per forward+backward
    return (0, s[0], s[1]) if varlen else s[:3]


def lse_strides(lse: torch.Tensor, varlen: bool):
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _launch_options(cfg):
    return {k: v for k, v in cfg.items() if k not in ("BLOCK_M", "BLOCK_N")}


# (kernel, table config, dtype, constexprs) -> the smaller config that fit this GPU
_FITTED_CONFIGS = {}


def _shrink(cfg):
    """Next smaller config after an out-of-resources launch: fewer pipeline
    stages first, then halve the larger tile (never below 16, tl.dot's minimum)."""
    cfg = dict(cfg)
    if cfg.get("num_stages", 1) > 1:
        cfg["num_stages"] -= 1
        return cfg
    key = "BLOCK_N" if cfg["BLOCK_N"] >= cfg["BLOCK_M"] else "BLOCK_M"
    if cfg[key] <= 16:
        return None
    cfg[key] //= 2
    return cfg


def even_qk(varlen: bool, seqlen_q: int, seqlen_k: int, *tiles) -> bool:
    """The kernels' EVEN_QK: a dense launch whose query and key counts are whole multiples of every (BLOCK_M,
    BLOCK_N) tile pair in `tiles`, so its masked blocks load without row or key bounds (only the window edges
    are masked).  Varlen launches never are: their sequences' lengths are on the device.  Like FlexAttention's
    IS_DIVISIBLE; the kernels round the lengths down under it (blocks.whole_blocks), so a load stays in bounds
    whatever the host passed."""
    return not varlen and all(seqlen_q % m == 0 and seqlen_k % n == 0 for m, n in tiles)


def grid_blocks(span, tile_key):
    """Grid axis 0 that covers `span` in steps of the config's tile `tile_key`."""
    return lambda cfg: cdiv(span, cfg[tile_key])


def launch(kernel, cfg, grid0, grid_tail, args, kwargs, per_cfg=None):
    """Launch `kernel` with the tiles of `cfg`; grid axis 0 has grid0(cfg) programs; per_cfg(cfg), if
    given, adds the arguments that follow the tiles (e.g. EVEN_QK, even_qk).

    A table entry that needs more shared memory or registers than this GPU has
    (a smaller-LDS part, fp32 inputs) is shrunk with a warning, never turned
    into a Triton error for the user; the fitted config is remembered."""
    table_cfg = cfg

    def variant():  # (kernel name, key of this table config's variant in _FITTED_CONFIGS)
        name = getattr(getattr(kernel, "fn", None), "__name__", None) or str(kernel)
        return name, (name, tuple(sorted(table_cfg.items())), str(args[0].dtype),
                      tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper())))

    if _FITTED_CONFIGS:  # the key costs host time on every launch: only build it once something was shrunk
        cfg = _FITTED_CONFIGS.get(variant()[1], cfg)
    while True:
        grid = (grid0(cfg),) + tuple(grid_tail)
        try:
            jit_launch(kernel, grid, args, dict(kwargs, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                                **_launch_options(cfg), **(per_cfg(cfg) if per_cfg else {})))
            return cfg
        except OutOfResources as err:
            smaller = _shrink(cfg)
            if smaller is None:
                raise
            name, key = variant()
            warnings.warn(f"fa_amd: {name} with {cfg} does not fit this GPU ({err}); using {smaller}, "
                          "which is slower. `fa-amd tune` finds the best config that fits.", stacklevel=3)
            cfg = _FITTED_CONFIGS[key] = smaller


# the launches of the launcher call being recorded into a LaunchPlan, per thread (autograd runs
# backward on its own thread); None when nothing is recorded
_RECORDING = threading.local()


def jit_launch(kernel, grid, args, kwargs):
    """kernel[grid](*args, **kwargs) through the JIT, recorded while a LaunchPlan is being built."""
    compiled = kernel[grid](*args, **kwargs)
    launches = getattr(_RECORDING, "launches", None)
    if launches is not None:
        launches.append((kernel, grid, args, kwargs, compiled))
    return compiled


class LaunchPlan:
    """The launches of one launcher call, replayed for later calls of the same structure.

    A small forward+backward is bound by host time (docs/TUNING_NOTES.md v11): resolving configs,
    deriving ~60 arguments per launch and the JIT's binding and specialising of them are most of
    it.  A launcher (attention_forward / attention_backward) that sees a call whose structure --
    shapes, strides, dtypes, device, scalars, tables and switches in force -- it has planned before
    only allocates its buffers and replays the recorded launches through CompiledLaunch, with this
    call's tensors in their slots: every other argument is the same by construction.

    Built from what `recording` collected around one ordinary call: each tensor argument of each launch must be one of
    the `named` tensors (the call's inputs and the buffers it allocated), else there is no plan."""

    __slots__ = ("launches",)

    def __init__(self, recorded, named, hip: bool):
        by_id = {}
        for name, t in named.items():
            if t is not None:
                by_id.setdefault(id(t), name)
        self.launches = []
        for kernel, grid, args, kwargs, compiled in recorded:
            if not isinstance(compiled, CompiledKernel):  # the interpreter, an AOT recorder
                raise LookupError("no compiled kernel")
            params, slots = [], []
            for param, value in list(zip(kernel.arg_names, args)) + list(kwargs.items()):
                if isinstance(value, torch.Tensor):
                    params.append(param)
                    slots.append(by_id[id(value)])  # KeyError: a tensor the plan cannot name
            same_as = [slots.index(name) for name in slots]  # (one name, one tensor: its address read once)
            self.launches.append((CompiledLaunch(kernel, compiled, grid, args, kwargs, params, hip, same_as=same_as),
                                  slots))

    @classmethod
    def build(cls, recorded, named, hip: bool):
        """The plan of the `recorded` launches, or None where one of them cannot be replayed."""
        try:
            return cls(recorded, named, hip)
        except LookupError:  # (KeyError included)
            return None

    def run(self, env) -> bool:
        """Replay every launch with the tensors `env` names; False (nothing launched) where Triton
        would specialise one of them differently than in the recorded call."""
        calls = [(launch, [env[name] for name in slots]) for launch, slots in self.launches]
        if not all(launch.fits(tensors) for launch, tensors in calls):
            return False
        stream = current_stream()  # once for all the launches (the runner looks it up per launch)
        for launch, tensors in calls:
            launch.launch(tensors, stream)
        return True


class _Recording:
    def __enter__(self):
        self.outer = getattr(_RECORDING, "launches", None)
        _RECORDING.launches = self.launches = []
        return self.launches

    def __exit__(self, *exc):
        _RECORDING.launches = self.outer
        if self.outer is not None:
            self.outer.extend(self.launches)


def recording():
    """`with recording() as launches:` collects the jit_launch calls made inside, in order."""
    return _Recording()


def alias_pattern(*tensors):
    """Which of `tensors` are the same object (each one's first position among them): part of a plan's
    key, since a plan names a tensor by its first slot -- one recorded with k is q must not replay a
    call whose k is another tensor."""
    ids = [id(t) for t in tensors]
    return tuple(map(ids.index, ids))


def current_stream():
    """The raw handle of the current device's current stream, looked up as Triton's runner does."""
    active = triton.runtime.driver.active
    return active.get_current_stream(active.get_current_device())


def zeros_outside_pools(n: int, device) -> torch.Tensor:
    """int32 zeros for a buffer that lives from call to call, never in a memory pool routed to this thread
    (torch.cuda.use_mem_pool).  Transformers' continuous batching runs each graph's eager warm-up inside
    its graphs' pool: a block allocated there may be one that an earlier capture freed, which that graph's
    replays keep writing -- zero counters would not stay zero (audit 2026-11-25: float32 generate_batch
    with CUDA graphs went wrong from the first decode step).  Pools route by thread, so a helper thread
    allocates (once per buffer) and waits for its memset."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    made = []

    def allocate():
        with torch.cuda.device(device):
            made.append(torch.zeros(n, dtype=torch.int32, device=device))
            torch.cuda.current_stream(device).synchronize()

    worker = threading.Thread(target=allocate, name="fa_amd-zeros")
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError(f"fa_amd: could not allocate a kept int32 buffer of {n} elements on {device}")
    return made[0]


def kept_zeros(buffers: dict, retired: list, key, n: int, device, capturing: bool = False) -> torch.Tensor:
    """At least n int32 zeros for launches that leave them zero again (the decode split counters, the
    forward's V NaN flags), so one buffer serves call after call with no memset: `buffers[key]` when it
    is big enough; under graph capture (`capturing`) otherwise a fresh zeroed one, cached nowhere (the
    memset is captured with the graph); else a new one of the next power of two (at least 256) made
    outside memory pools (zeros_outside_pools), the one it replaces kept in `retired` (a captured graph,
    or a launch still queued on another stream, may use it)."""
    buf = buffers.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if capturing:
        return torch.zeros(n, dtype=torch.int32, device=device)
    if buf is not None:
        retired.append(buf)
    buf = buffers[key] = zeros_outside_pools(max(256, next_power_of_2(n)), device)
    return buf


def _hooks_home(where: str):
    """The object whose launch_enter_hook / launch_exit_hook Triton's runner passes to the launcher
    (tables.COMPILED_LAUNCH["hooks"])."""
    if where == "knobs":
        import triton.knobs

        return triton.knobs.runtime
    return CompiledKernel


def _launch_hooks(home) -> bool:
    """Whether a Triton launch hook is registered: a hook is None, a plain function, or (triton >= 3.6)
    a HookChain whose list of `calls` may be empty."""
    enter, leave = home.launch_enter_hook, home.launch_exit_hook  # (no generator: this runs per replayed launch)
    return bool(enter is not None and getattr(enter, "calls", True)
                or leave is not None and getattr(leave, "calls", True))


def int_specialization(value: int):
    """What Triton's JIT specialises an int argument on (a compiled kernel holds only for ints of the same
    class): equal to 1, divisible by 16, and its type (i32, i64, u64 by range).  A superset of what every
    supported Triton version distinguishes."""
    return value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, value >= 2 ** 63


class CompiledLaunch:
    """One launch of a compiled Triton kernel, replayed without the JIT's dispatch.

    The decode loop is host-bound, and the JIT's per-call work (binding and specialising ~60
    arguments, the cache key) is most of a launch's host time: an empty 71-argument kernel took 52 us
    through `kernel[grid](...)` and 16 us through its CompiledKernel's runner (H100, triton 3.6,
    .ci/decode_host.py).  Built from one JIT launch -- its arguments and the CompiledKernel it
    returned -- and the names of the parameters that take each call's own tensors.  `run` launches
    the same call with new tensors, or returns False and launches nothing where Triton would
    specialise them differently (another dtype, another 16-byte alignment of a pointer; on HIP, another side of the
    2 GiB pointer range of buffer loads): the caller then launches through the JIT.  `fixed` names
    tensor parameters whose specialisation the caller guarantees (buffers it allocates itself in
    the plan's sizes, stand-ins that are another checked parameter's tensor): not checked per call.
    `same_as` (one entry per tensor parameter, default each its own index) gives, for a parameter whose tensor the
    caller guarantees is always an earlier parameter's (a stand-in for an absent tensor), that parameter's index:
    `launch` reads each distinct tensor's address once."""

    __slots__ = ("runner", "values", "slots", "signature", "hip", "checked", "index", "direct", "hooks", "distinct",
                 "spread", "runs")

    def __init__(self, kernel, compiled, grid, args, kwargs, tensor_params, hip: bool, fixed=(), same_as=None):
        from ..tuning import resolve_entry, tables

        params = kernel.params
        values = list(args) + [kwargs[p.name] if p.name in kwargs else p.default for p in params[len(args):]]
        keep = list(range(len(params)))
        how = resolve_entry(tables.COMPILED_LAUNCH)  # (this Triton's launcher: arguments, hooks)
        if how["args"] == "runtime":
            keep = [i for i in keep if not params[i].is_constexpr]
        self.index = index = {params[i].name: j for j, i in enumerate(keep)}
        self.values = [values[i] for i in keep]
        self.slots = [index[name] for name in tensor_params]
        grid = tuple(grid) + (1,) * (3 - len(grid))  # (the runner reads three axes)
        self.runner = compiled[grid]  # (initialises the kernel's handles)
        # the launcher's own leading arguments, as the runner passes them (launch_metadata and hooks None)
        self.direct = (compiled.run, grid[0], grid[1], grid[2], compiled.function, compiled.packed_metadata)
        self.hooks = _hooks_home(how["hooks"])
        self.hip = hip
        self.checked = tuple(i for i, name in enumerate(tensor_params) if name not in fixed)
        self.distinct = self.spread = self.runs = None  # (every tensor its own: launch reads each one's address)
        if same_as is not None and any(i != j for i, j in enumerate(same_as)):
            self.distinct = tuple(i for i, j in enumerate(same_as) if i == j)  # the tensors whose addresses it reads
            where = {i: n for n, i in enumerate(self.distinct)}
            # those addresses -> one per tensor parameter, in C (a trailing 0 keeps a one-item result a tuple)
            self.spread = operator.itemgetter(*[where[j] for j in same_as], 0)
            runs = []  # the tensor parameters' slots as runs of consecutive ones: [first slot, end, first param, end]
            for i, slot in enumerate(self.slots):
                if runs and runs[-1][1] == slot:
                    runs[-1][1] += 1
                    runs[-1][3] += 1
                else:
                    runs.append([slot, slot + 1, i, i + 1])
            self.runs = tuple(map(tuple, runs))
        self.signature = self._signature([self.values[self.slots[i]] for i in self.checked])
        for j in self.slots:  # hold no tensor of the first call (a KV cache may be gigabytes)
            self.values[j] = None

    def patched(self, ints: dict) -> "CompiledLaunch":
        """A copy that launches with the runtime int arguments `ints` (parameter name -> value) instead of
        the recorded ones.  The caller guarantees each new value's int_specialization equals the old one's."""
        twin = object.__new__(CompiledLaunch)
        for name in self.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.values = self.values.copy()
        for name, value in ints.items():
            twin.values[self.index[name]] = value
        return twin

    def _signature(self, tensors):
        # The dtype too: a plan's key may leave an argument's dtype open (an int32 or int64 index tensor), and the
        # compiled kernel reads each dtype differently.  is_cuda (HIP tensors too): `launch` hands the launcher
        # bare addresses, so the launcher's own refusal of a host tensor happens here instead.
        # (list comprehensions: a generator's frame costs more than the test itself, ~35 tensors per fwd+bwd)
        if self.hip:
            return tuple([(t.dtype, t.data_ptr() % 16 == 0, t.is_cuda, t.untyped_storage().size() <= MAX_ROW_OFFSET)
                          for t in tensors])
        return tuple([(t.dtype, t.data_ptr() % 16 == 0, t.is_cuda) for t in tensors])

    def fits(self, tensors) -> bool:
        """Whether Triton would specialise `tensors` as it did the recorded call's."""
        return self._signature([tensors[i] for i in self.checked]) == self.signature

    def run(self, tensors, stream=None) -> bool:
        """Launch with `tensors` (one per tensor parameter, in the order given at construction) on
        `stream` (a raw stream handle; None: the current device's current stream, looked up here)."""
        if not self.fits(tensors):
            return False
        self.launch(tensors, stream)
        return True

    def launch(self, tensors, stream=None):
        """`run` without the specialisation check (the caller made it)."""
        values = self.values.copy()
        if stream is None or _launch_hooks(self.hooks):  # (hooks may read the tensors)
            for slot, t in zip(self.slots, tensors):
                values[slot] = t
            self.runner(*values, stream=stream)
        else:
            # Device addresses instead of tensors: given an int, Triton's launcher (3.2-3.9, CUDA and HIP) skips
            # the data_ptr() call and the driver's pointer query it makes per tensor argument.  A stand-in's
            # address is its tensor's (a decode launch passes q for ~12 absent tensors).
            if self.spread is None:
                for slot, t in zip(self.slots, tensors):
                    values[slot] = t.data_ptr()
            else:
                addresses = self.spread([tensors[i].data_ptr() for i in self.distinct])
                for start, end, first, last in self.runs:
                    values[start:end] = addresses[first:last]
            run, x, y, z, function, packed_metadata = self.direct
            run(x, y, z, stream, function, packed_metadata, None, None, None, *values)


def descale_args(q_descale, k_descale, v_descale) -> dict:
    """The FP8 kernels' descale arguments (score_mods.load_head_descales): the caller's three fp32 tensors, read in
    place, and their (batch, head) strides."""
    return dict(QDescale=q_descale, KDescale=k_descale, VDescale=v_descale,
                stride_qdb=q_descale.stride(0), stride_qdh=q_descale.stride(1), stride_kdb=k_descale.stride(0),
                stride_kdh=k_descale.stride(1), stride_vdb=v_descale.stride(0), stride_vdh=v_descale.stride(1))


def score_args(q, alibi_slopes, rng_state, dropout_p, softmax_scale, window_left, window_right, softcap,
                max_seqlen_q, max_seqlen_k):
    """Runtime scalars + constexpr flags shared by every kernel launch."""
    # windows wider than any sequence are no-ops: drop them so the kernel skips the masks
    has_left = 0 <= window_left < max_seqlen_k - 1
    # (rel = col - row - diag spans [-(seqlen_k-1), seqlen_q-1]; e.g. causal with one query row masks nothing)
    has_right = 0 <= window_right < max_seqlen_q - 1
    has_dropout = dropout_p > 0.0
    scalars = dict(
        Alibi=alibi_slopes if alibi_slopes is not None else q,
        stride_ab=(alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0),
        SeedState=rng_state if has_dropout else q,
        keep_threshold=int(round(dropout_p * (1 << _DROPOUT_BITS))) if has_dropout else 0,
        qk_scale_log2=softmax_scale * _LOG2E,
        softcap_div=softmax_scale / softcap if softcap > 0 else 0.0,
        softcap_log2=softcap * _LOG2E,
        win_left=max(window_left, 0),
        win_right=max(window_right, 0),
    )
    flags = dict(
        IS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_DROPOUT=has_dropout,
        INPUT_PRECISION="ieee",
    )
    keep_scale = 1.0 / (1.0 - dropout_p) if has_dropout else 1.0
    return scalars, flags, keep_scale


def kernel_args(hq, hk, d, d_pad, varlen, flags, total_q=0, total_k=0):
    """GQA ratio, head dims, layout and feature flags: shared by every attention launch.  total_q /
    total_k (tokens of the packed q and k) bound the kernels' varlen segments (score_mods.seq_bounds)."""
    return dict(GROUP=hq // hk, HEAD_DIM=d, D_PAD=d_pad, IS_VARLEN=varlen,
                total_q=total_q if varlen else 0, total_k=total_k if varlen else 0, **flags)


def shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        _, nheads_q, head_dim = q.shape
        nheads_k = k.shape[1]
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        batch, seqlen_q, nheads_q, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
    return varlen, batch, nheads_q, nheads_k, head_dim, seqlen_q, seqlen_k
