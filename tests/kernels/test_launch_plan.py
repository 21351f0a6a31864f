"""kernels/launch.LaunchPlan: the attention launchers replay an earlier call's launches for a call of the
same structure, with the new call's tensors in their slots, and take the JIT path whenever Triton could
specialise a tensor differently, or a launch cannot be replayed."""
import pytest
import torch
from triton.compiler import CompiledKernel

from fa_amd.kernels import launch as L


class _Param:
    def __init__(self, name, default=None, is_constexpr=False):
        self.name, self.default, self.is_constexpr = name, default, is_constexpr


class _Compiled(CompiledKernel):
    """A CompiledKernel stand-in that records replayed calls (no GPU, no binary)."""

    def __init__(self):  # (CompiledKernel's own __init__ needs a compiled binary)
        self.replays = []

    def __del__(self):  # (nor has it a module to unload)
        pass

    function, packed_metadata = "function", "metadata"

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.replays.append((grid, args))

    def run(self, x, y, z, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        # the launcher itself, which a replay calls when no launch hook is registered
        assert (stream, function, metadata, launch_metadata, enter_hook, exit_hook) == (
            0, "function", "metadata", None, None, None)
        self.replays.append(((x, y, z), args))


@pytest.fixture(autouse=True)
def no_gpu_stream(monkeypatch):
    # a plan looks the current stream up once per replay (no GPU here: a stand-in handle)
    monkeypatch.setattr(L, "current_stream", lambda: 0)


class _Kernel:
    """A @triton.jit kernel's face: X, Y (tensors), n (int), S (tensor kwarg), K (constexpr)."""
    arg_names = ["X", "Y", "n", "S", "K"]
    params = [_Param("X"), _Param("Y"), _Param("n"), _Param("S"), _Param("K", is_constexpr=True)]

    def __init__(self, compiled=True):
        self.compiled = _Compiled() if compiled else None
        self.jit_calls = []

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.jit_calls.append(grid)
            return self.compiled
        return jit


def _record(kernel, x, y, s):
    with L.recording() as recorded:
        L.jit_launch(kernel, (3, 2), (x, y, 7), dict(S=s, K=4, num_warps=4))
    return recorded


def test_plan_replays_with_the_new_call_tensors():
    base = torch.zeros(256)
    x, y, s = base[:8], base[16:24], base[32:40]  # 16-byte aligned views
    kernel = _Kernel()
    recorded = _record(kernel, x, y, s)
    assert len(recorded) == 1 and kernel.jit_calls == [(3, 2)]
    plan = L.LaunchPlan(recorded, dict(inp=x, out=y, scratch=s), hip=False)
    x2, y2, s2 = base[48:56], base[64:72], base[80:88]
    assert plan.run(dict(inp=x2, out=y2, scratch=s2))
    (grid, args), = kernel.compiled.replays
    # the launcher itself gets device addresses (it then neither calls data_ptr() nor queries the driver)
    assert grid == (3, 2, 1) and args[:4] == (x2.data_ptr(), y2.data_ptr(), 7, s2.data_ptr())
    assert kernel.jit_calls == [(3, 2)]  # nothing went through the JIT again


def test_plan_refuses_a_tensor_triton_would_specialise_differently():
    base = torch.zeros(256)
    x, y, s = base[:8], base[16:24], base[32:40]
    kernel = _Kernel()
    plan = L.LaunchPlan(_record(kernel, x, y, s), dict(inp=x, out=y, scratch=s), hip=False)
    assert not plan.run(dict(inp=base[49:57], out=base[64:72], scratch=base[80:88]))  # 4-byte offset
    assert not kernel.compiled.replays


def test_a_registered_launch_hook_gets_the_tensors(monkeypatch):
    """With a launch hook registered (a profiler), replays go through the runner with the tensors themselves."""
    base = torch.zeros(256)
    x, y, s = base[:8], base[16:24], base[32:40]
    kernel = _Kernel()
    plan = L.LaunchPlan(_record(kernel, x, y, s), dict(inp=x, out=y, scratch=s), hip=False)
    monkeypatch.setattr(L, "_launch_hooks", lambda home: True)
    x2, y2, s2 = base[48:56], base[64:72], base[80:88]
    assert plan.run(dict(inp=x2, out=y2, scratch=s2))
    (_, args), = kernel.compiled.replays
    assert args[0] is x2 and args[1] is y2 and args[3] is s2


def test_a_host_tensor_is_refused_where_a_device_tensor_was_recorded(monkeypatch):
    """The launcher would take a host tensor's bare address without complaint: the replay check refuses it
    (the JIT launch then raises Triton's own error)."""
    base = torch.zeros(256)
    x, y, s = base[:8], base[16:24], base[32:40]
    kernel = _Kernel()
    plan = L.LaunchPlan(_record(kernel, x, y, s), dict(inp=x, out=y, scratch=s), hip=False)
    launch, _ = plan.launches[0]
    # as if recorded on a GPU
    launch.signature = tuple((dtype, aligned, True) for dtype, aligned, _ in launch.signature)
    assert not plan.run(dict(inp=base[48:56], out=base[64:72], scratch=base[80:88]))
    assert not kernel.compiled.replays


def test_a_same_tensor_in_two_slots_maps_to_one_name():
    """Launchers pass q where a tensor argument is absent (cu_seqlens of a dense call): one name."""
    base = torch.zeros(256)
    x, s = base[:8], base[32:40]
    kernel = _Kernel()
    plan = L.LaunchPlan(_record(kernel, x, x, s), dict(q=x, scratch=s), hip=False)
    x2 = base[48:56]
    assert plan.run(dict(q=x2, scratch=base[80:88]))
    (_, args), = kernel.compiled.replays
    assert args[0] == args[1] == x2.data_ptr()


def test_no_plan_for_an_unnamed_tensor_or_an_uncompiled_launch():
    base = torch.zeros(256)
    with pytest.raises(KeyError):  # a tensor the launcher did not name (made inside it, say)
        L.LaunchPlan(_record(_Kernel(), base[:8], base[16:24], base[32:40]), dict(inp=base[:8], out=base[16:24]),
                     hip=False)
    with pytest.raises(LookupError):  # the interpreter's launches return no CompiledKernel
        L.LaunchPlan(_record(_Kernel(compiled=False), base[:8], base[16:24], base[32:40]),
                     dict(inp=base[:8], out=base[16:24], scratch=base[32:40]), hip=False)
    x, y, s = base[:8], base[16:24], base[32:40]
    assert L.LaunchPlan.build(_record(_Kernel(), x, y, s), dict(inp=x, out=y), hip=False) is None
    assert L.LaunchPlan.build(_record(_Kernel(compiled=False), x, y, s), dict(inp=x, out=y, scratch=s),
                              hip=False) is None
    assert L.LaunchPlan.build(_record(_Kernel(), x, y, s), dict(inp=x, out=y, scratch=s), hip=False) is not None


def test_plans_live_while_their_table_rows_are_in_force(monkeypatch):
    """Plans share the config memo: found only with the rows they were built from, gone when it clears."""
    from fa_amd import tuning

    monkeypatch.setattr(tuning, "_RESOLVED", {})
    rows, other = [{}], [{}]
    tuning.memo_put(("plan", "x"), rows, "a plan")
    assert tuning.memo_get(("plan", "x"), rows, False) == "a plan"
    assert tuning.memo_get(("plan", "x"), other, False) is False
    tuning.memo_put(("plan", "y"), rows, None)  # a structure with no plan
    assert tuning.memo_get(("plan", "y"), rows, False) is None
    tuning._RESOLVED.clear()
    assert tuning.memo_get(("plan", "x"), rows, False) is False


def test_recordings_nest_and_stop():
    kernel = _Kernel()
    x = torch.zeros(8)
    with L.recording() as outer:
        L.jit_launch(kernel, (1,), (x, x, 1), {})
        with L.recording() as inner:
            L.jit_launch(kernel, (2,), (x, x, 1), {})
        assert [c[1] for c in inner] == [(2,)]
    assert [c[1] for c in outer] == [(1,), (2,)]
    L.jit_launch(kernel, (3,), (x, x, 1), {})  # outside any recording: nothing kept
    assert len(outer) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors run only under the interpreter (CPU runs)")
def test_cpu_calls_make_no_plans():
    """The interpreter's launches cannot be replayed: CPU calls never store a plan."""
    from fa_amd import flash_attn_func
    from fa_amd.tuning import _RESOLVED

    q = torch.randn(1, 20, 2, 16, dtype=torch.float16, requires_grad=True)
    flash_attn_func(q, q, q, causal=True).sum().backward()
    assert not [key for key in _RESOLVED if key and key[0] == "plan"]


# --------------------------------------------------------------------------- GPU: plans against the JIT path

def _fresh_plans():
    from fa_amd.tuning import _RESOLVED

    for key in [key for key in _RESOLVED if key and key[0] == "plan"]:
        del _RESOLVED[key]


# deterministic=False may sum in fp32 atomics (dQ on AMD, split GQA groups): those gradients are compared
# within a bf16/fp16 ulp, everything else bit for bit
CASES = {
    "dense-causal": dict(causal=True),
    "dense-full-gqa": dict(hk=2, deterministic=True),
    "dense-full-gqa-atomics": dict(hk=2),
    "window-softcap-alibi": dict(window_size=(37, 5), softcap=20.0, alibi=True, deterministic=True),
    "dropout": dict(causal=True, dropout_p=0.15, deterministic=True),
    "deterministic": dict(causal=True, deterministic=True, hk=3),
    "varlen": dict(varlen=True, causal=True, hk=2, deterministic=True),
    "varlen-atomics": dict(varlen=True, causal=True, hk=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_planned_calls_equal_jit_calls(case, dtype, monkeypatch):
    """The second and later calls of a structure run its plan: outputs and gradients bit-equal to the
    same call with no plan (the JIT path), on fresh data each time, and with misaligned views (another
    specialisation: the JIT path again, still right); NaN-poisoned outputs catch a replay that skips
    a write."""
    import fa_amd
    from fa_amd.kernels import launch as launch_mod

    monkeypatch.setattr(launch_mod, "POISON_OUTPUTS", True)
    opts = dict(CASES[case])
    hk, varlen, alibi = opts.pop("hk", 6), opts.pop("varlen", False), opts.pop("alibi", False)
    b, s, hq, d = 3, 203, 6, 64
    seqlens = torch.tensor([0, 57, 57, 203 + 150], dtype=torch.int32, device="cuda")  # an empty segment

    def inputs(offset, seed):
        torch.manual_seed(seed)
        n = b * s * (hq + 2 * hk) * d + offset
        flat = torch.randn(n, device="cuda", dtype=dtype)
        q = flat[offset:offset + b * s * hq * d].view(b, s, hq, d)
        rest = flat[offset + b * s * hq * d:].view(2, b, s, hk, d)
        k, v = rest[0], rest[1]
        if varlen:
            q, k, v = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        return [t.detach().requires_grad_() for t in (q, k, v)] + [torch.randn(q.shape, device="cuda", dtype=dtype)]

    slopes = torch.rand(hq, device="cuda") * 0.3 if alibi else None

    def run(q, k, v, dout):
        torch.manual_seed(1234)  # the same dropout mask for the planned and the JIT call
        if varlen:
            out = fa_amd.flash_attn_varlen_func(q, k, v, seqlens, seqlens, 296, 296, alibi_slopes=slopes, **opts)
        else:
            out = fa_amd.flash_attn_func(q, k, v, alibi_slopes=slopes, **opts)
        out.backward(dout)
        return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]

    for offset in (0, 3):  # 3 elements: q, k, v 16-byte misaligned
        _fresh_plans()
        run(*inputs(offset, 0))  # builds the plans
        data = inputs(offset, 1)
        planned = run(*data)
        for t in data[:3]:
            t.grad = None
        _fresh_plans()
        jit = run(*data)
        for i, (got, want) in enumerate(zip(planned, jit)):
            assert not got.isnan().any()
            if i == 0 or opts.get("deterministic"):  # (the forward has no atomics)
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_alias_pattern_tells_which_tensors_are_one_object():
    a, b = torch.zeros(2), torch.zeros(2)
    assert L.alias_pattern(a, a, b, None, None) == (0, 0, 2, 3, 3)
    assert L.alias_pattern(a, b, a) != L.alias_pattern(a, b, torch.zeros(2))


@pytest.mark.gpu
def test_a_plan_recorded_with_aliased_inputs_is_not_replayed_for_distinct_ones():
    """A plan names a tensor by its first slot: the one recorded for q is k is v (or one cu_seqlens
    for both sides) must not serve a call with distinct tensors."""
    import fa_amd

    torch.manual_seed(0)
    _fresh_plans()
    x = torch.randn(2, 77, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    fa_amd.flash_attn_func(x, x, x, causal=True).sum().backward()  # plans with q is k is v
    q, k, v = (torch.randn(2, 77, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))

    def run():
        for t in (q, k, v):
            t.grad = None
        out = fa_amd.flash_attn_func(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]

    got = run()
    _fresh_plans()
    for a, b in zip(got, run()):
        assert torch.equal(a, b)

    cu = torch.tensor([0, 30, 77], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 50, 77], dtype=torch.int32, device="cuda")
    qv, kv, vv = (t.detach().reshape(154, 4, 64)[:77] for t in (q, k, v))
    _fresh_plans()
    fa_amd.flash_attn_varlen_func(qv, kv, vv, cu, cu, 50, 50)  # one cu_seqlens for both sides
    got = fa_amd.flash_attn_varlen_func(qv, kv, vv, cu, cu_k, 50, 50)  # the same key but for the aliasing
    _fresh_plans()
    assert torch.equal(got, fa_amd.flash_attn_varlen_func(qv, kv, vv, cu, cu_k, 50, 50))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_planned_fp8_calls_equal_jit_calls(causal, monkeypatch):
    """FP8 forwards plan too (their descales a replayed tensor): the second call, on fresh FP8 data with
    other descales, equals the JIT path's bit for bit; V token-major where the family reads it so."""
    import fa_amd
    from fa_amd import fp8
    from fa_amd.kernels import launch as launch_mod
    from fa_amd.tuning import _RESOLVED

    if not fp8.fp8_dtypes(torch.empty(0, device="cuda")):
        pytest.skip("this GPU has no FP8 dot product")
    monkeypatch.setattr(launch_mod, "POISON_OUTPUTS", True)
    dtype = fp8.fp8_dtypes(torch.empty(0, device="cuda"))[0]

    def inputs(seed):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(2, 203, h, 128, device="cuda") for h in (8, 2, 2))
        q8, qd = fp8.quantize_fp8(q.reshape(2, 203, 2, 4 * 128), dtype)
        k8, kd = fp8.quantize_fp8(k, dtype)
        v8, vd = fp8.quantize_fp8(v, dtype)
        return q8.reshape(q.shape), k8, v8, dict(q_descale=qd * (1 + seed), k_descale=kd, v_descale=vd)

    def run(q8, k8, v8, descales):
        return fa_amd.flash_attn_func(q8, k8, v8, causal=causal, **descales)

    _fresh_plans()
    run(*inputs(0))
    assert any(key and key[0] == "plan" and key[1] == "fwd" for key in _RESOLVED)
    data = inputs(1)
    planned = run(*data)
    _fresh_plans()
    jit = run(*data)
    assert not planned.isnan().any() and torch.equal(planned, jit)
    assert not torch.equal(planned, run(*inputs(0)))  # (other descales, other data: not a stale replay)
