"""GPU probe (issue 18): a minimal FP8 forward beside fa_amd's, to find what fa_amd's causal FP8 forward pays for.

Minimal FP8 forwards (d128, dense, no features but causal; 64x128 tiles, 4 warps; P scaled into FP8's range):
  tiled       one query tile per program, heaviest tiles of every head first (group 0), or fa_amd's grouped
              order (groups of G heads, kernels/blocks.grouped_program_ids); NAN_MARK adds fa_amd's V NaN marks
              in one of several forms (1-5: per-element atomics, placed before / after the key loop, in the
              lightest / heaviest programs; 6-8: one atomic per feature after a reduction over the keys, 7 on
              32-bit words of four keys); LSE stores the row lse too
  persistent  a program per CTA slot, walking its tiles' key blocks in ONE flat loop, so the software pipeline
              prefetches the next tile's first K / V blocks while this tile finishes (Triton's persistent-matmul
              pattern); q goes through the pipeline with every block and a tile's output is written in the next
              tile's first iteration: the forms ptxas does not serialize (docs/TUNING_NOTES.md v40)
Timed beside fa_amd's FP8 and bf16 forwards (CUDA graph replays after bench.l2_flush, ROUNDS interleaved rounds).

    PYTHONPATH=. python .ci/persist_probe.py                    # GPU, PART=marks (default) or PART=persistent
    TRITON_INTERPRET=1 PYTHONPATH=. python .ci/persist_probe.py  # CPU: the kernels against float64 and each other
"""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

P_LOG2 = 8.0  # P scaled by 2**8 into FP8's range before the P.V dot (fa_amd: score_mods.p_shift)


