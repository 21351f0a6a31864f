"""Launch-configuration chooser: reads the per-arch tables (data, tables.py),
optionally overridden by a tuned table on disk (fa_amd.tuning.tuned_table, written by
fa_amd.autotune)."""
from __future__ import annotations

from typing import Dict, Optional

from ..arch import TRITON_VERSION, Arch
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


def _triton_bound(name: str) -> tuple:
    """"triton<3.6" -> (3, 6)."""
    return tuple(int(p) for p in name.split("<")[1].split("."))


def resolve_entry(entry: Dict, is_fp32: bool = False, causal: bool = False, short: bool = False,
                  kernel: Optional[str] = None, triton_version: tuple = None, fp8: bool = False) -> Dict:
    """A table entry as a launch dict: its "triton<X.Y" overrides whose bound is above the
    installed triton (tables.TRITON_OVERRIDES; `triton_version` overrides the installed one), then
    its "causal" override for causal (or right-windowed) attention, its "short" override for
    launches with at most tables.SHORT_SEQLEN_K keys per row, its "fp32" override for fp32
    inputs, its "fp8" override for fp8 inputs (half the shared memory per tile).  An override may hold
    dicts of the other cases of its own (e.g. "short": {..., "causal": {...}}: causal launches that are
    also short), applied right after it in those cases.  Then the default of every kernel
    switch (tables.KERNEL_SWITCHES) it does not set -- of the switches the table kernel `kernel`
    takes (tables.SWITCH_KERNELS) when it is given."""
    cfg = {k: v for k, v in entry.items() if k not in OVERRIDES}
    version = triton_version or TRITON_VERSION
    for name in tables.TRITON_OVERRIDES:
        if entry.get(name) and version < _triton_bound(name):
            cfg.update(entry[name])
    cases = (("causal", causal), ("short", short), ("fp32", is_fp32), ("fp8", fp8))
    for name, wanted in cases:
        if wanted and entry.get(name):
            override = entry[name]
            cfg.update({k: v for k, v in override.items() if k not in OVERRIDES})
            for case, on in cases:  # the override's own dicts of the other cases that hold
                if on and case != name and override.get(case):
                    cfg.update(override[case])
    switches = switches_of(kernel)
    foreign = sorted(k for k in cfg if k in KERNEL_SWITCHES and k not in switches)
    if foreign:
        raise ValueError(f"the {kernel!r} kernel takes no {', '.join(foreign)} (tables.SWITCH_KERNELS); "
                         f"fix its table entry {entry}")
    for name, default in switches.items():
        cfg.setdefault(name, default)
    return cfg


# (arch, kernel, head dim, fp32, causal, short, fp8) -> (the rows it was resolved from, launch dict).
# Every launch asks for its config; resolving it again each time was most of the
# launchers' host time.  An entry is used only while the table it came from is
# the same object (a tuned table read from disk, a candidate under test, or a
# replaced default list are new objects).
_RESOLVED: Dict[tuple, tuple] = {}


def table_rows(arch: Arch, head_dim_padded: int):
    """The rows in force for this arch now (what a launch's configs are resolved from; the launchers'
    plans are valid while these rows are, kernels/launch.plan_lookup)."""
    return _table_rows(arch, head_dim_padded)


def _table_rows(arch: Arch, head_dim_padded: int):
    """The family's rows in force now: a tuned table on disk (or a candidate under test) over the defaults."""
    if arch.backend in ("hip", "cuda") and tuned_table.first_use_hook is not None:
        tuned_table.first_use_hook(arch, head_dim_padded)  # fa_amd.autotune: no-op unless FA_AMD_AUTOTUNE=1
    family = family_of(arch)
    return _overrides().get(family) or TABLES[family]


