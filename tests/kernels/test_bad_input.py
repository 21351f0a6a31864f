"""Bad input gets a clear ValueError/TypeError naming the argument, never a
Triton compile error or a silently wrong result (issue 16; every checked input is tallied
for .ci/reliability_counts.py, see tests/reliability_log.py)."""
import numpy as np
import pytest
import torch

import fa_amd

from ..reliability_log import record
from .helpers import cu_seqlens


def _qkv(device, dtype=torch.float16, b=1, s=8, h=2, hk=2, d=32):
    return (torch.randn(b, s, h, d, device=device, dtype=dtype), torch.randn(b, s, hk, d, device=device, dtype=dtype),
            torch.randn(b, s, hk, d, device=device, dtype=dtype))


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    record("error", match)


def test_dtype_mismatch(device):
    q, k, v = _qkv(device)
    _raises(TypeError, "share one dtype", fa_amd.flash_attn_func, q, k.float(), v)


def test_unsupported_dtype(device):
    q, k, v = _qkv(device)
    _raises(TypeError, "q must be float16, bfloat16 or float32", fa_amd.flash_attn_func, q.double(), k.double(),
            v.double())
    _raises(TypeError, "k must be", fa_amd.flash_attn_func, q, k.to(torch.int32), v)


def test_packed_inputs_are_named_as_passed(device):
    # the packed wrappers' errors name qkv / kv, the caller's arguments, not the q / k / v views of them
    _raises(TypeError, "qkv must be float16", fa_amd.flash_attn_qkvpacked_func,
            torch.zeros(1, 8, 3, 2, 32, device=device, dtype=torch.int32))
    _raises(TypeError, "kv must be float16", fa_amd.flash_attn_kvpacked_func, _qkv(device)[0],
            torch.zeros(1, 8, 2, 2, 32, device=device, dtype=torch.int32))
    cu = cu_seqlens([3, 5], device)
    _raises(TypeError, "qkv must be float16", fa_amd.flash_attn_varlen_qkvpacked_func,
            torch.zeros(8, 3, 2, 32, device=device, dtype=torch.int32), cu, 5)
    _raises(TypeError, "kv must be float16", fa_amd.flash_attn_varlen_kvpacked_func,
            torch.randn(8, 2, 32, device=device).half(), torch.zeros(8, 2, 2, 32, device=device, dtype=torch.int32),
            cu, cu, 5, 5)


def test_not_a_tensor(device):
    q, k, v = _qkv(device)
    _raises(TypeError, "v must be a torch.Tensor", fa_amd.flash_attn_func, q, k, v.tolist())


def test_wrong_rank(device):
    q, k, v = _qkv(device)
    _raises(ValueError, "q must have rank 4", fa_amd.flash_attn_func, q[0], k, v)
    _raises(ValueError, "q must have rank 3", fa_amd.flash_attn_varlen_func, q, k[0], v[0],
            cu_seqlens([8], device), cu_seqlens([8], device), 8, 8)


def test_head_dim_too_large(device):
    q, k, v = _qkv(device, d=264)
    _raises(ValueError, "head dim must be in", fa_amd.flash_attn_func, q, k, v)


def test_head_dim_mismatch(device):
    q, k, v = _qkv(device)
    _raises(ValueError, "share the head dim", fa_amd.flash_attn_func, q, k[..., :16], v[..., :16])


def test_heads_not_multiple(device):
    q, k, v = _qkv(device, h=3, hk=2)
    _raises(ValueError, r"nheads of q \(3\) must be a multiple of nheads of k/v \(2\)", fa_amd.flash_attn_func, q, k, v)


def test_k_v_shape_mismatch(device):
    q, k, v = _qkv(device)
    _raises(ValueError, "k and v must have the same shape", fa_amd.flash_attn_func, q, k, v[:, :4])


def test_batch_mismatch(device):
    q, k, v = _qkv(device, b=2)
    _raises(ValueError, "same batch size", fa_amd.flash_attn_func, q, k[:1], v[:1])


def test_cu_seqlens_not_int32(device):
    q, k, v = (x[0] for x in _qkv(device))
    cu = cu_seqlens([3, 5], device)
    _raises(TypeError, "cu_seqlens_q must be int32", fa_amd.flash_attn_varlen_func, q, k, v, cu.long(), cu, 5, 5)


