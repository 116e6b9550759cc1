"""tools/bench/epilogue_peers.py (issue 59's peers) without a GPU: its command line, shapes, bytes
and targets, the fused call's hook; and where torch is installed (CPU is enough): the float64
reference with HF's rounding points, the fp8 group quantization, the checks (they pass the torch
chain and catch broken ones), and the Triton kernel under Triton's interpreter."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "epilogue_peers.py"


@pytest.fixture(scope="module")
def ep():
    spec = importlib.util.spec_from_file_location("epilogue_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_are_benchmarks_md_prefill_and_decode_at_1_32_64(ep):
    prefill = [(s["T"], s["K"], s["H"], s["dtype"]) for s in ep.prefill_shapes()]
    assert prefill == [(4096, 8, 7168, "bf16"), (4096, 8, 7168, "fp16"), (8192, 2, 4096, "bf16"),
                       (8192, 2, 4096, "fp32"), (16384, 8, 2048, "bf16"), (4096, 4, 2880, "bf16")]
    decode = [(s["T"], s["K"], s["H"]) for s in ep.decode_shapes()]
    assert decode == [(1, 8, 7168), (32, 8, 7168), (64, 8, 7168), (1, 2, 4096), (32, 2, 4096),
                      (64, 2, 4096)]
    assert all(ep.is_decode(s) for s in ep.decode_shapes())
    assert not any(ep.is_decode(s) for s in ep.prefill_shapes())
    # Each model's rms_norm_eps.
    assert {s["label"]: s["eps"] for s in ep.prefill_shapes()}["Mixtral-8x7B prefill"] == 1e-5
    assert len(ep.builtin_shapes("all", True)) == 4
    assert ep.builtin_shapes("decode", False) == ep.decode_shapes()


def test_command_line(ep):
    a = ep.parse_args([])
    assert a.epilogue == ["norm", "norm-fp8"] and a.layout == "gather_map" and not a.scale_pow2
    a = ep.parse_args(["--case", "64,8,7168,bf16,1e-5", "--epilogue", "residual,norm-fp8",
                       "--scale-pow2", "--layout", "token_index"])
    assert a.case[0]["eps"] == 1e-5 and a.epilogue == ["residual", "norm-fp8"]
    for bad in (["--case", "64,8,7168,fp8"], ["--case", "64,8,x,bf16"], ["--case", "0,8,8,bf16"],
                ["--case", "1,8,8,bf16,-1"], ["--epilogue", "norm,rope"], ["--rounds", "3"],
                ["--layout", "csr"]):
        with pytest.raises(SystemExit):
            ep.parse_args(bad)


def test_fused_bytes_count_rows_residual_out_and_scales(ep):
    s = {"T": 4096, "K": 8, "H": 7168, "dtype": "bf16"}
    r = 4096 * 8
    rows = r * 7168 * 2 + r * 8
    assert ep.fused_bytes(s, "norm") == rows + 3 * 4096 * 7168 * 2
    assert ep.fused_bytes(s, "norm-fp8") == rows + 2 * 4096 * 7168 * 2 + 4096 * 7168 + 4096 * 56 * 4
    assert ep.chain_bytes(s, "norm") == ep.fused_bytes(s, "norm") + 2 * 4096 * 7168 * 2
    assert ep.chain_bytes(s, "residual") == ep.fused_bytes(s, "residual") + 4096 * 7168 * 2
    assert ep.scale_groups(2880) == 23 and ep.scale_groups(128) == 1 and ep.scale_groups(1) == 1


def test_targets_follow_issue_59(ep):
    prefill = {"T": 4096, "K": 8, "H": 7168, "dtype": "bf16"}
    fb, cb = ep.fused_bytes(prefill, "norm"), ep.chain_bytes(prefill, "norm")
    us, why = ep.fused_target_us(prefill, "norm", 4000.0, 1000.0, 140.0)
    assert why == "90% of ceiling" and us == pytest.approx(fb / (0.9 * 4000e3))
    us, why = ep.fused_target_us(prefill, "norm", 4000.0, 160.0, 140.0)
    assert why.startswith("best chain") and us == pytest.approx(160.0 / (0.95 * cb / fb))
    decode = {"T": 32, "K": 8, "H": 7168, "dtype": "bf16"}
    assert ep.fused_target_us(decode, "norm", 4000.0, 30.0, 8.0) == (pytest.approx(9.2),
                                                                      "1.15 x combine")
    assert ep.fused_target_us(decode, "norm", 4000.0, 12.0, 8.0) == (pytest.approx(8.0),
                                                                      "best chain / 1.5")
    assert ep.fused_target_us(decode, "norm", 4000.0, None, None) == (None, None)


def test_the_fused_call_is_not_faked(ep):
    # This binding's moejit_combine_args has no epilogue fields yet: the hook says so, whatever
    # the inputs, and never runs anything else in its place.
    fields = ep.mirror_fields()
    if all(f in fields for f in ep.EPILOGUE_FIELDS):
        pytest.skip("the binding has the epilogue fields: the hook's own test is the epilogue "
                    "work's")
    with pytest.raises(ep.FusedUnavailable, match="no epilogue fields .*not available"):
        ep.fused_epilogue_call(None, None, "norm", False)
    assert "residual" in ep.fused_unavailable_reason()


def test_the_fused_call_sets_the_epilogue_and_the_library_accepts_it(ep, tmp_path):
    # The hook fills the plain combine's args with the epilogue (stand-in tensors: only their
    # addresses are read) and returns one library call; the args it builds pass the library's
    # checks (without a driver the call then stops at the driver; with one, nothing is launched
    # on these fake addresses).
    from moejit import _capi
    if ep.fused_unavailable_reason():
        pytest.skip(ep.fused_unavailable_reason())

    class Buffer:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    class Inp:
        shape = {"T": 33, "K": 2, "H": 4096, "dtype": "bf16"}
        eps, stream = 1e-5, 7
        residual, weight = Buffer(0x7f0050000000), Buffer(0x7f0060000000)
        out, scales = Buffer(0x7f0030000000), Buffer(0x7f0070000000)

        def combine_args(self, lib, out):
            a = _capi.new_combine_args()
            a.layout, a.num_tokens, a.top_k, a.num_rows, a.hidden_dim = 1, 33, 2, 66, 4096
            a.expert_hidden, a.expert_dtype = 0x7f0000000000, _capi.DTYPE_BFLOAT16
            a.indices, a.index_type = 0x7f0020000000, _capi.INDEX_INT32
            a.out, a.out_dtype = out.data_ptr(), _capi.DTYPE_BFLOAT16
            return a

    class Lib:
        calls = []

        def combine(self, args, stream):
            self.calls.append((args, stream))

    for epilogue, pow2 in (("residual", False), ("norm", False), ("norm-fp8", True)):
        lib = Lib()
        call = ep.fused_epilogue_call(lib, Inp(), epilogue, pow2)
        assert lib.calls == []  # nothing runs before the call is timed
        call()
        (a, stream), = lib.calls
        lib.calls.clear()
        assert stream == 7 and a.residual == 0x7f0050000000
        assert a.residual_dtype == _capi.DTYPE_BFLOAT16
        assert (a.norm_weight or None) == (None if epilogue == "residual" else 0x7f0060000000)
        if epilogue != "residual":
            assert a.norm_eps == pytest.approx(1e-5) and a.norm_weight_dtype == _capi.DTYPE_BFLOAT16
        fp8 = epilogue == "norm-fp8"
        assert a.out_dtype == (_capi.DTYPE_FLOAT8_E4M3 if fp8 else _capi.DTYPE_BFLOAT16)
        assert (a.out_scales or None) == (0x7f0070000000 if fp8 else None)
        assert a.out_scales_pow2 == int(fp8 and pow2)
        status = _capi.load_library().moe_combine(a, None) if not _driver_present() else None
        if status is not None:
            assert status == _capi.ERROR_DRIVER_NOT_FOUND, _capi.last_error_message()


def _driver_present():
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_without_torch_or_gpu_it_says_so_and_exits_1():
    # No GPU visible even on a GPU machine: the test must not start a benchmark there.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    assert "GPU" in r.stdout + r.stderr


# ---- with torch (CPU) ----------------------------------------------------------------------------

def rows(torch, gen, t, h):
    x = torch.rand((t, h), generator=gen, dtype=torch.float64) * (2 - 1 / 16) + 1 / 16
    return torch.where(torch.rand((t, h), generator=gen) < 0.5, -x, x)


def test_round_to_is_nearest_even_in_each_format(ep):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(100000, generator=gen, dtype=torch.float64) * 10
    v32 = v.float().double()  # exact in fp32: torch's fp32 -> 16-bit conversions round once
    for fmt, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        assert torch.equal(ep.round_to(torch, v32, fmt), v32.float().to(dt).double()), fmt
    small = v32.clamp(-448, 448) / 64  # e4m3 subnormals below 2^-6
    assert torch.equal(ep.round_to(torch, small, "e4m3"),
                       small.float().to(torch.float8_e4m3fn).double())
    assert ep.round_to(torch, torch.tensor([1000.0, -500.0, 0.0], dtype=torch.float64),
                       "e4m3").tolist() == [448.0, -448.0, 0.0]
    # Ties to even: 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7.
    assert ep.round_to(torch, torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8], dtype=torch.float64),
                       "bf16").tolist() == [1.0, 1 + 2 ** -6]


def test_quantization_reference(ep):
    torch = pytest.importorskip("torch")
    y = torch.zeros((2, 300), dtype=torch.float64)
    y[0, :128] = torch.linspace(-3, 1.5, 128, dtype=torch.float64)
    y[0, 128:256] = 0.001
    y[0, 256:] = torch.linspace(0, 7, 44, dtype=torch.float64)  # the short last group
    q, scales = ep.quantize_reference(torch, y, False)
    assert scales.shape == (2, 3)
    assert scales[0].tolist() == [ep.round_to(torch, torch.tensor(v / 448, dtype=torch.float64),
                                              "fp32").item() for v in (3.0, 0.001, 7.0)]
    assert scales[1].tolist() == [ep.round_to(torch, torch.tensor(1e-10 / 448), "fp32").item()] * 3
    assert q[0, 0].item() == -448.0 and q[0, 299].item() == 448.0 and q[1].abs().max() == 0
    q2, s2 = ep.quantize_reference(torch, y, True)
    m, _ = torch.frexp(s2)
    assert bool((m == 0.5).all()) and bool((s2 >= scales).all()) and bool((s2 < 2 * scales).all())
    assert q2.abs().max().item() <= 448.0


def inputs(ep, torch, fmt, t=64, h=300, seed=5):
    gen = torch.Generator().manual_seed(seed)
    res = ep.round_to(torch, rows(torch, gen, t, h), fmt)
    moe = rows(torch, gen, t, h) * 0.5
    w = ep.round_to(torch, torch.rand(h, generator=gen, dtype=torch.float64) + 0.5, fmt)
    return res, moe, w


def run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2, weight=None, eps=1e-6):
    r = res.to(dt)
    out = ep.post_combine(torch, r, ep.round_to(torch, moe, fmt).to(dt),
                          (w if weight is None else weight).to(dt), eps, epilogue, pow2)
    return (r, out[0], out[1]) if isinstance(out, tuple) else (r, out, None)


@pytest.mark.parametrize("epilogue", ["residual", "norm", "norm-fp8"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_the_eager_chain_passes_and_broken_chains_fail(ep, epilogue, fmt):
    torch = pytest.importorskip("torch")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt]
    res, moe, w = inputs(ep, torch, fmt)
    for pow2 in ((False, True) if epilogue == "norm-fp8" else (False,)):
        ref = ep.epilogue_reference(torch, moe, res, w, 1e-6, epilogue, fmt, True, pow2)

        def check(got, tolerance=ep.OUT_TOLERANCE["eager"], reference=ref):
            return ep.check_epilogue(torch, reference, *got, epilogue, fmt, fmt, tolerance)

        good = check(run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2))
        assert good["passed"], good
        # The residual left alone; added twice.
        untouched = run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2)
        assert not check((res.to(dt),) + untouched[1:])["passed"]
        twice = run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2)
        twice[0].add_(ep.round_to(torch, moe, fmt).to(dt))
        assert not check(twice)["passed"]
        if epilogue == "residual":
            continue
        # No norm weight; the norm of the old residual; a tenfold eps (fp32: one part in 1e5).
        no_weight = run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2,
                              weight=torch.ones_like(w))
        assert not check(no_weight)["passed"]
        stale = run_eager(ep, torch, res, moe * 0, w, fmt, dt, epilogue, pow2)
        assert not check((run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2)[0],)
                         + stale[1:])["passed"]
        if epilogue == "norm-fp8":
            # Scales of the wrong maximum (e4m3fnuz's 240 instead of 448).
            r, q, s = run_eager(ep, torch, res, moe, w, fmt, dt, epilogue, pow2)
            bad = check((r, q, s * 448 / 240))
            assert not bad["passed"] and bad["scale_groups_off"] == s.numel()


def test_hf_rounding_points_against_the_fused_semantics(ep):
    torch = pytest.importorskip("torch")
    res, moe, w = inputs(ep, torch, "bf16", t=128, h=1024)
    hf = ep.epilogue_reference(torch, moe, res, w, 1e-6, "norm", "bf16", True)
    fused = ep.epilogue_reference(torch, moe, res, w, 1e-6, "norm", "bf16", False)
    # The residual is exact in bf16 either way; the two differ where rounding the combine's
    # result first moves the sum across a rounding boundary.
    assert torch.equal(ep.round_to(torch, hf["residual"], "bf16"), hf["residual"])
    assert 0 < (hf["residual"] != fused["residual"]).double().mean().item() < 0.5
    # A contender with the fused semantics, checked against the chain's reference, fails on its
    # residual: each is held to its own rounding points.
    got = (fused["residual"].to(torch.bfloat16), ep.round_to(torch, fused["out"], "bf16"), None)
    assert ep.check_epilogue(torch, fused, *got, "norm", "bf16", "bf16", 1.25)["passed"]
    assert not ep.check_epilogue(torch, hf, *got, "norm", "bf16", "bf16", 1.25)["passed"]


@pytest.mark.parametrize("epilogue", ["residual", "norm", "norm-fp8"])
@pytest.mark.parametrize("fmt", ["fp16", "fp32"])
def test_triton_kernel_under_the_interpreter(ep, epilogue, fmt):
    """Triton's CPU interpreter truncates to bf16 and rounds fp8 wrongly where a value rounds up to
    the next power of two: bf16 is left out, and fp8 values are compared with that in mind."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    code = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {str(SCRIPT.parent)!r})