def _cached_config(rows, arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool, causal: bool,
                   short: bool = False, fp8: bool = False) -> Dict:
    key = (arch, kernel, head_dim_padded, bool(is_fp32), bool(causal), bool(short), bool(fp8))
    cfg = memo_get(key, rows)
    if cfg is None:
        cfg = _resolve(rows, arch, kernel, head_dim_padded, is_fp32, causal, short, fp8)
        memo_put(key, rows, cfg)
    return dict(cfg)


def memo_get(key, rows, default=None):
    """What _RESOLVED holds under `key`, while the table rows it was derived from (`rows`) are the
    ones in force; else `default`.  Launch configs and the launchers' plans (kernels/launch.LaunchPlan)
    share this memo: whatever clears it (a tuned table loaded, a test's changed table) drops both."""
    hit = _RESOLVED.get(key)
    return hit[1] if hit is not None and hit[0] is rows else default


def memo_put(key, rows, value):
    if len(_RESOLVED) > 256:
        _RESOLVED.clear()
    _RESOLVED[key] = (rows, value)


def get_config(arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool = False, causal: bool = False,
               short: bool = False, fp8: bool = False) -> Dict:
    """Launch dict for `kernel` ("fwd" | "dkdv" | "dq" | "dkdv_atomic"): tile sizes + launch options.
    short: the launch has at most tables.SHORT_SEQLEN_K keys per row (see is_short); fp8: fp8 operands."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return _cached_config(_table_rows(arch, head_dim_padded), arch, kernel, head_dim_padded, is_fp32, causal, short,
                          fp8)


def is_short(max_seqlen_k: int) -> bool:
    """Whether a launch with this many keys per row takes its entries' "short" overrides."""
    return max_seqlen_k <= tables.SHORT_SEQLEN_K


def _resolve(rows, arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool, causal: bool,
             short: bool = False, fp8: bool = False) -> Dict:
    cfg = resolve_entry(_entry(rows, kernel, head_dim_padded), is_fp32, causal, short, kernel, fp8=fp8)
    if arch.backend != "hip":
        # AMD-only launch options are rejected by other backends.
        for key in HIP_ONLY_OPTIONS:
            cfg.pop(key, None)
    return cfg


def row_for(rows, head_dim_padded: int) -> Dict:
    """The row of a table (rows by ascending head_dim) that a padded head dim resolves to: the first one at
    least as wide, else the widest."""
    return next((r for r in rows if r["head_dim"] >= head_dim_padded), rows[-1])


def _entry(rows, kernel: str, head_dim_padded: int) -> Dict:
    row = row_for(rows, head_dim_padded)
    # the atomic-dQ variant of dK/dV falls back to the plain dK/dV row
    return row.get(kernel) or row["dkdv"]


def default_entry(arch: Arch, kernel: str, head_dim_padded: int) -> Dict:
    """The default tables' entry for `kernel` (its override dicts unapplied), tuned tables ignored."""
    return _entry(TABLES[family_of(arch)], kernel, head_dim_padded)


def default_config(arch: Arch, kernel: str, head_dim_padded: int, is_fp32: bool = False, causal: bool = False,
                   short: bool = False, fp8: bool = False) -> Dict:
    """get_config from the default tables only (tuned tables ignored): what the AOT check builds."""
    return _resolve(TABLES[family_of(arch)], arch, kernel, head_dim_padded, is_fp32, causal, short, fp8)


def get_fwd_config(arch: Arch, head_dim_padded: int, is_fp32: bool = False, causal: bool = False,
                   short: bool = False, fp8: bool = False) -> Dict:
    return get_config(arch, "fwd", head_dim_padded, is_fp32, causal, short, fp8)


def get_bwd_config(arch: Arch, head_dim_padded: int, is_fp32: bool = False, causal: bool = False,
                   short: bool = False) -> Dict[str, Dict]:
    # the tables in force are looked up once for the three kernels (environment and tuned-file
    # checks are most of a cached lookup's host time); short: at most tables.SHORT_SEQLEN_K keys per row
    rows = _table_rows(arch, head_dim_padded)
    return {k: _cached_config(rows, arch, k, head_dim_padded, is_fp32, causal, short)
            for k in ("dkdv", "dq", "dkdv_atomic")}


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


