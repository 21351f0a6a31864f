"""The wide sweep, on a GPU: bf16 included, long sequences, big head dims,
GQA/MQA, ragged varlen, dropout statistics, deterministic backward."""
import functools

import pytest
import torch

import fa_amd
from fa_amd.kernels import backward, forward, launch

from .helpers import check_varlen, compare_dense, compare_output, dense_qkv

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    yield
    # float64 references of long sequences take ~10 GB: hand it back so parallel
    # workers sharing one GPU do not run each other out of memory
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [40, 64, 80, 96, 111, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(dtype, d, causal):
    q, k, v = dense_qkv("cuda", dtype, 2, 257, 333, 4, 2, d)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=causal), q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen", [1, 17, 113, 1025, 4096, 16384])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(dtype, seqlen, causal):
    # the float64 reference materializes (b, h, s, s) scores several times: keep it to ~10 GB
    b, hq, hk = (1, 1, 1) if seqlen >= 4096 else (2, 4, 2)
    q, k, v = dense_qkv("cuda", dtype, b, seqlen, seqlen, hq, hk, 128)
    compare_dense(functools.partial(fa_amd.flash_attn_func, causal=causal), q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (8, 2), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap", "alibi"])
def test_features_gqa(dtype, heads, feature):
    hq, hk = heads
    kw = {"plain": {}, "causal": {"causal": True}, "window": {"window_size": (77, 31)},
          "softcap": {"softcap": 30.0, "causal": True},
          "alibi": {"alibi_slopes": torch.rand(hq, device="cuda") * 0.3, "causal": True}}[feature]
    q, k, v = dense_qkv("cuda", dtype, 2, 391, 517, hq, hk, 64)
    compare_dense(functools.partial(fa_amd.flash_attn_func, **kw), q, k, v, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_ragged(dtype, causal, d):
    g = torch.Generator().manual_seed(d)
    lens_q = torch.randint(0, 700, (9,), generator=g).tolist() + [0, 1]
    lens_k = [max(0, n + int(x)) for n, x in zip(lens_q, torch.randint(-50, 300, (11,), generator=g))]
    check_varlen("cuda", dtype, lens_q, lens_k, 8, 2, d, causal=causal)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics(p):
    q, k, v = dense_qkv("cuda", torch.bfloat16, 2, 1000, 1000, 8, 2, 64)
    torch.manual_seed(0)
    _, _, s1 = fa_amd.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    _, _, s2 = fa_amd.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    keep1 = s1 >= 0
    n = keep1.numel()
    frac = keep1.double().mean().item()
    assert abs(frac - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, f"keep fraction {frac} vs {1 - p}"
    # independent across calls: agreement rate of two masks is p^2 + (1-p)^2
    agree = (keep1 == (s2 >= 0)).double().mean().item()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 0.01
    torch.manual_seed(0)
    _, _, s1b = fa_amd.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    assert torch.equal(keep1, s1b >= 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dropout_grads_match_reference(dtype):
    from fa_amd.reference import attention_ref

    p = 0.2
    q, k, v = dense_qkv("cuda", dtype, 2, 300, 300, 4, 2, 128)
    out, _, s = fa_amd.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    kw = dict(causal=True, dropout_p=p, dropout_mask=s >= 0)
    compare_output(out, lambda *x, **up: attention_ref(*x, **kw, **up), q, k, v)


@pytest.mark.parametrize("heads", [(16, 16), (16, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_deterministic_backward(heads):
    q, k, v = dense_qkv("cuda", torch.bfloat16, 2, 2048, 2048, heads[0], heads[1], 128)
    dout = torch.randn(2, 2048, heads[0], 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        out = fa_amd.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_cuda_graph_dropout_replays_fresh_masks():
    q, k, v = dense_qkv("cuda", torch.float16, 1, 128, 128, 2, 2, 64)
    static_out = {}

    def step():
        static_out["o"] = fa_amd.flash_attn_func(q.detach(), k.detach(), v.detach(), dropout_p=0.5)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    first = static_out["o"].clone()
    graph.replay()
    second = static_out["o"].clone()
    assert not torch.equal(first, second), "graph replays reused one dropout mask"
    assert torch.isfinite(first).all() and torch.isfinite(second).all()


@pytest.mark.parametrize("from_out", [True, False], ids=["from_out", "marks"])
def test_cuda_graph_nan_flags_replay_and_eager_calls(monkeypatch, from_out):
    """A masked forward captured in a CUDA graph (its NaN flags captured with their zero-fill, not the kept
    per-stream buffer; or, from_out, found in the last query block's output by the fix-up): replays with a NaN
    in V, then without, give the reference's NaN pattern each time; eager calls between the replays (the kept
    flags of this stream; launch plans replayed) give it too, and stay NaN-free with a clean V."""
    family = forward.family_of(forward.arch_for(torch.empty(0, device="cuda")))
    monkeypatch.setattr(forward.tables, "FWD_NAN_FIXUP_FAMILIES", (family,))
    monkeypatch.setattr(forward.tables, "FWD_NAN_FROM_OUT_FAMILIES", (family,) if from_out else ())
    monkeypatch.setattr(forward, "_NAN_FLAGS", {})
    q, k, v = dense_qkv("cuda", torch.bfloat16, 2, 300, 300, 4, 2, 128)
    q, k, v = q.detach(), k.detach(), v.detach()
    static_out = {}

    def step():
        static_out["o"] = fa_amd.flash_attn_func(q, k, v, causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    kept = dict(forward._NAN_FLAGS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert forward._NAN_FLAGS == kept  # (a capture caches no buffer)
    clean = v.clone()
    for with_nan in (True, False, True):
        v.copy_(clean)
        if with_nan:
            v[1, 250, 1, 7] = float("nan")  # causal rows before 250 skip its block: the fix-up writes their NaN
        graph.replay()
        got = static_out["o"].clone()
        eager = fa_amd.flash_attn_func(q, k, clean, causal=True)
        expect = torch.zeros_like(got, dtype=torch.bool)
        if with_nan:
            expect[1, :, 2:4, 7] = True  # every row of both query heads of KV head 1, feature 7
        assert torch.equal(got.isnan(), expect)
        assert not eager.isnan().any()
        assert torch.equal(fa_amd.flash_attn_func(q, k, v, causal=True).isnan(), expect)
        ref = fa_amd.flash_attn_func(q, k, clean, causal=True)
        assert torch.equal(got[~expect], ref[~expect]) if with_nan else torch.equal(got, ref)
    assert all(not buf.any() for buf in forward._NAN_FLAGS.values())
