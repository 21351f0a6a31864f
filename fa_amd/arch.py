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
