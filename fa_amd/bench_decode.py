"""Decode benchmarks: KV-cache attention rows and Transformers generate() tokens/s.

    fa-amd bench --decode                     # batch {1, 8, 64} x cache {2k, 8k, 32k, 128k}, GQA 32/8, d128
    fa-amd bench --decode --out bench_out     # + decode.json / decode.md
    fa-amd bench --generate                   # HF generate tokens/s, fa_amd vs sdpa, interleaved rounds
    fa-amd bench --decode --generate --markdown docs/PERFORMANCE.md   # (re)writes the doc's decode section
    TRITON_INTERPRET=1 fa-amd bench --decode --generate --smoke   # tiny CPU run (CI)

Decode rows: one query token per sequence attends a full KV cache (--dtype, bf16 by default; fp32 in
the CPU smoke run).  Every method reads the same cache tensors ((batch, kv_heads, cache, d) storage;
fa_amd and flash_attn get its (batch, cache, kv_heads, d) view), so a 128k x batch-64 row fits once in
memory.  KV GB/s counts the K and V bytes one call must read (2 x batch x cache x kv_heads x d x 2 bytes
in bf16) over its time.
Methods: fa_amd (flash_attn_with_kvcache), torch SDPA (its own backend choice, enable_gqa),
FlexAttention (torch.compile), flash_attn.flash_attn_with_kvcache if installed.  Timing as in
`fa-amd bench`: per row, every method is timed in interleaved rounds (each round starts with
another method and the method's own untimed warm-up calls, bench.ROUND_WARM_MS), each call after an L2
flush that leaves clean lines (DECODE_L2_FLUSH) with CUDA events, median call per round, median round.

generate(): a random-init Llama (8 layers, hidden 2048, 16 query / 4 KV heads, d128; the recipes'
GPU shape), batch 8, a 1024-token prompt, 128 new greedy tokens (min = max), DynamicCache and
StaticCache; each (implementation, cache) is warmed up once, then timed in interleaved rounds; new
tokens per second of the median round.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

from . import bench

DECODE_BATCHES = (1, 8, 64)
DECODE_CACHES = (2048, 8192, 32768, 131072)
DECODE_HEADS = (32, 8)
DECODE_HEAD_DIM = 128
DECODE_METHODS = ("fa_amd", "sdpa", "flex", "flash_attn")
# HBM peak (GB/s) of GPUs we know, for the "% of peak" column; others: --hbm-peak-gbs
HBM_PEAK_GBS = {"H100 80GB HBM3": 3350, "H100 SXM": 3350, "H100": 3350, "H200": 4800, "MI300X": 5300,
                "MI325X": 6000, "MI250X": 3277, "A100-SXM4-80GB": 2039, "A100": 1555}
GENERATE_IMPLS = ("fa_amd", "sdpa")
# decode rows are bandwidth-bound: their L2 flush leaves clean lines (bench.l2_flush "read"), so a call is
# not charged the write-back of a zeroing flush's dirty lines (~16 us on the H100; docs/PERFORMANCE.md)
DECODE_L2_FLUSH = "read"


@dataclass
class DecodeRow:
    batch: int
    cache: int
    heads_q: int = DECODE_HEADS[0]
    heads_kv: int = DECODE_HEADS[1]
    head_dim: int = DECODE_HEAD_DIM

    @property
    def label(self) -> str:
        return f"b{self.batch} cache {self.cache // 1024}k" if self.cache >= 1024 else f"b{self.batch} cache {self.cache}"

    def kv_bytes(self, itemsize: int = 2) -> int:
        return 2 * self.batch * self.cache * self.heads_kv * self.head_dim * itemsize


@dataclass
class DecodeResult:
    row: Dict
    label: str
    method: str
    us: Optional[float] = None
    gbs: Optional[float] = None
    note: str = ""
    rounds_us: List[float] = field(default_factory=list)
    host_us: Optional[float] = None  # CPU time to issue one call (no sync): decode is often host-bound


def decode_rows(smoke: bool = False) -> List[DecodeRow]:
    if smoke:
        return [DecodeRow(1, 40, 4, 2, 32), DecodeRow(2, 70, 4, 1, 32)]
    return [DecodeRow(b, s) for b in DECODE_BATCHES for s in DECODE_CACHES]


def parse_decode_rows(items: List[str]) -> List[DecodeRow]:
    """--decode-rows: BxCACHE items, integers B >= 1 and CACHE >= 1; ValueError (one line) otherwise."""
    rows = []
    for item in items:
        fields = item.lower().split("x")
        if len(fields) != 2 or not all(f.isascii() and f.isdigit() and int(f) >= 1 for f in fields):
            raise ValueError(f"--decode-rows takes BxCACHE with integers B >= 1 and CACHE >= 1 (e.g. 1x2048 "
                             f"64x131072), got {item!r}")
        rows.append(DecodeRow(int(fields[0]), int(fields[1])))
    return rows


# --------------------------------------------------------------------------- methods

def _decode_call(method: str, row: DecodeRow, q, k, v, device):
    """fn() computing the row's attention with `method`; q (b, hq, 1, d), k/v (b, hk, cache, d)."""
    if method == "fa_amd":
        import fa_amd

        q_f, k_f, v_f = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return lambda: fa_amd.flash_attn_with_kvcache(q_f, k_f, v_f)
    if method == "flash_attn":
        try:
            import flash_attn
        except Exception as exc:
            raise bench.Unavailable(f"flash_attn not importable ({type(exc).__name__})")
        if getattr(flash_attn, "__fa_amd_shim__", False):
            raise bench.Unavailable("flash_attn is fa_amd's own shim here")
        q_f, k_f, v_f = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return lambda: flash_attn.flash_attn_with_kvcache(q_f, k_f, v_f)
    if method == "sdpa":
        import torch.nn.functional as F

        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if method == "flex":
        if device == "cpu":
            raise bench.Unavailable("FlexAttention compile skipped on CPU")
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except Exception as exc:
            raise bench.Unavailable(f"no FlexAttention in torch {torch.__version__} ({type(exc).__name__})")
        torch._dynamo.reset()  # a fresh compile per row (see bench.make_flex)
        compiled = torch.compile(flex_attention)
        return lambda: compiled(q, k, v, enable_gqa=True)
    raise ValueError(f"unknown decode method {method!r}")


