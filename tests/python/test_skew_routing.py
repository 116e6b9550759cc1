"""tools/bench/skew_routing.py: moejit-bench --skew's routings in Python. Its fingerprints are
pinned to the values tests/unit/test_bench_data.cpp pins for the C++ generator, so peers.py --skew
and moejit-bench --skew time the very same routing for a seed. Pure Python: no torch, no GPU."""
import importlib.util
import math
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sr():
    spec = importlib.util.spec_from_file_location(
        "skew_routing", REPO / "tools" / "bench" / "skew_routing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (T, K, spread, hot_rows, drop, fingerprint): the same table as SkewRouting.
# FingerprintsMatchThePythonGenerator in tests/unit/test_bench_data.cpp (seed 7).
PINNED = [
    (64, 4, "uniform", 0, 0.0, 0x008AFD6400EB0FAE),
    (64, 4, "uniform", 0, 25.0, 0x96FA5E434472D316),
    (64, 4, "hot", 256, 0.0, 0x393BDD0D0CD0BDBD),
    (64, 4, "hot", 256, 25.0, 0x13F7A7EA5F29181F),
    (64, 4, "hot", 32, 0.0, 0x5896030A6A7FFA9A),
    (64, 4, "top_percent", 0, 0.0, 0x9FE79594C8FA3A14),
    (64, 4, "top_percent", 0, 25.0, 0xBDBFF3CA9D8305E1),
    (64, 4, "zipf", 0, 0.0, 0x2F39AF070D06800E),
    (64, 4, "zipf", 0, 25.0, 0x26201FEDB26CE892),
    (4096, 8, "hot", 64, 25.0, 0x6B24099A1F4729A5),
    (4096, 8, "top_percent", 0, 25.0, 0x29E1D0663B879724),
    (4096, 8, "zipf", 0, 25.0, 0x55257A7C5DF0D47E),
]


@pytest.mark.parametrize("T,K,spread,hot,drop,expected", PINNED)
def test_fingerprints_match_the_cpp_generator(sr, T, K, spread, hot, drop, expected):
    token_idx, gates, _ = sr.make_routing(T, K, sr.Spec(spread, hot, drop), 7)
    assert sr.fingerprint(token_idx, gates) == expected, hex(sr.fingerprint(token_idx, gates))


def test_mix_is_splitmix64(sr):
    # splitmix64's first outputs from state 0 (the generator adds the golden gamma first).
    assert sr.mix(0) == 0xE220A8397B1DCDAF
    assert sr.mix(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_rows_per_token_follow_each_spread(sr):
    T, K = 1024, 8
    R = T * K
    uniform, _, _ = sr.make_routing(T, K, sr.Spec("uniform"), 3)
    assert sr.rows_per_token(uniform, T) == [K] * T
    one, _, _ = sr.make_routing(T, K, sr.Spec("hot", R), 3)
    assert sr.rows_per_token(one, T)[0] == R
    for hot in (0, 16, 1024):
        count = sr.rows_per_token(sr.make_routing(T, K, sr.Spec("hot", hot), 3)[0], T)
        assert count[0] == hot and sum(count) == R
    # 1% of 1024 tokens is 10 (at least one): they hold exactly half the rows.
    top = sorted(sr.rows_per_token(sr.make_routing(T, K, sr.Spec("top_percent"), 3)[0], T),
                 reverse=True)
    assert sum(top[:10]) == R // 2 and top[9] > 250 and top[10] < 30


def test_zipf_follows_its_law(sr):
    T, K = 1024, 8
    R = T * K
    norm = sum(r ** -1.2 for r in range(1, T + 1))
    count = sorted(sr.rows_per_token(sr.make_routing(T, K, sr.Spec("zipf"), 5)[0], T),
                   reverse=True)
    for rank in (1, 2, 3):
        p = rank ** -1.2 / norm
        assert abs(count[rank - 1] - p * R) < 5 * math.sqrt(p * (1 - p) * R), rank


def test_drops_the_asked_share_and_keeps_the_rest(sr):
    T, K = 512, 8
    R = T * K
    for spread, hot in (("uniform", 0), ("hot", R), ("top_percent", 0), ("zipf", 0)):
        dropped_idx, dropped_gates, n = sr.make_routing(T, K, sr.Spec(spread, hot, 25.0), 9)
        kept_idx, kept_gates, _ = sr.make_routing(T, K, sr.Spec(spread, hot), 9)
        assert n == R // 4 == dropped_idx.count(-1)
        assert all(d in (-1, k) for d, k in zip(dropped_idx, kept_idx))
        assert dropped_gates == kept_gates
    assert sr.dropped_row_count(300, 12.5) == 38  # 37.5 rounds away from zero, as std::llround


def test_gates_are_float32_scores(sr):
    _, gates, _ = sr.make_routing(64, 4, sr.Spec("zipf"), 1)
    assert all(0.05 <= g < 1.0 and sr.float32(g) == g for g in gates)


def test_seed_changes_everything_and_only_the_seed(sr):
    spec = sr.Spec("zipf", 0, 25.0)
    a = sr.make_routing(256, 4, spec, 11)
    assert a == sr.make_routing(256, 4, spec, 11)
    assert a[0] != sr.make_routing(256, 4, spec, 12)[0]


def test_specs_are_moejit_benchs(sr):
    names = [s.name(32768) + (" drop" if s.drop_percent else "")
             for s in sr.skew_specs(32768, 25.0)]
    assert names == ["uniform", "one token", "1% of tokens: half", "zipf 1.2", "token 0: 0 rows",
                     "token 0: 64 rows", "token 0: 512 rows", "token 0: 4096 rows",
                     "token 0: 16384 rows", "uniform drop", "one token drop",
                     "1% of tokens: half drop", "zipf 1.2 drop"]
    assert len(sr.skew_specs(32768, 0.0)) == 9
    assert len(sr.skew_specs(256, 0.0)) == 8


def test_refuses_bad_arguments(sr):
    for T, K, spec in ((0, 8, sr.Spec("uniform")), (1 << 30, 8, sr.Spec("uniform")),
                       (4, 2, sr.Spec("hot", 9)), (4, 2, sr.Spec("zipf", 0, 101.0))):
        with pytest.raises(ValueError):
            sr.make_routing(T, K, spec, 1)
    with pytest.raises(ValueError, match="spread 'skewed'"):
        sr.Spec("skewed")
    for spread in ("hot", "top_percent", "zipf"):
        assert set(sr.make_routing(1, 8, sr.Spec(spread), 1)[0]) == {0}