def test_cu_seqlens_decreasing(device):
    q, k, v = (x[0] for x in _qkv(device))
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32, device=device)
    _raises(ValueError, "cu_seqlens_k must be non-decreasing", fa_amd.flash_attn_varlen_func, q, k, v,
            cu_seqlens([3, 2, 3], device), bad, 5, 5)


def test_cu_seqlens_bad_start_or_end(device):
    q, k, v = (x[0] for x in _qkv(device))
    cu = cu_seqlens([3, 5], device)
    _raises(ValueError, r"cu_seqlens_q\[0\] must be 0", fa_amd.flash_attn_varlen_func, q, k, v, cu + 1, cu, 5, 5)
    _raises(ValueError, "exceeds the 8 tokens", fa_amd.flash_attn_varlen_func, q, k, v,
            cu_seqlens([3, 9], device), cu, 9, 5)


def test_max_seqlen_too_small(device):
    q, k, v = (x[0] for x in _qkv(device))
    cu = cu_seqlens([3, 5], device)
    _raises(ValueError, "max_seqlen_q = 4 is smaller than the longest segment", fa_amd.flash_attn_varlen_func,
            q, k, v, cu, cu, 4, 5)
    for bad in (5.0, torch.tensor(5.0), torch.tensor([5])):
        _raises(TypeError, "max_seqlen_k must be an integer", fa_amd.flash_attn_varlen_func, q, k, v, cu, cu, 5, bad)
    # integers as flash-attn takes them: numpy ints and 0-d integer tensors (Transformers passes cu.diff().max())
    want = fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
    for max_k in (np.int64(5), torch.tensor(5), torch.tensor(5, dtype=torch.int32, device=device)):
        assert torch.equal(fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, cu.diff().max(), max_k), want)


def test_numpy_scalars_as_flash_attn_takes_them(device):
    """softmax_scale / softcap / dropout_p / window_size entries given as numpy scalars (e.g. np.float32 from a
    config computation) are their Python values, as flash-attn's C++ binding takes them; numpy bools stay refused."""
    q, k, v = _qkv(device)
    want = fa_amd.flash_attn_func(q, k, v, softmax_scale=0.25, window_size=(2, 0), softcap=3.0)
    got = fa_amd.flash_attn_func(q, k, v, dropout_p=np.float32(0.0), softmax_scale=np.float32(0.25),
                                 window_size=[np.int64(2), np.int32(0)], softcap=np.float64(3.0))
    assert torch.equal(got, want)
    _raises(TypeError, "causal must be a bool, got numpy.bool", fa_amd.flash_attn_func, q, k, v, causal=np.bool_(True))
    _raises(TypeError, "window_size must be a pair of ints", fa_amd.flash_attn_func, q, k, v,
            window_size=(np.float32(2.0), 0))


def test_tensor_scalars_as_flash_attn_takes_them(device):
    """One-element integer / float tensors as window_size entries, a (2,) tensor as window_size (flash-attn's own
    tests pass torch.randint(0, seqlen_k, (2,))) and a 0-dim softmax_scale are their Python values, as flash-attn's
    C++ binding reads them, on every entry point; float or bool tensors as window entries stay refused."""
    q, k, v = _qkv(device)
    want = fa_amd.flash_attn_func(q, k, v, softmax_scale=0.25, window_size=(2, 0))
    for window in (torch.tensor([2, 0]), (torch.tensor(2), torch.tensor([0], dtype=torch.int32))):
        got = fa_amd.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.25), window_size=window)
        assert torch.equal(got, want)
    k_cache, v_cache = k.detach().clone(), v.detach().clone()
    seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=device)
    want = fa_amd.flash_attn_with_kvcache(q.detach(), k_cache, v_cache, cache_seqlens=seqlens, window_size=(2, 0))
    got = fa_amd.flash_attn_with_kvcache(q.detach(), k_cache, v_cache, cache_seqlens=seqlens,
                                         window_size=torch.tensor([2, 0]))
    assert torch.equal(got, want)
    _raises(TypeError, "window_size must be a pair of ints", fa_amd.flash_attn_func, q, k, v,
            window_size=torch.tensor([2.0, 0.0]))
    _raises(TypeError, "window_size must be a pair of ints", fa_amd.flash_attn_func, q, k, v,
            window_size=(torch.tensor(True), 0))


