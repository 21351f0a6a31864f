"""Where are we running?  The one place that answers backend / arch / warp size.

Everything that depends on the hardware (config tables, launch options, the
interpreter switch) asks this module instead of probing torch or triton itself.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

import triton

# Triton decides at decoration time whether @triton.jit builds an interpreted
# function, so the switch is read once, when fa_amd is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
TRITON_VERSION = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
# Interpreters before triton 3.7 cannot run loops whose bounds come from
# program ids (every fa_amd kernel has them).
MIN_INTERPRETER_TRITON = (3, 7)
# The oldest Triton whose compiler builds every fa_amd kernel for a GPU (first matching arch-name
# prefix wins).  Checked under each version by the AOT matrix (.ci/aot_matrix.py, docs/AOT.md) for
# the AMD targets; ROCm PyTorch 2.6 ships triton 3.2.
MIN_TRITON = (("gfx950", (3, 2)), ("gfx", (3, 2)), ("sm", (3, 2)))
# Older Tritons build kernels that run correctly but spill registers to scratch (slower) on these
# GPUs (measured by the AOT matrix, docs/AOT.md): the first launch warns once below this version.
SPILL_FREE_TRITON = (("gfx11", (3, 6)), ("gfx12", (3, 6)))


def _triton_interprets() -> bool:
    """Whether triton itself runs in interpreter mode: it reads TRITON_INTERPRET when imported and
    decorates its own @jit library functions (tl.sum, tl.max, ...) accordingly."""
    import triton.language as tl

    return type(tl.standard.sum).__name__ == "InterpretedFunction"


# TRITON_INTERPRET changed between `import triton` (e.g. by `import torch._dynamo`) and `import fa_amd`:
# fa_amd's kernels and triton's own library functions then disagree, and every call would fail deep
# inside Triton ("Cannot call @triton.jit'd outside of the scope of a kernel").
LATE_INTERPRET = INTERPRET != _triton_interprets()


def _late_interpret_message() -> str:
    if INTERPRET:
        return ("TRITON_INTERPRET=1 was set after triton was imported (by `import triton`, `import torch._dynamo`, "
                "transformers, ... before `import fa_amd`): triton reads it once, when it is imported, so its "
                "library was built for a GPU while fa_amd's kernels were built for the interpreter. Set "
                "TRITON_INTERPRET=1 before anything imports triton (in the shell, or at the very top of the script)")
    return ("TRITON_INTERPRET was unset after triton was imported in interpreter mode and before `import fa_amd`; "
            "set it (or not) once, before anything imports triton")


def check_interpreter_supported() -> None:
    """Raises when the kernels cannot run as configured: TRITON_INTERPRET changed after triton was
    imported, or an interpreter too old for fa_amd's kernels.  Cheap: every call checks it."""
    if LATE_INTERPRET:
        raise RuntimeError(_late_interpret_message())
    if INTERPRET and TRITON_VERSION < MIN_INTERPRETER_TRITON:
        raise RuntimeError(
            f"TRITON_INTERPRET=1 with triton {triton.__version__}: its interpreter cannot run fa_amd's kernels "
            f"(loops with run-time bounds); use triton >= {'.'.join(map(str, MIN_INTERPRETER_TRITON))} for "
            "CPU/interpreter runs, or unset TRITON_INTERPRET on a GPU")


def cpu_without_interpreter_message(name: str) -> str:
    """Why a CPU tensor cannot run here: no interpreter, or TRITON_INTERPRET=1 set after `import fa_amd`."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return (f"{name} is a CPU tensor but fa_amd's kernels need a GPU: TRITON_INTERPRET=1 was set after fa_amd "
                "(and triton) were imported, and both read it once, at import. Set TRITON_INTERPRET=1 before "
                "anything imports triton or fa_amd (in the shell, or at the very top of the script)")
    return (f"{name} is a CPU tensor but fa_amd's kernels need a GPU; on a machine without one, set "
            "TRITON_INTERPRET=1 before importing fa_amd to run them through Triton's interpreter")


def min_triton(arch_name: str) -> tuple:
    """The oldest triton (major, minor) that builds fa_amd's kernels for this GPU (MIN_TRITON)."""
    return next((v for prefix, v in MIN_TRITON if arch_name.startswith(prefix)), MIN_TRITON[-1][1])


