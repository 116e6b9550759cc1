"""peers.py --skew and --awkward-h: which shapes run, the uniform ratios and summary of the skewed
routings, the error bound's growth with a token's rows; and, where torch is installed (CPU is
enough), the reference by token_idx and the check every contender gets. No GPU."""
import argparse
import importlib.util
import math
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers", REPO / "tools" / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def namespace(**kw):
    base = dict(case=[], cases_from=None, awkward_h=False, skew=False, skew_case=[], all=False,
                quick=False, no_extra=False)
    base.update(kw)
    return argparse.Namespace(**base)


def keys(shapes):
    return [(s["T"], s["K"], s["H"], s["in_dtype"]) for s in shapes]


def test_skew_and_awkward_h_choose_what_runs(peers):
    builtin = keys(peers.builtin_shapes(False, True))
    shapes, skew = peers.choose_shapes(namespace())
    assert keys(shapes) == builtin and skew == []
    shapes, skew = peers.choose_shapes(namespace(skew=True))
    assert shapes == []
    assert keys(skew) == [(4096, 8, 7168, "bf16"), (8192, 2, 4096, "bf16")]
    assert keys(peers.choose_shapes(namespace(skew=True, quick=True))[1]) == [
        (4096, 8, 7168, "bf16")]
    case = peers.parse_case("1024,4,512,fp16")
    shapes, skew = peers.choose_shapes(namespace(skew_case=[case]))
    assert shapes == [] and keys(skew) == [(1024, 4, 512, "fp16")]
    shapes, skew = peers.choose_shapes(namespace(awkward_h=True))
    assert skew == [] and len(shapes) == 18
    assert {s["H"] for s in shapes} == {1000, 1001, 2880, 5000, 7000, 7169}
    assert {s["in_dtype"] for s in shapes} == {"fp32", "fp16", "bf16"}
    assert all(s["T"] == 6000 and s["K"] == 8 for s in shapes)
    # Issue 58's target is for prefill sizes of at least 64 MB moved.
    assert min(peers.minimal_bytes(s) for s in shapes) >= 64e6
    shapes, _ = peers.choose_shapes(namespace(awkward_h=True, all=True))
    assert keys(shapes) == keys(peers.awkward_h_shapes()) + builtin


def case(shape, routing, drop, peers_us, max_rows=8):
    return dict(shape, routing=routing, drop_percent=drop, max_rows_per_token=max_rows,
                peers=[{"name": n, "us": us} if us else {"name": n, "error": "x"}
                       for n, us in peers_us.items()])


def test_skew_ratios_are_to_the_same_contenders_uniform_time(peers):
    shape = {"T": 4096, "K": 8, "H": 7168, "in_dtype": "bf16", "out_dtype": "bf16"}
    other = dict(shape, K=2)
    cases = [
        case(shape, "uniform", 0.0, {"libmoejit_token_index": 130.0, "torch_index_add": 2400.0}),
        case(shape, "one token", 0.0, {"libmoejit_token_index": 195.0, "torch_index_add": 2300.0},
             32768),
        case(other, "one token", 0.0, {"libmoejit_token_index": 50.0}),  # no uniform of its own
        case(shape, "uniform", 25.0, {"libmoejit_token_index": 100.0, "torch_index_add": None}),
        case(shape, "zipf 1.2", 25.0, {"libmoejit_token_index": 120.0, "torch_index_add": 900.0}),
    ]
    peers.add_uniform_ratios(cases)
    ratio = [[r.get("vs_uniform") for r in c["peers"]] for c in cases]
    assert ratio[0] == [1.0, 1.0]
    assert ratio[1] == [pytest.approx(1.5), pytest.approx(2300 / 2400)]
    assert ratio[2] == [None]
    assert ratio[4] == [pytest.approx(1.2), None]  # index_add_ failed on the uniform routing
    lines = peers.skew_summary_lines(cases)
    assert "x_unif" in lines[2] and "index_add_ us" in lines[2]
    one = [line for line in lines if "one token" in line][0]
    assert "32768" in one and "1.50" in one and "11.79" in one  # 2300 / 195: x lib
    assert "FAILED" in [line for line in lines if "uniform" in line and "25%" in line][0]


