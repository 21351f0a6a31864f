"""Host microseconds of the pieces of one Transformers decode-step attention call (issue 14: generate()
with a dynamic cache trails sdpa on host time), at the `fa-amd bench --generate` shape (batch 8, 16 / 4
heads, d128, a 1024-key cache, bf16): HF's attention functions for fa_amd and sdpa, fa_amd's layers
under it, and single pieces (allocations, the stream lookup, the replay's checks and Triton's runner).
Each figure: the best of 5 runs of N calls back to back, no sync.

    python .ci/decode_pieces.py            # on the GPU machine
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa_amd import kvcache  # noqa: E402
from fa_amd.bench import best_host_us  # noqa: E402
from fa_amd.kernels import decode as D  # noqa: E402
from integrations import hf_attention as H  # noqa: E402

N = int(os.environ.get("N", 2000))


def main():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    print(torch.cuda.get_device_name(), "torch", torch.__version__)

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 4

    module = Module().eval()
    b, hq, hk, d, length = 8, 16, 4, 128, 1024
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, length, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scale = d ** -0.5
    rows = []
    with torch.no_grad():
        rows.append(("HF sdpa_attention_forward", lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale)))
        rows.append(("HF fa_amd_attention_forward", lambda: H.fa_amd_attention_forward(module, q, k, v, None,
                                                                                        scaling=scale)))
        rows.append(("  fa_amd.kvcache.decode_attention", lambda: kvcache.decode_attention(qt, kt, vt, scale, -1, 0,
                                                                                           0.0)))
        rows.append(("  decode_forward", lambda: D.decode_forward(qt, kt, vt, scale, -1, 0, 0.0, None)))
        for _ in range(2):  # the plan, then its replay
            D.decode_forward(qt, kt, vt, scale, -1, 0, 0.0, None)
        plan = next(p for p in D._PLANS.values() if p.out_shape == tuple(qt.shape))
        stream = D._current_stream(qt)
        rows.append(("    _run_plan", lambda: D._run_plan(plan, qt, kt, vt, None, None, None, None, None, None, None)))
        rows.append(("    q.new_empty (out)", lambda: qt.new_empty(qt.shape)))
        rows.append(("    torch.empty fp32 (a split buffer)", lambda: torch.empty((4, b, hq, d), dtype=torch.float32,
                                                                                  device=qt.device)))
        rows.append(("    _current_stream", lambda: D._current_stream(qt)))
        replay = plan.replays["decode"]
        out = qt.new_empty(qt.shape)
        lse = qt.new_empty((b, hq, 1), dtype=torch.float32)
        parts = (torch.empty(plan.part_shapes[0], dtype=torch.float32, device="cuda"),
                 torch.empty(plan.part_shapes[1], dtype=torch.float32, device="cuda")) if plan.part_shapes else (lse,
                                                                                                                  lse)
        tensors = D._decode_tensors(qt, kt, vt, out, lse, *parts, None, None, None, None, None, None, None, None, None,
                                    None, None)
        extra = (D._counters_for(qt, plan.counters, stream, False),) if plan.counters else ()
        call = tensors + extra
        rows.append(("    _decode_tensors", lambda: D._decode_tensors(qt, kt, vt, out, lse, *parts, None, None, None,
                                                                      None, None, None, None, None, None, None,
                                                                      None)))
        rows.append(("    replay.fits", lambda: replay.fits(call)))
        rows.append(("    replay.launch (Triton's runner)", lambda: replay.launch(call, stream)))
        rows.append(("torch sdpa alone (enable_gqa)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=scale, enable_gqa=True)))
        rows.append(("q.transpose(1, 2)", lambda: q.transpose(1, 2)))
        for name, fn in rows:
            print(f"{name:42s} {best_host_us(fn, N, warmup=100):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
