"""Launch-configuration chooser: reads the per-arch tables (data, tables.py),
optionally overridden by a tuned table on disk (fa_amd.tuning.tuned_table, written by
fa_amd.autotune)."""
from __future__ import annotations

from typing import Dict, Optional

from ..arch import Arch
from . import tables, tuned_table
from .tables import FAMILY_ALIASES, HIP_ONLY_OPTIONS, KERNEL_SWITCHES, OVERRIDES, SWITCH_KERNELS, TABLES

KERNELS = ("fwd", "dkdv", "dq", "dkdv_atomic")


def family_of(arch: Arch) -> str:
    name = arch.name
    if name in TABLES:
        return name
    if name in FAMILY_ALIASES:
        return FAMILY_ALIASES[name]
    if arch.backend == "hip":
        return "gfx1100" if name.startswith("gfx1") else "gfx90a"
    if arch.backend == "cuda":
        major = int(name[2:-1] or 8) if name.startswith("sm") else 8
        return "sm90" if major >= 9 else "sm80"
    return "cpu"


def _overrides():
    return tuned_table.load_tuned_table()  # reads a json file only when present


def switches_of(kernel: Optional[str]) -> Dict:
    """The kernel switches (name -> default) the table kernel `kernel` ("fwd", "dkdv", ...) takes;
    every switch for None."""
    return {name: default for name, default in KERNEL_SWITCHES.items()
            if kernel is None or kernel in SWITCH_KERNELS.get(name, (kernel,))}


def resolve_entry(entry: Dict, is_fp32: bool = False, causal: bool = False, short: bool = False,
                  kernel: Optional[str] = None) -> Dict:
    """A table entry as a launch dict: its "causal" override applied for causal
    (or right-windowed) attention, its "short" override for launches with at most
    tables.SHORT_SEQLEN_K keys per row, its "fp32" override for fp32 inputs, and the
    default of every kernel switch (tables.KERNEL_SWITCHES) it does not set -- of the
    switches the table kernel `kernel` takes (tables.SWITCH_KERNELS) when it is given."""
    cfg = {k: v for k, v in entry.items() if k not in OVERRIDES}
    for name, wanted in (("causal", causal), ("short", short), ("fp32", is_fp32)):
        if wanted and entry.get(name):
            cfg.update(entry[name])
    switches = switches_of(kernel)
    foreign = sorted(k for k in cfg if k in KERNEL_SWITCHES and k not in switches)
    if foreign:
        raise ValueError(f"the {kernel!r} kernel takes no {', '.join(foreign)} (tables.SWITCH_KERNELS); "
                         f"fix its table entry {entry}")
    for name, default in switches.items():
        cfg.setdefault(name, default)
    return cfg


# (arch, kernel, head dim, fp32, causal) -> (the rows it was resolved from, launch dict).
# Every launch asks for its config; resolving it again each time was most of the
# launchers' host time.  An entry is used only while the table it came from is
# the same object (a tuned table read from disk, a candidate under test, or a
# replaced default list are new objects).
_RESOLVED: Dict[tuple, tuple] = {}


def _table_rows(arch: Arch, head_dim_padded: int):
    """The family's rows in force now: a tuned table on disk (or a candidate under test) over the defaults."""
    if arch.backend in ("hip", "cuda") and tuned_table.first_use_hook is not None:
        tuned_table.first_use_hook(arch, head_dim_padded)  # fa_amd.autotune: no-op unless FA_AMD_AUTOTUNE=1
    family = family_of(arch)
    return _overrides().get(family) or TABLES[family]


def _cached_config(rows, arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool, causal: bool,
                   short: bool = False) -> Dict:
    key = (arch, kernel, head_dim_padded, bool(is_fp32), bool(causal), bool(short))
    hit = _RESOLVED.get(key)
    if hit is not None and hit[0] is rows:
        return dict(hit[1])
    cfg = _resolve(rows, arch, kernel, head_dim_padded, is_fp32, causal, short)
    if len(_RESOLVED) > 256:
        _RESOLVED.clear()
    _RESOLVED[key] = (rows, cfg)
    return dict(cfg)


def get_config(arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool = False, causal: bool = False,
               short: bool = False) -> Dict:
    """Launch dict for `kernel` ("fwd" | "dkdv" | "dq" | "dkdv_atomic"): tile sizes + launch options.
    short: the launch has at most tables.SHORT_SEQLEN_K keys per row (see is_short)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return _cached_config(_table_rows(arch, head_dim_padded), arch, kernel, head_dim_padded, is_fp32, causal, short)


def is_short(max_seqlen_k: int) -> bool:
    """Whether a launch with this many keys per row takes its entries' "short" overrides."""
    return max_seqlen_k <= tables.SHORT_SEQLEN_K


def _resolve(rows, arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool, causal: bool,
             short: bool = False) -> Dict:
    row = next((r for r in rows if r["head_dim"] >= head_dim_padded), rows[-1])
    # the atomic-dQ variant of dK/dV falls back to the plain dK/dV row
    cfg = resolve_entry(row.get(kernel) or row["dkdv"], is_fp32, causal, short, kernel)
    if arch.backend != "hip":
        # AMD-only launch options are rejected by other backends.
        for key in HIP_ONLY_OPTIONS:
            cfg.pop(key, None)
    return cfg


def get_fwd_config(arch: Arch, head_dim_padded: int, is_fp32: bool = False, causal: bool = False,
                   short: bool = False) -> Dict:
    return get_config(arch, "fwd", head_dim_padded, is_fp32, causal, short)


def get_bwd_config(arch: Arch, head_dim_padded: int, is_fp32: bool = False, causal: bool = False) -> Dict[str, Dict]:
    # the tables in force are looked up once for the three kernels (environment and tuned-file
    # checks are most of a cached lookup's host time)
    rows = _table_rows(arch, head_dim_padded)
    return {k: _cached_config(rows, arch, k, head_dim_padded, is_fp32, causal) for k in ("dkdv", "dq", "dkdv_atomic")}


def _family_choice(name: str, family: str, default: str, choices: tuple) -> str:
    """The value a per-family policy dict of tables.py (`name`) gives `family` (`default` when
    not listed), checked against `choices`."""
    value = getattr(tables, name).get(family, default)
    if value not in choices:
        raise ValueError(f"fa_amd.tuning.tables.{name}[{family!r}] must be "
                         f"{' or '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def nondeterministic_dq(family: str) -> str:
    """"atomic" or "recompute": how the deterministic=False backward gets dQ on this arch family
    (tables.NONDETERMINISTIC_DQ)."""
    return _family_choice("NONDETERMINISTIC_DQ", family, "atomic", ("atomic", "recompute"))


def bwd_fusable(family: str, dkdv_cfg: Dict, dq_cfg: Dict) -> bool:
    """Whether the dQ programs run in the dK/dV launch: the family fuses (tables.FUSED_DQ_FAMILIES)
    and both launch dicts agree on everything but their tiles and the switches of one kernel only
    (warps, stages, HIP options, shared switches)."""
    def rest(cfg):
        return {k: v for k, v in cfg.items() if k not in ("BLOCK_M", "BLOCK_N") and k not in SWITCH_KERNELS}
    return family in tables.FUSED_DQ_FAMILIES and rest(dkdv_cfg) == rest(dq_cfg)


def gqa_split_sum(family: str) -> str:
    """"partials" or "atomic": how split GQA slices of dK/dV are summed when atomics are allowed,
    on this arch family (tables.GQA_SPLIT_SUM)."""
    return _family_choice("GQA_SPLIT_SUM", family, "partials", ("partials", "atomic"))