import torch
import epilogue_peers as ep
gen = torch.Generator().manual_seed(7)
T, H, fmt, epilogue = 6, 300, {fmt!r}, {epilogue!r}
dt = {{"fp16": torch.float16, "fp32": torch.float32}}[fmt]
def rows():
    x = torch.rand((T, H), generator=gen, dtype=torch.float64) * (2 - 1 / 16) + 1 / 16
    return torch.where(torch.rand((T, H), generator=gen) < 0.5, -x, x)
res0, moe = ep.round_to(torch, rows(), fmt), rows() * 0.5
w = ep.round_to(torch, torch.rand(H, generator=gen, dtype=torch.float64) + 0.5, fmt)
for pow2 in ((False, True) if epilogue == "norm-fp8" else (False,)):
    res, moe_out = res0.to(dt), ep.round_to(torch, moe, fmt).to(dt)
    out = moe_out if epilogue == "residual" else torch.empty(
        (T, H), dtype=torch.float8_e4m3fn if epilogue == "norm-fp8" else dt)
    scales = torch.full((T, ep.scale_groups(H)), float("nan"))
    ep.add_rms_norm_kernel[(T,)](res, moe_out, w.to(dt), out, scales, H, 1e-6,
                                 BLOCK=ep.triton_block(H), NORM=epilogue != "residual",
                                 QUANT=epilogue == "norm-fp8", POW2=pow2, GROUP_SIZE=128,
                                 num_warps=4)
    ref = ep.epilogue_reference(torch, moe, res0, w, 1e-6, epilogue, fmt, True, pow2)
    if epilogue != "norm-fp8":
        c = ep.check_epilogue(torch, ref, res, out, None, epilogue, fmt, fmt, 1.25)
        assert c["passed"], c
        continue
    assert torch.equal(res.double(), ref["residual"])
    off = (scales.double() - ref["scales"]).abs() > 2.0 ** -20 * ref["scales"]
    assert not off.any(), (scales, ref["scales"])
    q, qr = out.double(), ref["q"]
    m, e = torch.frexp(qr.abs())
    ulp = torch.ldexp(torch.ones_like(qr), torch.clamp(e - 1, min=-6) - 3)
    interpreter_carry = (m == 0.5) & (q == qr / 2)
    wrong = (q - qr).abs() > ulp
    assert not (wrong & ~interpreter_carry).any(), (q[wrong], qr[wrong])
    assert ((q != qr) & ~interpreter_carry).double().mean() < 0.02
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_torch_compile_runs_the_same_chain(ep):
    """The compiled chain is the eager function under torch.compile (on the CPU here: Inductor's
    C++; on the GPU, Triton): same residual, same outputs within a rounding."""
    torch = pytest.importorskip("torch")
    res, moe, w = inputs(ep, torch, "bf16", t=8, h=256)
    m = ep.round_to(torch, moe, "bf16").to(torch.bfloat16)
    for epilogue in ("norm", "norm-fp8"):
        torch._dynamo.reset()

        def post(residual, moe_out, weight):
            return ep.post_combine(torch, residual, moe_out, weight, 1e-6, epilogue, False)
        compiled = torch.compile(post, fullgraph=True, dynamic=False)
        r1, r2 = res.to(torch.bfloat16), res.to(torch.bfloat16)
        a, b = compiled(r1, m, w.to(torch.bfloat16)), post(r2, m, w.to(torch.bfloat16))
        assert torch.equal(r1, r2)
        ref = ep.epilogue_reference(torch, moe, res, w, 1e-6, epilogue, "bf16", True)
        got = (r1, a[0], a[1]) if isinstance(a, tuple) else (r1, a, None)
        assert ep.check_epilogue(torch, ref, *got, epilogue, "bf16", "bf16",
                                 ep.OUT_TOLERANCE["compiled"])["passed"]
        assert isinstance(a, tuple) == isinstance(b, tuple)
