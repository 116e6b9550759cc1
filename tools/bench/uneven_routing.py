#!/usr/bin/env python3
"""Token-index layout with uneven rows per token, on the H200's python3 (torch).

moejit-bench and peers.py give every token exactly K rows. The token-index layout exists for
routings that do not (expert-choice routing, capacity drops, ...), and a token with more rows than
the kernel holds in registers takes a slower path (kernel_templates/token_index_rows.cuh,
add_listed_rows_in_order; past its list's capacity, add_rows_by_warp_walk, or in the single launch's
small-call form a scan for the next window). This script times that case: per token a count drawn uniformly from
[lo, hi] (paired so that the total is exactly T * K: the kernel is then specialized exactly as for K
rows per token), rows shuffled; random routing, every row's token drawn uniformly (about Poisson(K)
rows per token, a few tokens with 2-3x K: what lists of twice the average did not hold, version 34
in NOTES.md); and one hot token, token 0 with a given number of rows past its list's capacity (four
times the average), the other rows on the other tokens at random (version 35).

Per case: libmoejit's median us (L2 flushed between runs, CUDA events, like moejit-bench), torch
index_add_ on the same inputs (rows weighted beforehand, untimed: a generous peer), and the
relative error of libmoejit against a float64 reference (exit status 3 above 1e-2).
libmoejit's kernel templates come from MOEJIT_TEMPLATE_DIR when set (how A/B runs compare two
template sets, one process each).

    MOEJIT_LIBRARY=build-gpu/libmoejit.so.0 PYTHONPATH=python python3 tools/bench/uneven_routing.py
"""

import argparse
import sys

import torch

import moejit

CASES = [  # T, K (mean rows per token), H, lo, hi
    (4096, 8, 7168, 4, 12),
    (4096, 8, 4096, 4, 12),
    (4096, 4, 2880, 2, 6),
    (8192, 2, 4096, 1, 3),
    (4096, 1, 5120, 0, 2),
    (4096, 8, 7168, 8, 8),  # the same shapes with exactly K rows per token, for comparison
    (8192, 2, 4096, 2, 2),
    (4096, 8, 7168, None, None),  # random routing: every row's token uniform
    (8192, 2, 4096, None, None),
    (4096, 4, 2880, None, None),
    (4096, 1, 5120, None, None),
    (384, 8, 7168, None, None),  # the single launch, one token per block
    (64, 8, 7168, "hot", 256),  # one hot token: the single launch, one token per block
    (384, 8, 7168, "hot", 100),
    (4096, 8, 7168, "hot", 64),  # the list path (prefill): whole warps walk token_idx
]


def token_idx_for(T, K, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    if lo is None:  # random routing
        return torch.randint(0, T, (T * K,), generator=g)
    if lo == "hot":  # token 0 has exactly hi rows, the others the rest at random
        rest = torch.randint(1, T, (T * K - hi,), generator=g)
        tok = torch.cat([torch.zeros(hi, dtype=torch.long), rest])
        return tok[torch.randperm(tok.numel(), generator=g)]
    half = torch.randint(lo, hi + 1, (T // 2,), generator=g)
    counts = torch.cat([half, 2 * K - half])  # pairs sum to 2K: T * K rows in all
    if T % 2:
        counts = torch.cat([counts, torch.tensor([K])])
    counts = counts[torch.randperm(T, generator=g)]
    tok = torch.repeat_interleave(torch.arange(T), counts)
    return tok[torch.randperm(tok.numel(), generator=g)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no GPU found: nothing to time")
        return 0
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def median_us(fn):
        for _ in range(args.warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        for i in range(args.reps):
            flush.fill_(i & 0xFF)
            starts[i].record()
            fn()
            stops[i].record()
        torch.cuda.synchronize()
        t = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, stops))
        # Of an even count, the mean of the two middle values (as moejit-bench's median).
        n = len(t)
        return t[n // 2] if n % 2 else (t[n // 2 - 1] + t[n // 2]) / 2

    print(f"{'case':<44}{'max rows':>9}{'moejit us':>11}{'index_add_ us':>15}{'x':>7}"
          f"{'rel err':>10}")
    failed = False
    for T, K, H, lo, hi in CASES:
        seed = T * 31 + K * 7 + H + (lo if isinstance(lo, int) else 99)
        tok = token_idx_for(T, K, lo, hi, seed).to(dev)
        most = torch.bincount(tok, minlength=T).max().item()
        tok32 = tok.to(torch.int32)
        R = tok.numel()
        x = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
        gates = torch.rand(R, device=dev, dtype=torch.float32)
        out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        lib = lambda: moejit.combine(x, layout="token_index", token_idx=tok32, gates=gates,
                                     num_tokens=T, out=out)
        out.fill_(float("nan"))  # poisoned: a token the call leaves unwritten fails the check
        lib()
        ref = torch.zeros(T, H, device=dev, dtype=torch.float64)
        ref.index_add_(0, tok, x.double() * gates.double()[:, None])
        err = ((out.double() - ref).norm() / ref.norm()).item()
        failed |= not err <= 1e-2
        weighted = (x.float() * gates[:, None]).to(torch.bfloat16)
        peer_out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        peer = lambda: peer_out.zero_().index_add_(0, tok, weighted)
        lib_us, peer_us = median_us(lib), median_us(peer)
        rows = ("random routing" if lo is None else f"token 0 with {hi} rows" if lo == "hot" else
                f"rows/token {lo}-{hi}")
        label = f"T{T} K{K} H{H} bf16 {rows}"
        print(f"{label:<44}{most:>9}{lib_us:>11.2f}{peer_us:>15.2f}{peer_us / lib_us:>7.2f}"
              f"{err:>10.1e}", flush=True)
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