# --------------------------------------------------------------------------- decode

DECODE_KERNELS = ("decode", "append", "merge")
_DECODE_RESOLVED: Dict[tuple, Dict] = {}


def _decode_family(arch: Arch) -> str:
    family = family_of(arch)
    return family if family in tables.DECODE_TABLES else ("gfx90a" if arch.backend == "hip" else "sm80")


def _decode_row(arch: Arch, head_dim_padded: int) -> Dict:
    """The tables.DECODE_TABLES row a padded head dim resolves to on this arch."""
    return row_for(tables.DECODE_TABLES[_decode_family(arch)], head_dim_padded)


def get_decode_config(arch: Arch, head_dim_padded: int, is_fp32: bool = False, wide: bool = False,
                      fp8: bool = False, many: bool = False) -> Dict[str, Dict]:
    """Launch dicts of the decode kernels ({"decode", "append", "merge"}) from tables.DECODE_TABLES:
    the "decode" entry with its "wide" override (more than tables.DECODE_WIDE_ROWS query rows per
    KV head) and "fp32" override applied, then for an FP8 KV cache the family's tables.DECODE_FP8
    override of the row; each of these dicts with its "triton<X.Y" overrides for the installed triton
    (decode_entry_config); AMD-only options dropped off HIP.  `many`: the family's tables.DECODE_MANY tile
    for the row (decode_many_rule says when).  Memoized (hot path)."""
    key = (arch, head_dim_padded, bool(is_fp32), bool(wide), bool(fp8), bool(many))
    hit = _DECODE_RESOLVED.get(key)
    if hit is not None:
        return hit
    row = _decode_row(arch, head_dim_padded)
    out = {}
    for kernel in DECODE_KERNELS:
        entry = row[kernel]
        cfg = decode_entry_config(entry)
        for name, wanted in (("wide", wide), ("fp32", is_fp32)):
            if wanted and entry.get(name):
                cfg.update(decode_entry_config(entry[name]))
        if many and kernel == "decode":
            cfg.update(_decode_many(arch).get("head_dims", {}).get(row["head_dim"], {}))
        if fp8 and kernel == "decode":
            fp8_entry = tables.DECODE_FP8.get(_decode_family(arch), {}).get(row["head_dim"], {})
            cfg.update(decode_entry_config(fp8_entry))
            if wide:
                cfg.update(decode_entry_config(fp8_entry.get("wide", {})))
        if arch.backend != "hip":
            for opt in HIP_ONLY_OPTIONS:
                cfg.pop(opt, None)
        if kernel == "decode":
            cfg.setdefault("RELOAD_CHUNK", KERNEL_SWITCHES["RELOAD_CHUNK"])
        out[kernel] = cfg
    _DECODE_RESOLVED[key] = out
    return out


_DECODE_CASES = ("wide", "fp32")


def _decode_many(arch: Arch) -> Dict:
    return tables.DECODE_MANY.get(_decode_family(arch), {})


def decode_many_rule(arch: Arch, head_dim_padded: int):
    """(min programs per SM, max keys) of the family's tables.DECODE_MANY tile for the decode row `head_dim_padded`
    resolves to, or None where it has none: a launch of the row's own tile with at least that many unsplit
    programs per SM over at most that many keys takes get_decode_config(..., many=True)."""
    rule = _decode_many(arch)
    if _decode_row(arch, head_dim_padded)["head_dim"] not in rule.get("head_dims", {}):
        return None
    return rule["min_programs_per_sm"], rule["max_keys"]


