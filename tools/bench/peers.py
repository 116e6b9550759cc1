#!/usr/bin/env python3
"""Peers of libmoejit's combine, measured in one process on the same torch tensors.

For every shape (BENCHMARKS.md's list, or --case / --cases-from), this builds one set of random
inputs (never zeros) and runs:

  libmoejit   through ctypes, in its three layouts (token_major, gather_map, token_index)
  torch       index_add_ (scatter-add by token_idx, in the output dtype, as BENCHMARKS.md measured)
              and gather+sum (x[gather_map].view(T, K, H) * gates -> sum(dim=1))
  Triton      a gather kernel with the inverse map and fp32 accumulation (one program per token x
              BLOCK_H chunk: loads the K rows, sums in fp32, stores once; BLOCK_H and num_warps
              tuned per shape), and the original atomic scatter-add formulation (zero the output,
              one program per row x BLOCK_H chunk, atomic_add into the token's row)

Method, the same as moejit-bench: CUDA events around each run, warm-up, median; L2 flushed between
runs by writing a 256 MB buffer outside the events (and, in L2-warm mode, a GPU sleep instead);
the copy ceiling measured here with a 1 GiB torch copy (bytes read + written). Outputs are
poisoned with NaN before the checked run and compared with a float64 reference afterwards.

Paired phase (unless --no-paired): libmoejit's three layouts, the Triton gather and index_add_ run
again in interleaved rounds (one flushed run of each per round, in a random order every round), and
each comparison the issue sets (PAIRS) is read round by round: the peer's time over libmoejit's,
its median and a distribution-free 95% interval. An interval entirely above 1 says libmoejit is
faster, entirely below 1 the peer; one that contains 1 says the two are level within the noise.

--drop P drops P% of each shape's routing slots, as capacity-factor routing does (moejit-bench's
--drop): the gather map's entry and the token_idx of the row that held the slot become -1, gates
stay as they are, and the reference leaves those slots out. libmoejit's token-major layout cannot
express a drop and is left out. Each peer takes the -1 entries the way a torch user would have to,
and that work is timed with it: the Triton kernels mask the dropped rows' loads (and atomics);
gather+sum and index_add_ redirect -1 to one spare row (a zero row after the expert rows, a
discarded row after the output's) with torch.where in every call. Such a run is no record
(merge_results.py refuses it).

--skew (issue 58) runs moejit-bench --skew's routings of the same R = T*K rows (skew_routing.py
gives the very same token_idx, row order, dropped rows and gates for a seed: one token with all
rows, 1% of tokens with half, Zipf(1.2), token 0 with R/512..R/2 rows; at 0% and 25% dropped) with
the contenders that take a token_idx: libmoejit's token_index, index_add_ and the Triton atomic
scatter, paired against libmoejit; each time also over the same contender's on the uniform routing
(K rows per token). --awkward-h adds moejit-bench --awkward-h's shapes (H = 1000, 1001, 2880,
5000, 7000, 7169 at T6000 K8, every dtype) to the shapes run with every peer.

Needs torch (and triton for the Triton peers); libmoejit.so from --lib or $MOEJIT_LIBRARY.
`--check-binding` only loads the library and checks the ctypes structs (no torch, no GPU).
"""

import argparse
import ctypes
import datetime
import json
import math
import os
import random
import re
import statistics
import sys

# ---- libmoejit through ctypes ----------------------------------------------------------------
# The struct mirrors are the package's own (python/moejit/_capi.py, checked against the C header
# by tests/python): one definition for the bindings and the benchmark.
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python"))
from moejit._capi import CombineArgs, Stats  # noqa: E402  (needs no torch)
# moejit-bench --skew's routings, the same for a seed (tools/bench/skew_routing.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skew_routing  # noqa: E402

LAYOUTS = {"token_major": 0, "gather_map": 1, "token_index": 2}
DTYPES = {"fp32": 0, "fp16": 1, "bf16": 2}
INDEX_INT32 = 0
CACHE_MODE_DISABLED = 3


def _check_layout():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise RuntimeError("peers.py expects a 64-bit platform")


class Moejit:
    """The few entry points the peers need, with errors turned into exceptions."""

    def __init__(self, path):
        _check_layout()
        self.path = path
        lib = ctypes.CDLL(path)
        lib.moejit_version_string.restype = ctypes.c_char_p
        lib.moejit_status_name.restype = ctypes.c_char_p
        lib.moejit_status_name.argtypes = [ctypes.c_int]
        lib.moejit_last_error_message.restype = ctypes.c_char_p
        # The sized init (the C header's moejit_combine_args_init macro) writes no more than the
        # mirror's size; libraries older than it (A/B runs against earlier builds) have only the
        # unsized one, which wrote their own size.
        self._sized_init = hasattr(lib, "moejit_combine_args_init_sized")
        if self._sized_init:
            lib.moejit_combine_args_init_sized.restype = ctypes.c_int
            lib.moejit_combine_args_init_sized.argtypes = [
                ctypes.POINTER(CombineArgs), ctypes.c_size_t]
        else:
            lib.moejit_combine_args_init.restype = ctypes.c_int
            lib.moejit_combine_args_init.argtypes = [ctypes.POINTER(CombineArgs)]
        lib.moejit_combine_workspace_size.restype = ctypes.c_int
        lib.moejit_combine_workspace_size.argtypes = [
            ctypes.POINTER(CombineArgs), ctypes.POINTER(ctypes.c_size_t)]
        lib.moe_combine.restype = ctypes.c_int
        lib.moe_combine.argtypes = [ctypes.POINTER(CombineArgs), ctypes.c_void_p]
        lib.moejit_runtime_get_stats.restype = ctypes.c_int
        lib.moejit_runtime_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(Stats)]
        self.lib = lib
        self.version = lib.moejit_version_string().decode()
        probe = self._init_args()
        # The library's own sizeof(moejit_combine_args) (or one it accepts): a mismatch means the
        # header changed.
        if probe.struct_size != ctypes.sizeof(CombineArgs):
            raise RuntimeError(f"{path}: sizeof(moejit_combine_args) is {probe.struct_size}, "
                               f"peers.py mirrors {ctypes.sizeof(CombineArgs)}: update the mirror")

    def _init_args(self):
        a = CombineArgs()
        if self._sized_init:
            self._check(self.lib.moejit_combine_args_init_sized(ctypes.byref(a), ctypes.sizeof(a)),
                        "moejit_combine_args_init_sized")
        else:
            self._check(self.lib.moejit_combine_args_init(ctypes.byref(a)),
                        "moejit_combine_args_init")
        return a

    def _check(self, status, call):
        if status != 0:
            name = self.lib.moejit_status_name(status).decode()
            message = (self.lib.moejit_last_error_message() or b"").decode()
            raise RuntimeError(f"{call}: {name}: {message}")

    def args(self, layout, num_tokens, top_k, num_rows, hidden, expert, expert_dtype, gates,
             indices, out, out_dtype):
        a = self._init_args()
        a.layout = LAYOUTS[layout]
        a.num_tokens, a.top_k, a.num_rows, a.hidden_dim = num_tokens, top_k, num_rows, hidden
        a.expert_hidden, a.expert_dtype = expert, DTYPES[expert_dtype]
        a.gates, a.indices, a.index_type = gates, indices, INDEX_INT32
        a.out, a.out_dtype = out, DTYPES[out_dtype]
        return a

    def workspace_size(self, args):
        n = ctypes.c_size_t(0)
        self._check(self.lib.moejit_combine_workspace_size(ctypes.byref(args), ctypes.byref(n)),
                    "moejit_combine_workspace_size")
        return n.value

    def combine(self, args, stream):
        self._check(self.lib.moe_combine(ctypes.byref(args), stream), "moe_combine")

    def stats(self):
        s = Stats()
        s.struct_size = ctypes.sizeof(Stats)
        self._check(self.lib.moejit_runtime_get_stats(None, ctypes.byref(s)),
                    "moejit_runtime_get_stats")
        return {name: getattr(s, name) for name, _ in Stats._fields_ if name != "struct_size"}


