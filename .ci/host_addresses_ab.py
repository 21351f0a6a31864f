"""Host time per call with Triton's launcher handed device addresses (kernels/launch.CompiledLaunch.launch, as
shipped) against the tensors themselves (the launcher then calls data_ptr() and queries the driver per tensor
argument), in interleaved rounds in one process; SDPA / Transformers' sdpa function alongside.

Rows: flash_attn_with_kvcache (GQA 32/8, d128, bf16, one query token), Transformers' attention function on a
decode step (fa_amd vs sdpa; batch 8, 16/4 heads, 1025 keys), and a small forward+backward (b32 s512 h16 d128
causal, flash_attn_func vs SDPA).  Microseconds to issue one call, best of 5 runs of CALLS calls (no sync inside
a run), median over ROUNDS rounds.

    python .ci/host_addresses_ab.py        # on the GPU machine; ROUNDS=7 CALLS=40
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa_amd  # noqa: E402
from fa_amd.bench import best_host_us  # noqa: E402
from fa_amd.kernels import launch as L  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 9))
CALLS = int(os.environ.get("CALLS", 40))
_SHIPPED = L.CompiledLaunch.launch


def _launch_tensors(self, tensors, stream=None):
    """CompiledLaunch.launch before addresses: the tensors in their slots, on either path."""
    values = self.values.copy()
    for slot, t in zip(self.slots, tensors):
        values[slot] = t
    if stream is None or L._launch_hooks(self.hooks):
        self.runner(*values, stream=stream)
    else:
        run, x, y, z, function, packed_metadata = self.direct
        run(x, y, z, stream, function, packed_metadata, None, None, None, *values)


def rows():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from integrations.hf_attention import fa_amd_attention_forward

    dev, bf = "cuda", torch.bfloat16
    out = {}
    for batch, cache in ((1, 2048), (8, 2048)):
        q = torch.randn(batch, 1, 32, 128, device=dev, dtype=bf)
        k = torch.randn(batch, cache, 8, 128, device=dev, dtype=bf)
        v = torch.randn_like(k)
        lens = torch.full((batch,), cache - 7, dtype=torch.int32, device=dev)
        out[f"kvcache b{batch} {cache}"] = (lambda q=q, k=k, v=v, lens=lens: fa_amd.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lens, causal=True), None)
    # the replayed launch alone (kernels/launch.CompiledLaunch.launch), on a call whose kernel is shorter than its
    # host time: what the variants change, without the rest of the call's host time and its noise
    from fa_amd.kernels import decode as D

    q = torch.randn(1, 1, 32, 128, device=dev, dtype=bf)
    k = torch.randn(1, 256, 8, 128, device=dev, dtype=bf)
    for _ in range(2):  # the plan, then its replay
        D.decode_forward(q, k, k, 128 ** -0.5, -1, 0, 0.0, None)
    plan = next(p for p in D._PLANS.values() if p.out_shape == tuple(q.shape))
    stream = D._current_stream(q)
    o, lse = q.new_empty(q.shape), q.new_empty((1, 32, 1), dtype=torch.float32)
    parts = (torch.empty(plan.part_shapes[0], dtype=torch.float32, device=dev),
             torch.empty(plan.part_shapes[1], dtype=torch.float32, device=dev)) if plan.part_shapes else (lse, lse)
    call = D._decode_tensors(q, k, k, o, lse, *parts, *([None] * 11)) + (
        (D._counters_for(q, plan.counters, stream, False),) if plan.counters else ())
    replay = plan.replays["decode"]
    out["replayed launch alone (decode b1 256)"] = (lambda: replay.launch(call, stream), None)
    module = torch.nn.Module()
    module.is_causal, module.training, module.num_key_value_groups = True, False, 4
    q = torch.randn(8, 16, 1, 128, device=dev, dtype=bf)
    k = torch.randn(8, 4, 1025, 128, device=dev, dtype=bf)
    v = torch.randn_like(k)
    mask = torch.ones(8, 1025, dtype=torch.long, device=dev)
    out["HF decode step b8"] = (lambda: fa_amd_attention_forward(module, q, k, v, mask, scaling=128 ** -0.5),
                                lambda: sdpa_attention_forward(module, q, k, v, None, scaling=128 ** -0.5))
    qs = [torch.randn(32, 512, 16, 128, device=dev, dtype=bf, requires_grad=True) for _ in range(3)]
    do = torch.randn(32, 512, 16, 128, device=dev, dtype=bf)

    def fa_fwd_bwd():
        fa_amd.flash_attn_func(*qs, causal=True).backward(do)

    qt = [t.detach().transpose(1, 2).requires_grad_() for t in qs]
    dot = do.transpose(1, 2)

    def sdpa_fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(*qt, is_causal=True).backward(dot)

    out["fwd+bwd b32 s512 d128 causal"] = (fa_fwd_bwd, sdpa_fwd_bwd)
    return out


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "rounds", ROUNDS, "calls", CALLS)
    cells = {}
    table = rows()
    for r in range(ROUNDS):
        order = [("addresses", _SHIPPED), ("tensors", _launch_tensors)]
        for variant, method in (order if r % 2 == 0 else order[::-1]):
            L.CompiledLaunch.launch = method
            for name, (fn, peer) in table.items():
                cells.setdefault((name, variant), []).append(best_host_us(fn, CALLS))
        L.CompiledLaunch.launch = _SHIPPED
        for name, (fn, peer) in table.items():
            if peer is not None:
                cells.setdefault((name, "peer"), []).append(best_host_us(peer, CALLS))
    for name in table:
        line = " | ".join(f"{variant} {statistics.median(cells[(name, variant)]):6.1f}"
                          for variant in ("addresses", "tensors", "peer") if (name, variant) in cells)
        print(f"# {name}: host us per call, {line}")


if __name__ == "__main__":
    main()
