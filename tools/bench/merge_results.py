#!/usr/bin/env python3
"""Merges moejit-bench's JSON and peers.py's JSON into one record (tools/bench/results/h200.json).

  merge_results.py bench.json [peers.json] [--decode-peers peers-decode.json]   merged JSON
  merge_results.py bench.json [peers.json] ... --markdown   the README's tables
  merge_results.py h200.json --markdown                     the same from a merged record

Per case (shape, dtype, layout): libmoejit's median us (L2 flushed; parity_split_us: median of the
odd runs minus the even ones, which alternate by 0.6-0.75 us on the H200) and L2-warm us, GB/s, % of
the copy ceiling, % of the launch-adjusted floor (minimal bytes at the ceiling + one empty kernel;
computed from the other fields for a bench JSON that predates it), ratio to the empty kernel, a
device-to-device copy of the same bytes (us, % of the ceiling, % of the launch-adjusted floor),
relative error, the peers' us on the same shape, and peers.py's paired comparisons of that layout
(the peer's time over libmoejit's per interleaved round: median, 95% interval, verdict). The peers
ran in their own process (same method, their own inputs and copy ceiling); their us are comparable,
their % uses peers.py's ceiling.
"""

import argparse
import json
import sys

# Which libmoejit layout each peer's input corresponds to (the markdown column order too).
PEERS = [
    ("torch_index_add", "torch index_add_", "token_index"),
    ("torch_gather_sum", "torch gather+sum", "gather_map"),
    ("triton_gather_inv", "Triton gather(inv), fp32 acc", "gather_map"),
    ("triton_atomic_scatter", "Triton atomic scatter", "token_index"),
]
LAYOUTS = ["token_major", "gather_map", "token_index"]
# The key merge() writes first: what tells a record apart from moejit-bench's JSON on re-rendering.
RECORD_MARKER = "moejit-bench + peers.py, merged by merge_results.py"

# What the record keeps of each paired comparison (peers.py, paired_summary).
PAIRED_FIELDS = ("rounds", "lib_us", "peer_us", "peer_over_lib", "ci95", "lib_minus_peer_us",
                 "verdict")
# The paired table's columns: (layout, peer, title).
PAIRED_COLUMNS = [
    ("token_major", "triton_gather_inv", "Triton / token_major"),
    ("gather_map", "triton_gather_inv", "Triton / gather_map"),
    ("token_index", "triton_gather_inv", "Triton / token_index"),
    ("token_index", "torch_index_add", "index_add_ / token_index"),
]


def shape_key(d):
    return (d["T"], d["K"], d["H"], d["in_dtype"], d["out_dtype"])


def shape_text(key):
    t, k, h, i, o = key
    return f"T{t} K{k} H{h} {i}" + (f"->{o}" if o != i else "")


def pct_floor_with_launch(minimal_bytes, us, ceiling_gbps, empty_us):
    """BENCHMARKS.md's launch-adjusted floor (minimal bytes at the copy ceiling plus one empty
    kernel) as % of `us`: how it reads the 95% target for prefill shapes whose bytes-only floor is
    under about 60 us."""
    if not (minimal_bytes and us and ceiling_gbps) or empty_us is None:
        return None
    return 100 * (minimal_bytes / (ceiling_gbps * 1e3) + empty_us) / us


def paired_of(peer_shape, layout):
    """peers.py's paired comparisons of one libmoejit layout on one shape, by peer."""
    return {p["peer"]: {k: p.get(k) for k in PAIRED_FIELDS}
            for p in (peer_shape or {}).get("paired") or []
            if p.get("lib") == "libmoejit_" + layout}


