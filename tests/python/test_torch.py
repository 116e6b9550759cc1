"""moejit.combine and the moejit::combine custom op on real torch tensors.

Skips (with the reason) without torch; the GPU tests also skip without a CUDA device. Every
result is compared with a float64 reference computed by torch, on a NaN-poisoned output.
"""
import os
import threading

import pytest

# MOEJIT_REQUIRE_GPU=1 (tools/gpu-check-package.sh) turns "skip" into "fail": on the GPU machine a
# missing torch or GPU is a broken setup, not a reason to pass.
REQUIRE_GPU = os.environ.get("MOEJIT_REQUIRE_GPU") == "1"
if REQUIRE_GPU:
    import torch
else:
    torch = pytest.importorskip("torch", reason="torch is not installed")

import moejit  # noqa: E402

needs_gpu = pytest.mark.skipif(not REQUIRE_GPU and not torch.cuda.is_available(),
                               reason="no CUDA GPU")


def test_gpu_present_when_required():
    if not REQUIRE_GPU:
        pytest.skip("MOEJIT_REQUIRE_GPU is not set")
    assert torch.cuda.is_available(), "MOEJIT_REQUIRE_GPU=1 but torch sees no CUDA GPU"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---- argument errors on real tensors (no GPU needed) ---------------------------------------------


def test_cpu_tensor_is_rejected():
    with pytest.raises(ValueError, match="expert_hidden is on device cpu"):
        moejit.combine(torch.zeros(4, 2, 8))


def test_wrong_dtype_is_rejected_on_real_tensors():
    with pytest.raises(TypeError, match="expert_hidden has dtype torch.int32"):
        moejit.combine(torch.zeros(4, 2, 8, dtype=torch.int32))


# ---- helpers -------------------------------------------------------------------------------------


def reference(expert, layout, *, T, K=None, gates=None, index=None, scale=1.0, base=None):
    """float64 result of the combine, from torch ops that are obviously right."""
    x = expert.double().reshape(-1, expert.shape[-1])
    H = x.shape[1]
    g = gates.double().reshape(-1) if gates is not None else None
    if layout == "token_major":
        rows = x.reshape(T, K, H)
        w = g.reshape(T, K, 1) if g is not None else 1.0
        out = (rows * w).sum(1)
    elif layout == "gather_map":
        m = index.reshape(T, K).long()
        valid = (m >= 0).unsqueeze(-1).double()
        rows = x[m.clamp(min=0)] * valid
        w = g.reshape(T, K, 1) if g is not None else 1.0
        out = (rows * w).sum(1)
    else:
        idx = index.long()
        keep = idx >= 0
        w = g[keep].unsqueeze(-1) if g is not None else 1.0
        out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
        out.index_add_(0, idx[keep], x[keep] * w)
    out = out * scale
    if base is not None:
        out = out + base.double()
    return out


def assert_close(got, ref, dtype):
    assert not torch.isnan(got).any(), "output has unwritten (NaN-poisoned) elements"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


def routing(layout, T, K, R, device, index_dtype, drop=0.15, gen=None):
    if layout == "gather_map":
        m = torch.randperm(R, generator=gen)[: T * K].reshape(T, K)
        m[torch.rand(T, K, generator=gen) < drop] = -1
        return m.to(device=device, dtype=index_dtype)
    if layout == "token_index":
        idx = torch.randint(0, T, (R,), generator=gen)
        idx[torch.rand(R, generator=gen) < drop] = -1
        return idx.to(device=device, dtype=index_dtype)
    return None


