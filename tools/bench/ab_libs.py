#!/usr/bin/env python3
"""Two or more builds of libmoejit against each other, in one process, in interleaved rounds.

  ab_libs.py --lib A=build-before/libmoejit.so --lib B=build/libmoejit.so \\
             --case 32,8,7168,bf16 --case 64,2,4096,bf16 [--layout gather_map,token_major]

Each library is a copy of its .so loaded through ctypes, so two builds with the same symbols live
side by side. Every round runs each library once per case and layout, in a random order, each run
flushed like moejit-bench (a GPU sleep, a 256 MB fill) and timed with CUDA events; every library
writes the same output buffer. Per case: the first library's time over each other's, round by
round, as a median with a distribution-free 95% interval (> 1: that library is faster), and
whether every library's output is bitwise the first one's (expected where only the thread
geometry differs: the summation order does not depend on it). Exit status 1 if any output is wrong
(relative error against a float64 reference of 1e-2 or more).

Why not two moejit-bench processes: at decode sizes every other flushed run takes 0.6-0.75 us
longer on the H200, so medians of separate blocks of runs move by 0.1-0.3 us; and two output
buffers put the same kernel up to 4% apart (tools/bench/NOTES.md, version 38). A library listed
twice (A and A2) is the control: its intervals should contain 1.

Needs torch and a GPU; the statistics are peers.py's (median_ci, paired_summary).
"""

import argparse
import importlib.util
import math
import os
import random
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = ("token_major", "gather_map", "token_index")