def merge(bench, peers, decode_peers=None):
    """The record: bench's cases with peers.py's figures on the same shapes; decode_peers (optional)
    is a second peers.py run on the decode shapes alone, with more paired rounds (run-h200.sh)."""
    dropped = [c for c in bench.get("cases", []) if c.get("drop_percent", 0) > 0]
    if dropped:
        # Peers run every slot and the record's GB/s assume them all: such a run is no record.
        raise ValueError(
            f"the moejit-bench run dropped routing slots (--drop {dropped[0]['drop_percent']:g}):"
            " its figures are not comparable with the peers' or the record's; merge a run"
            " without --drop")
    for name, run in (("peers.py", peers), ("the decode peers.py", decode_peers)):
        if (run or {}).get("drop_percent", 0) > 0:
            raise ValueError(
                f"{name} run dropped routing slots (--drop {run['drop_percent']:g}): its figures"
                " are not comparable with the record's; merge a run without --drop")
    peer_shapes = {shape_key(s): s for s in (peers or {}).get("shapes", [])}
    decode_shapes = {shape_key(s): s for s in (decode_peers or {}).get("shapes", [])}
    ceiling, empty = bench.get("copy_ceiling_gbps"), bench.get("empty_kernel_us")
    cases = []
    for c in bench.get("cases", []):
        key = shape_key(c)
        row = {name: c.get(name) for name in (
            "label", "T", "K", "H", "in_dtype", "out_dtype", "layout", "minimal_bytes",
            "median_us", "parity_split_us", "l2_warm_us", "gbps", "pct_ceiling",
            "pct_floor_with_launch",
            "ratio_empty", "same_size_copy_us", "pct_ceiling_same_size_copy",
            "pct_floor_with_launch_same_size_copy", "rel_err", "correct", "error")
            if name in c}
        if "error" not in row:
            complete_floor_figures(row, ceiling, empty)
        ps = peer_shapes.get(key)
        if ps is not None:
            by_name = {p["name"]: p for p in ps.get("peers", [])}
            row["peers_us"] = {name: by_name[name].get("us") for name, _, _ in PEERS
                               if name in by_name}
            row["peers_rel_err"] = {name: by_name[name].get("rel_err") for name, _, _ in PEERS
                                    if name in by_name}
            # The same library timed from Python on torch tensors: a cross-check of the C++ figure.
            mine = by_name.get("libmoejit_" + c["layout"])
            if mine is not None:
                row["libmoejit_ctypes_us"] = mine.get("us")
            # peers.py's paired phase: this layout against each peer, round by round.
            paired = paired_of(ps, c["layout"])
            if paired:
                row["paired"] = paired
        paired_decode = paired_of(decode_shapes.get(key), c["layout"])
        if paired_decode:
            row["paired_decode"] = paired_decode
        cases.append(row)
    return {
        "record": RECORD_MARKER,
        "device": bench.get("device"),
        "date": bench.get("date"),
        "library_version": bench.get("library_version"),
        "method": bench.get("method"),
        "copy_ceiling_gbps": bench.get("copy_ceiling_gbps"),
        "empty_kernel_us": bench.get("empty_kernel_us"),
        "empty_kernel_l2_warm_us": bench.get("empty_kernel_l2_warm_us"),
        "empty_kernel_parity_split_us": bench.get("empty_kernel_parity_split_us"),
        "peers": None if peers is None else {
            "date": peers.get("date"),
            "torch_version": peers.get("torch_version"),
            "triton_version": peers.get("triton_version"),
            "copy_ceiling_gbps": peers.get("copy_ceiling_gbps"),
            "empty_kernel_us": peers.get("empty_kernel_us"),
            "empty_kernel_parity_split_us": peers.get("empty_kernel_parity_split_us"),
            "method": peers.get("method"),
            "configs": {shape_text(shape_key(s)): {p["name"]: p.get("config")
                                                   for p in s.get("peers", []) if p.get("config")}
                        for s in peers.get("shapes", [])},
        },
        "peers_decode": None if decode_peers is None else {
            "date": decode_peers.get("date"),
            "empty_kernel_us": decode_peers.get("empty_kernel_us"),
            "configs": {shape_text(shape_key(s)): {p["name"]: p.get("config")
                                                   for p in s.get("peers", []) if p.get("config")}
                        for s in decode_peers.get("shapes", [])},
        },
        "cases": cases,
        "jit": bench.get("jit"),
        "default_runtime_stats": bench.get("default_runtime_stats"),
    }