@triton.jit
def _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, m0, qk_scale_log2,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    kT = tl.load(k_ptrs)
    qk = tl.dot(q, kT)
    if CAUSAL:
        if start_n + BLOCK_N > m0:
            qk = tl.where(offs_n[None, :] <= (offs_m - start_n)[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
    p = tl.exp2(qk * qk_scale_log2 - (m_new - 8.0)[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _n_blocks(mblk, nkb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    if CAUSAL:
        return tl.minimum(((mblk + 1) * BLOCK_M + BLOCK_N - 1) // BLOCK_N, nkb)
    else:
        return nkb


@triton.jit
def _mark(flags, v_head, start, end, step, offs_n, offs_d, S):
    for n0 in range(start, end, step):
        vt = tl.load(v_head + offs_d[None, :] * S + (n0 + offs_n)[:, None]).to(tl.float32)
        tl.atomic_or(flags + offs_d[None, :] + 0 * offs_n[:, None], 1, mask=vt != vt, sem="relaxed")


@triton.jit
def _mark_cols(flags, v_head, start, end, step, offs_n, offs_d, S, FORM: tl.constexpr):
    """FORM 6: NaN bits per element, reduced over the keys (within a warp: token-major V), one atomic per
    feature; 7: the same on int32 words of 4 keys (SWAR: byte b is NaN iff (w & 0x7F) + 1 carries into bit 7);
    8: the per-element atomics with the keys bounded (mask rows < S, as fa_amd's masked loads)."""
    for n0 in range(start, end, step):
        if FORM == 6:
            bits = tl.load(v_head + offs_d[None, :] * S + (n0 + offs_n)[:, None]).to(tl.uint8, bitcast=True)
            nan = tl.max(((bits & 0x7F) == 0x7F).to(tl.int32), 0)
            tl.atomic_or(flags + offs_d, 1, mask=nan != 0, sem="relaxed")
        elif FORM == 7:
            offs_w = tl.arange(0, offs_n.shape[0] // 4)
            words = tl.load(v_head.to(tl.pointer_type(tl.uint32), bitcast=True)
                            + offs_d[None, :] * (S // 4) + (n0 // 4 + offs_w)[:, None])
            hit = ((words & 0x7F7F7F7F) + 0x01010101) & 0x80808080  # (bit 7 of a byte: that byte is 0x7F)
            nan = tl.max((hit != 0).to(tl.int32), 0)
            tl.atomic_or(flags + offs_d, 1, mask=nan != 0, sem="relaxed")
        else:
            rows = n0 + offs_n
            vt = tl.load(v_head + offs_d[None, :] * S + rows[:, None], mask=rows[:, None] < S, other=0.0)
            bits = vt.to(tl.uint8, bitcast=True)
            tl.atomic_or(flags + offs_d[None, :] + 0 * offs_n[:, None], 1, mask=(bits & 0x7F) == 0x7F,
                         sem="relaxed")


@triton.jit
def fwd_tiled(Q, K, V, O, S, H, stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vh,
              stride_ob, stride_om, qk_scale_log2, Flags, Lse, group,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              NAN_MARK: tl.constexpr = 0, LSE: tl.constexpr = False):
    """group 0: every (batch, head)'s heaviest tile first, then the next heaviest...; group G: fa_amd's order
    (kernels/blocks.grouped_program_ids), groups of G pairs in turn.  NAN_MARK: each program reads one V block
    for NaNs first (fa_amd's _v_nan_mark on masked FP8 launches); LSE: the row lse stored too."""
    tile = tl.program_id(0)
    nm = S // BLOCK_M
    BH = tl.num_programs(0) // nm
    if group > 0:
        grp = tile // (nm * group)
        rank = tile - grp * (nm * group)
        size = tl.minimum(BH - grp * group, group)
        pid0 = rank // size
        bh = grp * group + (rank - pid0 * size)
        mblk = nm - 1 - pid0
    else:
        mblk = nm - 1 - tile // BH
        bh = tile % BH
    b = bh // H
    h = bh % H
    m0 = mblk * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    v_head = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    # NAN_MARK 1: before the key loop, query block i scans V block i (fa_amd's form); 2: before, the heaviest
    # query blocks scan (block nm - 1 - i); 3: as 2, after the key loop; 4: after the loop, the heaviest query
    # block scans every V block; 5: as 1, after the loop
    if NAN_MARK == 1 or NAN_MARK == 2:
        share = mblk if NAN_MARK == 1 else nm - 1 - mblk
        _mark(Flags + bh * D, v_head, share * BLOCK_N, S, nm * BLOCK_N, offs_n, offs_d, S)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h * D + offs_m[:, None] * stride_qm + offs_d[None, :])
    k_base = K + b.to(tl.int64) * stride_kb + h * D + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_base = v_head + offs_d[None, :] * S + offs_n[:, None]
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    nb = _n_blocks(mblk, S // BLOCK_N, BLOCK_M, BLOCK_N, CAUSAL)
    for j in range(0, nb):
        start_n = j * BLOCK_N
        acc, l_i, m_i = _block(acc, l_i, m_i, q, k_base + start_n * stride_kn, v_base + start_n, start_n, m0,
                               qk_scale_log2, BLOCK_M, BLOCK_N, CAUSAL)
    if NAN_MARK == 3 or NAN_MARK == 5:
        share = mblk if NAN_MARK == 5 else nm - 1 - mblk
        _mark(Flags + bh * D, v_head, share * BLOCK_N, S, nm * BLOCK_N, offs_n, offs_d, S)
    if NAN_MARK >= 6:
        _mark_cols(Flags + bh * D, v_head, mblk * BLOCK_N, S, nm * BLOCK_N, offs_n, offs_d, S, NAN_MARK)
    if NAN_MARK == 4:
        if mblk == nm - 1:
            _mark(Flags + bh * D, v_head, 0, S, BLOCK_N, offs_n, offs_d, S)
    out = acc / l_i[:, None]
    tl.store(O + b.to(tl.int64) * stride_ob + h * D + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(O.dtype.element_ty))
    if LSE:
        tl.store(Lse + bh.to(tl.int64) * S + offs_m, (m_i - 8.0 + tl.log2(l_i)) * 0.6931471805599453)


@triton.jit
def fwd_persistent(Q, K, V, O, S, H, n_tiles, stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vh,
                   stride_ob, stride_om, qk_scale_log2,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   NUM_STAGES: tl.constexpr):
    """One flat loop over this program's (tile, key block)s.  For ptxas to keep the wgmma asynchronous
    (no C7513-C7515): q is loaded with every block (a pipelined load like K and V: the dot reads it from
    shared memory), and a tile's output is written in the next tile's first iteration, after its QK^T
    dot's wait (no wgmma in flight), not right after the tile's last P.V dot."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    nm = S // BLOCK_M
    nkb = S // BLOCK_N
    BH = n_tiles // nm
    total = 0
    for t in range(pid, n_tiles, P):
        total += _n_blocks(nm - 1 - t // BH, nkb, BLOCK_M, BLOCK_N, CAUSAL)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, BLOCK_M)
    tile = pid - P
    j = -1
    nb = 0
    m0 = 0
    b = 0
    h = 0
    o_prev = O + offs_r[:, None] * stride_om + offs_d[None, :]
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for it in tl.range(0, total, num_stages=NUM_STAGES):
        j = tl.where(j == nb - 1, 0, j + 1)
        first = j == 0
        if first:
            tile += P
            mblk = nm - 1 - tile // BH
            bh = tile % BH
            b = bh // H
            h = bh % H
            m0 = mblk * BLOCK_M
            nb = _n_blocks(mblk, nkb, BLOCK_M, BLOCK_N, CAUSAL)
        start_n = j * BLOCK_N
        q = tl.load(Q + b.to(tl.int64) * stride_qb + h * D + (m0 + offs_r)[:, None] * stride_qm + offs_d[None, :])
        k_ptrs = K + b.to(tl.int64) * stride_kb + h * D + (start_n + offs_n)[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = (V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh + offs_d[None, :] * S
                  + (start_n + offs_n)[:, None])
        kT = tl.load(k_ptrs)
        qk = tl.dot(q, kT)
        if first:
            if it > 0:  # the previous tile's output
                tl.store(o_prev, (acc / l_i[:, None]).to(O.dtype.element_ty))
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            o_prev = (O + b.to(tl.int64) * stride_ob + h * D + (m0 + offs_r)[:, None] * stride_om
                      + offs_d[None, :])
        if CAUSAL:
            if start_n + BLOCK_N > m0:
                qk = tl.where(offs_n[None, :] <= (m0 + offs_r - start_n)[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
        p = tl.exp2(qk * qk_scale_log2 - (m_new - 8.0)[:, None])
        alpha = tl.exp2(m_i - m_new)  # 0 on a tile's first block: the old tile's acc is dropped
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    if total > 0:
        tl.store(o_prev, (acc / l_i[:, None]).to(O.dtype.element_ty))


def run(kind, q8, k8, vT8, causal, scale, slots=None, block_m=64, block_n=128, warps=4, stages=3, group=0,
        nan_mark=False, lse=False, scratch={}):
    """Out (bf16) of the minimal kernel `kind`; vT8 is token-major V, (batch, heads, d, seqlen)."""
    b, s, h, d = q8.shape
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=q8.device)
    n_tiles = b * h * (s // block_m)
    args = (q8, k8, vT8, out, s, h)
    strides = (q8.stride(0), q8.stride(1), k8.stride(0), k8.stride(1), vT8.stride(0), vT8.stride(1),
               out.stride(0), out.stride(1), scale * 1.4426950408889634)
    if kind == "tiled":
        key = (q8.device, b, h, s, d)
        if key not in scratch:
            scratch[key] = (torch.zeros(b * h * d, dtype=torch.int32, device=q8.device),
                            torch.empty(b * h * s, dtype=torch.float32, device=q8.device))
        flags, lse_buf = scratch[key]
        fwd_tiled[(n_tiles,)](*args, *strides, flags, lse_buf, group, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                              CAUSAL=causal, NAN_MARK=nan_mark, LSE=lse, num_warps=warps, num_stages=stages)
    else:
        grid = min(n_tiles, slots)
        fwd_persistent[(grid,)](*args, n_tiles, *strides, D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                                NUM_STAGES=stages, num_warps=warps)
    return out


def inputs(b, s, h, d, device, fp8=torch.float8_e4m3fn):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device) for _ in range(3))
    q8, k8, v8 = (x.to(fp8) for x in (q, k, v))
    vT8 = v8.permute(0, 2, 3, 1).contiguous()
    return q8, k8, v8, vT8


def reference(q8, k8, v8, causal, scale):
    q, k, v = (x.double().transpose(1, 2) for x in (q8, k8, v8))
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def check_cpu():
    for causal in (False, True):
        for slots in (1, 3, 5):
            q8, k8, v8, vT8 = inputs(2, 256, 3, 32, "cpu")
            scale = 32 ** -0.5
            ref = reference(q8, k8, v8, causal, scale)
            outs = [run(kind, q8, k8, vT8, causal, scale, slots=slots, block_m=32, block_n=64, warps=4, stages=2)
                    for kind in ("tiled", "persistent")]
            err = (outs[0].double() - ref).abs().max().item()  # (P in FP8: few-key rows err most)
            print(f"causal={causal} slots={slots}: tiled max err {err:.4f}; persistent == tiled: "
                  f"{torch.equal(outs[0], outs[1])}")
            assert err < 0.5 and torch.equal(outs[0], outs[1])


def time_gpu():
    import fa_amd
    from fa_amd import bench

    rounds = int(os.environ.get("ROUNDS", 7))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [(4, 4096, 16, True), (2, 8192, 16, True), (8, 2048, 16, True), (4, 4096, 16, False)]
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, f"{sms} SMs", flush=True)
    q8, k8, v8, vT8 = inputs(2, 4096, 4, 128, "cuda")
    vn = vT8.clone()
    vn[1, 2, 5, 4000] = float("nan")
    for m in (1, 2, 3, 4, 5, 6, 7, 8):
        sc = {}
        run("tiled", q8, k8, vn, True, 0.1, nan_mark=m, scratch=sc)
        flags = list(sc.values())[0][0].view(2, 4, 128)
        print(f"  mark{m} flags at {flags.nonzero().tolist()} (want [[1, 2, 5]])")
    for b, s, h, causal in rows:
        q8, k8, v8, vT8 = inputs(b, s, h, 128, "cuda")
        scale = 128 ** -0.5
        ref = reference(q8[:1], k8[:1], v8[:1], causal, scale)
        qb, kb, vb = (x.to(torch.bfloat16) for x in (q8, k8, v8))
        vt_fa = bench.fp8_inputs(qb, kb, vb)
        fns = {
            "fa_amd bf16": lambda: fa_amd.flash_attn_func(qb, kb, vb, causal=causal),
            "fa_amd fp8": lambda: fa_amd.flash_attn_func(q8, k8, vt_fa[2], causal=causal),
            "tiled": lambda: run("tiled", q8, k8, vT8, causal, scale),
        }
        if os.environ.get("PART", "marks") == "persistent":
            fns.update({
                "tiled s2": lambda: run("tiled", q8, k8, vT8, causal, scale, stages=2),
                # (q through the pipeline too: 131 KB of shared memory at 3 stages, one CTA per SM; 90 KB at 2)
                "persistent s2 2/SM": lambda: run("persistent", q8, k8, vT8, causal, scale, slots=2 * sms, stages=2),
                "persistent s3 1/SM": lambda: run("persistent", q8, k8, vT8, causal, scale, slots=sms)})
        else:
            fns["tiled G8"] = lambda: run("tiled", q8, k8, vT8, causal, scale, group=8)
            fns.update({f"tiled G8 mark{m}": (lambda m=m: run("tiled", q8, k8, vT8, causal, scale, group=8,
                                                                nan_mark=m)) for m in (1, 2, 3, 4, 5, 6, 7, 8)})
        with torch.no_grad():
            for name in [n for n in fns if not n.startswith("fa_amd")][:3]:
                err = (fns[name]()[:1].double() - ref).abs().max().item()
                print(f"  {name}: max err vs float64 {err:.4f}")
            graphs = {n: bench.cuda_graph(f, warmup=2).replay for n, f in fns.items()}
            times = bench.interleaved_rounds_ms({n: (g, ()) for n, g in graphs.items()}, rounds)
        flops = 4 * b * h * s * s * 128 / (2 if causal else 1)
        print(f"### b{b} s{s} h{h} {'causal' if causal else 'full'}")
        for n, ts in times.items():
            ms = statistics.median(ts)
            print(f"  {n:18s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  rounds {[round(t * 1e3) for t in ts]}")
        sys.stdout.flush()
        del graphs, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_cpu()
    else:
        time_gpu()