def check_triton_floor(arch: "Arch") -> None:
    """Raises a RuntimeError naming the installed and the needed triton when it is older than
    MIN_TRITON allows for this GPU (compiling would fail with a Triton error on first launch)."""
    if arch.backend == "interpreter":
        return
    need = min_triton(arch.name)
    if TRITON_VERSION < need:
        raise RuntimeError(
            f"fa_amd needs triton >= {'.'.join(map(str, need))} on {arch.name}; found triton {triton.__version__}. "
            f"Install a newer one (e.g. `pip install 'triton>={'.'.join(map(str, need))}'`, or the PyTorch build "
            "for your ROCm/CUDA that ships it)")


# Triton's interpreter keeps bf16 tensors as their raw uint16 bits, and its tl.dot and elementwise ops
# compute on those integers (triton 3.7 .. 3.9; fp16, fp32 and fp8 are exact): a bf16 dot, sum or product
# is garbage, and `v != v` never finds a NaN (so the V NaN rule missed bf16 NaNs on the CPU).  With fa_amd in
# interpreter mode, bf16 operands of dots and elementwise ops are widened to fp32 first (exact: every bf16
# value is an fp32 value), and an elementwise op's float result is rounded back to bf16 (to nearest even, as
# a GPU's bf16 instructions; the dot keeps its fp32 result, as a GPU's bf16 dot computes fp32 products and
# sums).  Its casts: _fix_interpreter_rounding below.  False where the interpreter could not be patched
# (bf16 inputs then raise on CPU instead of computing garbage).
INTERPRETER_BF16_DOT = False


def _bf16_bits_to_fp32(bits):
    """numpy bf16 bit patterns (uint16, any shape) -> their float32 values (exact: the bits shifted up)."""
    import numpy as np

    return (np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(bits))


def _fp32_to_bf16_bits(values):
    """numpy float32 values -> bf16 bit patterns (uint16), rounded to nearest even by torch's cast (through
    int16: torch's uint16 has no numpy() in older releases)."""
    import numpy as np

    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16).view(torch.int16) \
        .numpy().view(np.uint16).reshape(np.shape(values))


def _fix_interpreter_bf16_math() -> bool:
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return False
    if getattr(InterpreterBuilder.create_dot, "fa_amd_bf16", False):
        return True

    def is_bf16_bits(h):
        return getattr(h.dtype, "scalar", h.dtype) == tl.bfloat16 and getattr(h.data, "dtype", None) == np.uint16

    def widen(h):
        return TensorHandle(_bf16_bits_to_fp32(h.data), tl.float32) if is_bf16_bits(h) else h

    def narrow(h):  # an fp32 result back to bf16 bits, rounded to nearest even
        return TensorHandle(_fp32_to_bf16_bits(h.data), tl.bfloat16) if getattr(h.data, "dtype", None) == np.float32 \
            else h

    def elementwise(method):
        def patched(self, *args):
            handles = [i for i, a in enumerate(args) if isinstance(a, TensorHandle)]
            if not any(is_bf16_bits(args[i]) for i in handles):
                return method(self, *args)
            wide = tuple(widen(a) if i in handles else a for i, a in enumerate(args))
            return narrow(method(self, *wide))
        patched.fa_amd_bf16 = True
        return patched

    create_dot = InterpreterBuilder.create_dot

    def bf16_safe_create_dot(self, a, b, *args, **kwargs):
        return create_dot(self, widen(a), widen(b), *args, **kwargs)

    cast_impl = InterpreterBuilder.cast_impl

    def bf16_safe_cast_impl(self, src, dst_type):
        # an int (or fp16) -> bf16 cast wrote the value's numpy cast to uint16 as bf16 bits: go through fp32
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar not in (tl.float32, tl.bfloat16):
            return narrow(cast_impl(self, src, tl.float32))
        return cast_impl(self, src, dst_type)

    for name in ("binary_op", "unary_op", "ternary_op", "create_fma"):
        setattr(InterpreterBuilder, name, elementwise(getattr(InterpreterBuilder, name)))
    _fix_interpreter_bf16_reductions(np, tl, widen, narrow)
    InterpreterBuilder.cast_impl = bf16_safe_cast_impl
    bf16_safe_create_dot.fa_amd_bf16 = True
    InterpreterBuilder.create_dot = bf16_safe_create_dot
    return True


