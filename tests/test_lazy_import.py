"""`import fa_amd` stays cheap: Transformers is registered with when its modeling code loads, in
either import order, instead of being imported by fa_amd."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(code: str):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_import_fa_amd_then_transformers_registers_on_first_use():
    _run("""
        import sys
        import fa_amd
        import fa_amd.integrations
        assert not any(m == "transformers" or m.startswith("transformers.") for m in sys.modules), \\
            sorted(m for m in sys.modules if m.startswith("transformers"))
        import transformers  # the package alone (e.g. for a tokenizer) does not load the modeling code
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
        from transformers.masking_utils import AttentionMaskInterface
        assert "fa_amd" in AttentionInterface._global_mapping
        assert "fa_amd" in AttentionMaskInterface._global_mapping
        config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2)
        assert LlamaForCausalLM._from_config(config, attn_implementation="fa_amd").config._attn_implementation \\
            == "fa_amd"
        print("ok")
    """)


def test_transformers_first_then_fa_amd():
    _run("""
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.masking_utils import AttentionMaskInterface
        import fa_amd
        assert "fa_amd" in AttentionMaskInterface._global_mapping
        config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2)
        assert LlamaForCausalLM._from_config(config, attn_implementation="fa_amd").config._attn_implementation \\
            == "fa_amd"
        print("ok")
    """)


def test_post_import_hook_runs_once_after_the_module_body(tmp_path, monkeypatch):
    from fa_amd.import_hooks import when_imported

    (tmp_path / "fa_amd_hook_probe.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported(("fa_amd_hook_probe",), lambda: seen.append(sys.modules["fa_amd_hook_probe"].VALUE + 1))
    assert seen == []
    import fa_amd_hook_probe  # noqa: F401

    assert seen == [42]
    del sys.modules["fa_amd_hook_probe"]
    import fa_amd_hook_probe  # noqa: F401,F811  (a re-import does not fire it again)

    assert seen == [42]
    when_imported(("fa_amd_hook_probe",), lambda: seen.append("now"))  # already imported: runs at once
    assert seen == [42, "now"]
    del sys.modules["fa_amd_hook_probe"]


def test_uninstalled_source_checkout_finds_its_integrations(tmp_path):
    """A checkout run in place with no (or a failed) install: fa_amd.integrations still loads from the
    integrations/ folder beside fa_amd/, and "fa_amd" still registers with Transformers."""
    import shutil

    for name in ("fa_amd", "integrations"):
        shutil.copytree(REPO_ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    code = f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, {str(tmp_path)!r})
        import fa_amd
        assert fa_amd.__file__.startswith({str(tmp_path)!r}), fa_amd.__file__
        from fa_amd.integrations.hf_attention import fa_amd_attention_forward
        assert fa_amd.integrations.__file__.startswith({str(tmp_path)!r})
        import transformers.modeling_utils
        from transformers import AttentionInterface
        assert "fa_amd" in AttentionInterface._global_mapping
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