def load_peers():
    """peers.py as a module (its Moejit binding and paired statistics; needs no torch)."""
    spec = importlib.util.spec_from_file_location("peers", os.path.join(HERE, "peers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_lib(text):
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lib {text}: expected NAME=path/to/libmoejit.so")
    return name, path


def parse_case(text):
    f = text.split(",")
    if len(f) not in (3, 4) or (len(f) == 4 and f[3] not in DTYPES):
        raise argparse.ArgumentTypeError(f"--case {text}: expected T,K,H[,fp32|fp16|bf16]")
    try:
        t, k, h = (int(x) for x in f[:3])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case {text}: T, K and H must be integers") from None
    if min(t, k, h) < 1:
        raise argparse.ArgumentTypeError(f"--case {text}: T, K and H must be positive")
    return t, k, h, f[3] if len(f) == 4 else "bf16"


def parse_layouts(text):
    layouts = text.split(",")
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        raise argparse.ArgumentTypeError(f"--layout {text}: expected a comma-separated subset of "
                                         f"{', '.join(LAYOUTS)}")
    return layouts


def check_libs(parser, libs):
    """--lib's rule: two or more libraries, each under its own name."""
    names = [name for name, _ in libs]
    if len(names) < 2 or len(set(names)) != len(names):
        parser.error("--lib: give at least two libraries, each under its own name")


def load_copies(peers, libs, scratch):
    """Each (name, path) as peers.Moejit of a copy in scratch: dlopen loads each file once, so
    builds with the same symbols live side by side."""
    loaded = {}
    for name, path in libs:
        copy = os.path.join(scratch, f"libmoejit_{name}.so")
        shutil.copy(path, copy)
        loaded[name] = peers.Moejit(copy)
    return loaded


def worst_error(errors):
    """The largest relative error, NaN if any is NaN: an output left poisoned (NaN) has no error
    that max() would keep (max(0.0, nan) is 0.0)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors, default=0.0)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", action="append", type=parse_lib, required=True,
                   help="NAME=path of a libmoejit.so (repeatable; the first is the reference)")
    p.add_argument("--case", action="append", type=parse_case, required=True,
                   help="T,K,H[,dtype] (repeatable; dtype bf16 unless given)")
    p.add_argument("--layout", type=parse_layouts, default=["gather_map", "token_major"],
                   help="comma-separated layouts (default gather_map,token_major)")
    p.add_argument("--rounds", type=int, default=1000, help="interleaved rounds (default 1000)")
    p.add_argument("--seed", type=int, default=20261201)
    a = p.parse_args(argv)
    check_libs(p, a.lib)
    if a.rounds < 6:
        p.error("--rounds: at least 6 (fewer give no 95% interval)")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    import torch  # after the arguments: --help and argument errors need no torch

    peers = load_peers()
    if not torch.cuda.is_available():
        print("ab_libs.py: no GPU found (torch.cuda.is_available() is False); nothing to compare.")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=dev)  # the primary context, current on this thread
    scratch = tempfile.mkdtemp(prefix="moejit-ab-")
    libs = load_copies(peers, a.lib, scratch)
    names = list(libs)
    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    lead = int(100 * peers.sleep_cycles_per_us(torch))  # 100 us of GPU sleep per run
    stream = torch.cuda.current_stream(dev).cuda_stream
    failed = False
    print(f"ab_libs.py: {', '.join(f'{n}={p}' for n, p in a.lib)}; {a.rounds} rounds; "
          f"figures: {names[0]}'s time over each other's (> 1: that one is faster)")

    for T, K, H, dt in a.case:
        R, odt = T * K, tdtype[dt]
        gen = torch.Generator(device=dev)
        gen.manual_seed(a.seed + T * 1_000_003 + K * 1_009 + H)
        # Magnitudes in [1/16, 2) with random signs, never zero; expert-sorted rows.
        x = torch.rand((R, H), generator=gen, device=dev) * (2 - 1 / 16) + 1 / 16
        x = torch.where(torch.rand((R, H), generator=gen, device=dev) < 0.5, -x, x)
        x_tm = x.to(odt)
        u = torch.rand((T, K), generator=gen, device=dev) * 0.95 + 0.05
        gates = (u / u.sum(dim=1, keepdim=True)).reshape(R).contiguous()
        perm = torch.randperm(R, generator=gen, device=dev)
        x_sorted = x_tm[perm].contiguous()
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(R, device=dev)
        inputs = {"token_major": (x_tm, gates, None),
                  "gather_map": (x_sorted, gates, inverse.to(torch.int32)),
                  "token_index": (x_sorted, gates[perm].contiguous(), (perm // K).to(torch.int32))}
        ref = (x_tm.double().view(T, K, H) * gates.double().view(T, K, 1)).sum(dim=1)
        out = torch.empty((T, H), dtype=odt, device=dev)  # every library writes this one
        for layout in a.layout:
            x_in, g_in, idx = inputs[layout]
            fns, first, keep = {}, None, []
            same, errors = True, []
            for name, lib in libs.items():
                args = lib.args(layout, T, K, R, H, x_in.data_ptr(), dt, g_in.data_ptr(),
                                None if idx is None else idx.data_ptr(), out.data_ptr(), dt)
                ws_bytes = lib.workspace_size(args)
                ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
                if ws_bytes:
                    args.workspace, args.workspace_bytes = ws.data_ptr(), ws_bytes
                keep.append((args, ws))
                fns[name] = lambda lib=lib, args=args: lib.combine(args, stream)
                out.fill_(float("nan"))
                fns[name]()
                torch.cuda.synchronize()
                errors.append(((out.double() - ref).norm() / ref.norm()).item())
                if first is None:
                    first = out.clone()
                else:
                    same = same and torch.equal(out, first)
            worst = worst_error(errors)
            us, _ = peers.time_interleaved(torch, fns, a.rounds, 5, random.Random(a.seed), flush,
                                           lead)
            failed = failed or not worst < 1e-2  # differing outputs are news, not a failure
            line = (f"{layout:<12}T{T} K{K} H{H} {dt}  {names[0]} "
                    f"{statistics.median(us[names[0]]):.2f} us")
            for name in names[1:]:
                p = peers.paired_summary(us[name], us[names[0]])
                lo, hi = p["ci95"]
                line += (f" | {name} {statistics.median(us[name]):.2f} us "
                         f"{p['peer_over_lib']:.3f} [{lo:.3f}, {hi:.3f}]")
            line += f"  rel_err {worst:.1e}" + ("" if same else "  OUTPUTS DIFFER") + (
                "" if worst < 1e-2 else "  WRONG")
            print(line, flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