def decode_masked_stages(arch: Arch, head_dim_padded: int) -> int:
    """tables.DECODE_MASKED_STAGES for the decode row `head_dim_padded` resolves to: the pipeline stages of the
    decode kernel's masked key loops (0: as the launch's num_stages)."""
    row = _decode_row(arch, head_dim_padded)["head_dim"]
    return tables.DECODE_MASKED_STAGES.get(_decode_family(arch), {}).get(row, 0)


def decode_merge_step(arch: Arch, live_rows: int, block_m: int) -> tuple:
    """(rows per chunk, splits per step) of the fused split merge (tables.DECODE_MERGE_STEP) for a tile of
    `block_m` rows of which at most `live_rows` hold a query row."""
    rows = min(block_m, 1 << max(0, live_rows - 1).bit_length())
    rule = tables.DECODE_MERGE_STEP.get(family_of(arch), tables.DECODE_MERGE_STEP["default"])
    return rows, max(2, min(rule["MAX_SPLITS"], rule["SLOTS"] // rows))


def decode_entry_config(entry: Dict, triton_version: tuple = None) -> Dict:
    """A decode table entry (or one of its "wide" / "fp32" / tables.DECODE_FP8 override dicts) without
    its case overrides, with its "triton<X.Y" overrides whose bound is above the installed triton
    (`triton_version` overrides it) applied, broadest bound first, as in resolve_entry."""
    cfg = {k: v for k, v in entry.items() if k not in _DECODE_CASES and k not in tables.TRITON_OVERRIDES}
    version = triton_version or TRITON_VERSION
    for name in tables.TRITON_OVERRIDES:
        if entry.get(name) and version < _triton_bound(name):
            cfg.update(entry[name])
    return cfg


def get_decode_split_policy(arch: Arch, d_pad: int = 0, table_tile: bool = True) -> Dict:
    """The split-count rule's parameters for this arch family (tables.DECODE_SPLITS), with the
    family's "head_dims" overrides of the decode table row that `d_pad` resolves to when the launch
    runs that row's own tile (`table_tile`: not the "wide", "fp32" or FP8 variants of it)."""
    policy = tables.DECODE_SPLITS.get(family_of(arch), tables.DECODE_SPLITS["default"])
    flat = {k: v for k, v in policy.items() if k != "head_dims"}
    if table_tile and d_pad and policy.get("head_dims"):
        flat.update(policy["head_dims"].get(_decode_row(arch, d_pad)["head_dim"], {}))
    return flat


def _by_arch(table: Dict, arch: Arch, default):
    """A per-target table's entry for `arch`: by its name first, then by its family."""
    if arch.name in table:
        return table[arch.name]
    return table.get(family_of(arch), default)


def fp8_dtype_names(arch: Arch) -> tuple:
    """torch dtype names of the FP8 types with a dot product on `arch` (tables.FP8_DTYPES), the
    quantising functions' type first; () where there is none."""
    return tuple(_by_arch(tables.FP8_DTYPES, arch, ()))


def fp8_min_triton(arch: Arch) -> tuple:
    """The oldest (major, minor) Triton that compiles `arch`'s FP8 dot (tables.FP8_MIN_TRITON)."""
    return tuple(_by_arch(tables.FP8_MIN_TRITON, arch, (3, 2)))


def fp8_v_token_major(arch: Arch) -> bool:
    """Whether FP8 V goes to the forward kernel token-major per head (tables.FP8_V_TOKEN_MAJOR, by arch
    name, then family)."""
    return arch.name in tables.FP8_V_TOKEN_MAJOR or family_of(arch) in tables.FP8_V_TOKEN_MAJOR


def fp8_quantize_config(arch: Arch) -> Dict:
    """Launch settings of the FP8 quantisation kernels (tables.FP8_QUANTIZE: by arch name, then
    family, then "default")."""
    return _by_arch(tables.FP8_QUANTIZE, arch, tables.FP8_QUANTIZE["default"])


def rotary_config(arch: Arch) -> Dict:
    """Launch settings of the fused RoPE kernel (tables.ROTARY_TILE: by arch name, then family, then
    "default")."""
    return _by_arch(tables.ROTARY_TILE, arch, tables.ROTARY_TILE["default"])


def _program_groups(arch: Arch, kernel: str) -> Dict:
    """tables.PROGRAM_GROUPS' rows of the family's `kernel` ("fwd" / "bwd"); empty when not listed."""
    return tables.PROGRAM_GROUPS.get(family_of(arch), {}).get(kernel) or {}


def grouped_order(arch: Arch, kernel: str) -> bool:
    """Whether the family's `kernel` ("fwd" / "bwd") launches compile the grouped program order
    (tables.PROGRAM_GROUPS lists it): one compiled variant per family, its group size a runtime int."""
    return bool(_program_groups(arch, kernel))


def program_group(arch: Arch, kernel: str, head_dim_padded: int, programs: int, causal: bool, fp8: bool = False) -> int:
    """How many (batch, head) pairs the causal forward ("fwd") or backward ("bwd") launch runs as one group
    (kernels/blocks.grouped_program_ids) when each pair has `programs` programs on axis 0: 1 (the grid order)
    unless causal; then tables.PROGRAM_GROUPS' target for the family, kernel, the table row of
    `head_dim_padded` and the dtype ("fp8" or "causal") over `programs`, within [1, tables.PROGRAM_GROUP_MAX]."""
    by_row = _program_groups(arch, kernel)
    if not causal or not by_row:
        return 1
    case = by_row.get(row_for(TABLES[family_of(arch)], head_dim_padded)["head_dim"], {})
    target = case.get("fp8" if fp8 else "causal", 0)
    return max(1, min(tables.PROGRAM_GROUP_MAX, target // max(1, programs)))


def nan_flags_config(arch: Arch) -> Dict:
    """Launch settings of the forward's V NaN-flag pass (tables.V_NAN_FLAGS: by arch name, then family,
    then "default")."""
    return _by_arch(tables.V_NAN_FLAGS, arch, tables.V_NAN_FLAGS["default"])


def bwd_preprocess_config(arch: Arch, head_dim_padded: int) -> Dict:
    """The backward's delta preprocess launch at this padded head dim: {"BLOCK_M": query rows per
    program, "num_warps"} from tables.BWD_PREPROCESS (by arch name, then family, then "default")."""
    entry = _by_arch(tables.BWD_PREPROCESS, arch, tables.BWD_PREPROCESS["default"])
    return {"BLOCK_M": max(16, entry["BLOCK_ELEMENTS"] // head_dim_padded), "num_warps": entry["num_warps"]}


def head_dim_chunks(arch: Arch, head_dim: int, head_dim_padded: int) -> tuple:
    """(D_PAD, D_HI): the head-dim chunks the kernels compute.  (head_dim_padded, 0) -- one chunk -- unless the
    family splits (tables.HEAD_DIM_SPLIT_FAMILIES), the padded head dim is at least tables.HEAD_DIM_SPLIT_MIN_PADDED
    and the rest past head_dim_padded / 2 is itself a power of two >= 16 (no padded column in the second chunk;
    tables says why): then (head_dim_padded / 2, that rest).  The launch reads the table row of D_PAD + D_HI (the
    first row whose head_dim is at least that: e.g. a 192 row for 128 + 64, else the padded head dim's row);
    where that row's entry sets RELOAD_CHUNK, the launch runs one chunk (the reloading kernels take no second one)."""
    lo = head_dim_padded // 2
    hi = head_dim - lo
    if (hi < 16 or hi & (hi - 1) or lo + hi >= head_dim_padded or head_dim_padded < tables.HEAD_DIM_SPLIT_MIN_PADDED
            or family_of(arch) not in tables.HEAD_DIM_SPLIT_FAMILIES):
        return head_dim_padded, 0
    return lo, hi