def check_binding(path):
    """Host-only check of the binding: loads the library, fills args, asks the workspace size."""
    lib = Moejit(path)
    a = lib.args("token_index", 4096, 0, 8192, 4096, None, "bf16", None, None, None, "bf16")
    ws = lib.workspace_size(a)
    bad = lib.args("gather_map", 4, 0, 8, 4096, None, "bf16", None, None, None, "bf16")
    try:
        lib.workspace_size(bad)
        rejected = "NOT rejected (unexpected)"
    except RuntimeError as e:
        rejected = f"rejected as expected ({e})"
    print(f"libmoejit {lib.version} at {path}: ctypes layout ok "
          f"(sizeof {ctypes.sizeof(CombineArgs)}), token_index workspace for T4096 R8192 = "
          f"{ws} bytes; top_k=0 for gather_map {rejected}")


# ---- shapes ----------------------------------------------------------------------------------

def _shape(t, k, h, dt, label, out=None):
    return {"T": t, "K": k, "H": h, "in_dtype": dt, "out_dtype": out or dt, "label": label}


def builtin_shapes(quick, extra):
    if quick:
        return [_shape(1536, 2, 128, "fp32", "original scatter-add problem"),
                _shape(1, 8, 7168, "bf16", "DeepSeek-V3 decode"),
                _shape(4096, 8, 7168, "bf16", "DeepSeek-V3 prefill"),
                _shape(8192, 2, 4096, "bf16", "Mixtral-8x7B prefill")]
    shapes = [
        _shape(1536, 2, 128, "fp32", "original scatter-add problem"),
        _shape(1, 8, 7168, "bf16", "DeepSeek-V3 decode"),
        _shape(32, 8, 7168, "bf16", "DeepSeek-V3 decode"),
        _shape(64, 2, 4096, "bf16", "Mixtral-8x7B decode"),
        _shape(4096, 8, 7168, "bf16", "DeepSeek-V3 prefill"),
        _shape(4096, 8, 7168, "fp16", "DeepSeek-V3 prefill"),
        _shape(8192, 2, 4096, "bf16", "Mixtral-8x7B prefill"),
        _shape(8192, 2, 4096, "fp32", "Mixtral-8x7B prefill"),
        _shape(16384, 8, 2048, "bf16", "Qwen3-30B-A3B prefill"),
        _shape(4096, 4, 2880, "bf16", "gpt-oss-120b prefill"),
    ]
    if extra:
        shapes += [_shape(4096, 8, 4096, "bf16", "Qwen3-235B prefill"),
                   _shape(4096, 1, 5120, "bf16", "Llama-4 prefill"),
                   _shape(4096, 4, 6144, "bf16", "DBRX prefill"),
                   _shape(4096, 8, 3584, "bf16", "Qwen2-57B prefill")]
    return shapes


def awkward_h_shapes():
    """moejit-bench --awkward-h: issue 58's hidden sizes that are not multiples of the vector tile,
    at T=6000 K=8 in every dtype (108 MB or more moved each)."""
    return [_shape(6000, 8, h, dt, "awkward H")
            for h in (1000, 1001, 2880, 5000, 7000, 7169) for dt in ("fp32", "fp16", "bf16")]


def default_skew_shapes(quick):
    """moejit-bench --skew's shapes without --skew-case (skew_bench.cpp, default_skew_shapes)."""
    shapes = [_shape(4096, 8, 7168, "bf16", "DeepSeek-V3 prefill"),
              _shape(8192, 2, 4096, "bf16", "Mixtral-8x7B prefill")]
    return shapes[:1] if quick else shapes


def parse_case(text):
    f = text.split(",")
    if len(f) not in (4, 5) or f[3] not in DTYPES or (len(f) == 5 and f[4] not in DTYPES):
        raise argparse.ArgumentTypeError(f"--case {text}: expected T,K,H,dtype[,out_dtype]")
    t, k, h = (int(x) for x in f[:3])
    if min(t, k, h) < 1:
        raise argparse.ArgumentTypeError(f"--case {text}: T, K and H must be positive")
    return _shape(t, k, h, f[3], "", f[4] if len(f) == 5 else None)


def shapes_from_bench(path):
    """The distinct shapes of a moejit-bench JSON file, in its order."""
    with open(path) as f:
        bench = json.load(f)
    seen, shapes = set(), []
    for c in bench.get("cases", []):
        key = (c["T"], c["K"], c["H"], c["in_dtype"], c["out_dtype"])
        if key not in seen:
            seen.add(key)
            shapes.append(_shape(*key[:4], c.get("label", ""), key[4]))
    return shapes


def select_shapes(shapes, max_tokens):
    """The shapes with at most max_tokens tokens, in order (0: all of them)."""
    return [s for s in shapes if max_tokens == 0 or s["T"] <= max_tokens]


def shape_text(s):
    text = f"T{s['T']} K{s['K']} H{s['H']} {s['in_dtype']}"
    return text + (f"->{s['out_dtype']}" if s["out_dtype"] != s["in_dtype"] else "")


def minimal_bytes(s):
    """BENCHMARKS.md: R*H*in + R*8 (index + gate) + T*H*out; a dropped slot's row is not read
    ((R - dropped)*H*in, as moejit-bench counts it)."""
    size = {"fp32": 4, "fp16": 2, "bf16": 2}
    r = s["T"] * s["K"]
    read = r - s.get("dropped_slots", 0)
    return read * s["H"] * size[s["in_dtype"]] + r * 8 + s["T"] * s["H"] * size[s["out_dtype"]]


MAX_DROP_PERCENT = 90.0  # moejit-bench's limit: past it most tokens get no row at small K


