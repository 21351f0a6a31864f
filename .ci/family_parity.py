#!/usr/bin/env python
"""Per-family parity of fa_amd inside Hugging Face models: a markdown table for docs/TRANSFORMERS.md.

Each supported family is built from a tiny random-init config (the tests' configs where a test has
one: tests/test_parity_hf.py, tests/test_family_patches.py) and run on one padded batch, a right-
and a left-padded copy of three rows (24, 17 and 9 real tokens; 24 is longer than every sliding
window here), with

  * attn_implementation="eager"   (the reference; fp32, and fp64 for the noise floor),
  * attn_implementation="fa_amd",
  * apply_fa_amd_to_<family>(model) (fused rotary + fa_amd) where the family has a patch.

Printed per family: max |logit diff| over the real tokens of both copies and max |grad diff| over
every parameter's gradient of the next-token loss over real tokens (a real token predicting the next
real one), each against eager in the same dtype; and the same two numbers for eager itself against
float64 eager on each row alone, unpadded: the precision's own error.  With --check the run fails
when fa_amd's error against float64 exceeds twice eager's own plus one unit in the last place of
the largest value (the developers' guide's bound).

    python .ci/family_parity.py                       # CPU: Triton's interpreter, fp32 (~2-4 min on 2 cores)
    python .ci/family_parity.py --families olmo2 cohere2 --check
    python .ci/family_parity.py --device cuda --dtype bf16
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "cohere2", "smollm3",
            "gpt_oss")
# what each tiny config exercises (the table's second column)
EXERCISES = {
    "llama": "GQA 4/2",
    "mistral": "sliding window 8",
    "qwen2": "second layer slides (window 5)",
    "qwen3": "q/k RMS norm per head",
    "gemma2": "query_pre_attn_scalar, attention softcap 5, sliding + global",
    "gemma3": "q/k norm, local + global rotary bases, sliding + global",
    "phi3": "fused qkv_proj, partial rotary 0.5",
    "olmo2": "q/k RMS norm over all heads",
    "cohere2": "interleaved rotary on sliding layers, NoPE global layer",
    "smollm3": "NoPE second layer",
    "gpt_oss": "learnable sinks, yarn rotary, sliding + full, MoE",
}
SEQ, LENGTHS = 24, (24, 17, 9)
# Random init (std 0.02) gives attention scores of ~0.03: near-uniform attention, where a wrong
# scale or softcap hardly shows.  Multiplying the q/k projections by 8 makes the scores O(1) (a
# 24-key row's largest probability goes from ~0.04 to ~0.3-0.6); families that RMS-norm q and k
# (Qwen3, Gemma 3, OLMo 2) are O(1) already and unchanged by it.
QK_GAIN = 8.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu runs fa_amd's kernels through Triton's interpreter (sets TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--qk-gain", type=float, default=QK_GAIN,
                        help=f"multiply q/k projection weights by this (default {QK_GAIN:g}: O(1) attention "
                             "scores; 1 = the tests' plain init, near-uniform attention)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when fa_amd's error vs float64 exceeds 2x eager's own + eps")
    return parser.parse_args(argv)


def tiny_model(family: str, qk_gain: float = QK_GAIN):
    """(model in fp32 with eager attention, its apply_fa_amd_to_<family> patch or None); q/k projection
    weights multiplied by `qk_gain`."""
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from fa_amd.integrations import monkey_patch as mp
    from tests import test_family_patches as fp
    from tests import test_parity_hf as ph

    patches = {"llama": mp.apply_fa_amd_to_llama, "mistral": mp.apply_fa_amd_to_mistral,
               **{name: entry[1] for name, entry in fp.FAMILIES.items()}}
    if family in ("llama", "mistral"):
        model = ph.tiny_model(family, "cpu", attn="eager")
    elif family in fp.FAMILIES:
        model = fp._model(family, "cpu")  # gpt-oss: random sinks, so a dropped sink would show
    else:  # no test builds these three; same shape of config as the family-patch tests
        t = transformers
        ids = dict(bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
        cls, config = {
            "olmo2": lambda: (t.Olmo2ForCausalLM, t.Olmo2Config(**fp.COMMON, **ids)),
            "cohere2": lambda: (t.Cohere2ForCausalLM, t.Cohere2Config(
                **fp.COMMON, **ids, head_dim=16, sliding_window=fp.WINDOW, logit_scale=0.25,
                layer_types=["sliding_attention", "full_attention"])),
            "smollm3": lambda: (t.SmolLM3ForCausalLM, t.SmolLM3Config(**fp.COMMON, **ids, no_rope_layers=[1, 0])),
        }[family]()
        torch.manual_seed(0)
        model = cls(config)
        model.set_attn_implementation("eager")
    assert getattr(model.config, "attention_dropout", 0.0) == 0.0  # deterministic comparisons
    if family == "gpt_oss":  # the experts' default grouped_mm has no float64 (the reference)
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                param.mul_(qk_gain)
    return model.float(), patches.get(family)


def padded_batches(vocab: int, device):
    """The same three rows right- and left-padded: [(ids, mask)] (pad id 0), and the rows themselves."""
    import torch

    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]
    batches = []
    for side in ("right", "left"):
        ids = torch.zeros(len(rows), SEQ, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, row in enumerate(rows):
            span = slice(0, len(row)) if side == "right" else slice(SEQ - len(row), SEQ)
            ids[r, span], mask[r, span] = row, 1
        batches.append((ids.to(device), mask.to(device)))
    return batches, [row.to(device) for row in rows]


def forward_backward(model, batches):
    """The logits of every real token (row by row, in order) and every parameter's gradient of the
    next-token loss over real tokens only (a real token predicting the next real one), so padded
    batches and unpadded single rows compare.  A mask of None means a row without padding."""
    import torch

    model.zero_grad(set_to_none=True)
    logits, targets = [], []
    for ids, mask in batches:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        for r in range(ids.shape[0]):
            logits.append(out[r][keep[r]])
            targets.append(ids[r][keep[r]])
    loss = sum(torch.nn.functional.cross_entropy(lg[:-1].double(), tg[1:], reduction="sum")
               for lg, tg in zip(logits, targets)) / sum(len(tg) - 1 for tg in targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits).detach(), grads


def max_diffs(run, ref):
    """(max |logit diff|, max |grad diff|) of `run` against `ref`, both in float64."""
    logits, grads = run
    ref_logits, ref_grads = ref
    assert grads.keys() == ref_grads.keys() and grads
    dl = (logits.double() - ref_logits.double()).abs().max().item()
    dg = max((grads[n].double() - ref_grads[n].double()).abs().max().item() for n in grads)
    return dl, dg


def family_parity(family: str, device: str = "cpu", dtype_name: str = "fp32", qk_gain: float = QK_GAIN) -> dict:
    """Errors of eager, fa_amd and the family patch (fp32 or half) against eager, and against eager in
    float64; on one right- and one left-padded batch."""
    import torch

    from fa_amd.integrations import monkey_patch as mp

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model, patch = tiny_model(family, qk_gain)
    batches, rows = padded_batches(model.config.vocab_size, device)
    model.train()  # attention dropout is 0: train mode is deterministic here and takes the training paths
    # float64 reference: each row alone, unpadded (HF's eager softmax runs in fp32, so an fp64 model's
    # fully masked pad rows turn into NaN that reaches real tokens through 0 * NaN), once per copy
    exact = forward_backward(model.to(device=device, dtype=torch.float64),
                             [(row[None], None) for row in rows] * len(batches))
    model.to(dtype)
    eager = forward_backward(model, batches)
    model.set_attn_implementation("fa_amd")
    fa = forward_backward(model, batches)
    model.set_attn_implementation("eager")
    row = dict(family=family, exercises=EXERCISES[family], dtype=dtype_name,
               eager_vs_fp64=max_diffs(eager, exact), fa_amd=max_diffs(fa, eager),
               fa_amd_vs_fp64=max_diffs(fa, exact), patch=None, patch_vs_fp64=None,
               scale=(exact[0].abs().max().item(), max(g.abs().max().item() for g in exact[1].values())))
    row["eps"] = tuple(torch.finfo(dtype).eps * size for size in row["scale"])  # one unit in the last place
    if patch is not None:
        try:
            assert patch(model) is model and model.config._attn_implementation == "fa_amd"
            patched = forward_backward(model, batches)
        finally:
            mp.revert_fa_amd_patches()
            model.set_attn_implementation("eager")
        row["patch"] = max_diffs(patched, eager)
        row["patch_vs_fp64"] = max_diffs(patched, exact)
    return row


def within_bound(row: dict) -> bool:
    """fa_amd's (and the patch's) error vs float64 at most 2x eager's own error + eps (the dtype's
    machine epsilon times the largest logit / gradient), for logits and for gradients."""
    floor = row["eager_vs_fp64"]
    for key in ("fa_amd_vs_fp64", "patch_vs_fp64"):
        bounds = [2 * f + eps for f, eps in zip(floor, row["eps"])]
        if row[key] is not None and not all(err <= bound for err, bound in zip(row[key], bounds)):  # NaN fails
            return False
    return True


def markdown(rows) -> str:
    def pair(p):
        return f"{p[0]:.1e} | {p[1]:.1e}"

    lines = ["| family | the tiny config exercises | fa_amd: max \\|Δlogit\\| | max \\|Δgrad\\| "
             "| patch: max \\|Δlogit\\| | max \\|Δgrad\\| | eager vs fp64: \\|Δlogit\\| | \\|Δgrad\\| "
             "| max \\|logit\\| | max \\|grad\\| |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        patch = "— | —" if r["patch"] is None else pair(r["patch"])
        lines.append(f"| {r['family']} | {r['exercises']} | {pair(r['fa_amd'])} | {patch} | "
                     f"{pair(r['eager_vs_fp64'])} | {pair(r['scale'])} |")
    return "\n".join(lines)


def environment(device: str) -> str:
    import platform

    import torch
    import transformers
    import triton

    where = (torch.cuda.get_device_name() if device == "cuda" else
             f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), Triton interpreter")
    return (f"{time.strftime('%Y-%m-%d', time.gmtime())}, {where}, torch {torch.__version__}, "
            f"triton {triton.__version__}, transformers {transformers.__version__}, Python "
            f"{platform.python_version()}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    sys.path.insert(0, str(REPO))
    import fa_amd  # noqa: F401  (registers "fa_amd")

    rows, failed = [], []
    for family in args.families:
        start = time.perf_counter()
        row = family_parity(family, args.device, args.dtype, args.qk_gain)
        rows.append(row)
        ok = within_bound(row)
        if not ok:
            failed.append(family)
        print(f"{family}: fa_amd {row['fa_amd']}, patch {row['patch']}, eager vs fp64 {row['eager_vs_fp64']}, "
              f"fa_amd vs fp64 {row['fa_amd_vs_fp64']}, patch vs fp64 {row['patch_vs_fp64']}, eps {row['eps']}, "
              f"{'ok' if ok else 'OVER 2x eager error'} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print(f"{args.dtype}, q/k gain {args.qk_gain:g}, {environment(args.device)}\n")
    print(markdown(rows))
    if args.check and failed:
        print(f"error: over the bound (2x eager's error vs fp64 + eps): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