def test_fp8_tensors_to_a_quantising_function_name_the_descaled_entry(device):
    """FP8 tensors given to flash_attn_fp8_func (which quantises high-precision inputs itself) get a TypeError that
    says where FP8 tensors go."""
    q = torch.randn(1, 8, 2, 16, device=device).to(torch.float8_e4m3fn)
    _raises(TypeError, "FP8 tensors go to flash_attn_func", fa_amd.flash_attn_fp8_func, q, q, q)


def test_cu_seqlens_length_mismatch(device):
    q, k, v = (x[0] for x in _qkv(device))
    _raises(ValueError, "same length", fa_amd.flash_attn_varlen_func, q, k, v, cu_seqlens([3, 5], device),
            cu_seqlens([8], device), 5, 8)


def test_block_table_needs_paged_kv(device):
    # block_table is supported (paged KV); unpaged 3-D k/v with it is a clear error naming block_table
    q, k, v = (x[0] for x in _qkv(device))
    cu = cu_seqlens([8], device)
    _raises(ValueError, "block_table", fa_amd.flash_attn_varlen_func, q, k, v, cu, cu, 8, 8,
            block_table=torch.zeros(1, 1, dtype=torch.int32, device=device))


def test_window_shape(device):
    q, k, v = _qkv(device)
    _raises(TypeError, "window_size must be a pair of ints", fa_amd.flash_attn_func, q, k, v, window_size=(3,))
    _raises(TypeError, "window_size must be a pair of ints", fa_amd.flash_attn_func, q, k, v, window_size=(3.0, 1))
    _raises(ValueError, "window_size entries must be >= -1", fa_amd.flash_attn_func, q, k, v, window_size=(-2, 0))
    # a window past any sequence is no window (it reached Triton's int specialisation as 2**64 and overflowed there)
    for huge in (2 ** 31, 2 ** 64, 10 ** 30):
        assert torch.equal(fa_amd.flash_attn_func(q, k, v, window_size=(huge, huge)),
                           fa_amd.flash_attn_func(q, k, v))
        assert torch.equal(fa_amd.flash_attn_func(q, k, v, window_size=(huge, 0)),
                           fa_amd.flash_attn_func(q, k, v, causal=True))


def test_alibi_shape_and_dtype(device):
    q, k, v = _qkv(device, b=2, h=4, hk=2)
    _raises(ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)", fa_amd.flash_attn_func, q, k, v,
            alibi_slopes=torch.rand(2, device=device))
    _raises(TypeError, "alibi_slopes must be a floating tensor", fa_amd.flash_attn_func, q, k, v,
            alibi_slopes=torch.ones(4, dtype=torch.int32, device=device))


def test_scalar_arguments(device):
    q, k, v = _qkv(device)
    _raises(ValueError, r"dropout_p must be in \[0, 1\)", fa_amd.flash_attn_func, q, k, v, dropout_p=1.0)
    _raises(TypeError, "dropout_p must be a float", fa_amd.flash_attn_func, q, k, v, dropout_p="0.1")
    _raises(ValueError, "softcap must be a finite float >= 0", fa_amd.flash_attn_func, q, k, v, softcap=-1.0)
    _raises(ValueError, "softmax_scale must be finite", fa_amd.flash_attn_func, q, k, v, softmax_scale=float("nan"))
    _raises(TypeError, "causal must be a bool", fa_amd.flash_attn_func, q, k, v, causal="yes")


def test_packed_shapes(device):
    q, k, v = _qkv(device)
    _raises(ValueError, r"qkv must be a tensor of shape \(batch, seqlen, 3", fa_amd.flash_attn_qkvpacked_func, q)
    _raises(ValueError, r"kv must be a tensor of shape \(batch, seqlen_k, 2", fa_amd.flash_attn_kvpacked_func, q, k)


def test_cpu_tensors_without_interpreter(monkeypatch):
    import fa_amd.interface as interface

    monkeypatch.setattr(interface, "INTERPRET", False)
    q, k, v = _qkv("cpu")
    _raises(ValueError, "CPU tensor but fa_amd's kernels need a GPU.*TRITON_INTERPRET=1", fa_amd.flash_attn_func,
            q, k, v)