def parse_drop(text):
    """--drop: a percentage in 0..90 written as digits with an optional decimal part ("12",
    "12.5"), as moejit-bench takes it; no sign, exponent, spaces or "nan"."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text) or float(text) > MAX_DROP_PERCENT:
        raise argparse.ArgumentTypeError(
            f"--drop {text}: expected a percentage in 0..{MAX_DROP_PERCENT:g} (an integer or a "
            "decimal)")
    return float(text)


def dropped_slot_count(rows, drop_percent):
    """round(drop_percent% of rows), halves away from zero (moejit-bench's std::llround)."""
    return int(math.floor(rows * drop_percent / 100.0 + 0.5))


def with_drops(shapes, drop_percent):
    """The shapes with their drop rate and dropped-slot count; unchanged at 0."""
    if not drop_percent:
        return shapes
    return [dict(s, drop_percent=drop_percent,
                 dropped_slots=dropped_slot_count(s["T"] * s["K"], drop_percent)) for s in shapes]


def error_bound(rounding, norm=1.0, rows=1):
    """moejit-bench's bound on an error (bench_data.h, error_bound), from what rounding the float64
    reference once to the output dtype costs: relative, or with the reference's norm absolute
    (elementwise on tensors too). The library accumulates in fp32 and rounds once. rows: the most
    terms a sum has (a number, or a tensor of them per token): past 64, the fp32 part grows as
    sqrt(rows / 64), as an in-order fp32 sum's error does."""
    if hasattr(rows, "clamp"):
        terms = (rows / 64.0).clamp(min=1.0).sqrt()
    else:
        terms = math.sqrt(max(1.0, rows / 64.0))
    return 1.25 * rounding + 1e-6 * norm * terms


def legacy_error_bound(out_dtype):
    """The fixed bounds of records made before rel_err_bound was recorded."""
    return {"fp32": 1e-5, "fp16": 1e-3}.get(out_dtype, 1e-2)


def libmoejit_failures(shapes):
    """(shape, entry name) of every libmoejit entry that failed: an error, NaN or Inf left in its
    output, a relative error (before or after the timed runs) over its bound, or tokens over their
    own bound."""
    failed = []
    for s in shapes:
        for r in s["peers"]:
            if not r["name"].startswith("libmoejit_"):
                continue
            bound = r.get("rel_err_bound", legacy_error_bound(s["out_dtype"]))
            wrong = any(not r[k] <= bound for k in ("rel_err", "rel_err_after") if k in r)
            bad = r.get("nan_elements") or r.get("nonfinite_elements") or r.get("tokens_over_bound")
            if "error" in r or bad or wrong:
                failed.append((shape_text(s), r["name"]))
    return failed


def add_uniform_ratios(skew_cases):
    """Each --skew result's time over the same contender's on the uniform routing (K rows per
    token) of the same shape and drop rate ("vs_uniform"; None without that figure): issue 58's
    target reads libmoejit's against 1.5."""
    uniform = {}
    for c in skew_cases:
        if c["routing"] == "uniform":
            key = (shape_text(c), c["drop_percent"])
            uniform[key] = {r["name"]: r["us"] for r in c["peers"] if "us" in r}
    for c in skew_cases:
        base = uniform.get((shape_text(c), c["drop_percent"]), {})
        for r in c["peers"]:
            b = base.get(r["name"])
            r["vs_uniform"] = r["us"] / b if "us" in r and b else None


SKEW_COLUMNS = [("libmoejit_token_index", "libmoejit"), ("torch_index_add", "index_add_"),
                ("triton_atomic_scatter", "Triton atomic")]


def skew_summary_lines(skew_cases):
    """The --skew summary: per routing, each contender's us and its ratio to its own uniform time
    (x_unif), and the peers' time over libmoejit's (x lib)."""
    head = f"{'shape':<22}{'routing':<22}{'drop':>5}{'max_rows':>9}"
    for _, title in SKEW_COLUMNS:
        head += f"{title + ' us':>18}{'x_unif':>7}" + ("" if title == "libmoejit" else
                                                        f"{'x lib':>7}")
    lines = ["", "Skewed token_index routing (--skew, moejit-bench's routings): us; x_unif = us / "
             "the same contender's on the uniform routing (K rows per token) of the shape and "
             "drop; x lib = peer us / libmoejit us", head]
    for c in skew_cases:
        by_name = {r["name"]: r for r in c["peers"]}
        lib_us = by_name.get("libmoejit_token_index", {}).get("us")
        line = (f"{shape_text(c):<22}{c['routing']:<22}{c['drop_percent']:>4g}%"
                f"{c['max_rows_per_token']:>9}")
        for name, title in SKEW_COLUMNS:
            r = by_name.get(name, {})
            us, unif = r.get("us"), r.get("vs_uniform")
            line += f"{us:>18.2f}" if us else f"{'-' if not r.get('error') else 'FAILED':>18}"
            line += f"{unif:>7.2f}" if unif else f"{'-':>7}"
            if title != "libmoejit":
                line += f"{us / lib_us:>7.2f}" if us and lib_us else f"{'-':>7}"
        lines.append(line)
    return lines


def print_skew_summary(skew_cases):
    print("\n".join(skew_summary_lines(skew_cases)))


class Case:
    """One input's float64 reference, the check every contender's output gets, and the results
    of its contenders (torch tensors on any device: the tests run it on the CPU).
    check(out) gives (relative error, NaN or Inf elements, tokens over their own bound)."""

    def __init__(self, ref, odt, reps, token_rows=None):
        import torch
        # The bound, as moejit-bench's: from what one rounding of the reference to the output
        # dtype costs, over the whole output and per token (a few wrong tokens barely move the
        # whole); token_rows (rows per token, when they vary: --skew) widens the fp32 part for
        # tokens of more than 64 rows (error_bound).
        self.ref, self.reps = ref, reps
        self.ref_norm = torch.linalg.vector_norm(ref).item()
        rounding = ref.to(odt).double() - ref
        most = 1 if token_rows is None else max(1, int(token_rows.max().item()))
        self.rel_err_bound = error_bound(
            torch.linalg.vector_norm(rounding).item() / (self.ref_norm or 1.0), 1.0, most)
        token_norm = torch.linalg.vector_norm(ref, dim=1)
        rows = 1 if token_rows is None else token_rows.double()
        self.token_bound = error_bound(torch.linalg.vector_norm(rounding, dim=1), token_norm, rows)
        self.results, self.timed = [], {}

    def check(self, out):
        import torch
        nonfinite = int((~torch.isfinite(out)).sum().item())
        diff = out.double() - self.ref
        err = torch.linalg.vector_norm(diff).item() / (self.ref_norm or 1.0)
        bad = int((~(torch.linalg.vector_norm(diff, dim=1) <= self.token_bound)).sum().item())
        return err, nonfinite, bad


def token_index_reference(torch, x_sorted, tidx64, gates_by_row, T):
    """float64 sum of each token's rows by token_idx (-1 left out), chunked over rows to bound the
    temporaries; and the rows each token has."""
    R, H = x_sorted.shape
    keep = tidx64 >= 0
    ref = torch.zeros((T, H), dtype=torch.float64, device=x_sorted.device)
    step = max(1, (1 << 27) // H)
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        k = keep[r0:r1]
        ref.index_add_(0, tidx64[r0:r1][k],
                       x_sorted[r0:r1][k].double() * gates_by_row[r0:r1][k].double()[:, None])
    return ref, torch.bincount(tidx64[keep], minlength=T)


# ---- paired comparisons ----------------------------------------------------------------------
# At decode sizes two blocks of runs of the same kernel (bench below) differ by 0.1-0.3 us, as much
# as libmoejit and the Triton peer differ: every other flushed run takes 0.6-0.75 us longer, and a
# block's median falls somewhere between the two modes. The paired phase runs the contenders in
# rounds, one run each per round in a random order (so each lands on either mode alike), and
# compares them round by round, so that a slow stretch hits both sides of a comparison alike.

PAIRS = [  # (libmoejit's entry, the peer it must beat): the "never slower" comparisons
    ("libmoejit_token_major", "triton_gather_inv"),
    ("libmoejit_gather_map", "triton_gather_inv"),
    ("libmoejit_token_index", "triton_gather_inv"),
    ("libmoejit_token_index", "torch_index_add"),
]
SKEW_PAIRS = [  # --skew: only token_idx peers take a routing without K rows per token
    ("libmoejit_token_index", "torch_index_add"),
    ("libmoejit_token_index", "triton_atomic_scatter"),
]


def median_ci(values, confidence=0.95):
    """A distribution-free confidence interval of the median: order statistics x_(j) and
    x_(n+1-j), j the largest with P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2. None for fewer
    than 6 values (no interval at 95%)."""
    x = sorted(values)
    n = len(x)
    tail, j = 0.0, 0
    while True:  # tail = P(B < j + 1) for the next candidate j + 1
        tail += math.comb(n, j) / (1 << n)  # exact integers: no overflow for long series
        if tail > (1 - confidence) / 2:
            break
        j += 1
    if j == 0:
        return None
    return x[j - 1], x[n - j]


def parity_split(values):
    """Median of the odd-numbered values minus median of the even-numbered ones (0 for fewer
    than 4): how far every other flushed run lands from the others."""
    if len(values) < 4:
        return 0.0
    return statistics.median(values[1::2]) - statistics.median(values[0::2])


def paired_summary(lib_us, peer_us):
    """Round-by-round comparison of two interleaved series (us): the peer's time over libmoejit's
    (> 1: libmoejit faster), its median and 95% interval, the median difference in us, and the
    verdict the interval supports."""
    if len(lib_us) != len(peer_us) or not lib_us:
        raise ValueError("paired_summary needs two series of the same, non-zero length")
    ratios = [p / l for l, p in zip(lib_us, peer_us)]
    ci = median_ci(ratios)
    if ci is None:
        verdict = "too few rounds"
    elif ci[0] > 1:
        verdict = "libmoejit faster"
    elif ci[1] < 1:
        verdict = "peer faster"
    else:
        verdict = "level (within the interval)"
    return {
        "rounds": len(ratios),
        "lib_us": statistics.median(lib_us),
        "peer_us": statistics.median(peer_us),
        "peer_over_lib": statistics.median(ratios),
        "ci95": list(ci) if ci else None,
        "lib_minus_peer_us": statistics.median(l - p for l, p in zip(lib_us, peer_us)),
        "verdict": verdict,
    }


# ---- timing shared with ab_libs.py (torch passed in: importing this file needs no torch) --------

def sleep_cycles_per_us(torch):
    """GPU cycles per microsecond of torch.cuda._sleep, which spins for a number of cycles."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    s.record()
    torch.cuda._sleep(2_000_000)
    e.record()
    torch.cuda.synchronize()
    return 2_000_000 / max(s.elapsed_time(e) * 1e3, 1.0)


def time_interleaved(torch, fns, rounds, warmup, rng, flush, lead_cycles):
    """us per run of each function, run in rounds: one run of each per round, in a random order
    drawn for every round, each after a GPU sleep (lead_cycles, so host time never shows inside
    the events) and a fill of `flush` (the L2 flush). A fixed rotation kept each function's
    predecessor and the parity of its runs (every other flushed run is 0.6-0.75 us slower) in step
    with the other side of a comparison: it read the gather map at T=1 0.967x Triton where random
    orders read 1.013x. Returns the series and the orders."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    events = {name: [] for name in names}
    orders = []
    n = 0
    for _ in range(rounds):
        order = rng.sample(names, len(names))
        orders.append(order)
        for name in order:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            torch.cuda._sleep(lead_cycles)
            flush.fill_(n & 0xFF)
            n += 1
            start.record()
            fns[name]()
            stop.record()
            events[name].append((start, stop))
    torch.cuda.synchronize()
    series = {name: [s.elapsed_time(e) * 1e3 for s, e in pairs] for name, pairs in events.items()}
    return series, orders


# ---- Triton kernels --------------------------------------------------------------------------
# At module level: Triton resolves the names a kernel uses (tl) in its module's globals.
try:
    import triton
    import triton.language as tl
except ImportError as _triton_import_error:  # the torch peers and libmoejit still run
    triton, tl = None, None
    TRITON_MISSING = str(_triton_import_error)
else:
    TRITON_MISSING = None

if triton is not None:
    @triton.jit
    def gather_kernel(x_ptr, map_ptr, gate_ptr, out_ptr, H,
                      K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DROPS: tl.constexpr = False):
        # One token x one BLOCK_H chunk: K independent row loads (unrolled), fp32 sum, one store.
        # HAS_DROPS (--drop): a -1 entry's row is not loaded (it adds zero); without it the
        # kernel is the one the record measures.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(map_ptr + t * K + k).to(tl.int64)
            g = tl.load(gate_ptr + t * K + k)
            if HAS_DROPS:
                x = tl.load(x_ptr + row * H + offs, mask=mask & (row >= 0), other=0.0)
            else:
                x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
            acc += g * x.to(tl.float32)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def atomic_kernel(x_ptr, tidx_ptr, gate_ptr, out_ptr, H, BLOCK_H: tl.constexpr,
                      HAS_DROPS: tl.constexpr = False):
        # The original formulation: each row adds itself into its token's output row; with
        # HAS_DROPS a row whose token is -1 loads and adds nothing.
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        t = tl.load(tidx_ptr + r).to(tl.int64)
        if HAS_DROPS:
            mask = mask & (t >= 0)
        g = tl.load(gate_ptr + r)
        x = tl.load(x_ptr + r * H + offs, mask=mask, other=0.0)
        val = (g * x.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.atomic_add(out_ptr + t * H + offs, val, mask=mask, sem="relaxed")


# ---- everything below needs torch and a GPU -------------------------------------------------

def main_gpu(args, shapes, skew_shapes=(), skew_drop=skew_routing.DEFAULT_SECOND_DROP):
    import torch

    if triton is None:
        print(f"peers.py: triton unavailable ({TRITON_MISSING}); skipping the Triton peers",
              file=sys.stderr)

    if not torch.cuda.is_available():
        print("peers.py: no GPU found (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    torch.cuda.init()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # creates the primary context, current on this thread
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

    lib = None
    lib_path = args.lib or os.environ.get("MOEJIT_LIBRARY")
    if lib_path:
        lib = Moejit(lib_path)
    else:
        print("peers.py: no --lib or MOEJIT_LIBRARY: libmoejit is not measured", file=sys.stderr)

    # ---- timing: the same method as moejit-bench --------------------------------------------
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    # torch.cuda._sleep spins for a number of GPU cycles: calibrate cycles per microsecond.
    cycles_per_us = sleep_cycles_per_us(torch)
    # Python enqueues slowly (tens of us for the multi-kernel torch peers): a GPU sleep before each
    # run's separator keeps the GPU behind the host, so host time never shows up as GPU idle
    # inside the events.
    lead_cycles = int(100 * cycles_per_us)

    # Flushed runs alternate on the H200: every other run takes 0.6-0.75 us longer (moejit-bench's
    # Timer measures the same), so at decode sizes a median falls in a two-mode distribution and
    # moves by 0.1-0.3 us between measurements. Each measurement reports its odd runs' median
    # minus its even runs' (parity_split_us); the paired phase decides what needs finer than that.
    last = {"parity_split_us": 0.0}

    def bench(fn, reps, warmup, warm_l2=False):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            torch.cuda._sleep(lead_cycles)
            if not warm_l2:
                flush.fill_(i & 0xFF)
            starts[i].record()
            fn()
            stops[i].record()
        torch.cuda.synchronize()
        us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, stops)]
        last["parity_split_us"] = parity_split(us)
        return statistics.median(us)

    def copy_ceiling():
        n = 1 << 30
        src = torch.full((n,), 0x5A, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        us = bench(lambda: dst.copy_(src), 20, 3)
        del src, dst
        return 2 * n / (us * 1e-6) / 1e9

    def configs(h, quick):
        full = [(128, 1), (256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8)]
        if quick:
            full = [(256, 2), (1024, 4), (2048, 8)]
        limit = max(128, 1 << (h - 1).bit_length())
        picked = [c for c in full if c[0] <= limit]
        return picked or [(128, 1)]

    def tune(make_fn, candidates):
        """Fastest candidate, timed interleaved (40 rounds, one flushed run of each per round, a
        random order every round); returns (config, fn). Candidates timed one after another, 20
        runs each, picked differently from run to run at decode sizes (every other flushed run is
        0.6-0.75 us slower): the Triton gather at T=64 K=2 got BLOCK_H 2048, 256 and 256 in three
        runs, 5.38-6.11 us."""
        fns = {cfg: make_fn(cfg) for cfg in candidates}
        series, _ = interleaved(fns, 40, 3, random.Random(args.seed))
        cfg = min(series, key=lambda c: statistics.median(series[c]))
        return cfg, fns[cfg]

    # ---- what every input's contenders share ---------------------------------------------------
    def random_rows(rows, H, dt, gen):
        """Magnitudes in [1/16, 2) with random signs: never zero, like moejit-bench."""
        x = torch.rand((rows, H), generator=gen, device=device)
        x.mul_(2 - 1 / 16).add_(1 / 16)
        x = torch.where(torch.rand((rows, H), generator=gen, device=device) < 0.5, -x, x)
        return x.to(dt)

    def measure(case, name, layout, fn, out_of, config=None, poison=None):
        """Checked run (poisoned output), then flushed and L2-warm timings, then a re-check."""
        entry = {"name": name, "input": layout, "config": config}
        try:
            if poison is not None:
                poison.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err, nonfinite, bad = case.check(out_of())
            entry["us"] = bench(fn, case.reps, args.warmup)
            entry["parity_split_us"] = last["parity_split_us"]
            if not args.no_l2_warm:
                entry["l2_warm_us"] = bench(fn, case.reps, args.warmup, warm_l2=True)
            err_after, nonfinite_after, bad_after = case.check(out_of())
            entry.update(rel_err=err, rel_err_after=err_after, rel_err_bound=case.rel_err_bound,
                         nonfinite_elements=nonfinite + nonfinite_after,
                         tokens_over_bound=max(bad, bad_after))
            case.timed[name] = fn
        except Exception as e:  # one failing peer must not hide the others
            entry["error"] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
        case.results.append(entry)

    def measure_libmoejit(case, layout, T, K, R, H, x, g, idx, out, shape):
        a = lib.args(layout, T, K, R, H, x.data_ptr(), shape["in_dtype"], g.data_ptr(),
                     None if idx is None else idx.data_ptr(), out.data_ptr(), shape["out_dtype"])
        ws_bytes = lib.workspace_size(a)
        ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=device)
        if ws_bytes:
            a.workspace, a.workspace_bytes = ws.data_ptr(), ws_bytes
        s = stream()
        measure(case, f"libmoejit_{layout}", layout,
                lambda a=a, ws=ws: lib.combine(a, s),  # ws kept alive by the lambda
                lambda: out, poison=out)

    def measure_index_add(case, out_storage, T, tidx64, x_sorted, g_rows, odt, dropped):
        """torch index_add_: the scatter-add formulation, in the output dtype. With drops,
        out_storage has a spare row after the T: the -1 rows go there, redirected in every call."""
        out_ia = out_storage[:T]

        if not dropped:
            def index_add():
                out_ia.zero_()
                out_ia.index_add_(0, tidx64, (x_sorted * g_rows).to(odt))
        else:
            def index_add():
                out_storage.zero_()
                out_storage.index_add_(0, torch.where(tidx64 < 0, T, tidx64),
                                       (x_sorted * g_rows).to(odt))
        measure(case, "torch_index_add", "token_index", index_add, lambda: out_ia, poison=out_ia)

    def measure_atomic_scatter(case, out_ta, R, H, x_sorted, tidx32, gates_by_row, odt, dropped):
        """The original atomic scatter-add in Triton (zeroing the output is part of it)."""
        scratch = {}

        def make_atomic(cfg):
            bh, nw = cfg
            grid = (R, triton.cdiv(H, bh))
            if "fp32" in scratch:  # this Triton lacks atomics in odt: fp32 buffer, then cast
                acc = scratch["fp32"]

                def fn():
                    acc.zero_()
                    atomic_kernel[grid](x_sorted, tidx32, gates_by_row, acc, H,
                                        BLOCK_H=bh, HAS_DROPS=bool(dropped), num_warps=nw)
                    out_ta.copy_(acc)
                return fn

            def fn():
                out_ta.zero_()
                atomic_kernel[grid](x_sorted, tidx32, gates_by_row, out_ta, H,
                                    BLOCK_H=bh, HAS_DROPS=bool(dropped), num_warps=nw)
            return fn
        note = ""
        try:
            try:
                make_atomic((1024, 4))()
            except Exception as e:
                if odt == torch.float32:
                    raise
                scratch["fp32"] = torch.empty(tuple(out_ta.shape), dtype=torch.float32,
                                              device=device)
                note = f" (fp32 atomics + cast: {type(e).__name__} on {odt} atomics)"
            torch.cuda.synchronize()
            cfg, fn = tune(make_atomic, configs(H, args.quick))
            measure(case, "triton_atomic_scatter", "token_index", fn, lambda: out_ta,
                    config=f"BLOCK_H={cfg[0]} num_warps={cfg[1]}{note}", poison=out_ta)
        except Exception as e:
            case.results.append({"name": "triton_atomic_scatter", "input": "token_index",
                                 "error": f"{type(e).__name__}: {e}"})

    def stream():
        return torch.cuda.current_stream(device).cuda_stream

    def default_reps(shape):
        return args.reps or (200 if minimal_bytes(shape) < 64e6 else 100)

    def finish(case, shape, pairs, seed):
        """The paired phase, and each result's % of the ceiling and ratio to libmoejit taking the
        same input: gather peers vs its gather_map, scatter peers (token_idx) vs its
        token_index."""
        paired, paired_raw = ([], None) if args.no_paired else run_pairs(
            case.timed, case.reps, seed, pairs)
        lib_us = {r["input"]: r["us"] for r in case.results
                  if r["name"].startswith("libmoejit_") and "us" in r}
        for r in case.results:
            if "us" in r:
                r["pct_ceiling"] = 100 * minimal_bytes(shape) / (r["us"] * 1e-6) / 1e9 / ceiling
                base = lib_us.get(r["input"])
                r["vs_libmoejit"] = r["us"] / base if base else None
        return case.results, paired, paired_raw

    # ---- one shape ----------------------------------------------------------------------------
    def run_shape(shape):
        T, K, H = shape["T"], shape["K"], shape["H"]
        R = T * K
        dt, odt = torch_dtype[shape["in_dtype"]], torch_dtype[shape["out_dtype"]]
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed + T * 1_000_003 + K * 1_009 + H)

        x_tm = random_rows(R, H, dt, gen)
        u = torch.rand((T, K), generator=gen, device=device) * 0.95 + 0.05
        # A top-k softmax's gates sum to 1; at K = 1 that would make every gate 1, so a top-1
        # router's sigmoid score instead (Llama 4), as moejit-bench does.
        if K > 1:
            u = u / u.sum(dim=1, keepdim=True)
        gates = u.reshape(R).contiguous()  # fp32, [T*K]

        # Expert-sorted rows: a random permutation of token-major order; the map is its inverse.
        perm = torch.randperm(R, generator=gen, device=device)
        x_sorted = x_tm[perm].contiguous()
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(R, device=device)
        gmap32 = inverse.to(torch.int32)
        tidx32 = (perm // K).to(torch.int32)
        gates_by_row = gates[perm].contiguous()
        gmap64, tidx64 = inverse, perm // K

        # --drop: the slots to drop, from a generator of their own (rows, gates and permutation
        # stay those of --drop 0). A slot's map entry and the token_idx of the sorted row that
        # held it become -1; the gates stay (not renormalized), and the reference leaves the
        # slots out (a zero gate there: x * 0 adds exactly nothing).
        dropped = shape.get("dropped_slots", 0)
        gates_ref = gates
        if dropped:
            drop_gen = torch.Generator(device=device)
            drop_gen.manual_seed(args.seed + 0xD209 + T * 1_000_003 + K * 1_009 + H)
            slots = torch.randperm(R, generator=drop_gen, device=device)[:dropped]
            gmap64, tidx64 = inverse.clone(), tidx64.clone()
            gmap64[slots] = -1
            tidx64[inverse[slots]] = -1
            gmap32, tidx32 = gmap64.to(torch.int32), tidx64.to(torch.int32)
            gates_ref = gates.clone()
            gates_ref[slots] = 0

        # float64 reference, chunked over tokens to bound the temporaries.
        ref = torch.empty((T, H), dtype=torch.float64, device=device)
        step = max(1, (1 << 27) // (K * H))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            xs = x_tm[t0 * K:t1 * K].double().view(t1 - t0, K, H)
            ref[t0:t1] = (xs * gates_ref[t0 * K:t1 * K].double().view(t1 - t0, K, 1)).sum(dim=1)
            del xs
        case = Case(ref, odt, default_reps(shape))

        # One output buffer for every contender that takes one (libmoejit, the Triton kernels,
        # index_add_): where each wrote its own, two runs of the same kernel into two buffers
        # differed by up to 4% at decode sizes (T64 K2 H4096, paired rounds), as much as the
        # contenders do. Each measurement poisons it and checks its own result.
        # With --drop it has one spare row after the T the others see: index_add_ sends the -1
        # rows there.
        out_storage = torch.empty((T + (1 if dropped else 0), H), dtype=odt, device=device)
        out_shared = out_storage[:T]

        # libmoejit, three layouts, on the same tensors.
        if lib is not None:
            layouts = {
                "token_major": (x_tm, gates, None),
                "gather_map": (x_sorted, gates, gmap32),
                "token_index": (x_sorted, gates_by_row, tidx32),
            }
            if dropped:  # a token-major buffer has a row for every slot: no way to mark a drop
                del layouts["token_major"]
            for layout, (x, g, idx) in layouts.items():
                measure_libmoejit(case, layout, T, K, R, H, x, g, idx, out_shared, shape)

        # torch gather + sum: takes the inverse map, like the gather kernels.
        g_tkh = gates.to(dt).view(T, K, 1)
        gs_out = {}

        if not dropped:
            def gather_sum():
                gs_out["out"] = (x_sorted[gmap64].view(T, K, H) * g_tkh).sum(dim=1).to(odt)
        else:
            # -1 sends a slot to a zero row after the expert rows (a buffer a user would allocate
            # once); the redirect runs in every call, as the routing changes from call to call.
            x_pad = torch.cat([x_sorted, torch.zeros((1, H), dtype=dt, device=device)])

            def gather_sum():
                rows = torch.where(gmap64 < 0, R, gmap64)
                gs_out["out"] = (x_pad[rows].view(T, K, H) * g_tkh).sum(dim=1).to(odt)
        measure(case, "torch_gather_sum", "gather_map", gather_sum, lambda: gs_out["out"])

        measure_index_add(case, out_storage, T, tidx64, x_sorted, gates_by_row.to(dt)[:, None],
                          odt, dropped)

        if triton is not None:
            out_tg = out_shared

            def make_gather(cfg):
                bh, nw = cfg
                grid = (T, triton.cdiv(H, bh))
                return lambda: gather_kernel[grid](x_sorted, gmap32, gates, out_tg, H,
                                                   K=K, BLOCK_H=bh, HAS_DROPS=bool(dropped),
                                                   num_warps=nw)
            try:
                cfg, fn = tune(make_gather, configs(H, args.quick))
                measure(case, "triton_gather_inv", "gather_map", fn, lambda: out_tg,
                        config=f"BLOCK_H={cfg[0]} num_warps={cfg[1]}", poison=out_tg)
            except Exception as e:
                case.results.append({"name": "triton_gather_inv", "input": "gather_map",
                                     "error": f"{type(e).__name__}: {e}"})
            measure_atomic_scatter(case, out_shared, R, H, x_sorted, tidx32, gates_by_row, odt,
                                   dropped)

        return finish(case, shape, PAIRS, args.seed + T * 1_000_003 + K * 1_009 + H)

    # ---- one skewed routing (--skew) ----------------------------------------------------------
    def run_skew(shape, spec):
        """The token-index contenders on moejit-bench --skew's routing `spec` of the shape
        (skew_routing.py: the same token_idx, row order, drops and gates as moejit-bench for the
        seed). Returns (the shape as printed, with the routing's name and drops; results; paired;
        raw series)."""
        T, K, H = shape["T"], shape["K"], shape["H"]
        R = T * K
        dt, odt = torch_dtype[shape["in_dtype"]], torch_dtype[shape["out_dtype"]]
        token_list, gate_list, dropped = skew_routing.make_routing(
            T, K, spec, args.seed)
        tidx32 = torch.tensor(token_list, dtype=torch.int32, device=device)
        tidx64 = tidx32.long()
        gates_by_row = torch.tensor(gate_list, dtype=torch.float32, device=device)
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed + T * 1_000_003 + K * 1_009 + H)
        x_sorted = random_rows(R, H, dt, gen)
        ref, token_rows = token_index_reference(torch, x_sorted, tidx64, gates_by_row, T)
        routed = dict(shape, routing=spec.name(R), hot_rows=spec.hot_rows,
                      drop_percent=spec.drop_percent, dropped_slots=dropped,
                      max_rows_per_token=int(token_rows.max().item()),
                      tokens_with_rows=int((token_rows > 0).sum().item()))
        case = Case(ref, odt, default_reps(routed), token_rows)

        out_storage = torch.empty((T + (1 if dropped else 0), H), dtype=odt, device=device)
        out_shared = out_storage[:T]
        if lib is not None:
            measure_libmoejit(case, "token_index", T, K, R, H, x_sorted, gates_by_row, tidx32,
                              out_shared, shape)
        measure_index_add(case, out_storage, T, tidx64, x_sorted, gates_by_row.to(dt)[:, None],
                          odt, dropped)
        if triton is not None:
            measure_atomic_scatter(case, out_shared, R, H, x_sorted, tidx32, gates_by_row, odt,
                                   dropped)
        results, paired, raw = finish(case, routed, SKEW_PAIRS,
                                      args.seed + T * 1_000_003 + K * 1_009 + H)
        return routed, results, paired, raw

    def interleaved(fns, rounds, warmup, rng):
        return time_interleaved(torch, fns, rounds, warmup, rng, flush, lead_cycles)

    def run_pairs(timed, rounds, seed, wanted=PAIRS):
        """The pairs of `wanted` whose two sides both ran correctly, compared round by round; and
        the raw series and orders (peers.json keeps them, the record does not)."""
        pairs = [(a, b) for a, b in wanted if a in timed and b in timed]
        if not pairs:
            return [], None
        names = sorted({n for pair in pairs for n in pair})
        series, orders = interleaved({n: timed[n] for n in names}, rounds, args.warmup,
                                     random.Random(seed))
        raw = {"series_us": {n: [round(x, 4) for x in v] for n, v in series.items()},
               "orders": orders}
        return [dict(lib=a, peer=b, **paired_summary(series[a], series[b]))
                for a, b in pairs], raw

    def print_pairs(paired):
        if not paired:
            return
        print("paired, interleaved rounds (peer / libmoejit per round; median [95% interval]):")
        for p in paired:
            lo, hi = p["ci95"] if p["ci95"] else (float("nan"), float("nan"))
            print(f"  {p['peer']:<22} / {p['lib']:<22} {p['peer_over_lib']:6.3f} [{lo:.3f}, "
                  f"{hi:.3f}]  {p['lib_minus_peer_us']:+8.2f} us  {p['verdict']} "
                  f"({p['rounds']} rounds)")

    def print_table(shape, results):
        floor_us = minimal_bytes(shape) / (ceiling * 1e9) * 1e6
        drop = (f"  drop {shape['drop_percent']:g}% ({shape['dropped_slots']} slots)"
                if shape.get("drop_percent") else "")
        print(f"\n== {shape_text(shape)}{drop}  {shape['label']}  (bytes floor {floor_us:.1f} us "
              f"at {ceiling:.0f} GB/s)")
        print(f"{'peer':<24}{'input':<13}{'us':>10}{'l2warm':>10}{'%ceil':>8}{'x lib':>8}"
              f"{'rel_err':>10}  notes")
        for r in results:
            if "error" in r:
                print(f"{r['name']:<24}{r['input']:<13}  FAILED: {r['error'][:200]}")
                continue
            ratio = f"{r['vs_libmoejit']:.2f}" if r.get("vs_libmoejit") else "-"
            notes = r.get("config") or ""
            if "parity_split_us" in r:  # odd - even flushed runs
                notes += f" odd-even {r['parity_split_us']:+.2f}"
            if r.get("nonfinite_elements"):
                notes += f" NaN/Inf:{r['nonfinite_elements']}"
            if r.get("tokens_over_bound"):
                notes += f" tokens over bound:{r['tokens_over_bound']}"
            print(f"{r['name']:<24}{r['input']:<13}{r['us']:>10.2f}"
                  f"{r.get('l2_warm_us', float('nan')):>10.2f}{r['pct_ceiling']:>7.1f}%"
                  f"{ratio:>8}{r['rel_err']:>10.2e}  {notes}")

    ceiling = copy_ceiling()
    # The launch floor in this harness: a kernel that does nothing (torch's spin kernel with zero
    # cycles), timed like every peer. Decode figures divide by it here, as moejit-bench divides
    # by its own empty kernel; the two harnesses' floors differ, so ratios are taken within one.
    empty_us = bench(lambda: torch.cuda._sleep(0), 200, 10)
    empty_split = last["parity_split_us"]
    print(f"peers.py on {torch.cuda.get_device_name(device)}: torch {torch.__version__}, "
          f"triton {getattr(triton, '__version__', 'n/a')}, libmoejit "
          f"{lib.version if lib else 'n/a'}; copy ceiling {ceiling:.0f} GB/s (1 GiB torch copy); "
          f"empty kernel {empty_us:.2f} us (L2 flushed; odd - even runs {empty_split:+.2f} us)")
    print("x lib = peer us / libmoejit us on the same input layout (> 1: libmoejit is faster)")

    report = {
        "tool": "peers.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "triton_version": getattr(triton, "__version__", None),
        "libmoejit_version": lib.version if lib else None,
        "libmoejit_path": lib.path if lib else None,
        "copy_ceiling_gbps": ceiling,
        "empty_kernel_us": empty_us,
        "drop_percent": args.drop,
        "empty_kernel_parity_split_us": empty_split,
        "method": "CUDA events around each run; median; a GPU sleep then a 256 MB fill between "
                  "runs (parity_split_us: median of the odd runs minus the even ones); "
                  "l2_warm_us: the sleep only; minimal bytes = (R - dropped)*H*in + R*8 + "
                  "T*H*out; "
                  "paired: the contenders in rounds (one flushed run each per round, a random "
                  "order every round), peer / libmoejit per round, median and its "
                  "distribution-free 95% interval; one output buffer for every contender",
        "shapes": [],
    }
    for shape in shapes:
        results, paired, paired_raw = run_shape(shape)
        print_table(shape, results)
        print_pairs(paired)
        sys.stdout.flush()
        report["shapes"].append(dict(shape, minimal_bytes=minimal_bytes(shape), peers=results,
                                     paired=paired, paired_raw=paired_raw))
        torch.cuda.empty_cache()
    if skew_shapes:
        report["skew_drop_percent"] = skew_drop
        report["skew_cases"] = []
        for shape in skew_shapes:
            for spec in skew_routing.skew_specs(shape["T"] * shape["K"], skew_drop):
                routed, results, paired, paired_raw = run_skew(shape, spec)
                label = (f"{shape['label']}, routing: {routed['routing']}, most rows on a token "
                         f"{routed['max_rows_per_token']}").lstrip(", ")
                print_table(dict(routed, label=label), results)
                print_pairs(paired)
                sys.stdout.flush()
                report["skew_cases"].append(dict(routed, minimal_bytes=minimal_bytes(routed),
                                                 peers=results, paired=paired,
                                                 paired_raw=paired_raw))
                torch.cuda.empty_cache()
        add_uniform_ratios(report["skew_cases"])
        print_skew_summary(report["skew_cases"])
    if lib is not None:
        report["libmoejit_stats"] = lib.stats()

    def finite(v):  # JSON has no NaN / Infinity
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, list):
            return [finite(x) for x in v]
        return v

    if args.json:
        with open(args.json, "w") as f:
            json.dump(finite(report), f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    failed = libmoejit_failures(report["shapes"] + report.get("skew_cases", []))
    if failed:
        print(f"peers.py: libmoejit failed on {failed}")
        return 3
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", help="path of libmoejit.so (default: $MOEJIT_LIBRARY)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--case", action="append", type=parse_case, default=[],
                   help="T,K,H,dtype[,out_dtype] (repeatable); replaces the built-in shapes")
    p.add_argument("--cases-from", help="take the shapes of a moejit-bench JSON file")
    p.add_argument("--quick", action="store_true", help="a short subset, fewer tuning configs")
    p.add_argument("--no-extra", action="store_true", help="skip the other models' shapes")
    p.add_argument("--no-l2-warm", action="store_true", help="skip the L2-warm timing")
    p.add_argument("--reps", type=int, default=0, help="timed runs (default 200, 100 if > 64 MB)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="only the shapes with at most this many tokens (decode shapes: 64)")
    p.add_argument("--no-paired", action="store_true",
                   help="skip the paired phase (libmoejit and the peers in interleaved rounds)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=20261130)
    p.add_argument("--drop", type=parse_drop, default=None, metavar="P",
                   help="drop P%% (0..90) of each shape's routing slots (-1 entries); libmoejit's "
                        "token_major is left out; no record. With --skew: its second drop rate "
                        "(default 25)")
    p.add_argument("--skew", action="store_true",
                   help="moejit-bench --skew's routings (the same ones for a seed) with the "
                        "token_idx peers: libmoejit token_index, index_add_, Triton atomic scatter")
    p.add_argument("--skew-case", action="append", type=parse_case, default=[],
                   help="T,K,H,dtype[,out_dtype]: a shape for --skew (repeatable; implies --skew; "
                        "default T4096 K8 H7168 bf16 and T8192 K2 H4096 bf16)")
    p.add_argument("--awkward-h", action="store_true",
                   help="H 1000, 1001, 2880, 5000, 7000, 7169 at T6000 K8 in fp32, fp16, bf16")
    p.add_argument("--all", action="store_true",
                   help="with --case, --skew or --awkward-h: also the built-in shapes")
    p.add_argument("--check-binding", action="store_true",
                   help="only load the library and check the ctypes structs (no torch, no GPU)")
    args = p.parse_args()

    if args.check_binding:
        path = args.lib or os.environ.get("MOEJIT_LIBRARY")
        if not path:
            p.error("--check-binding needs --lib or MOEJIT_LIBRARY")
        check_binding(path)
        return 0
    shapes, skew_shapes = choose_shapes(args)
    if args.max_tokens < 0:
        p.error("--max-tokens: expected a positive number of tokens (0: every shape)")
    shapes = select_shapes(shapes, args.max_tokens)
    if not shapes and not skew_shapes:
        p.error(f"--max-tokens {args.max_tokens}: no shape has that few tokens")
    if args.quick and not args.reps:
        args.reps = 50
    skew_drop = skew_routing.DEFAULT_SECOND_DROP if args.drop is None else args.drop
    args.drop = args.drop or 0.0
    shapes = with_drops(shapes, args.drop)
    return main_gpu(args, shapes, skew_shapes, skew_drop)


def choose_shapes(args):
    """(the shapes, the --skew shapes): --case, --cases-from, --awkward-h and --skew choose what
    runs (the built-in shapes too with --all); without any of them, the built-in shapes."""
    shapes = list(args.case)
    if args.cases_from:
        shapes += shapes_from_bench(args.cases_from)
    if args.awkward_h:
        shapes += awkward_h_shapes()
    skew = bool(args.skew or args.skew_case)
    chosen = bool(args.case or args.cases_from or args.awkward_h or skew)
    if not shapes and args.cases_from and not (args.awkward_h or skew):
        chosen = False  # a bench JSON without cases (a --jit-only run): the built-in shapes
    if not chosen or args.all:
        shapes += builtin_shapes(args.quick, not args.no_extra)
    skew_shapes = (args.skew_case or default_skew_shapes(args.quick)) if skew else []
    return shapes, skew_shapes


if __name__ == "__main__":
    sys.exit(main())