def test_error_bound_grows_past_sixty_four_rows_like_moejit_benchs(peers):
    assert peers.error_bound(1e-3) == peers.error_bound(1e-3, 1.0, 64) == 1.25e-3 + 1e-6
    assert peers.error_bound(0.0, 1.0, 64 * 400) == pytest.approx(20e-6)
    assert peers.error_bound(0.0, 2.0, 32) == pytest.approx(2e-6)


def test_a_wrong_skewed_libmoejit_result_fails_the_run(peers):
    shape = {"T": 8, "K": 1, "H": 4, "in_dtype": "bf16", "out_dtype": "bf16"}
    good = case(shape, "zipf 1.2", 0.0, {"libmoejit_token_index": 5.0})
    good["peers"][0].update(rel_err=1e-3, rel_err_after=1e-3, rel_err_bound=2e-3)
    bad = case(shape, "one token", 0.0, {"libmoejit_token_index": 5.0})
    bad["peers"][0].update(rel_err=1e-3, rel_err_bound=2e-3, tokens_over_bound=1)
    assert peers.libmoejit_failures([good]) == []
    assert peers.libmoejit_failures([good, bad]) == [("T8 K1 H4 bf16", "libmoejit_token_index")]


# ---- with torch (CPU): the reference by token_idx and the check ---------------------------------

def test_token_index_reference_and_check_on_a_skewed_routing(peers):
    torch = pytest.importorskip("torch")
    sr = peers.skew_routing
    T, K, H = 256, 8, 32
    token_list, gates, dropped = sr.make_routing(T, K, sr.Spec("hot", T * K, 25.0), 3)
    tidx = torch.tensor(token_list, dtype=torch.int64)
    g = torch.tensor(gates, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand((T * K, H), generator=gen) * 1.9 + 0.0625).to(torch.bfloat16)
    ref, rows = peers.token_index_reference(torch, x, tidx, g, T)
    assert rows[0].item() == T * K - dropped and rows[1:].sum().item() == 0
    naive = torch.zeros((T, H), dtype=torch.float64)
    for r, t in enumerate(token_list):
        if t >= 0:
            naive[t] += x[r].double() * float(g[r])
    assert torch.allclose(ref, naive, rtol=1e-12, atol=0)

    check = peers.Case(ref, torch.float32, 10, rows)
    # A correct fp32 kernel sums the 1536 rows of token 0 in order in fp32: its error is over
    # the 1e-6 of K <= 64 rows, within the bound that grows with the rows.
    acc = torch.zeros(H, dtype=torch.float32)
    for r, t in enumerate(token_list):
        if t == 0:
            acc += x[r].float() * g[r]
    out = torch.zeros((T, H), dtype=torch.float32)
    out[0] = acc
    err, nonfinite, bad = check.check(out)
    assert (nonfinite, bad) == (0, 0) and err <= check.rel_err_bound
    assert check.rel_err_bound > peers.error_bound(0.0)
    # One row of token 0 left out, or a token without rows written: caught on that token.
    first = token_list.index(0)
    wrong = out.clone()
    wrong[0] -= x[first].float() * g[first]
    assert check.check(wrong)[2] == 1
    leaked = out.clone()
    leaked[5, 3] = 1e-3
    assert check.check(leaked)[2] == 1
    leaked[7, 0] = float("nan")
    assert check.check(leaked)[1:] == (1, 2)


def test_check_of_a_fixed_k_shape_is_unchanged(peers):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    ref = torch.rand((64, 128), generator=gen, dtype=torch.float64) + 0.5
    check = peers.Case(ref, torch.bfloat16, 10)
    rounding = ref.to(torch.bfloat16).double() - ref
    assert check.rel_err_bound == peers.error_bound(
        (torch.linalg.vector_norm(rounding) / torch.linalg.vector_norm(ref)).item())
    err, nonfinite, bad = check.check(ref.to(torch.bfloat16))
    assert (nonfinite, bad) == (0, 0)
    assert math.isclose(err, (check.rel_err_bound - 1e-6) / 1.25, rel_tol=1e-9)