def make_case(layout, T, K, H, in_dtype, index_dtype=torch.int32, gates=True, pad=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    R = T * K + (5 if layout != "token_major" else 0)
    full = torch.randn(R, H + pad, generator=gen).to(dev, in_dtype)
    expert = full[:, :H]  # padded rows when pad > 0: exercises the row stride
    if layout == "token_major":
        expert = expert.reshape(T, K, H) if pad == 0 else expert
    g = torch.rand(R if layout == "token_index" else T * K, generator=gen).to(dev) if gates else None
    index = routing(layout, T, K, R, dev, index_dtype, gen=gen)
    return expert, g, index


def call(layout, expert, g, index, *, T, K, **kw):
    if layout == "token_major":
        return moejit.combine(expert, layout=layout, top_k=K if expert.dim() == 2 else None,
                              gates=g, **kw)
    if layout == "gather_map":
        return moejit.combine(expert, layout=layout, gather_map=index.reshape(T, K), gates=g, **kw)
    return moejit.combine(expert, layout=layout, token_idx=index, gates=g, num_tokens=T, **kw)


# ---- GPU: correctness ----------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("layout", ["token_major", "gather_map", "token_index"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,K,H", [(1, 8, 7168), (33, 2, 4096), (257, 4, 2880)])
def test_combine_matches_reference(layout, dtype, T, K, H):
    dt = DTYPES[dtype]
    expert, g, index = make_case(layout, T, K, H, dt, seed=T)
    out = torch.full((T, H), float("nan"), dtype=dt, device="cuda")
    got = call(layout, expert, g, index, T=T, K=K, out=out, scale=2.5)
    assert got is out
    torch.cuda.synchronize()
    assert_close(got, reference(expert, layout, T=T, K=K, gates=g, index=index, scale=2.5), dt)


@needs_gpu
@pytest.mark.parametrize("layout", ["token_major", "gather_map", "token_index"])
def test_mixed_dtypes_int64_indices_padded_rows_no_gates(layout):
    T, K, H = 33, 2, 1000
    expert, _, index = make_case(layout, T, K, H, torch.bfloat16, index_dtype=torch.int64,
                                 gates=False, pad=24)
    got = call(layout, expert, None, index, T=T, K=K, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert_close(got, reference(expert, layout, T=T, K=K, index=index), torch.float32)


@needs_gpu
@pytest.mark.parametrize("layout", ["token_major", "gather_map", "token_index"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accumulate_into_strided_out(layout, dtype):
    T, K, H = 33, 2, 4096
    dt = DTYPES[dtype]
    expert, g, index = make_case(layout, T, K, H, dt, seed=7)
    wide = torch.randn(T, H + 64, device="cuda").to(dt)
    out = wide[:, :H]
    base = out.clone()
    padding = wide[:, H:].clone()
    call(layout, expert, g, index, T=T, K=K, out=out, accumulate=True, scale=0.5)
    ref = reference(expert, layout, T=T, K=K, gates=g, index=index, scale=0.5, base=base)
    assert_close(out, ref, dt)
    assert torch.equal(wide[:, H:], padding), "elements between the rows of out were written"


@needs_gpu
def test_writing_into_out_bumps_its_version():
    # out saved for backward, then overwritten by the combine: autograd must notice.
    T, K, H = 4, 2, 128
    x = torch.randn(T, H, device="cuda", requires_grad=True)
    out = torch.zeros(T, H, device="cuda")
    y = x * out
    before = out._version
    moejit.combine(torch.randn(T, K, H, device="cuda"), out=out)
    assert out._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@needs_gpu
def test_all_rows_dropped_gives_zero():
    T, K, H = 5, 2, 256
    expert = torch.randn(T * K, H, device="cuda")
    m = torch.full((T, K), -1, dtype=torch.int32, device="cuda")
    got = moejit.combine(expert, layout="gather_map", gather_map=m)
    assert torch.equal(got, torch.zeros_like(got))


@needs_gpu
def test_empty_batch():
    got = moejit.combine(torch.empty(0, 2, 128, device="cuda"))
    assert got.shape == (0, 128)


@needs_gpu
def test_deterministic():
    T, K, H = 257, 4, 2880
    expert, g, index = make_case("token_index", T, K, H, torch.bfloat16, seed=3)
    a = call("token_index", expert, g, index, T=T, K=K)
    b = call("token_index", expert, g, index, T=T, K=K)
    assert torch.equal(a, b)


@needs_gpu
def test_runs_on_the_current_stream_and_from_a_new_thread():
    T, K, H = 33, 2, 4096
    expert, g, index = make_case("gather_map", T, K, H, torch.bfloat16, seed=11)
    ref = reference(expert, "gather_map", T=T, K=K, gates=g, index=index)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = call("gather_map", expert, g, index, T=T, K=K)
    s.synchronize()
    assert_close(got, ref, torch.bfloat16)

    results = []

    def worker():
        try:
            results.append(call("gather_map", expert, g, index, T=T, K=K))
            torch.cuda.synchronize()
        except Exception as e:  # reported below, in the test's thread
            results.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not isinstance(results[0], Exception), results[0]
    assert_close(results[0], ref, torch.bfloat16)


@needs_gpu
def test_stats_count_launches():
    before = moejit.stats()["launches"]
    moejit.combine(torch.randn(4, 2, 64, device="cuda"))
    assert moejit.stats()["launches"] > before


@needs_gpu
def test_mismatched_devices_or_dtypes_on_gpu():
    x = torch.randn(4, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="gates is on device cpu"):
        moejit.combine(x, gates=torch.rand(4, 2))
    with pytest.raises(TypeError, match="gates has dtype torch.float16"):
        moejit.combine(x, gates=torch.rand(4, 2, device="cuda", dtype=torch.float16))


@needs_gpu
@pytest.mark.parametrize("layout", ["token_major", "gather_map", "token_index"])
def test_tensors_on_a_gpu_that_is_not_current(layout):
    # An engine that keeps device 0 current and hands in tensors of device 1: the call runs on
    # device 1, in its context and on its current stream, and leaves device 0 current.
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; found {torch.cuda.device_count()}")
    T, K, H = 33, 2, 4096
    expert, g, index = make_case(layout, T, K, H, torch.bfloat16, seed=23)
    on_1 = [x.to("cuda:1") if x is not None else None for x in (expert, g, index)]
    with torch.cuda.device(0):
        got = call(layout, *on_1, T=T, K=K)
        assert torch.cuda.current_device() == 0
    assert got.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    assert_close(got, reference(on_1[0], layout, T=T, K=K, gates=on_1[1], index=on_1[2]),
                 torch.bfloat16)
    # The same call from a fresh thread, which has no current context of its own yet.
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=call(layout, *on_1, T=T, K=K)))
    thread.start()
    thread.join()
    torch.cuda.synchronize(1)
    assert torch.equal(result["out"], got)


# ---- GPU: CUDA graphs, the custom op, torch.compile ----------------------------------------------


@needs_gpu
@pytest.mark.parametrize("layout", ["gather_map", "token_index"])
def test_cuda_graph_capture_and_replay(layout):
    T, K, H = 33, 2, 4096
    expert, g, index = make_case(layout, T, K, H, torch.bfloat16, seed=5)
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compiles/loads the kernel outside the capture
        call(layout, expert, g, index, T=T, K=K, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(layout, expert, g, index, T=T, K=K, out=out)
    for seed in (1, 2):
        new_expert, new_g, _ = make_case(layout, T, K, H, torch.bfloat16, seed=100 + seed)
        expert.copy_(new_expert)
        g.copy_(new_g)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(expert, layout, T=T, K=K, gates=g, index=index),
                     torch.bfloat16)


@needs_gpu
def test_custom_op_is_functional():
    T, K, H = 33, 2, 512
    expert, g, index = make_case("gather_map", T, K, H, torch.float32, seed=9)
    base = torch.randn(T, H, device="cuda")
    base_before = base.clone()
    got = moejit.combine_op(expert, layout="gather_map", gather_map=index.reshape(T, K), gates=g,
                            base=base, scale=2.0)
    assert torch.equal(base, base_before), "the custom op must not mutate base"
    ref = reference(expert, "gather_map", T=T, K=K, gates=g, index=index, scale=2.0, base=base)
    assert_close(got, ref, torch.float32)


def test_custom_op_infers_shapes_on_meta_tensors():
    # A model built on device="meta" runs the op's fake implementation: shapes and dtypes come
    # back, nothing is launched; the eager combine (which launches) still refuses meta tensors.
    T, K, H = 33, 2, 512
    expert = torch.empty(T * K, H, device="meta", dtype=torch.bfloat16)
    m = torch.empty(T, K, device="meta", dtype=torch.int32)
    g = torch.empty(T, K, device="meta", dtype=torch.float32)
    got = moejit.combine_op(expert, layout="gather_map", gather_map=m, gates=g,
                            out_dtype=torch.float32)
    assert got.device.type == "meta" and got.shape == (T, H) and got.dtype == torch.float32
    base = torch.empty(H, device="meta", dtype=torch.bfloat16).expand(T, H)
    got = moejit.combine_op(expert.reshape(T, K, H), base=base)
    assert got.device.type == "meta" and got.shape == (T, H) and got.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="expert_hidden is on device meta; moejit needs CUDA"):
        moejit.combine(expert.reshape(T, K, H))
    with pytest.raises(ValueError, match="gates is on device cpu; moejit needs CUDA tensors"):
        moejit.combine_op(expert, layout="gather_map", gather_map=m, gates=torch.ones(T, K))


@needs_gpu
def test_custom_op_index_argument_goes_with_its_layout_and_base_may_broadcast():
    T, K, H = 8, 2, 256
    expert, g, index = make_case("gather_map", T, K, H, torch.float32, seed=10)
    # The op's single `indices` argument is read by layout: a gather map with layout
    # 'token_index' (or token_idx with 'gather_map') is refused, never read as the other.
    with pytest.raises(ValueError, match="gather_map is given but layout = 'token_index'"):
        moejit.combine_op(expert, layout="token_index", gather_map=index, num_tokens=T)
    with pytest.raises(ValueError, match="token_idx is given but layout = 'gather_map'"):
        moejit.combine_op(expert, layout="gather_map", token_idx=index, top_k=K)
    # A broadcast bias as base: the op accumulates into a contiguous copy.
    bias = torch.randn(H, device="cuda")
    got = moejit.combine_op(expert, layout="gather_map", gather_map=index.reshape(T, K), gates=g,
                            base=bias.expand(T, H))
    ref = reference(expert, "gather_map", T=T, K=K, gates=g, index=index,
                    base=bias.expand(T, H).contiguous())
    assert_close(got, ref, torch.float32)


@needs_gpu
@pytest.mark.parametrize("layout", ["token_major", "gather_map", "token_index"])
def test_custom_op_opcheck(layout):
    T, K, H = 9, 2, 256
    expert, g, index = make_case(layout, T, K, H, torch.bfloat16, seed=4)
    args = (expert, index, g, None, layout, None if layout == "token_index" else K,
            T if layout == "token_index" else None, None, 1.0)
    torch.library.opcheck(torch.ops.moejit.combine.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


@needs_gpu
def test_torch_compile_with_the_custom_op():
    T, K, H = 33, 2, 4096
    expert, g, index = make_case("gather_map", T, K, H, torch.bfloat16, seed=12)
    shared = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    combine_op = moejit.combine_op

    def moe_block(expert, m, g, shared):
        y = combine_op(expert, layout="gather_map", gather_map=m, gates=g, base=shared,
                              scale=2.5)
        return torch.nn.functional.silu(y.float()).to(torch.bfloat16)

    compiled = torch.compile(moe_block, fullgraph=True)
    m = index.reshape(T, K)
    got = compiled(expert, m, g, shared)
    want = moe_block(expert, m, g, shared)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2)


# ---- the epilogue: residual=, norm_weight=, eps=, out_scales= -------------------------------------


def epilogue_reference(c, residual, weight, eps, fp8, pow2, model_dtype):
    """The documented math (moejit.h, "The epilogue") from c, the combine's fp32 result, in torch
    ops whose every fp32 operation is one IEEE operation: the pairwise sum of squares level by
    level, division and square root as IEEE. Returns (new residual or None, out, scales)."""
    # Divisions by a tensor, never by a Python number: torch computes a tensor divided by a scalar
    # as a product with its reciprocal, which is not the IEEE quotient moejit.h specifies.
    def div(a, b):
        return a / torch.full_like(a, b)

    v = c  # without a norm, out receives the combine, with or without a residual
    new_residual = None
    if residual is not None:
        h = residual.float() + c
        new_residual = h.to(residual.dtype)
    if weight is not None:
        x = (h if residual is not None else c).to(model_dtype).float()
        T, H = x.shape
        P = 1
        while P < H:
            P *= 2
        s = torch.zeros(T, P, dtype=torch.float32, device=x.device)
        s[:, :H] = x * x
        while s.shape[1] > 1:
            s = s.view(T, -1, 2).sum(-1)  # one fp32 add per pair: the pairwise order
        r = torch.ones_like(s) / torch.sqrt(div(s, float(H)) + eps)
        v = ((x * r).to(model_dtype).float() * weight.float()).to(model_dtype).float()
    if not fp8:
        return new_residual, v, None
    T, H = v.shape
    G = (H + 127) // 128
    padded = torch.zeros(T, G * 128, device=v.device)
    padded[:, :H] = v.abs()
    scales = div(padded.view(T, G, 128).amax(-1).clamp(min=1e-10), 448.0)
    if pow2:
        scales = ((scales.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    q = (v / scales.repeat_interleave(128, dim=1)[:, :H]).to(torch.float8_e4m3fn)
    return new_residual, q, scales


@needs_gpu
@pytest.mark.parametrize("layout", ["token_major", "gather_map", "token_index"])
@pytest.mark.parametrize("epilogue", ["residual", "norm", "norm-fp8", "norm-only", "fp8-only"])
@pytest.mark.parametrize("T,K,H", [(1, 8, 7168), (33, 2, 2880), (300, 4, 4096)])
def test_epilogue_matches_the_documented_math_bit_for_bit(layout, epilogue, T, K, H):
    dt = torch.bfloat16
    expert, g, index = make_case(layout, T, K, H, dt, seed=T + K)
    gen = torch.Generator().manual_seed(H)
    residual = None if epilogue in ("norm-only", "fp8-only") else \
        torch.randn(T, H, generator=gen).to("cuda", dt)
    weight = None if epilogue in ("residual", "fp8-only") else \
        (torch.rand(H, generator=gen) + 0.5).to("cuda", dt)
    fp8 = epilogue.endswith("fp8") or epilogue == "fp8-only"
    pow2 = T == 33
    # c: the plain combine's fp32 result is exactly the epilogue's (fma(sum, scale, 0)).
    c = call(layout, expert, g, index, T=T, K=K, out_dtype=torch.float32, scale=1.5)
    want_res, want_out, want_scales = epilogue_reference(
        c, residual, weight, 1e-5, fp8, pow2, residual.dtype if residual is not None else dt)
    res = residual.clone() if residual is not None else None
    got = call(layout, expert, g, index, T=T, K=K, scale=1.5, residual=res, norm_weight=weight,
               eps=1e-5, out_dtype=torch.float8_e4m3fn if fp8 else dt, out_scales_pow2=pow2)
    torch.cuda.synchronize()
    if fp8:
        out, scales = got
        assert torch.equal(scales, want_scales)
        assert torch.equal(out.view(torch.uint8), want_out.view(torch.uint8))
    else:
        assert torch.equal(got.float(), want_out.to(dt).float())
    if res is not None:
        assert torch.equal(res, want_res)


@needs_gpu
def test_epilogue_into_given_buffers_and_deepgemm_scales():
    T, K, H = 33, 8, 7168
    expert, g, index = make_case("gather_map", T, K, H, torch.bfloat16, seed=21)
    residual = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(H, device="cuda", dtype=torch.bfloat16) + 0.5
    out = torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn)
    G, T4 = H // 128, (T + 3) // 4 * 4
    storage = torch.full((G, T4), float("nan"), device="cuda")
    scales = storage.t()[:T]  # DeepGEMM's column-major, 4-aligned layout
    res = residual.clone()
    version = res._version
    got = call("gather_map", expert, g, index, T=T, K=K, out=out, residual=res,
               norm_weight=weight, out_scales=scales)
    assert got[0] is out and got[1] is scales and res._version > version
    torch.cuda.synchronize()
    c = call("gather_map", expert, g, index, T=T, K=K, out_dtype=torch.float32)
    want_res, want_out, want_scales = epilogue_reference(c, residual, weight, 1e-6, True, False,
                                                         torch.bfloat16)
    assert torch.equal(res, want_res) and torch.equal(scales, want_scales)
    assert torch.isnan(storage[:, T:]).all(), "entries past the batch were written"
    assert torch.equal(out.view(torch.uint8), want_out.view(torch.uint8))


@needs_gpu
def test_epilogue_op_mutates_the_residual_and_matches_the_eager_call():
    T, K, H = 9, 2, 4096
    expert, g, index = make_case("gather_map", T, K, H, torch.bfloat16, seed=22)
    m = index.reshape(T, K)
    residual = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(H, device="cuda", dtype=torch.bfloat16) + 0.5
    eager_res, op_res = residual.clone(), residual.clone()
    eager = moejit.combine(expert, layout="gather_map", gather_map=m, gates=g, residual=eager_res,
                           norm_weight=weight, out_dtype=torch.float8_e4m3fn)
    out, scales = moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m, gates=g,
                                             residual=op_res, norm_weight=weight,
                                             out_dtype=torch.float8_e4m3fn,
                                             scales_column_major=True)
    torch.cuda.synchronize()
    assert torch.equal(op_res, eager_res)
    assert torch.equal(out.view(torch.uint8), eager[0].view(torch.uint8))
    assert torch.equal(scales.t()[:T], eager[1])
    args = (expert, m, g, None, residual.clone(), weight, "gather_map", K, None, None, 1.0, 1e-6,
            False, False)
    torch.library.opcheck(torch.ops.moejit.combine_epilogue.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))

    def layer(expert, m, g, residual, weight):
        return moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m, gates=g,
                                          residual=residual, norm_weight=weight)

    compiled = torch.compile(layer, fullgraph=True)
    a, b = residual.clone(), residual.clone()
    got, want = compiled(expert, m, g, a, weight), layer(expert, m, g, b, weight)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(a, b)


def test_epilogue_op_infers_shapes_on_meta_tensors():
    T, K, H = 33, 2, 512
    expert = torch.empty(T * K, H, device="meta", dtype=torch.bfloat16)
    m = torch.empty(T, K, device="meta", dtype=torch.int32)
    res = torch.empty(T, H, device="meta", dtype=torch.bfloat16)
    w = torch.empty(H, device="meta", dtype=torch.float32)
    out, scales = moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m,
                                             residual=res, norm_weight=w,
                                             out_dtype=torch.float8_e4m3fn)
    assert out.shape == (T, H) and out.dtype == torch.float8_e4m3fn and scales.shape == (T, 4)
    out, scales = moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m,
                                             out_dtype=torch.float8_e4m3fn,
                                             scales_column_major=True)
    assert scales.shape == (4, 36) and scales.dtype == torch.float32
    got = moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m, residual=res)
    assert got.shape == (T, H) and got.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="residual is on device cpu"):
        moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m,
                                   residual=torch.empty(T, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="eps = -1.0"):
        moejit.combine_epilogue_op(expert, layout="gather_map", gather_map=m, norm_weight=w,
                                   eps=-1.0)
