"""The GPU A/B scripts built on .ci/family_ab.py run end to end in their SMOKE mode (CPU interpreter, made-up
times): each switches its table between the two routes and puts it back, so a GPU call does not fail on a typo."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.cpu_only
@pytest.mark.parametrize("script,table,routes", [
    ("nan_fixup_ab.py", "FWD_NAN_FIXUP_FAMILIES", ("fixup", "pass")),
    ("bwd_delta_ab.py", "BWD_DELTA_IN_DQ_FAMILIES", ("dq first", "preprocess")),
    ("split_return_ab.py", "DKDV_SPLIT_EARLY_RETURN_FAMILIES", ("early return", "empty ranges")),
    ("even_ab.py", "EVEN_QK_FAMILIES", ("whole blocks", "bounded")),
])
def test_family_ab_scripts_switch_their_table(script, table, routes):
    code = (f"import runpy, sys; sys.argv = ['{script}']; sys.path.insert(0, {os.path.join(ROOT, '.ci')!r})\n"
            "import family_ab\n"
            "from fa_amd.tuning import tables\n"
            f"before = tables.{table}\n"
            "seen = []\n"
            "real = family_ab._timed\n"
            "def spy(shape, method, direction, table, modes, *maker):\n"
            "    call, grads = real(shape, method, direction, table, modes, *maker)\n"
            "    def wrapped():\n"
            "        call()\n"
            "        seen.append((method, getattr(tables, table)))\n"
            "    return wrapped, grads\n"
            "family_ab._timed = spy\n"
            f"runpy.run_path({os.path.join(ROOT, '.ci', script)!r}, run_name='__main__')\n"
            f"assert tables.{table} == before\n"
            "print('SEEN', sorted(set(seen)))\n")
    env = dict(os.environ, SMOKE="1", TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    seen = dict(ast.literal_eval(res.stdout.split("SEEN ", 1)[1].strip()))
    on, off = routes
    assert "cpu" in seen[on] and "cpu" not in seen[off]
    assert f"| {on} | {off} |" in res.stdout


@pytest.mark.cpu_only
def test_fwd_timeline_patches_this_forward():
    """.ci/fwd_timeline.py patches attn_fwd_kernel by anchors in its source: they must all still be found, so a GPU
    call does not fail on an edit of the forward (the patched copy imports under its own name)."""
    code = (f"import runpy, sys; sys.path.insert(0, {ROOT!r})\n"
            f"m = runpy.run_path({os.path.join(ROOT, '.ci', 'fwd_timeline.py')!r})\n"
            f"mod, fwd = m['load_patched']('ci', {ROOT!r})\n"
            "text = open(fwd.__file__).read()\n"
            "assert text.count('Timeline') == 7 and 'Timeline=_TIMELINE[0]' in text\n"
            "print('PATCHED', mod.__name__)\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "PATCHED fa_amd_tl_ci" in res.stdout