def complete_floor_figures(row, ceiling, empty):
    """Fills the launch-adjusted figures of a case from a bench JSON that predates them (minimal
    bytes = GB/s x median)."""
    if row.get("minimal_bytes") is None and row.get("gbps") and row.get("median_us"):
        row["minimal_bytes"] = round(row["gbps"] * row["median_us"] * 1e3)
    for pct, us in (("pct_floor_with_launch", "median_us"),
                    ("pct_floor_with_launch_same_size_copy", "same_size_copy_us")):
        if row.get(pct) is None:
            value = pct_floor_with_launch(row.get("minimal_bytes"), row.get(us), ceiling, empty)
            if value is not None:
                row[pct] = value


def fmt_us(us, pct=None):
    if us is None:
        return ""
    text = f"{us:.1f}" if us >= 10 else f"{us:.2f}"
    return text + (f" ({pct:.0f}%)" if pct is not None else "")


def markdown(merged):
    out = []
    ceiling = merged.get("copy_ceiling_gbps") or 0
    peer_ceiling = ((merged.get("peers") or {}).get("copy_ceiling_gbps")) or ceiling
    out.append(f"{merged.get('device')} ({merged.get('date')}): copy ceiling {ceiling:.0f} GB/s, "
               f"empty kernel {merged.get('empty_kernel_us') or 0:.2f} us. Median us with the L2 "
               f"flushed, (% of the copy ceiling); \"x empty\" is gather_map / empty kernel; "
               f"\"same-size copy\": a device-to-device copy moving the same bytes, timed the "
               f"same way (what a launch of that size leaves of the ceiling).")
    if merged.get("peers") and peer_ceiling != ceiling:
        # Each peer's % divides by the ceiling of the harness it ran in: said here, or a row could
        # read as if a slower peer (132.4 us, 95%) reached more of one ceiling than libmoejit
        # (131.8 us, 94%).
        out[-1] += (f" The peers' % are of peers.py's own copy ceiling, {peer_ceiling:.0f} GB/s "
                    f"(the harness they ran in).")
    out.append("")
    header = ["case", "libmoejit token_major", "libmoejit gather_map", "libmoejit token_index",
              "x empty", "L2-warm gather_map", "same-size copy"] + [title for _, title, _ in PEERS]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + " --- |" * len(header))
    rows = {}
    for c in merged["cases"]:
        rows.setdefault(shape_key(c), {})[c["layout"]] = c
    for key, by_layout in rows.items():
        cells = [shape_text(key)]
        for layout in LAYOUTS:
            c = by_layout.get(layout)
            if c is None:
                cells.append("")
            elif c.get("error"):
                cells.append("error")
            else:
                cell = fmt_us(c.get("median_us"), c.get("pct_ceiling"))
                cells.append(cell + ("" if c.get("correct", True) else " FAIL"))
        # "x empty" and the L2-warm time are the gather map's own: blank where it did not run.
        # The shape's figures (same-size copy, bytes, peers) come from any layout that ran.
        gm = by_layout.get("gather_map") or {}
        gm = {} if gm.get("error") else gm
        ran = [c for c in by_layout.values() if not c.get("error")]
        g = gm or (ran[0] if ran else next(iter(by_layout.values())))
        cells.append(f"{gm['ratio_empty']:.2f}x" if gm.get("ratio_empty") else "")
        cells.append(fmt_us(gm.get("l2_warm_us")))
        cells.append(fmt_us(g.get("same_size_copy_us") or None,
                            g.get("pct_ceiling_same_size_copy") or None))
        peers_us = g.get("peers_us") or {}
        minimal = None
        for name, _, _ in PEERS:
            us = peers_us.get(name)
            if us is not None and peer_ceiling and g.get("gbps") and g.get("median_us"):
                minimal = g["gbps"] * g["median_us"] * 1e3  # bytes
                cells.append(fmt_us(us, 100 * minimal / (us * 1e3) / peer_ceiling))
            else:
                cells.append(fmt_us(us))
        out.append("| " + " | ".join(cells) + " |")
    out.extend(same_harness(merged, rows))
    out.extend(paired_table(rows))
    out.extend(paired_table(rows, "paired_decode"))
    out.extend(launch_adjusted(merged, rows))
    jit = merged.get("jit")
    if jit:
        out.append("")
        cold = jit.get("cold_compiles") or []
        if cold:
            def kind(spec):
                first = spec.split()[0].split("=")
                if first[0] == "kind":  # KernelSpec::describe() since the variant table
                    return {"token_index_list_helpers":
                            "token-index list helpers (one module per index type)",
                            "token_index_one_token": "token-index one token",
                            "token_index_small_scan": "token-index single launch (small calls)",
                            "token_index_ordered_scan": "token-index single launch",
                            "token_index_scan": "token-index single launch",
                            "token_index_lists": "token-index lists",
                            "gather_map_one_token": "gather-map one token"}.get(
                                first[1], first[1].replace("_", "-"))
                layout = first[1]  # the older layout=... form, in earlier records
                if layout == "token_index":
                    if "helpers=1" in spec:
                        return "token-index list helpers (one module per index type)"
                    if "one_token=1" in spec:
                        return "token-index one token"
                    if "small_scan=1" in spec:
                        return "token-index single launch (small calls)"
                    return "token-index single launch" if "scan=1" in spec else "token-index lists"
                return layout.replace("_", "-")
            cache = jit.get("compute_cache")
            cache_note = ""
            if cache:
                cache_note = ("; NVRTC's compute cache off, every compile cold"
                              if cache.startswith("CUDA_CACHE_DISABLE=1")
                              else f"; compute cache: {cache}")
            out.append(f"JIT ({jit.get('target')}, NVRTC {jit.get('nvrtc_version')}{cache_note}): cold "
                       f"compile {cold[0]['ms']:.0f} ms first in process; then per module kind, "
                       "first compile / median of later compiles"
                       + (" (their minimum)" if any("later_min_ms" in c for c in cold) else "")
                       + ": " + ", ".join(f"{kind(c['spec'])} {c['ms']:.0f} / "
                                          f"{c.get('later_median_ms', c['ms']):.0f}"
                                          + (f" ({c['later_min_ms']:.0f})" if "later_min_ms" in c
                                             else "") + " ms" for c in cold)
                       + ".")
            with_cpu = [c for c in cold if "later_cpu_median_ms" in c]
            if with_cpu:
                out.append("The process's CPU time in those later compiles, median: "
                           + ", ".join(f"{kind(c['spec'])} {c['later_cpu_median_ms']:.0f}"
                                       for c in with_cpu) + " ms; " + cpu_reading(with_cpu, kind))
        if jit.get("pair_serial_ms"):
            out.append(f"The token index's list-path combine and list helpers (K=8 H=7168), which a "
                       f"first list-path call needs together: {jit['pair_serial_ms']:.0f} ms one "
                       f"after the other, {jit['pair_concurrent_ms']:.0f} ms built concurrently "
                       "(as the library does).")
        # module_load_ms is null where moejit-bench ran without a GPU.
        load = jit.get("module_load_ms", 0)
        load = "n/a (no GPU)" if load is None else f"{load:.2f} ms"
        if jit.get("disk_cache_available"):
            out.append(f"Disk-cache hit {jit['disk_hit_ms']:.2f} ms + module load {load}.")
        else:
            out.append(f"{jit.get('disk_cache_note')}; module load {load}.")
        if jit.get("host_calls"):
            out.append(f"Host time per call ({jit['host_case']}): moe_combine "
                       f"{jit['moe_combine_host_us']:.2f} us vs bare cuLaunchKernel "
                       f"{jit['bare_launch_host_us']:.2f} us ({jit['host_overhead_us']:+.2f} us; "
                       f"median of alternating batches); "
                       f"first call on a fresh runtime {jit['first_call_ms']:.1f} ms"
                       + (f", {jit['first_call_token_index_ms']:.1f} ms for "
                          f"{jit['first_call_token_index_case']}"
                          if jit.get("first_call_token_index_ms") else "")
                       + ".")
    return "\n".join(out) + "\n"


