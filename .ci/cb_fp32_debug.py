"""GPU debug (scratch): HF continuous batching through route_flash_attention_2(), float32, CUDA graphs with
warmup -- which fa_amd memo makes the block-table decode path go wrong (audit 2026-11-25, repro_04)."""
import sys

import torch

import fa_amd
from fa_amd import kvcache
from fa_amd.kernels import decode, launch
from fa_amd.tuning import tables

fa_amd.integrations.route_flash_attention_2()
import transformers as T  # noqa: E402
from transformers import ContinuousBatchingConfig as C, GenerationConfig as G  # noqa: E402

B = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, pad_token_id=0)


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else "len")


class NoMemo(dict):
    def get(self, *a, **k):
        return None


VARIANTS = {
    "as is": lambda: None,
    "merge launch": lambda: setattr(tables, "DECODE_FUSED_MERGE_FAMILIES", ()),
    "no plain-call memo": lambda: setattr(kvcache, "_CHECKED_PLAIN_CALLS", NoMemo()),
    "no kept scratch": lambda: setattr(decode, "_MAX_KEPT_SCRATCH", 0),
    "no split": lambda: setattr(decode, "_num_splits", lambda *a: 1),
    "counters in the pool (before the fix)": lambda: setattr(
        launch, "zeros_outside_pools", lambda n, device: torch.zeros(n, dtype=torch.int32, device=device)),
}
names = sys.argv[1:] or list(VARIANTS)[:1]  # one variant per process (plans are memoized)
dt = torch.float32
torch.manual_seed(0)
m = T.LlamaForCausalLM._from_config(T.LlamaConfig(**B), attn_implementation="eager").cuda().to(dt).eval()
with torch.no_grad():
    for k, p in m.named_parameters():
        if "q_proj.w" in k or "k_proj.w" in k:
            p.mul_(8)
torch.manual_seed(3)
P = [torch.randint(3, 256, (x,)).tolist() for x in (20, 9, 14, 3)]
ex = [m.generate(torch.tensor([p]).cuda(), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=-1)[
    0, len(p):].tolist() for p in P]
m.set_attn_implementation("flash_attention_2")
calls = []
real = fa_amd.flash_attn_with_kvcache


def spy(q, k_cache, v_cache, *a, **kw):
    calls.append((tuple(q.shape), q.dtype, kw.get("num_splits", 0), torch.cuda.is_current_stream_capturing()))
    return real(q, k_cache, v_cache, *a, **kw)


for name in names:
    VARIANTS[name]()
    R = m.generate_batch(P, generation_config=G(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=-1),
                         continuous_batching_config=C(num_blocks=32, max_batch_tokens=64, block_size=16,
                                                      max_blocks_per_request=8, use_cuda_graph=None),
                         progress_bar=False, warmup=True)
    print(name, "diffs", [first_diff(R[f"req_{i}"].generated_tokens, ex[i]) for i in range(4)], flush=True)