def test_config_too_big_for_gpu_shrinks_with_warning(monkeypatch):
    """A table entry that does not fit the GPU (OutOfResources) is shrunk with a
    warning and remembered, never raised to the user as a Triton error."""
    from triton.runtime.errors import OutOfResources

    from fa_amd.kernels import launch

    monkeypatch.setattr(launch, "_FITTED_CONFIGS", {})
    launches = []

    class SharedMemoryHungryKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK_N"], kwargs["num_stages"]))
                if kwargs["num_stages"] > 1 or kwargs["BLOCK_N"] > 32:
                    raise OutOfResources(200000, 101376, "shared memory")
            return run

    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    args = (torch.zeros(1),)
    kernel = SharedMemoryHungryKernel()
    with pytest.warns(UserWarning, match="does not fit this GPU"):
        used = launch.launch(kernel, cfg, launch.grid_blocks(100, "BLOCK_M"), (2, 1), args, {"HEAD_DIM": 64})
    assert used == {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    assert launches[-1] == ((2, 2, 1), 32, 1)
    launches.clear()
    launch.launch(kernel, cfg, launch.grid_blocks(100, "BLOCK_M"), (2, 1), args, {"HEAD_DIM": 64})
    assert len(launches) == 1, "the fitted config is remembered"
    record("right", "a launch config too big for the GPU (shrunk, with a warning)")


def test_cu_seqlens_checked_again_after_inplace_change(device):
    q, k, v = (x[0] for x in _qkv(device))
    cu = cu_seqlens([3, 5], device)
    fa_amd.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)  # valid: remembered
    cu[1] = 6  # same tensor object, new contents (version bumps)
    _raises(ValueError, "max_seqlen_q = 5 is smaller", fa_amd.flash_attn_varlen_func, q, k, v, cu, cu, 5, 6)


def test_old_triton_interpreter_gets_a_clear_error(monkeypatch, device):
    import fa_amd.arch as arch

    monkeypatch.setattr(arch, "INTERPRET", True)
    monkeypatch.setattr(arch, "TRITON_VERSION", (3, 6))
    q, k, v = _qkv(device)
    _raises(RuntimeError, "triton >= 3.7", fa_amd.flash_attn_func, q, k, v)


def test_memo_per_tensor_invalidates_on_inplace_write():
    from fa_amd.memo import memo_per_tensor

    calls = []

    def total(t):
        calls.append(1)
        return int(t.sum())

    x = torch.arange(4)
    assert memo_per_tensor(x, "sum", total) == 6
    assert memo_per_tensor(x, "sum", total) == 6 and len(calls) == 1
    x[0] = 10
    assert memo_per_tensor(x, "sum", total) == 16 and len(calls) == 2
    assert memo_per_tensor(x.clone(), "sum", total) == 16 and len(calls) == 3


def test_memo_entry_dies_with_its_tensor():
    import gc

    from fa_amd import memo

    x = torch.arange(3)
    memo.memo_per_tensor(x, "len", lambda t: t.numel())
    key = (id(x), "len")
    assert key in memo._entries
    del x
    gc.collect()
    assert key not in memo._entries


def test_sequence_past_int32_offsets(device):
    # 131073 keys x 128 query heads x d128: one token past the 2**31 elements per sequence that the
    # dQ / dK work buffers (nheads_q x head_dim per token) may span (131072 keys fit exactly)
    q = torch.randn(1, 1, 128, 128, device=device, dtype=torch.float16)
    k = torch.randn(1, 131073, 1, 128, device=device, dtype=torch.float16)
    _raises(ValueError, r"sequence length 131073 x nheads 128 x head dim 128 exceeds the 2\*\*31 elements",
            fa_amd.flash_attn_func, q, k, k)
    from fa_amd.kernels.launch import row_offsets_fit

    assert row_offsets_fit(131072, 128 * 128, 128) and not row_offsets_fit(131073, 128 * 128, 128)
    # varlen: the lengths are the caller's max_seqlen_q / max_seqlen_k, named so
    q = torch.randn(11, 2, 16, device=device, dtype=torch.float16)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    _raises(ValueError, r"max\(max_seqlen_q, max_seqlen_k\) = 1099511627776 x nheads 2 x head dim 16 exceeds",
            fa_amd.flash_attn_varlen_func, q, q, q, cu, cu, 2 ** 40, 7)
    # the (seqlen_q x seqlen_k) probability matrix of return_attn_probs (materialised with dropout only, as in
    # flash-attn: without it S_dmask is empty, so such a call runs; too long for the interpreter here)
    q = torch.randn(1, 46341, 1, 16, device=device, dtype=torch.float16)
    _raises(ValueError, r"return_attn_probs=True needs a 46341 x 46341 probability matrix",
            fa_amd.flash_attn_func, q, q, q, dropout_p=0.1, return_attn_probs=True)


