"""Tuned tables on disk (opt-in).  Placeholder reader: returns {} until a tuned
table exists; `fa-amd tune` writes one."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path


def tuned_table_path() -> Path:
    root = os.environ.get("FA_AMD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fa_amd")
    return Path(root) / "tuned_table.json"


@functools.lru_cache(maxsize=None)
def load_tuned_table() -> dict:
    path = tuned_table_path()
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)
