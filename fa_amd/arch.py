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
# program ids (every fa_amd kernel has them); compiled kernels need only 3.2.
MIN_INTERPRETER_TRITON = (3, 7)


def check_interpreter_supported() -> None:
    if INTERPRET and TRITON_VERSION < MIN_INTERPRETER_TRITON:
        raise RuntimeError(
            f"TRITON_INTERPRET=1 with triton {triton.__version__}: its interpreter cannot run fa_amd's kernels "
            f"(loops with run-time bounds); use triton >= {'.'.join(map(str, MIN_INTERPRETER_TRITON))} for "
            "CPU/interpreter runs, or unset TRITON_INTERPRET on a GPU")


# Triton's interpreter (3.9) rounds float32/float16/bfloat16 -> fp8 wrongly: its round-to-nearest adds
# the first dropped bit to the mantissa without carrying into the exponent (e4m3: 127.5 -> 64 where a GPU
# gives 128), and ignores the other dropped bits.  The FP8 kernels round P with that cast (fa_amd.fp8), so
# on the interpreter the downcasts to the fp8 types torch has go through torch's own conversion (round
# to nearest even, as the GPUs' cvt instructions).  Triton type name -> torch dtype name.
_INTERPRETER_FP8 = {"fp8e4nv": "float8_e4m3fn", "fp8e4b8": "float8_e4m3fnuz", "fp8e5": "float8_e5m2",
                    "fp8e5b16": "float8_e5m2fnuz"}


def _fix_interpreter_fp8_rounding() -> None:
    try:
        from triton.runtime import interpreter
        import numpy as np
    except ImportError:  # pragma: no cover - a triton without the interpreter module
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_fa_amd_fp8", False):
        return
    rtz = getattr(getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None), "RTZ", object())

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        target = _INTERPRETER_FP8.get(getattr(output_dtype, "name", ""))
        source = getattr(input_dtype, "name", "")
        if target is None or source not in ("fp32", "fp16", "bf16") or rounding_mode == rtz:
            return original(input, input_dtype, output_dtype, rounding_mode)
        if source == "bf16":  # stored as uint16: widen the bits to float32
            values = torch.from_numpy((np.ascontiguousarray(input).view(np.uint16).astype(np.uint32) << 16)
                                      .view(np.float32))
        else:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32 if source == "fp32" else np.float16))
        return values.to(getattr(torch, target)).view(torch.uint8).numpy().reshape(input.shape)

    convert_float._fa_amd_fp8 = True
    interpreter._convert_float = convert_float


if INTERPRET:
    _fix_interpreter_fp8_rounding()


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