def test_memo_sees_numpy_writes_to_cpu_tensors():
    # a numpy view writes without bumping the version counter: CPU entries compare contents
    from fa_amd.memo import memo_per_tensor

    calls = []
    x = torch.arange(4)
    assert memo_per_tensor(x, "sum-np", lambda t: calls.append(1) or int(t.sum())) == 6
    x.numpy()[0] = 10
    assert memo_per_tensor(x, "sum-np", lambda t: calls.append(1) or int(t.sum())) == 16 and len(calls) == 2


def test_too_many_varlen_sequences(device):
    q, k, v = (x[0] for x in _qkv(device))
    cu = torch.zeros(65536, dtype=torch.int32, device=device)  # 65535 sequences: one over the grid limit
    _raises(ValueError, "at most 65534 sequences", fa_amd.flash_attn_varlen_func, q, k, v, cu, cu, 1, 1)


def test_softmax_scale_out_of_float32_range(device):
    q, k, v = _qkv(device)
    _raises(ValueError, "softmax_scale = 1e\\+39 overflows", fa_amd.flash_attn_func, q, k, v, softmax_scale=1e39)


def test_audit_2026_11_28_arguments_are_named(device, monkeypatch):
    """Findings of the 2026-11-28 bad-input audit: each error names the argument the caller got wrong (before, an
    OverflowError from float(), a comparison TypeError, or a message about a descale sized by a bad batch)."""
    q, k, v = _qkv(device)
    for name in ("softmax_scale", "softcap", "dropout_p"):
        _raises(ValueError, f"{name} is an int too large", fa_amd.flash_attn_func, q, k, v, **{name: 10 ** 400})
    _raises(TypeError, "causal must be a bool, got numpy.bool", fa_amd.flash_attn_func, q, k, v, causal=np.bool_(True))
    qv, kv = q[0], k[0]  # (8, 2, 32) packed tokens
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    pages = torch.randn(2, 16, 2, 32, device=device, dtype=q.dtype)
    paged = dict(block_table=table)
    _raises(TypeError, "cu_seqlens_q must be a torch.Tensor", fa_amd.flash_attn_varlen_func, qv, pages, pages,
            [0, 3, 8], cu, 5, 16, **paged)
    _raises(ValueError, "cu_seqlens_q must be 1-D with batch\\+1 entries", fa_amd.flash_attn_varlen_func, qv, pages,
            pages, cu[:0], cu, 5, 16, **paged)
    _raises(TypeError, "max_seqlen_k must be an integer", fa_amd.flash_attn_varlen_func, qv, pages, pages, cu, cu, 5,
            None, **paged)
    _raises(TypeError, "deterministic must be a bool", fa_amd.flash_attn_varlen_func, qv, pages, pages, cu, cu, 5, 16,
            deterministic="x", **paged)
    _raises(TypeError, "return_attn_probs must be a bool", fa_amd.flash_attn_varlen_func, qv, kv, kv, cu, cu, 5, 5,
            return_attn_probs="yes", seqused_k=torch.tensor([2, 5], dtype=torch.int32, device=device))
    monkeypatch.setenv("FA_AMD_CHECK_KVCACHE", "1")  # (device values: checked on a GPU only when asked)
    _raises(ValueError, "seqused_k entries must not exceed", fa_amd.flash_attn_varlen_func, qv, kv, kv, cu, cu, 5, 5,
            seqused_k=torch.tensor([4, 5], dtype=torch.int32, device=device))
    monkeypatch.delenv("FA_AMD_CHECK_KVCACHE")
    # a max_seqlen_q far past the packed tokens only sized the grid (10**20: a Triton OverflowError, 2**31: a hang)
    want = fa_amd.flash_attn_varlen_func(qv, pages, pages, cu, cu, 5, 16, **paged)
    # (another grid may split the keys otherwise: equal up to rounding)
    torch.testing.assert_close(fa_amd.flash_attn_varlen_func(qv, pages, pages, cu, cu, 10 ** 20, 16, **paged), want,
                               atol=2e-3, rtol=2e-3)
    f8 = torch.float8_e4m3fn
    _raises(ValueError, "q must have rank 4", fa_amd.flash_attn_with_kvcache, qv.to(f8)[:, 0], pages[:1].to(f8),
            pages[:1].to(f8), cache_seqlens=3, k_descale=torch.ones(2, 2, device=device))
    slopes = torch.rand(2, device=device, requires_grad=True)
    _raises(ValueError, "alibi_slopes requires grad", fa_amd.flash_attn_func, q.requires_grad_(), k, v,
            alibi_slopes=slopes)
    with torch.no_grad():
        fa_amd.flash_attn_func(q, k, v, alibi_slopes=slopes)  # (no graph, nothing lost)