def _decode_inputs(row: DecodeRow, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = rnd(row.batch, row.heads_q, 1, row.head_dim)
    # one (b, hk, cache, d) tensor per K and V, filled in chunks (a 128k x 64 cache is 17 GB)
    k = torch.empty(row.batch, row.heads_kv, row.cache, row.head_dim, dtype=dtype, device=device)
    v = torch.empty_like(k)
    for t in (k, v):
        for b in range(row.batch):
            t[b].normal_(generator=gen)
    return q, k, v


def bench_decode_row(methods, row: DecodeRow, dtype, device, smoke: bool, rounds: int) -> List[DecodeResult]:
    q, k, v = _decode_inputs(row, dtype, device)
    base = dict(row=asdict(row), label=row.label)
    timed = []
    for method in methods:
        try:
            timed.append(bench._Timed(base, "decode", _decode_call(method, row, q, k, v, device), (), [],
                                      flush=DECODE_L2_FLUSH))
        except bench.Unavailable as exc:
            timed.append(bench._Timed(base, "decode", None, (), [], note=f"n/a: {exc}"))
        timed[-1].base = dict(base, method=method)
    for r in range(max(1, rounds)):
        order = timed[r % len(timed):] + timed[:r % len(timed)]
        for t in order:
            bench._time_round(t, smoke, first=r == 0)
    results = []
    for t in timed:
        if t.note or not t.rounds:
            results.append(DecodeResult(**t.base, note=t.note or "n/a: not measured"))
            continue
        ms = sorted(t.rounds)[len(t.rounds) // 2]
        host = bench.host_ms_per_call(t.call, (), calls=10) * 1e3 if not smoke else None
        results.append(DecodeResult(**t.base, us=ms * 1e3, gbs=row.kv_bytes(q.element_size()) / (ms * 1e-3) / 1e9,
                                    rounds_us=[round(x * 1e3, 2) for x in t.rounds], host_us=host))
    del q, k, v, timed
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def run_decode(methods, dtype, device, smoke=False, rounds=bench.ROUNDS, log=print, checkpoint=None,
               rows=None) -> List[DecodeResult]:
    """Every row (or `rows`); `checkpoint(results so far)` after each (a cut run keeps what it measured)."""
    results = []
    for row in rows or decode_rows(smoke):
        if checkpoint is not None and results:
            checkpoint(results)
        log(row.label)
        for r in bench_decode_row(methods, row, dtype, device, smoke, rounds):
            results.append(r)
            shown = f"{r.gbs:8.0f} GB/s  {r.us:9.1f} us" if r.us is not None else r.note
            log(f"  {r.method:12s} {shown}")
    return results


def hbm_peak_gbs(gpu_name: str) -> Optional[float]:
    for key, value in HBM_PEAK_GBS.items():
        if key in gpu_name:
            return float(value)
    return None


def decode_markdown(results: List[DecodeResult], peak_gbs: Optional[float], dtype: str = "bf16") -> str:
    methods = [m for m in DECODE_METHODS if any(r.method == m for r in results)]
    labels = list(dict.fromkeys(r.label for r in results))
    idx = {(r.label, r.method): r for r in results}
    head = "| batch, cache | " + " | ".join(methods) + (" | fa_amd % of HBM peak |" if peak_gbs else " |")
    # the heads and head dim of the rows that ran (the --smoke rows are not the GQA 32/8, d128 ones)
    heads = dict.fromkeys(f"{r.row['heads_q']}/{r.row['heads_kv']}" for r in results)
    dims = dict.fromkeys(str(r.row["head_dim"]) for r in results)
    what = f"GQA {' and '.join(heads)}, d{' / d'.join(dims)}"
    out = [f"\n### Decode: KV GB/s (us per call); {dtype}, {what}, one query token\n", head,
           "|---" * (len(methods) + 1 + (1 if peak_gbs else 0)) + "|"]
    for label in labels:
        cells = []
        for m in methods:
            r = idx.get((label, m))
            cells.append("n/a" if r is None or r.gbs is None else f"{r.gbs:.0f} ({r.us:.1f})")
        ours = idx.get((label, "fa_amd"))
        extra = ""
        if peak_gbs:
            extra = " | " + (f"{100 * ours.gbs / peak_gbs:.0f} %" if ours is not None and ours.gbs else "n/a")
        out.append(f"| {label} | " + " | ".join(cells) + extra + " |")
    if any(r.host_us is not None for r in results):
        out += ["\n### Decode: host time to issue one call (us, no sync; above the GPU time the row is host-bound)\n",
                "| batch, cache | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        for label in labels:
            out.append(f"| {label} | " + " | ".join(
                "n/a" if idx.get((label, m)) is None or idx[(label, m)].host_us is None
                else f"{idx[(label, m)].host_us:.0f}" for m in methods) + " |")
    trailing = []
    for label in labels:
        ours = idx.get((label, "fa_amd"))
        if ours is None or ours.gbs is None:
            continue
        ahead = [f"{m} {idx[(label, m)].gbs:.0f}" for m in methods if m != "fa_amd" and idx.get((label, m))
                 and idx[(label, m)].gbs and idx[(label, m)].gbs > ours.gbs]
        if ahead:
            trailing.append(f"- {label}: fa_amd {ours.gbs:.0f} GB/s < " + ", ".join(ahead))
    out += ["\nRows where a peer reads the cache faster than fa_amd:\n"] + (trailing or ["- none in this run"])
    notes = sorted({f"{r.method}: {r.note[5:]}" for r in results if r.note.startswith("n/a")})
    if notes:
        out += ["\nn/a reasons:\n"] + [f"- {n}" for n in notes]
    return "\n".join(out)


# --------------------------------------------------------------------------- HF generate

@dataclass
class GenerateResult:
    impl: str
    cache: str
    tokens_per_s: Optional[float] = None
    seconds: Optional[float] = None
    rounds_s: List[float] = field(default_factory=list)
    note: str = ""


def _generate_model(device, dtype, smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    import fa_amd  # noqa: F401  (registers "fa_amd")

    if smoke:
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def left_padded_mask(batch: int, prompt: int) -> torch.Tensor:
    """A left-padded batch's attention mask: row i keeps its last prompt - i * prompt // (2 * batch) tokens
    (row 0 unpadded, the last row about half padding), as a tokenizer pads prompts of different lengths."""
    keep = torch.tensor([prompt - i * prompt // (2 * batch) for i in range(batch)])
    return (torch.arange(prompt)[None, :] >= (prompt - keep)[:, None]).to(torch.long)


# generate()'s rounds by default: a round is ~1 s of host-bound work (dynamic cache), and one lent H200 host's
# rounds of the same work spread by up to 25 % (2026-11-28 22:06 UTC: fa_amd 0.89-1.12 s, sdpa 0.97-1.13 s), so
# a median of 3 can put either ahead
GENERATE_ROUNDS = 7
# warm-up passes over every (implementation, cache) before the timed rounds: until each one's time is within
# GENERATE_SETTLED of its previous pass's (the first pass compiles), at most GENERATE_WARMUP_PASSES
GENERATE_WARMUP_PASSES = 5
GENERATE_SETTLED = 0.1


def run_generate(dtype, device, smoke=False, rounds=GENERATE_ROUNDS, batch=8, prompt=1024, new_tokens=128,
                 impls=GENERATE_IMPLS, caches=("dynamic", "static"), padded=False, log=print) -> List[GenerateResult]:
    """HF generate() new tokens/s per (attention implementation, cache), in interleaved rounds.  `padded`: the
    prompts left-padded to one length (left_padded_mask), as a batch of prompts of different lengths is."""
    if smoke:
        batch, prompt, new_tokens, caches = 2, 12, 3, caches[:1]
    model = _generate_model(device, dtype, smoke)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    mask = left_padded_mask(batch, prompt).to(device) if padded else torch.ones_like(ids)
    if padded:
        ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
        caches = tuple(f"{c}, left-padded" for c in caches)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run(impl, cache):
        model.set_attn_implementation(impl)
        kwargs = {} if cache.startswith("dynamic") else dict(cache_implementation="static")
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0, **kwargs)
        sync()
        return time.perf_counter() - start

    runs = [GenerateResult(impl, cache) for cache in caches for impl in impls]
    # warm-up: kernels compiled, a static cache's torch.compile done, then passes until every cell's time
    # settles -- a lent H200's first rounds after the compiles ran 1.3-1.5 s where later ones ran 0.8 s
    # (2026-11-28 22:29 UTC, both implementations), which a median of a few rounds still picked up
    last = {}
    for _ in range(GENERATE_WARMUP_PASSES):
        settled = True
        for r in runs:
            if r.note:
                continue
            try:
                t = run(r.impl, r.cache)
            except Exception as exc:
                r.note = bench._failure_note(exc)
                continue
            settled = settled and id(r) in last and abs(t - last[id(r)]) <= GENERATE_SETTLED * last[id(r)]
            last[id(r)] = t
        if settled or smoke:
            break
    for i in range(max(1, rounds)):
        for r in runs[i % len(runs):] + runs[:i % len(runs)]:
            if not r.note:
                r.rounds_s.append(run(r.impl, r.cache))
    for r in runs:
        if r.rounds_s:
            r.seconds = sorted(r.rounds_s)[len(r.rounds_s) // 2]
            r.tokens_per_s = batch * new_tokens / r.seconds
        log(f"  generate {r.cache:8s} {r.impl:8s} " + (f"{r.tokens_per_s:9.0f} new tokens/s" if r.tokens_per_s
                                                          else r.note))
    return runs


def generate_markdown(results: List[GenerateResult], smoke: bool) -> str:
    shape = ("tiny smoke model" if smoke else
             "random-init Llama, 8 layers, hidden 2048, 16/4 heads, d128; batch 8, prompt 1024, 128 new tokens")
    if any(r.cache.endswith("left-padded") for r in results):
        shape += "; left-padded: row i keeps its last 1024 - 64 i prompt tokens" if not smoke else ""
    caches = list(dict.fromkeys(r.cache for r in results))
    impls = list(dict.fromkeys(r.impl for r in results))
    idx = {(r.impl, r.cache): r for r in results}
    out = [f"\n### HF generate(), new tokens/s ({shape}; median of interleaved rounds, and the slowest .. fastest "
           "round)\n",
           "| cache | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
    for cache in caches:
        out.append(f"| {cache} | " + " | ".join(_generate_cell(idx[(i, cache)]) for i in impls) + " |")
    return "\n".join(out)


def _generate_cell(r: GenerateResult) -> str:
    if not r.tokens_per_s:
        return "n/a"
    if len(r.rounds_s) < 2:
        return f"{r.tokens_per_s:.0f}"
    tokens = r.tokens_per_s * r.seconds  # (new tokens per round)
    return f"{r.tokens_per_s:.0f} ({tokens / max(r.rounds_s):.0f} .. {tokens / min(r.rounds_s):.0f})"


SECTION_BEGIN = "<!-- fa-amd bench --decode/--generate: begin -->"
SECTION_END = "<!-- fa-amd bench --decode/--generate: end -->"


def write_section(path: str, doc: str) -> None:
    """Put `doc` in `path` between the decode markers: replaces an earlier decode section, else appends
    one (the prefill tables that `fa-amd bench --markdown` writes stay as they are)."""
    section = f"{SECTION_BEGIN}\n## Decode and generation\n\n{doc}\n{SECTION_END}\n"
    text = open(path).read() if os.path.exists(path) else ""
    if SECTION_BEGIN in text and SECTION_END in text:
        head, rest = text.split(SECTION_BEGIN, 1)
        text = head + section + rest.split(SECTION_END, 1)[1].lstrip("\n")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# --------------------------------------------------------------------------- CLI (from fa_amd.bench)

def run_cli(args) -> int:
    rows = None
    if args.decode and args.decode_rows:
        try:
            rows = parse_decode_rows(args.decode_rows)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.decode and args.hbm_peak_gbs is not None and not 0 < args.hbm_peak_gbs < float("inf"):
        print(f"error: --hbm-peak-gbs must be a positive number of GB/s, got {args.hbm_peak_gbs}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("error: no GPU found; decode/generate benchmarks need one (--smoke with TRITON_INTERPRET=1 on CPU)",
              file=sys.stderr)
        return 2
    if device == "cpu" and not bench.interpreter_on():  # (else every fa_amd row fails, one by one)
        print(bench.NO_INTERPRETER_ERROR, file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if device == "cpu":
        dtype = torch.float32  # the interpreter's bf16 dot is unreliable; the smoke run checks plumbing only
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    rounds = args.rounds if args.rounds is not None else (1 if args.smoke else bench.ROUNDS)
    generate_rounds = getattr(args, "generate_rounds", None)
    if generate_rounds is None:
        generate_rounds = 1 if args.smoke else GENERATE_ROUNDS
    for flag, n in (("--rounds", rounds), ("--generate-rounds", generate_rounds)):
        if n < 1:
            print(f"error: {flag} must be >= 1, got {n}", file=sys.stderr)
            return 2
    env = bench.environment(device)
    payload = {"environment": env, "dtype": dtype_name, "rounds": rounds}
    if args.generate:
        payload["generate_rounds"] = generate_rounds
    parts = []
    if args.decode:
        methods = [m for m in (args.decode_methods or DECODE_METHODS)]

        def checkpoint(results):  # decode.partial.json: what a run cut short had measured
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "decode.partial.json"), "w") as f:
                json.dump(dict(payload, decode=[asdict(r) for r in results]), f, indent=1)

        results = run_decode(methods, dtype, device, smoke=args.smoke, rounds=rounds,
                             checkpoint=checkpoint if args.out else None, rows=rows)
        peak = args.hbm_peak_gbs or hbm_peak_gbs(env.get("gpu", ""))
        payload["decode"] = [asdict(r) for r in results]
        payload["hbm_peak_gbs"] = peak
        parts.append(decode_markdown(results, peak, dtype_name))
        fa_rows = [r for r in results if r.method == "fa_amd"]  # (none with --decode-methods without fa_amd)
        if fa_rows and all(r.us is None for r in fa_rows):
            print("error: every fa_amd decode measurement failed", file=sys.stderr)
            print("\n".join(parts))
            return 1
    if args.generate:
        gen = run_generate(dtype, device, smoke=args.smoke, rounds=generate_rounds,
                           padded=getattr(args, "generate_padded", False))
        payload["generate"] = [asdict(r) for r in gen]
        parts.append(generate_markdown(gen, args.smoke))
        fa_gen = [r for r in gen if r.impl == "fa_amd"]
        if fa_gen and all(r.tokens_per_s is None for r in fa_gen):
            print("error: every fa_amd generate measurement failed", file=sys.stderr)
            print("\n".join(parts))
            return 1
    arch = "" if env.get("arch") == "cpu" else f" ({env.get('arch')})"  # (on CPU the gpu text says it all)
    doc = (f"Measured by `fa-amd bench{' --decode' if args.decode else ''}{' --generate' if args.generate else ''}` "
           f"on **{env.get('gpu')}**{arch}, {dtype_name}, torch {env['torch']}, triton {env['triton']}, "
           f"{env['date']}.\n" + "\n".join(parts) + "\n")
    print(doc)
    if args.markdown:
        write_section(args.markdown, doc)
        print(f"wrote the decode section of {args.markdown}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(payload, f, indent=1)
        with open(os.path.join(args.out, "decode.md"), "w") as f:
            f.write(doc)
        partial = os.path.join(args.out, "decode.partial.json")
        if os.path.exists(partial):
            os.remove(partial)
        print(f"results: {args.out}/decode.json, {args.out}/decode.md")
    return 0
