"""Another tree's fa_amd imported beside this one: the GPU A/B probes (.ci/twin_ab.py, .ci/fwd_timeline.py) load
two versions of the kernels into one process; and how they compare the two versions' rounds."""
import os
import shutil
import sys
import tempfile


def copy_fa_amd(tree: str, pkg: str) -> str:
    """tree/fa_amd copied to a temporary folder on sys.path as package `pkg` (its torch.library ops renamed into
    the `pkg` namespace, so both versions register); returns the copy's folder (edit it before importing)."""
    src = os.path.join(tree, "fa_amd")
    if not os.path.isdir(src):
        raise SystemExit(f"{tree} has no fa_amd/ folder")
    root = tempfile.mkdtemp(prefix=f"{pkg}_")
    dst = os.path.join(root, pkg)
    shutil.copytree(src, dst)
    for folder, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                file = os.path.join(folder, name)
                with open(file) as f:
                    text = f.read()
                with open(file, "w") as f:
                    f.write(text.replace('"fa_amd::', f'"{pkg}::'))
    sys.path.insert(0, root)
    return dst


def paired_change_pct(new_rounds, base_rounds):
    """(median, lowest, highest) per-round change of `new` against `base` in %: a round times both at about the
    same clock level, so the paired change is far steadier than the ratio of medians when the GPU moves between
    power-cap levels."""
    paired = sorted(100 * (new / base - 1) for new, base in zip(new_rounds, base_rounds))
    return paired[len(paired) // 2], paired[0], paired[-1]