def same_harness(merged, rows):
    """Every shape timed in one harness (peers.py): libmoejit through ctypes next to the peers, on
    the same inputs and the same L2 flush, with the ratios the targets are about. Decode rows
    (T <= 64) also give each time over that harness's own empty kernel."""
    peers = merged.get("peers")
    if not peers or not rows:
        return []
    empty = peers.get("empty_kernel_us")
    out = ["", "All shapes in one harness (peers.py: libmoejit through ctypes"
           + (f", empty kernel {empty:.2f} us there" if empty else "")
           + "); us, (x empty) at decode sizes. Ratios > 1: libmoejit faster.", "",
           "| case | libmoejit token_major | libmoejit gather_map | libmoejit token_index | "
           "Triton gather(inv) | torch index_add_ | Triton / token_major | Triton / gather_map | "
           "index_add_ / token_index |",
           "|" + " --- |" * 9]

    def cell(us, decode):
        if not us:
            return ""
        return f"{us:.2f} ({us / empty:.2f}x)" if decode and empty else fmt_us(us)

    def ratio(num, den):
        return f"{num / den:.2f}" if num and den else ""

    any_row = False
    for key, by_layout in rows.items():
        decode = key[0] <= 64
        mine = {layout: (by_layout.get(layout) or {}).get("libmoejit_ctypes_us")
                for layout in LAYOUTS}
        g = by_layout.get("gather_map") or next(iter(by_layout.values()))
        peer_us = g.get("peers_us") or {}
        tri, ia = peer_us.get("triton_gather_inv"), peer_us.get("torch_index_add")
        if not any(mine.values()) and not tri:
            continue
        any_row = True
        cells = [shape_text(key)] + [cell(mine[layout], decode) for layout in LAYOUTS]
        cells += [cell(tri, decode), cell(ia, decode), ratio(tri, mine["token_major"]),
                  ratio(tri, mine["gather_map"]), ratio(ia, mine["token_index"])]
        out.append("| " + " | ".join(cells) + " |")
    return out if any_row else []


