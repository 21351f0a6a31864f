"""fa_amd.import_hooks.when_imported called from inside the import of a watched module (a module that
the watched one imports imports fa_amd): that import's loader ran before the post-import finder could
wrap it, so the callback used to be lost for good -- "fa_amd" was then never registered with
Transformers if fa_amd got imported while transformers.modeling_utils was importing.  It now runs at
the first import after the watched module finished."""
import subprocess
import sys
import textwrap

import pytest

PACKAGE = {
    "__init__.py": "",
    # the watched module imports the code that registers the hook, then the second watched module
    "watched.py": "import probe_pkg.registers\n{second}\nVALUE = 1\n",
    "second.py": "VALUE = 2\n",
    "registers.py": textwrap.dedent("""
        import sys
        from fa_amd.import_hooks import when_imported
        fired = []
        when_imported(("probe_pkg.watched", "probe_pkg.second"),
                      lambda: fired.append(sys.modules["probe_pkg.watched"].VALUE))
    """),
    "later.py": "",
}


@pytest.mark.parametrize("second_first", [False, True], ids=["watched_alone", "second_loaded_before"])
@pytest.mark.parametrize("watched_imports_second", [True, False])
def test_hook_registered_during_a_watched_import_still_fires(tmp_path, second_first, watched_imports_second):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    for name, text in PACKAGE.items():
        text = text.format(second="import probe_pkg.second" if watched_imports_second else "")
        (pkg / name).write_text(text)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import fa_amd.import_hooks
        {"import probe_pkg.second" if second_first else ""}
        import probe_pkg.watched
        import probe_pkg.registers as r
        assert r.fired == [] or r.fired == [1], r.fired
        import probe_pkg.later  # the next import after the watched one finished
        assert r.fired == [1], r.fired
        import probe_pkg.second
        import json, email.mime.text  # nothing fires it twice
        assert r.fired == [1], r.fired
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_failed_watched_import_leaves_the_hook_waiting(tmp_path):
    """A deferred hook whose watched import failed (no module left loaded) does not fire then, and still
    fires once the module imports."""
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "registers.py").write_text(textwrap.dedent("""
        from fa_amd.import_hooks import when_imported
        fired = []
        when_imported(("probe_pkg.watched",), lambda: fired.append(1))
    """))
    (pkg / "watched.py").write_text("import os\nimport probe_pkg.registers\nif not os.environ.get('OK'):\n"
                                    "    raise RuntimeError('boom')\n")
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import fa_amd.import_hooks
        try:
            import probe_pkg.watched
        except RuntimeError:
            pass
        import probe_pkg.registers as r
        import json, email.mime.text
        assert r.fired == [], r.fired
        os.environ["OK"] = "1"
        import probe_pkg.watched
        assert r.fired == [1], r.fired
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
