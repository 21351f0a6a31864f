"""The package's layers import only the layers below them (DESIGN.md): kernels read tables,
the tools that time kernels (autotune, bench, aot) sit above them, and nothing below the
public interface imports it."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fa_amd"
# module (dotted, under fa_amd) -> the fa_amd modules it must never import
FORBIDDEN = {
    "kernels": ("autotune", "bench", "aot", "cli", "interface", "ops", "sdpa"),
    "tuning": ("kernels", "autotune", "bench", "aot", "cli", "interface", "ops", "sdpa"),
    "arch": ("kernels", "tuning", "autotune", "bench", "aot", "cli", "interface", "ops"),
}


def _fa_amd_imports(path: Path):
    """fa_amd submodules (first component under fa_amd) that `path` imports, absolute or relative."""
    rel_parts = path.relative_to(ROOT).with_suffix("").parts
    package = rel_parts[:-1] if path.name != "__init__.py" else rel_parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)]) if node.level > 1 else list(package)
                mod = base + (node.module.split(".") if node.module else [])
                targets = [mod + [a.name] for a in node.names] if not node.module else [mod]
            elif node.module and node.module.startswith("fa_amd"):
                targets = [node.module.split(".")[1:]]
            else:
                continue
            found.update(t[0] for t in targets if t)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("fa_amd."))
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_below(layer):
    files = sorted((ROOT / layer).rglob("*.py")) if (ROOT / layer).is_dir() else [ROOT / f"{layer}.py"]
    assert files
    for path in files:
        bad = _fa_amd_imports(path) & set(FORBIDDEN[layer])
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} from a layer above it"