def test_tokens_past_the_last_segment_get_lse_inf_on_every_route(device):
    """Tokens past cu_seqlens_q[-1] (static buffers) belong to no sequence: output 0 and lse +inf, on the dense
    varlen route and the split-KV decode kernel's (seqused_k) alike (the latter gave -inf)."""
    q = torch.randn(11, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(11, 2, 16, device=device, dtype=torch.float16)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 9, 9], dtype=torch.int32, device=device)
    _, lse_dense, _ = fa_amd.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 5, 5, return_attn_probs=True)
    out, lse_used, _ = fa_amd.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 5, 5, return_attn_probs=True,
                                                     seqused_k=(cu_k[1:] - cu_k[:-1]).contiguous())
    assert torch.isposinf(lse_dense[:, 8:]).all() and torch.isposinf(lse_used[:, 8:]).all()
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))


def test_one_entry_cu_seqlens_must_be_zero(device):
    """cu_seqlens of a batch of 0 sequences is [0]; [5] names the argument (audit 2026-11-29: accepted)."""
    q = torch.randn(4, 2, 16, device=device, dtype=torch.float16)
    cu = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        fa_amd.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4)


def test_fp8_packed_functions_name_qkv(device):
    """The quantising packed functions check qkv's dtype under its own name (audit 2026-11-29: "q must be ...")."""
    with pytest.raises(TypeError, match="qkv must be float16, bfloat16 or float32"):
        fa_amd.flash_attn_qkvpacked_fp8_func(torch.zeros(1, 8, 3, 2, 16, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="qkv must be float16, bfloat16 or float32"):
        fa_amd.flash_attn_varlen_qkvpacked_fp8_func(torch.zeros(8, 3, 2, 16, dtype=torch.int32, device=device),
                                                    torch.tensor([0, 8], dtype=torch.int32, device=device), 8)


def test_fp8_descale_product_past_float32_range(device):
    """softmax_scale * q_descale * k_descale is the scores' float32 scale: past the bound softmax_scale has alone
    it raises where the values are read without a sync (audit 2026-11-29: descales of 1e20 gave all-NaN rows)."""
    from fa_amd.fp8 import fp8_dtypes
    if device != "cpu":
        pytest.skip("the values are read without a sync on CPU tensors only (FA_AMD_CHECK_KVCACHE=1 on a GPU)")
    q = torch.randn(1, 8, 2, 16, device=device).to(fp8_dtypes(torch.empty(0, device=device))[0])
    big = torch.full((1, 2), 1e20, device=device)
    with pytest.raises(ValueError, match=r"softmax_scale \* q_descale \* k_descale"):
        fa_amd.flash_attn_func(q, q, q, q_descale=big, k_descale=big)
    out = fa_amd.flash_attn_func(q, q, q, q_descale=big, k_descale=torch.full((1, 2), 1e-20, device=device))
    assert not out.isnan().any()