def paired_table(rows, field="paired"):
    """peers.py's paired phase: per round, the peer's time over libmoejit's (> 1: libmoejit
    faster), median and distribution-free 95% interval, and what the interval supports. Separate
    blocks of runs differ by 0.1-0.3 us at decode sizes, as much as the contenders do; rounds
    that interleave them compare like with like. field "paired_decode": the second run on the
    decode shapes alone."""
    marks = {"libmoejit faster": "faster", "peer faster": "**slower**",
             "level (within the interval)": "level"}
    out = []
    for key, by_layout in rows.items():
        cells, filled = [shape_text(key)], False
        for layout, peer, _ in PAIRED_COLUMNS:
            p = ((by_layout.get(layout) or {}).get(field) or {}).get(peer)
            if not p or p.get("peer_over_lib") is None:
                cells.append("")
                continue
            filled = True
            ci = p.get("ci95")
            cells.append(f"{p['peer_over_lib']:.3f}"
                         + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
                         + f" {marks.get(p.get('verdict'), p.get('verdict') or '')}")
        if filled:  # a shape without a paired phase (peers.py --no-paired) has no row
            out.append("| " + " | ".join(cells) + " |")
    if not out:
        return []
    rounds = "/".join(str(r) for r in sorted(
        {p["rounds"] for by_layout in rows.values() for c in by_layout.values()
         for p in (c.get(field) or {}).values() if p.get("rounds")}))
    if field == "paired_decode":
        text = (f"The decode shapes again, in a peers.py run of their own ({rounds} rounds): the "
                "same reading, with intervals that resolve a few hundredths of a microsecond.")
    else:
        text = ("Paired (peers.py: libmoejit's layouts, the Triton gather and index_add_ in "
                f"interleaved rounds, one flushed run each per round, {rounds} rounds): the "
                "peer's time over libmoejit's per round, median [95% interval]; \"faster\" / "
                "\"slower\" where the interval excludes 1, \"level\" where it contains it.")
    head = ["", text, "",
            "| case | " + " | ".join(title for _, _, title in PAIRED_COLUMNS) + " |",
            "|" + " --- |" * (len(PAIRED_COLUMNS) + 1)]
    return head + out


