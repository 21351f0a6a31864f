"""The FP8 quantisation kernels (fa_amd/kernels/quantize.py) behind fa_amd.fp8.quantize_fp8 and the
token-major V copy, and the forward's token-major V path (tables.FP8_V_TOKEN_MAJOR, Hopper and gfx942)
taken on the interpreter by patching the table.

The quantiser is held to the exact rule of fa_amd.reference.fp8_quantize_ref (bitwise: same amax, same
fp32 scale and descale, same rounding), on odd shapes whose token blocks do not divide the sequences,
with every program walking several blocks (a tiny tables.FP8_QUANTIZE entry); the layout path is held
to bitwise equality with the head-dim-major path (the same products in another memory order)."""
import functools

import pytest
import torch

import fa_amd
from fa_amd import fp8 as fp8_mod
from fa_amd.kernels import launch
from fa_amd.reference import fp8_quantize_ref
from fa_amd.tuning import resolve_entry, tables

from .helpers import cu_seqlens
from .test_fp8 import E4M3, _fresh, _quantized

TINY = {"BLOCK_ELEMENTS": 64, "MAX_SPLITS": 2, "num_warps": 4}


@pytest.fixture(autouse=True)
def poison_and_tiny_blocks(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    for key in ("default", "cpu"):  # several blocks per program on any device
        monkeypatch.setitem(tables.FP8_QUANTIZE, key, TINY)


def token_major_on(monkeypatch):
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", tables.FP8_V_TOKEN_MAJOR + ("cpu",))


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _same_descale(got, ref):
    """Equal but for the last bit: amax / fp8_max is a true division in the kernel and on the CPU, a
    multiplication by fp32(1 / fp8_max) in torch's CUDA division by a scalar."""
    return got.shape == ref.shape and torch.allclose(got, ref, rtol=2 ** -22, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("token_major", [False, True])
def test_quantize_dense_matches_reference(device, dtype, token_major):
    x = (_fresh(2, 23, 3, 40, device=device) * 11).to(dtype)
    x[1, :, 1] = 0  # an all-zero head: descale 1
    x[0, 5, 2, 7] = 3e4  # one large value sets its head's scale
    x8, descale = fp8_mod.quantize_fp8(x, E4M3, token_major=token_major)
    r8, rd = fp8_quantize_ref(x, E4M3)
    assert _same_bits(x8, r8) and _same_descale(descale, rd) and descale[1, 1] == 1.0
    if token_major:  # (batch, nheads, d, 32 padded tokens) storage, padding zero
        assert x8.stride()[1] == 1 and x8.stride()[3] == 32
        storage = torch.as_strided(x8, (2, 3, 40, 32), (3 * 40 * 32, 40 * 32, 32, 1))
        assert not storage[..., 23:].float().any()
    else:
        assert x8.is_contiguous()


def test_quantize_edge_cases(device):
    """A non-contiguous input (a slice of packed qkv), gfx942's fnuz type, a NaN (out of its head's
    amax: the other values keep their scale, the NaN stays; test_fp8_robustness.py has inf and
    degenerate heads), no tokens at all."""
    qkv = _fresh(1, 19, 3, 2, 24, device=device, dtype=torch.float16) * 5
    k = qkv[:, :, 1]
    # gfx942's fnuz type where this device converts to it (the interpreter; a GPU refuses other archs' types)
    for fp8_dtype in (E4M3, torch.float8_e4m3fnuz) if device == "cpu" else fp8_mod.fp8_dtypes(k):
        x8, descale = fp8_mod.quantize_fp8(k, fp8_dtype)
        r8, rd = fp8_quantize_ref(k, fp8_dtype)
        assert _same_bits(x8, r8) and _same_descale(descale, rd)
    x = _fresh(1, 9, 2, 16, device=device) * 1000
    x[0, 3, 1, 2] = float("nan")
    x8, descale = fp8_mod.quantize_fp8(x, E4M3)
    assert torch.isnan(x8[0, 3, 1, 2].float()) and x8[0, :, 1].float().isnan().sum() == 1
    r8, rd = fp8_quantize_ref(x, E4M3)  # (the NaN takes no part in the scale)
    assert _same_bits(x8, r8) and _same_descale(descale, rd) and descale[0, 1] > 1.0
    empty8, empty_descale = fp8_mod.quantize_fp8(x[:, :0], E4M3, token_major=True)
    assert empty8.shape == (1, 0, 2, 16) and torch.equal(empty_descale, torch.ones(1, 2, device=device))
    if device != "cpu":
        other = torch.float8_e4m3fnuz if torch.float8_e4m3fnuz not in fp8_mod.fp8_dtypes(k) else E4M3
        with pytest.raises(TypeError, match="fp8_dtype"):
            fp8_mod.quantize_fp8(k, other)


@pytest.mark.parametrize("max_seqlen", [None, 30, 4])
def test_quantize_varlen_matches_reference(device, max_seqlen):
    """Empty segments, and 5 tokens past cu_seqlens[-1] (static-buffer padding: no sequence, scale 1).
    max_seqlen only sizes the grid: a value below the longest segment still quantises every token."""
    lens = [7, 0, 30, 1, 0]
    cu = cu_seqlens(lens, device)
    x = _fresh(sum(lens) + 5, 3, 24, device=device, dtype=torch.bfloat16) * 300
    x[:7, 2] = 0
    x8, descale = fp8_mod.quantize_fp8(x, E4M3, cu, max_seqlen=max_seqlen)
    r8, rd = fp8_quantize_ref(x, E4M3, cu)
    n = sum(lens)
    assert _same_bits(x8[:n], r8[:n]) and _same_descale(descale, rd)
    assert descale[1].eq(1).all() and descale[4].eq(1).all() and descale[0, 2] == 1.0
    assert _same_bits(x8[n:], x[n:].float().clamp(-448, 448).to(E4M3))
    none8, none_descale = fp8_mod.quantize_fp8(x, E4M3, cu_seqlens(lens[:0], device))  # no sequence: all tail
    assert none_descale.shape == (0, 3) and _same_bits(none8, x.float().clamp(-448, 448).to(E4M3))


@pytest.mark.parametrize("seqlen", [1, 21, 32])
def test_token_major_copy(device, seqlen):
    v8 = _fresh(2, seqlen, 3, 40, device=device).to(E4M3)
    tm = fp8_mod.token_major_copy(v8)
    assert tm.shape == v8.shape and tm.stride()[1] == 1 and _same_bits(tm, v8)
    padded = -(-seqlen // 16) * 16
    storage = torch.as_strided(tm, (2, 3, 40, padded), (3 * 40 * padded, 40 * padded, padded, 1))
    assert not storage[..., seqlen:].float().any()


LAYOUT_CASES = [
    # b, sq, sk, hq, hk, d, options
    (1, 33, 33, 4, 2, 40, dict()),  # GQA, full, padded head dim, rows of 33 tokens (padded to 48)
    (2, 19, 30, 2, 2, 64, dict(causal=True, softcap=4.0)),
    (1, 25, 17, 3, 1, 32, dict(window_size=(6, 2))),  # MQA, sliding window (NaN flags over token-major V)
]


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,opts", LAYOUT_CASES)
def test_token_major_path_matches_head_dim_major(device, monkeypatch, b, sq, sk, hq, hk, d, opts):
    """FA3-style FP8 inputs: V in the usual layout copied token-major per call, V passed already
    token-major (no copy), and the head-dim-major read give the same bits; so does the quantising
    function, which writes V token-major itself."""
    q, k, v = _fresh(b, sq, hq, d, device=device), _fresh(b, sk, hk, d, device=device), _fresh(b, sk, hk, d,
                                                                                               device=device)
    q8, k8, v8, qd, kd, vd = _quantized(q, k, v)
    call = functools.partial(fa_amd.flash_attn_func, q8, k8, q_descale=qd, k_descale=kd, v_descale=vd,
                             out_dtype=torch.float32, **opts)
    monkeypatch.setattr(tables, "FP8_V_TOKEN_MAJOR", ())
    natural, quantising = call(v8), fa_amd.flash_attn_fp8_func(q, k, v, **opts)
    token_major_on(monkeypatch)
    assert torch.equal(call(v8), natural)
    pre = fp8_mod.token_major_copy(v8)
    if sk % 16 == 0:  # rows exactly seqlen long: taken as they are
        assert fp8_mod._v_layout(pre, False, fp8_mod.arch_for(pre)) is pre
    assert torch.equal(call(pre), natural)
    assert torch.equal(fa_amd.flash_attn_fp8_func(q, k, v, **opts), quantising)


def test_fp8_override_refines_per_case():
    """A table entry's "fp8" override may carry its own "causal" / "short" dicts (FP8 tiles differ per
    case); they apply after it, and only to FP8 launches."""
    entry = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
             "causal": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
             "fp8": {"BLOCK_M": 64, "num_warps": 4, "causal": {"BLOCK_N": 128, "num_stages": 2},
                     "short": {"num_stages": 4}}}
    tiles = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")

    def resolved(**kw):
        cfg = resolve_entry(entry, **kw)
        assert "causal" not in cfg and "short" not in cfg
        return tuple(cfg[k] for k in tiles)

    assert resolved() == (128, 128, 8, 3) and resolved(causal=True) == (64, 64, 4, 3)
    assert resolved(fp8=True) == (64, 128, 4, 3)
    assert resolved(fp8=True, causal=True) == (64, 128, 4, 2)
    assert resolved(fp8=True, causal=True, short=True) == (64, 128, 4, 4)


def test_quantize_refuses_a_non_fp8_dtype(device):
    x = _fresh(1, 5, 2, 16, device=device)
    with pytest.raises(TypeError, match="fp8_dtype must be a torch FP8 dtype"):
        fp8_mod.quantize_fp8(x, torch.float16)
