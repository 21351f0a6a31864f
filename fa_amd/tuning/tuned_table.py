"""Tuned launch tables on disk: reading, merging over the defaults, writing.

The file at `tuned_table_path()` holds, per arch family, rows with the same
structure as tables.py ({"head_dim", "fwd", "dkdv", "dq"}) plus a "tuned" note
(device, triton version, timings).  `load_tuned_table()` returns every family
present there with its tuned rows merged over the default rows, so a family
tuned only for head dim 128 still gets the default 64 and 256 rows.

The tuner that writes the file times kernels, so it sits above them, in
fa_amd/autotune.py; this module only reads and writes tables (data), which the
kernels' launch-config chooser (fa_amd.tuning) needs.  With FA_AMD_AUTOTUNE=1
the chooser calls `first_use_hook` (installed by fa_amd.autotune) before it
reads a head-dim class for the first time.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Dict, List, Optional

from .tables import TABLES

AUTOTUNE_ENV = "FA_AMD_AUTOTUNE"
FILE_FORMAT = 1
ROW_KERNELS = ("fwd", "dkdv", "dq")  # every row has these
# optional per row (falls back to "dkdv"): dK/dV kernel that also accumulates dQ
# with atomics, used by the non-deterministic backward
OPTIONAL_KERNELS = ("dkdv_atomic",)


def tuned_table_path() -> Path:
    return Path(_current_table_path())


# The bytes mapping behind os.environ on POSIX (os.environ writes through to it, monkeypatched values too).
_RAW_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS: Dict[str, bytes] = {}


def getenv(name: str) -> Optional[str]:
    """os.environ.get(name) without its per-call key encoding (~0.8 us a read, ~2.5 us on the lent GPU
    machines' CPUs): every launch config lookup reads three variables (the tuned table's path, autotune)."""
    if not isinstance(_RAW_ENVIRON, dict):
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    raw = _RAW_ENVIRON.get(key)
    return None if raw is None else os.fsdecode(raw)


def _current_table_path() -> str:
    return _tuned_table_path(getenv("FA_AMD_CACHE_DIR"), getenv("HOME"))


@functools.lru_cache(maxsize=8)
def _tuned_table_path(cache_dir: Optional[str], _home: Optional[str]) -> str:
    # keyed on the two variables it depends on: every launch asks (via get_config),
    # and building the path with pathlib/expanduser cost more than the launch's own Python
    root = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "fa_amd")
    return os.path.join(root, "tuned_table.json")


def autotune_enabled() -> bool:
    return (getenv(AUTOTUNE_ENV) or "0") not in ("", "0", "false", "False")


# --------------------------------------------------------------------------- reading / writing

# While the tuner times a candidate it installs that candidate here, so the
# ordinary launchers (and get_config) run it unchanged.
_candidate_override: Optional[Dict[str, list]] = None
# (arch, head_dim_padded) -> None, called by the chooser before each lookup on a GPU; set by
# fa_amd.autotune (tune on first use with FA_AMD_AUTOTUNE=1), None until then.
first_use_hook = None


def _valid_launch(cfg) -> bool:
    return (isinstance(cfg, dict) and isinstance(cfg.get("BLOCK_M"), int) and isinstance(cfg.get("BLOCK_N"), int)
            and all(isinstance(v, (int, dict)) for v in cfg.values()))


def _valid_row(row) -> bool:
    return (isinstance(row, dict) and isinstance(row.get("head_dim"), int)
            and all(_valid_launch(row.get(k)) for k in ROW_KERNELS)
            and all(_valid_launch(row[k]) for k in OPTIONAL_KERNELS if k in row))


def _read_file(path: Path) -> Dict[str, List[dict]]:
    """{family: [tuned rows]} from disk; a missing file is empty, a broken one is ignored with a warning."""
    if not path.exists():
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        families = data["families"] if "families" in data else data
        good = {fam: [r for r in rows if _valid_row(r)] for fam, rows in families.items() if isinstance(rows, list)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(f"fa_amd: ignoring unreadable tuned table {path} ({exc}); using default configs")
        return {}
    return {fam: rows for fam, rows in good.items() if rows}


def merge_rows(default_rows: List[dict], tuned_rows: List[dict]) -> List[dict]:
    """Default rows with each tuned row replacing the default row of its head_dim, sorted by head_dim."""
    by_dim = {r["head_dim"]: r for r in default_rows}
    by_dim.update({r["head_dim"]: r for r in tuned_rows})
    return [by_dim[d] for d in sorted(by_dim)]


@functools.lru_cache(maxsize=None)
def _load_from_disk(path: str) -> Dict[str, List[dict]]:
    tuned = _read_file(Path(path))
    return {fam: merge_rows(TABLES.get(fam, []), rows) for fam, rows in tuned.items()}


def load_tuned_table() -> dict:
    """{family: rows} for every family with tuned rows on disk (merged over the defaults)."""
    if _candidate_override is not None:
        return _candidate_override
    return _load_from_disk(_current_table_path())


def invalidate_cache():
    from . import _RESOLVED  # the chooser's memo of resolved configs (fa_amd.tuning imports this module)

    _load_from_disk.cache_clear()
    _RESOLVED.clear()


def save_tuned_rows(family: str, rows: List[dict], path: Optional[Path] = None) -> Path:
    """Merge `rows` into the family's entry on disk (atomic replace) and drop the read cache."""
    path = Path(path) if path is not None else tuned_table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = _read_file(path)
    existing[family] = merge_rows(existing.get(family, []), rows)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuned_table.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FILE_FORMAT, "families": existing}, f, indent=1)
    os.replace(tmp, path)  # readers in other processes see the old or the new file, never half of one
    invalidate_cache()
    return path


def tuned_copy() -> Dict[str, List[dict]]:
    """Deep copy of what is on disk (for `fa-amd info`)."""
    return copy.deepcopy(_read_file(tuned_table_path()))