def launch_adjusted(merged, rows):
    """The shapes past decode against BENCHMARKS.md's launch-adjusted floor: the minimal bytes at
    the copy ceiling plus one empty kernel, over each time, in %. BENCHMARKS.md reads the 95%
    target this way where the bytes-only floor is under about 60 us. libmoejit and the same-size
    copy against moejit-bench's floors; Triton against peers.py's own (its ceiling and empty
    kernel, the harness it was timed in)."""
    ceiling, empty = merged.get("copy_ceiling_gbps"), merged.get("empty_kernel_us")
    if not ceiling or empty is None:
        return []
    peers = merged.get("peers") or {}
    peer_ceiling, peer_empty = peers.get("copy_ceiling_gbps"), peers.get("empty_kernel_us")
    out = ["", f"Against the launch-adjusted floor (BENCHMARKS.md: the minimal bytes at the copy "
           f"ceiling plus one empty kernel, {empty:.2f} us here; the reading of the 95% target "
           f"for prefill shapes whose bytes-only floor is under about 60 us), in % of each "
           f"time. Triton against its own harness's floor (empty kernel "
           + (f"{peer_empty:.2f} us" if peer_empty is not None else "not measured") + ").", "",
           "| case | bytes-only floor us | token_major | gather_map | token_index | "
           "same-size copy | Triton gather(inv) |",
           "|" + " --- |" * 7]

    def pct(value):
        return f"{value:.1f}%" if value is not None else ""

    any_row = False
    for key, by_layout in rows.items():
        if key[0] <= 64:
            continue
        g = by_layout.get("gather_map") or next(iter(by_layout.values()))
        minimal = g.get("minimal_bytes")
        if not minimal:
            continue
        any_row = True
        cells = [shape_text(key), f"{minimal / (ceiling * 1e3):.1f}"]
        cells += [pct((by_layout.get(layout) or {}).get("pct_floor_with_launch"))
                  for layout in LAYOUTS]
        cells.append(pct(g.get("pct_floor_with_launch_same_size_copy")))
        tri = (g.get("peers_us") or {}).get("triton_gather_inv")
        cells.append(pct(pct_floor_with_launch(minimal, tri, peer_ceiling, peer_empty)))
        out.append("| " + " | ".join(cells) + " |")
    return out if any_row else []


def is_merged_record(data):
    """A record merge() wrote (results/h200.json) rather than moejit-bench's own JSON: merge()
    marks it ("record"); older records are known by a peers or peers_decode section that is a
    summary ("configs"), not peers.py's shapes."""
    if data.get("record") == RECORD_MARKER:
        return True
    return any(isinstance(data.get(k), dict) and "configs" in data[k]
               for k in ("peers", "peers_decode"))


def cpu_reading(with_cpu, kind):
    """What the CPU time says about the wall time, read from the figures, so that a record never
    claims waits its figures do not show."""
    waited = [c for c in with_cpu
              if c["later_cpu_median_ms"] < 0.9 * c.get("later_median_ms", c["ms"])]
    if waited:
        return ("under 90% of the wall time for " + ", ".join(kind(c["spec"]) for c in waited)
                + ": those compiles waited for a CPU.")
    return ("each within 10% of its wall time: the compiles took that long on a CPU, "
            "they did not wait for one.")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench", help="moejit-bench --json output")
    p.add_argument("peers", nargs="?", help="peers.py --json output")
    p.add_argument("--decode-peers", metavar="JSON",
                   help="a second peers.py --json output, the decode shapes in more paired rounds")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead")
    args = p.parse_args()
    with open(args.bench) as f:
        bench = json.load(f)
    peers = None
    if args.peers:
        with open(args.peers) as f:
            peers = json.load(f)
    decode_peers = None
    if args.decode_peers:
        with open(args.decode_peers) as f:
            decode_peers = json.load(f)
    if peers is None and decode_peers is None and is_merged_record(bench):
        merged = bench  # a record this script wrote: render it again, peers included
        for c in merged["cases"]:
            if "error" not in c:
                complete_floor_figures(c, merged.get("copy_ceiling_gbps"),
                                       merged.get("empty_kernel_us"))
    else:
        try:
            merged = merge(bench, peers, decode_peers)
        except ValueError as e:
            print(f"merge_results.py: {e}", file=sys.stderr)
            return 2
    if args.markdown:
        sys.stdout.write(markdown(merged))
    else:
        json.dump(merged, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