def _fix_interpreter_bf16_reductions(np, tl, widen, narrow) -> None:
    """tl.sum / tl.max / tl.min / argmax of a bf16 tensor on the interpreter: numpy reduces the raw bits
    (a sum is garbage, and a negative value's bits compare above every positive one's); reduce the widened
    values, and round a sum's result back to bf16."""
    try:
        from triton.runtime.interpreter import ReduceOps, TensorHandle
    except ImportError:  # pragma: no cover - a triton without the interpreter's reduce class
        return

    def widened(x):
        if not (x.dtype == tl.bfloat16 and getattr(x.handle.data, "dtype", None) == np.uint16):
            return None
        return widen(x.handle).data

    def as_bf16(self, values):
        return self.to_tensor(narrow(TensorHandle(np.asarray(values, dtype=np.float32), tl.float32)).data,
                              tl.bfloat16)

    original_sum, original_min_max = ReduceOps.sum, ReduceOps.min_max

    def bf16_sum(self, input):
        data = widened(input)
        if data is None:
            return original_sum(self, input)
        return as_bf16(self, np.sum(data, axis=self.axis, keepdims=self.keep_dims))

    def bf16_min_max(self, input, val_reduce_op, idx_reduce_op=None):
        value = input[0] if isinstance(input, tuple) else input
        data = widened(value)
        if data is None:
            return original_min_max(self, input, val_reduce_op, idx_reduce_op)
        val = idx = None
        if val_reduce_op:
            val = as_bf16(self, val_reduce_op(data, axis=self.axis, keepdims=self.keep_dims))
        if idx_reduce_op:
            idx = self.to_tensor(idx_reduce_op(data, axis=self.axis, keepdims=self.keep_dims), tl.int32)
        return (val, idx) if val is not None and idx is not None else (val if val is not None else idx)

    ReduceOps.sum, ReduceOps.min_max = bf16_sum, bf16_min_max


if INTERPRET and not LATE_INTERPRET:
    INTERPRETER_BF16_DOT = _fix_interpreter_bf16_math()


# Triton's interpreter (3.9) rounds float32 -> bfloat16 and float32/float16/bfloat16 -> fp8 wrongly.  To
# bf16 it truncates (1.999 -> 1.9921875, 1.01171875 -> 1.0078125 where a GPU gives 2.0 and 1.015625) and
# mangles subnormals: every kernel output, P and dS it rounds to bf16 carried about twice a GPU's error, a
# bias toward zero, and bf16 gradients on short rows landed past 2x PyTorch's own bf16 error in ~1 draw of 10.
# To fp8 its round-to-nearest adds the first dropped bit to the mantissa without carrying into the exponent
# (e4m3: 127.5 -> 64 where a GPU gives 128) and ignores the other dropped bits; the FP8 kernels round P with
# that cast (fa_amd.fp8).  So on the interpreter these downcasts (and bf16 -> fp32, exact by its bits) go
# through torch's own conversions: round to nearest even, as the GPUs' cvt instructions.  Triton type name
# -> torch dtype name.
_INTERPRETER_CASTS = {"bf16": "bfloat16", "fp8e4nv": "float8_e4m3fn", "fp8e4b8": "float8_e4m3fnuz",
                      "fp8e5": "float8_e5m2", "fp8e5b16": "float8_e5m2fnuz"}
# The upcasts too: its FP8 -> wider conversion (also what an FP8 tl.dot's operands go through: fp8 -> fp16)
# decodes every exponent-all-ones byte as a finite number (e4m3fn NaN 0x7F -> 480.0, e5m2 NaN -> 114688.0,
# e5m2 inf -> 65536.0), so a NaN stored in an FP8 tensor vanished on the CPU (a GPU keeps it).  FP8 sources
# (and FP8 -> FP8 casts) go through torch's conversion of the same bytes: exact, NaN and inf kept.  Triton
# type name -> (torch dtype, the torch and numpy integer types of its bits) of the wider targets.
_INTERPRETER_WIDE = {"fp16": ("float16", "int16", "uint16"), "bf16": ("bfloat16", "int16", "uint16"),
                     "fp32": ("float32", "int32", "uint32"), "fp64": ("float64", "int64", "uint64")}


def _interpreter_fp8(name: str):
    """The torch dtype of a Triton FP8 type name (None: not an FP8 type torch has)."""
    return getattr(torch, _INTERPRETER_CASTS[name], None) if name in _INTERPRETER_CASTS and name != "bf16" else None


