"""moejit-bench --skew's routings in Python, identical for a seed (tools/bench/skew_routing.h
states the algorithm; tests/python/test_skew_routing.py and tests/unit/test_bench_data.cpp pin
the same fingerprints). peers.py --skew times its peers on these, so that its figures and
moejit-bench's are of the very same routing: the token of every row, the row order, the dropped
rows and the gates. (The rows' values are each tool's own draws from the same distribution: they
do not change what a combine moves.)

Pure Python, no numpy or torch: the tests run without them. R = 131072 rows take about a second.
"""

import bisect
import math
import struct

MASK = (1 << 64) - 1
TOKEN_SALT, SLOT_SALT, ROW_SALT, DROP_SALT, GATE_SALT = (0x70C3E5, 0x5107, 0x7035, 0xD209A1,
                                                         0x6A7E5B1)
SPREADS = ("uniform", "hot", "top_percent", "zipf")
ZIPF_S = 1.2
DEFAULT_SECOND_DROP = 25.0  # issue 58: each distribution with 0% and 25% of the rows dropped


def mix(x):
    """splitmix64's finalizer (bench_data.h, mix)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


class Stream:
    def __init__(self, seed, salt):
        self.base = mix((seed ^ salt) & MASK)

    def key(self, i):
        return mix((self.base + i) & MASK)


def draw(h, n):
    """An integer in [0, n) from the high half of h (n < 2^32)."""
    return ((h >> 32) * n) >> 32


def sorted_by_key(n, stream):
    """0..n-1 ordered by the stream's keys, ties by index."""
    return sorted(range(n), key=lambda i: (stream.key(i), i))


def dropped_row_count(rows, drop_percent):
    """round(drop_percent% of rows), halves away from zero (std::llround)."""
    return int(math.floor(rows * drop_percent / 100.0 + 0.5))


class Spec:
    """One routing: spread (SPREADS), hot_rows (spread "hot": rows on token 0), drop_percent."""

    def __init__(self, spread, hot_rows=0, drop_percent=0.0, zipf_s=ZIPF_S):
        if spread not in SPREADS:
            raise ValueError(f"spread {spread!r}: expected one of {', '.join(SPREADS)}")
        self.spread, self.hot_rows, self.drop_percent, self.zipf_s = (spread, hot_rows,
                                                                       drop_percent, zipf_s)

    def name(self, rows):
        """moejit-bench's name of the routing (RoutingSpec::name)."""
        if self.spread == "uniform":
            return "uniform"
        if self.spread == "hot":
            return "one token" if self.hot_rows == rows else f"token 0: {self.hot_rows} rows"
        if self.spread == "top_percent":
            return "1% of tokens: half"
        return f"zipf {self.zipf_s:g}"

    def __repr__(self):
        return (f"Spec({self.spread!r}, hot_rows={self.hot_rows}, "
                f"drop_percent={self.drop_percent:g})")


def skew_specs(rows, drop_percent):
    """moejit-bench --skew's list for a shape of `rows` rows, in its order (skew_routing.h,
    skew_specs): the four spreads, issue 58's table (token 0 with 0, R/512, R/64, R/8, R/2 rows,
    counts met twice left out), then the four again at drop_percent unless it is 0."""
    def four(drop):
        return [Spec("uniform", 0, drop), Spec("hot", rows, drop), Spec("top_percent", 0, drop),
                Spec("zipf", 0, drop)]
    specs = four(0.0)
    counts = []
    for divisor in (0, 512, 64, 8, 2):
        n = 0 if divisor == 0 else rows // divisor
        if n == rows or n in counts:
            continue
        counts.append(n)
        specs.append(Spec("hot", n))
    if drop_percent > 0:
        specs += four(drop_percent)
    return specs


def _slot_tokens(T, K, spec, seed):
    R = T * K
    slots = Stream(seed, SLOT_SALT)
    if spec.spread == "uniform":
        return [j // K for j in range(R)]
    if spec.spread == "hot":
        return [0 if j < spec.hot_rows or T == 1 else 1 + draw(slots.key(j), T - 1)
                for j in range(R)]
    order = sorted_by_key(T, Stream(seed, TOKEN_SALT))
    if spec.spread == "top_percent":
        hot = max(1, (T + 50) // 100)
        tokens = []
        for j in range(R):
            h = slots.key(j)
            to_hot = j < R // 2 or hot == T
            tokens.append(order[draw(h, hot) if to_hot else hot + draw(h, T - hot)])
        return tokens
    # Zipf: the running sum of pow(r + 1, -s) in rank order (math.pow: the C library's pow, as
    # std::pow), then the first rank whose running sum exceeds unit(h) * total.
    cdf, total = [], 0.0
    for r in range(T):
        total += math.pow(float(r + 1), -spec.zipf_s)
        cdf.append(total)
    tokens = []
    for j in range(R):
        u = float(slots.key(j) >> 11) * 2.0 ** -53 * total
        tokens.append(order[min(bisect.bisect_right(cdf, u), T - 1)])
    return tokens


def float32(x):
    """x rounded to the nearest float32 (as static_cast<float>), back as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def make_routing(T, K, spec, seed):
    """(token_idx, gates, dropped): token_idx[p] the token of row p (-1: dropped), gates[p] its
    gate (float32 values as Python floats), for R = T*K rows; as skew_routing.h's make_routing."""
    if T < 1 or K < 1 or T * K > 2**31 - 1:
        raise ValueError(f"make_routing: tokens {T} x top_k {K} must be 1..INT32_MAX rows")
    R = T * K
    if not 0 <= spec.hot_rows <= R:
        raise ValueError(f"make_routing: hot_rows {spec.hot_rows} must be in 0..{R}")
    if not spec.zipf_s > 0 or not 0 <= spec.drop_percent <= 100:
        raise ValueError("make_routing: zipf_s must be > 0, drop_percent in 0..100")
    token = _slot_tokens(T, K, spec, seed)
    source = sorted_by_key(R, Stream(seed, ROW_SALT))
    token_idx = [token[j] for j in source]
    dropped = dropped_row_count(R, spec.drop_percent)
    if dropped:
        for p in sorted_by_key(R, Stream(seed, DROP_SALT))[:dropped]:
            token_idx[p] = -1
    gates_stream = Stream(seed, GATE_SALT)
    gates = [float32(0.05 + 0.95 * float(gates_stream.key(p) >> 11) * 2.0 ** -53)
             for p in range(R)]
    return token_idx, gates, dropped


def rows_per_token(token_idx, T):
    count = [0] * T
    for t in token_idx:
        if 0 <= t < T:
            count[t] += 1
    return count


def fingerprint(token_idx, gates):
    """skew_routing.h's routing_fingerprint."""
    h = 0
    for t, g in zip(token_idx, gates):
        bits = struct.unpack("<I", struct.pack("<f", g))[0]
        h = mix(h ^ ((t & 0xFFFFFFFF) | bits << 32))
    return h
