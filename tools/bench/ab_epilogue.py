#!/usr/bin/env python3
"""Two or more builds of libmoejit's fused epilogue against each other, in one process.

  ab_epilogue.py --lib A=build-before/libmoejit.so --lib B=build/libmoejit.so \\
                 [--shapes decode|prefill] [--epilogue norm,norm-fp8] [--rounds 300]

For each of epilogue_peers.py's shapes and epilogues: every build's fused call (the residual add,
RMSNorm and, for norm-fp8, the fp8 group quantization in one call) on the same inputs, and the
first build's plain combine as the baseline, timed in peers.py's interleaved rounds (a random order
per round, each run after a GPU sleep and an L2 flush, CUDA events). Prints medians, each fused
call over the plain combine, and the first build's time over each other's, round by round (> 1:
that build is faster), with a distribution-free 95% interval; and whether each build's new
residual, output and scales are bitwise the first build's (they should be: the epilogue's bits do
not depend on the geometry). Each library is a copy of its .so loaded through ctypes, as
ab_libs.py does. Exit status 1 if any build's bits differ from the first's.

Needs torch and a GPU (tools/bench/NOTES.md, version 58, used it for the decode exchange).
"""

import argparse
import importlib.util
import os
import random
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv, ep=None):
    ep = ep or load("epilogue_peers")
    ab = load("ab_libs")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", action="append", type=ab.parse_lib, required=True,
                   help="NAME=path/to/libmoejit.so (two or more; the first is the reference)")
    p.add_argument("--shapes", choices=("decode", "prefill"), default="decode")
    p.add_argument("--epilogue", type=ep.parse_epilogues, default=["norm", "norm-fp8"])
    p.add_argument("--layout", choices=ep.LAYOUTS, default="gather_map")
    p.add_argument("--rounds", type=int, default=300, help="interleaved rounds (default 300)")
    p.add_argument("--seed", type=int, default=20261130)
    args = p.parse_args(argv)
    ab.check_libs(p, args.lib)
    if args.rounds < 6:
        p.error("--rounds: at least 6 (fewer give no 95% interval)")
    return args


def main(argv=None):
    ep = load("epilogue_peers")
    args = parse_args(argv, ep)
    import torch
    peers = ep.load_peers()
    scratch = tempfile.mkdtemp(prefix="moejit-ab-epilogue-")
    libs = load("ab_libs").load_copies(peers, args.lib, scratch)
    names = list(libs)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    lead = int(200 * peers.sleep_cycles_per_us(torch))
    print(f"ab_epilogue.py on {torch.cuda.get_device_name(device)}: {args.layout}, "
          f"{args.rounds} rounds; reference {names[0]}")
    shapes = ep.decode_shapes() if args.shapes == "decode" else ep.prefill_shapes()
    differ = []
    for shape in shapes:
        for epilogue in args.epilogue:
            inp = ep.Inputs(torch, shape, epilogue, args.layout, args.seed, device)
            plain = inp.combine_args(libs[names[0]], inp.moe_out)
            fns = {"combine": lambda a=plain: libs[names[0]].combine(a, inp.stream)}
            outputs = {}
            for name in names:
                fused = ep.fused_epilogue_call(libs[name], inp, epilogue, False)
                inp.reset()
                inp.poison()
                fused()
                torch.cuda.synchronize()
                outputs[name] = [t.view(torch.uint8).clone()
                                 for t in (inp.residual, inp.out, inp.scales)]
                fns[name] = fused
            inp.reset()
            series = peers.time_interleaved(torch, fns, args.rounds, 5,
                                            random.Random(args.seed), flush, lead)[0]
            med = {k: statistics.median(v) for k, v in series.items()}
            line = f"{ep.shape_text(shape):<22} {epilogue:<9} combine {med['combine']:8.2f}"
            for name in names:
                line += f" | {name} {med[name]:8.2f} ({med[name] / med['combine']:.2f}x)"
                if name != names[0]:
                    s = peers.paired_summary(series[name], series[names[0]])
                    ci = s["ci95"]
                    line += f" {names[0]}/{name} {s['peer_over_lib']:.3f}"
                    line += f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
                    if not all(torch.equal(a, b) for a, b in zip(outputs[name], outputs[names[0]])):
                        line += " BITS DIFFER"
                        differ.append((ep.shape_text(shape), epilogue, name))
            print(line, flush=True)
            torch.cuda.empty_cache()
    shutil.rmtree(scratch, ignore_errors=True)
    if differ:
        print(f"ab_epilogue.py: bits differ from {names[0]}'s: {differ}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
