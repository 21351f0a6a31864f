""".ci/family_parity.py (the per-family parity table in docs/TRANSFORMERS.md) on the three families that
no other test builds: OLMo 2 (q/k norm over all heads), Cohere 2 (interleaved rotary, NoPE global
layer) and SmolLM3 (NoPE layer), each with attn_implementation="fa_amd" against eager on a right- and
a left-padded batch in fp32, within 2x eager's own error against float64 (logits and every gradient)."""
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "family_parity.py"


@pytest.fixture(scope="module")
def family_parity():
    spec = importlib.util.spec_from_file_location("family_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["olmo2", "cohere2", "smollm3"])
def test_family_matches_eager(family_parity, family, device):
    row = family_parity.family_parity(family, device)
    assert row["patch"] is None  # no apply_fa_amd_to_<family> for these: attn_implementation="fa_amd" only
    assert family_parity.within_bound(row), row
    # the comparison is not vacuous: real logits and gradients, and a measurable eager error
    assert min(row["scale"]) > 1e-3 and min(row["eager_vs_fp64"]) > 0


def test_table_and_bound(family_parity):
    row = dict(family="x", exercises="y", eager_vs_fp64=(1e-7, 1e-8), fa_amd=(1e-7, 1e-8), fa_amd_vs_fp64=(1e-7, 1e-8),
               patch=None, patch_vs_fp64=None, scale=(0.5, 0.1), eps=(6e-8, 1.2e-8))
    assert family_parity.within_bound(row)
    table = family_parity.markdown([row]).splitlines()
    cells = [len(re.findall(r"(?<!\\)\|", line)) for line in table]  # escaped \| stay inside a cell
    assert len(table) == 3 and cells == [cells[0]] * 3
    assert not family_parity.within_bound(dict(row, fa_amd_vs_fp64=(1e-5, 1e-8)))
    assert not family_parity.within_bound(dict(row, patch_vs_fp64=(float("nan"), 0.0)))