def _fix_interpreter_rounding() -> None:
    try:
        from triton.runtime import interpreter
        import numpy as np
    except ImportError:  # pragma: no cover - a triton without the interpreter module
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_fa_amd_rounding", False):
        return
    rtz = getattr(getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None), "RTZ", object())

    def float_values(input, source):
        if source == "bf16":  # stored as uint16
            return torch.from_numpy(_bf16_bits_to_fp32(input))
        return torch.from_numpy(np.ascontiguousarray(input).view(np.float32 if source == "fp32" else np.float16))

    def fp8_upcast(input, fp8, target_name):
        """FP8 bits (of torch dtype fp8) -> the target's bits, input's shape, by torch's conversion."""
        values = torch.from_numpy(np.ascontiguousarray(input).view(np.uint8)).view(fp8)
        if target_name in _INTERPRETER_WIDE:
            wide, bits, np_bits = _INTERPRETER_WIDE[target_name]
            out = values.to(getattr(torch, wide)).view(getattr(torch, bits)).numpy().view(np_bits)
        else:  # FP8 -> FP8: through fp32 (exact), then torch's round to nearest even
            out = values.float().to(_interpreter_fp8(target_name)).view(torch.uint8).numpy()
        return out.reshape(np.shape(input))

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        target_name = getattr(output_dtype, "name", "")
        source = getattr(input_dtype, "name", "")
        if source == "bf16" and target_name == "fp32":
            return _bf16_bits_to_fp32(input)
        fp8 = _interpreter_fp8(source)
        if fp8 is not None and (target_name in _INTERPRETER_WIDE or (
                _interpreter_fp8(target_name) is not None and target_name != source and rounding_mode != rtz)):
            return fp8_upcast(input, fp8, target_name)
        target = _INTERPRETER_CASTS.get(target_name)
        if target is None or source not in ("fp32", "fp16", "bf16") or source == target_name or rounding_mode == rtz:
            return original(input, input_dtype, output_dtype, rounding_mode)
        if target == "bfloat16":
            return _fp32_to_bf16_bits(float_values(input, source).float().numpy())
        return float_values(input, source).to(getattr(torch, target)).view(torch.uint8).numpy().reshape(input.shape)

    convert_float._fa_amd_rounding = True
    interpreter._convert_float = convert_float


if INTERPRET and not LATE_INTERPRET:
    _fix_interpreter_rounding()


@dataclass(frozen=True)
class Arch:
    backend: str  # "hip" | "cuda" | "interpreter"
    name: str  # "gfx942", "sm90", "cpu"
    warp_size: int

    @property
    def family(self) -> str:
        """Key into the tuning tables: the arch name, with fallbacks in tuning."""
        return self.name

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"


def _hip_arch_name(props) -> str:
    # gcnArchName looks like "gfx90a:sramecc+:xnack-"; the tables want "gfx90a".
    return str(getattr(props, "gcnArchName", "gfx942")).split(":")[0]


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int = 0) -> Arch:
    """The GPU's Arch, once its triton floor is checked (cached: once per process and device)."""
    arch = detect_arch(device_index)
    check_triton_floor(arch)
    want = next((v for prefix, v in SPILL_FREE_TRITON if arch.name.startswith(prefix)), None)
    if want and TRITON_VERSION < want:
        import warnings

        warnings.warn(f"fa_amd: triton {triton.__version__} builds fa_amd's kernels for {arch.name} with register "
                      f"spills (correct, but slower); triton >= {'.'.join(map(str, want))} builds them spill-free "
                      "(docs/AOT.md)", stacklevel=2)
    return arch


def detect_arch(device_index: int = 0) -> Arch:
    """The Arch of a device (no checks)."""
    if INTERPRET or not torch.cuda.is_available():
        return Arch("interpreter", "cpu", 32)
    props = torch.cuda.get_device_properties(device_index)
    if torch.version.hip is not None:
        name = _hip_arch_name(props)
        # CDNA (gfx9xx) runs 64-wide wavefronts, RDNA (gfx1xxx) 32-wide.
        return Arch("hip", name, 64 if name.startswith("gfx9") else 32)
    return Arch("cuda", f"sm{props.major}{props.minor}", 32)


def arch_for(tensor: torch.Tensor) -> Arch:
    if tensor.device.type == "cpu":
        return Arch("interpreter", "cpu", 32)
    return device_arch(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def num_sms(tensor: torch.Tensor) -> int:
    """Streaming multiprocessors / compute units: how many programs run at once."""
    if tensor.device.type == "cpu":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(tensor.device).multi_processor_count
