"""tools/bench/merge_results.py, which turns a moejit-bench JSON and a peers.py JSON into the
committed record (results/h200.json) and the README table; peers.py's paired statistics; and
ab_libs.py's and ab_epilogue.py's command lines: synthetic inputs, no GPU."""
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def bench_tool(name):
    """tools/bench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def merge_results():
    return bench_tool("merge_results")


def bench_case(T, K, H, layout, us):
    return {"label": "x", "T": T, "K": K, "H": H, "in_dtype": "bf16", "out_dtype": "bf16",
            "layout": layout, "median_us": us, "l2_warm_us": us * 0.9, "gbps": 1000.0,
            "pct_ceiling": 25.0, "ratio_empty": us / 4.0, "rel_err": 1e-3, "correct": True}


def bench_json():
    cases = []
    for T, K, H in ((1, 8, 7168), (4096, 8, 7168)):
        for layout, us in (("token_major", 5.0), ("gather_map", 5.5), ("token_index", 6.0)):
            cases.append(bench_case(T, K, H, layout, us * (1 if T == 1 else 26)))
    return {
        "device": "GPU", "date": "2026-11-30T00:00:00Z", "copy_ceiling_gbps": 4000.0,
        "empty_kernel_us": 4.0, "empty_kernel_l2_warm_us": 3.5, "cases": cases,
        "jit": {
            "target": "sm_90", "nvrtc_version": "13.0",
            "compute_cache": "CUDA_CACHE_DISABLE=1 (set by moejit-bench: every compile is cold)",
            "cold_compiles": [
                {"spec": "layout=gather_map in=bf16 K=8", "ms": 30.0, "later_median_ms": 20.0},
                {"spec": "layout=token_index in=bf16 cap=8", "ms": 300.0,
                 "later_median_ms": 25.0},
                {"spec": "layout=token_index in=bf16 cap=16 scan=1", "ms": 28.0},
                {"spec": "layout=token_index in=bf16 cap=16 scan=1 small_scan=1", "ms": 21.0,
                 "later_median_ms": 19.0},
            ],
            "disk_cache_available": True, "disk_hit_ms": 0.02, "module_load_ms": 0.04,
        },
    }


def peers_json(empty_kernel_us=3.5):
    def shape(T, K, H, scale):
        peers = [{"name": "triton_gather_inv", "input": "gather_map", "us": 4.7 * scale,
                  "config": "BLOCK_H=128 num_warps=1"},
                 {"name": "torch_index_add", "input": "token_index", "us": 15.0 * scale}]
        for layout, us in (("token_major", 4.6), ("gather_map", 5.0), ("token_index", 5.6)):
            peers.append({"name": "libmoejit_" + layout, "input": layout, "us": us * scale})
        return {"T": T, "K": K, "H": H, "in_dtype": "bf16", "out_dtype": "bf16", "peers": peers}
    report = {"copy_ceiling_gbps": 4100.0,
              "shapes": [shape(1, 8, 7168, 1), shape(4096, 8, 7168, 26)]}
    if empty_kernel_us is not None:
        report["empty_kernel_us"] = empty_kernel_us
    return report


def test_merge_keeps_peers_and_the_ctypes_cross_check(merge_results):
    merged = merge_results.merge(bench_json(), peers_json())
    assert merged["peers"]["empty_kernel_us"] == 3.5
    gm = [c for c in merged["cases"] if c["layout"] == "gather_map" and c["T"] == 1][0]
    assert gm["peers_us"]["triton_gather_inv"] == pytest.approx(4.7)
    assert gm["libmoejit_ctypes_us"] == pytest.approx(5.0)
    assert merged["peers"]["configs"]["T1 K8 H7168 bf16"]["triton_gather_inv"].startswith(
        "BLOCK_H=128")


def test_a_run_with_dropped_slots_is_no_record(merge_results):
    bench = bench_json()
    bench["cases"][0]["drop_percent"] = 12.5
    with pytest.raises(ValueError, match="--drop 12.5"):
        merge_results.merge(bench, peers_json())
    bench["cases"][0]["drop_percent"] = 0
    merge_results.merge(bench, peers_json())


def test_a_peers_run_with_dropped_slots_is_no_record(merge_results):
    peers = peers_json()
    peers["drop_percent"] = 50
    with pytest.raises(ValueError, match="peers.py run dropped routing slots \\(--drop 50\\)"):
        merge_results.merge(bench_json(), peers)
    with pytest.raises(ValueError, match="decode peers.py run dropped"):
        merge_results.merge(bench_json(), peers_json(), peers)
    peers["drop_percent"] = 0
    merge_results.merge(bench_json(), peers, peers)


def test_one_harness_table_has_every_shape_and_the_ratios(merge_results):
    text = merge_results.markdown(merge_results.merge(bench_json(), peers_json()))
    assert "All shapes in one harness (peers.py" in text
    section = text.split("All shapes in one harness")[1].split("Against the launch-adjusted")[0]
    decode = [line for line in section.splitlines() if line.startswith("| T1 K8 H7168 bf16 |")]
    assert len(decode) == 1, text
    # Decode: libmoejit through ctypes and the peers, each over the peers' own empty kernel.
    assert "4.60 (1.31x)" in decode[0] and "5.00 (1.43x)" in decode[0]
    assert "5.60 (1.60x)" in decode[0] and "4.70 (1.34x)" in decode[0]
    # Ratios: Triton / token_major 4.7 / 4.6, Triton / gather_map 4.7 / 5.0, index_add_ / token
    # index 15 / 5.6.
    assert decode[0].rstrip().endswith("| 1.02 | 0.94 | 2.68 |"), decode[0]
    prefill = [line for line in section.splitlines() if line.startswith("| T4096 K8 H7168 bf16 |")]
    assert len(prefill) == 1, text
    # Prefill rows give plain times (no "x empty") and the same ratios.
    assert "x)" not in prefill[0]
    assert "| 119.6 | 130.0 | 145.6 | 122.2 | 390.0 | 1.02 | 0.94 | 2.68 |" in prefill[0], prefill[0]


def test_main_table_has_the_same_size_copy(merge_results):
    bench = bench_json()
    for c in bench["cases"]:
        if c["T"] == 4096:
            c["same_size_copy_us"], c["pct_ceiling_same_size_copy"] = 120.0, 91.0
    merged = merge_results.merge(bench, peers_json())
    gm = [c for c in merged["cases"] if c["layout"] == "gather_map" and c["T"] == 4096][0]
    assert gm["same_size_copy_us"] == 120.0 and gm["pct_ceiling_same_size_copy"] == 91.0
    text = merge_results.markdown(merged)
    header = [line for line in text.splitlines() if line.startswith("| case |")][0]
    assert "| L2-warm gather_map | same-size copy |" in header
    prefill = [line for line in text.splitlines() if line.startswith("| T4096 K8 H7168 bf16 |")][0]
    assert "| 120.0 (91%) |" in prefill, prefill
    # A record without the figure (older bench): an empty cell, not a crash.
    decode = [line for line in text.splitlines() if line.startswith("| T1 K8 H7168 bf16 |")][0]
    assert decode.split(" | ")[6] == "", decode


def test_main_table_takes_x_empty_and_l2_warm_from_the_gather_map_only(merge_results):
    bench = bench_json()
    bench["cases"] = [c for c in bench["cases"] if c["layout"] != "gather_map" or c["T"] == 1]
    for c in bench["cases"]:
        if c["T"] == 4096 and c["layout"] == "token_major":
            c["error"] = "moe_combine: out of memory"
    text = merge_results.markdown(merge_results.merge(bench, peers_json()))
    row = [line for line in text.splitlines() if line.startswith("| T4096 K8 H7168 bf16 |")][0]
    cells = row.split(" | ")
    # token_major errored, no gather_map: no "x empty" or L2-warm of another layout's...
    assert cells[1:4] == ["error", "", "156.0 (25%)"], row
    assert cells[4:6] == ["", ""], row
    # ...but the peers keep their % (from the bytes of a layout that ran).
    assert "122.2 (" in row, row
    decode = [line for line in text.splitlines() if line.startswith("| T1 K8 H7168 bf16 |")][0]
    assert decode.split(" | ")[4] == "1.38x", decode


def test_main_table_names_the_ceiling_of_the_peers_percentages(merge_results):
    # A peer's % is of its own harness's ceiling (peers.py's), not the bench's that the table's
    # first line gives: the line must say so, or a slower peer could show the higher %.
    peers = peers_json()
    peers["copy_ceiling_gbps"] = 2000.0
    text = merge_results.markdown(merge_results.merge(bench_json(), peers))
    intro = text.splitlines()[0]
    assert "copy ceiling 4000 GB/s" in intro
    assert "The peers' % are of peers.py's own copy ceiling, 2000 GB/s" in intro, intro
    prefill = [line for line in text.splitlines() if line.startswith("| T4096 K8 H7168 bf16 |")][0]
    # Triton 122.2 us on the gather map's minimal bytes (1000 GB/s x 143 us): 143e6 / 122.2e3 /
    # 2000 = 58.5%, where the bench's ceiling would give 29%.
    assert "| 122.2 (59%) |" in prefill, prefill
    # Without the peers, or with the same ceiling, nothing to say.
    assert "peers.py's own copy ceiling" not in merge_results.markdown(
        merge_results.merge(bench_json(), None))
    peers["copy_ceiling_gbps"] = 4000.0
    assert "peers.py's own copy ceiling" not in merge_results.markdown(
        merge_results.merge(bench_json(), peers))


def test_one_harness_table_needs_the_peers(merge_results):
    # Without the peers' empty kernel the table stays, without "x empty".
    text = merge_results.markdown(merge_results.merge(bench_json(), peers_json(None)))
    assert "All shapes in one harness" in text and "(1.31x)" not in text
    # The bench alone: no such table.
    alone = merge_results.markdown(merge_results.merge(bench_json(), None))
    assert "All shapes in one harness" not in alone


def test_jit_line_names_each_module_kind(merge_results):
    text = merge_results.markdown(merge_results.merge(bench_json(), peers_json()))
    line = [line for line in text.splitlines() if line.startswith("JIT (")][0]
    assert "cold compile 30 ms first in process" in line
    assert line.startswith("JIT (sm_90, NVRTC 13.0; NVRTC's compute cache off, every compile cold)")
    assert "gather-map 30 / 20 ms" in line
    assert "token-index lists 300 / 25 ms" in line
    # An older record without the later median shows its first compile twice.
    assert "token-index single launch 28 / 28 ms" in line
    assert "token-index single launch (small calls) 21 / 19 ms" in line
    assert "(their minimum)" not in line  # records before the minimum was measured


def markdown_with_first_two_cold(merge_results, field, first, second):
    """The record rendered with `field` set on its first two cold compiles only."""
    bench = bench_json()
    cold = bench["jit"]["cold_compiles"]
    cold[0][field] = first
    cold[1][field] = second
    return merge_results.markdown(merge_results.merge(bench, peers_json()))


def test_jit_line_gives_the_minimum_of_later_compiles_where_measured(merge_results):
    text = markdown_with_first_two_cold(merge_results, "later_min_ms", 18.0, 22.0)
    line = [line for line in text.splitlines() if line.startswith("JIT (")][0]
    assert "first compile / median of later compiles (their minimum): " in line
    assert "gather-map 30 / 20 (18) ms" in line
    assert "token-index lists 300 / 25 (22) ms" in line
    assert "token-index single launch 28 / 28 ms" in line  # none measured: no parentheses
    assert "CPU time in those later compiles" not in text  # not measured in this record


def test_jit_cpu_time_of_later_compiles_where_measured(merge_results):
    text = markdown_with_first_two_cold(merge_results, "later_cpu_median_ms", 19.4, 24.6)
    line = [line for line in text.splitlines() if "CPU time in those later compiles" in line][0]
    assert ": gather-map 19, token-index lists 25 ms; " in line
    # 19.4 of 20 and 24.6 of 25 ms: the compiles computed, they did not wait.
    assert line.endswith("each within 10% of its wall time: the compiles took that long on a "
                         "CPU, they did not wait for one.")
    assert "waited" not in line


def test_jit_cpu_time_names_the_compiles_that_waited(merge_results):
    # The lists' later compiles: 25 ms of wall time, 15 of CPU.
    text = markdown_with_first_two_cold(merge_results, "later_cpu_median_ms", 19.4, 15.0)
    line = [line for line in text.splitlines() if "CPU time in those later compiles" in line][0]
    assert line.endswith("under 90% of the wall time for token-index lists: those compiles "
                         "waited for a CPU.")


def test_launch_adjusted_table_reads_the_floor_plus_one_empty_kernel(merge_results):
    bench = bench_json()
    for c in bench["cases"]:
        if c["T"] == 4096:
            c["minimal_bytes"] = 400e6  # 100 us at the bench's 4000 GB/s
            if c["layout"] == "gather_map":
                c["same_size_copy_us"] = 110.0
    merged = merge_results.merge(bench, peers_json())
    by_layout = {c["layout"]: c for c in merged["cases"] if c["T"] == 4096}
    # (100 us of bytes + the bench's 4 us empty kernel) / the median.
    assert by_layout["token_major"]["pct_floor_with_launch"] == pytest.approx(104 / 130 * 100)
    assert by_layout["gather_map"]["pct_floor_with_launch_same_size_copy"] == pytest.approx(
        104 / 110 * 100)
    text = merge_results.markdown(merged)
    section = text.split("Against the launch-adjusted floor")[1]
    assert "4.00 us here" in section and "empty kernel 3.50 us" in section
    rows = [line for line in section.splitlines() if line.startswith("| T")]
    # Decode shapes have their own target (x empty): not in this table.
    assert len(rows) == 1 and rows[0].startswith("| T4096 K8 H7168 bf16 | 100.0 |"), rows
    # token_major 130, gather_map 143, token_index 156 us; the copy 110; Triton (122.2 us) against
    # its own harness: 400 MB at 4100 GB/s plus 3.5 us.
    expected = [104 / 130, 104 / 143, 104 / 156, 104 / 110, (400e6 / 4100e3 + 3.5) / 122.2]
    assert rows[0].split(" | ")[2:] == [f"{100 * v:.1f}%" for v in expected[:-1]] + [
        f"{100 * expected[-1]:.1f}% |"], rows[0]


def test_launch_adjusted_figures_from_an_older_bench_json(merge_results):
    # No minimal_bytes and no pct_floor_with_launch: both from GB/s x median (1000 GB/s here).
    merged = merge_results.merge(bench_json(), None)
    tm = [c for c in merged["cases"] if c["layout"] == "token_major" and c["T"] == 4096][0]
    assert tm["minimal_bytes"] == pytest.approx(1000 * 130 * 1e3)
    assert tm["pct_floor_with_launch"] == pytest.approx((130e6 / 4000e3 + 4.0) / 130 * 100)
    assert "pct_floor_with_launch_same_size_copy" not in tm  # no copy measured


def test_a_merged_record_renders_the_same_tables(merge_results, tmp_path, capsys, monkeypatch):
    import json
    import sys
    bench = bench_json()
    for c in bench["cases"]:
        c["minimal_bytes"] = 400e6 if c["T"] == 4096 else 1e6
    merged = merge_results.merge(bench, peers_json())
    assert merge_results.is_merged_record(merged)
    assert not merge_results.is_merged_record(bench)
    record = tmp_path / "h200.json"
    record.write_text(json.dumps(merged))
    monkeypatch.setattr(sys, "argv", ["merge_results.py", str(record), "--markdown"])
    assert merge_results.main() == 0
    assert capsys.readouterr().out == merge_results.markdown(merged)


# ---- peers.py's paired phase: its statistics, and the record's table of it ------------------

@pytest.fixture(scope="module")
def peers():
    # Importable without torch or a GPU (Triton optional): only its pure functions are used here.
    return bench_tool("peers")


def test_median_interval_is_the_binomial_order_statistics(peers):
    # n = 6: P(B = 0) = 1/64 <= 2.5%, P(B <= 1) = 7/64 > 2.5%: the minimum and the maximum.
    assert peers.median_ci([6, 1, 5, 2, 4, 3]) == (1, 6)
    # Five values cannot give a 95% interval (the extremes cover only 93.75%).
    assert peers.median_ci([1, 2, 3, 4, 5]) is None
    # n = 200: the textbook x_(86), x_(115) (1-based), i.e. indices 85 and 114.
    assert peers.median_ci(list(range(200))) == (85, 114)
    # Long series need exact integers, not 2.0 ** n (which overflows past n = 1023).
    lo, hi = peers.median_ci(list(range(3000)))
    assert lo == 1445 and hi == 3000 - 1446


def test_peers_fails_a_wrong_libmoejit_result(peers):
    def shape(out_dtype, **entry):
        return {"T": 1, "K": 8, "H": 7168, "in_dtype": "bf16", "out_dtype": out_dtype,
                "peers": [dict({"name": "libmoejit_gather_map", "us": 5.0, "nan_elements": 0},
                               **entry),
                          {"name": "torch_index_add", "us": 15.0, "rel_err": 0.5}]}
    ok = shape("bf16", rel_err=1.7e-3, rel_err_after=1.7e-3)
    assert peers.libmoejit_failures([ok]) == []  # a peer's own error is not libmoejit's failure
    # A finite but wrong result (no NaN, no error) once exited 0.
    for wrong in (shape("bf16", rel_err=0.3, rel_err_after=0.3),
                  shape("bf16", rel_err=1.7e-3, rel_err_after=0.3),
                  shape("fp32", rel_err=1e-3, rel_err_after=1e-3),
                  shape("fp16", rel_err=1.7e-3, rel_err_after=1.7e-3),  # bf16's rounding
                  shape("bf16", rel_err=float("nan"), rel_err_after=1.7e-3),
                  shape("bf16", error="RuntimeError: moe_combine: ..."),
                  shape("bf16", rel_err=1.7e-3, rel_err_after=1.7e-3, nan_elements=3)):
        assert peers.libmoejit_failures([wrong]) == [(peers.shape_text(wrong),
                                                      "libmoejit_gather_map")], wrong
    assert peers.libmoejit_failures([shape("fp16", rel_err=2.1e-4, rel_err_after=2.1e-4)]) == []
    # Records with their own bound (one rounding of the reference, 1.25 times, plus 1e-6): an
    # error within it passes, bf16 accumulation (1.45 times one rounding at K=2) does not, nor do
    # tokens over their own bound or an Inf.
    bound = peers.error_bound(1.66e-3)
    assert peers.libmoejit_failures([shape("bf16", rel_err=1.66e-3, rel_err_after=1.66e-3,
                                           rel_err_bound=bound)]) == []
    for wrong in (shape("bf16", rel_err=2.4e-3, rel_err_after=2.4e-3, rel_err_bound=bound),
                  shape("bf16", rel_err=1.66e-3, rel_err_after=1.66e-3, rel_err_bound=bound,
                        tokens_over_bound=1),
                  shape("bf16", rel_err=1.66e-3, rel_err_after=1.66e-3, rel_err_bound=bound,
                        nonfinite_elements=1)):
        assert peers.libmoejit_failures([wrong]) == [(peers.shape_text(wrong),
                                                      "libmoejit_gather_map")], wrong


def test_parity_split_is_odd_minus_even_runs(peers):
    # Every other run 0.7 us slower (the flush's alternation): odd - even = +0.7.
    runs = [3.3 if i % 2 == 0 else 4.0 for i in range(40)]
    assert peers.parity_split(runs) == pytest.approx(0.7)
    assert peers.parity_split(runs[1:]) == pytest.approx(-0.7)  # the first run odd
    assert peers.parity_split([3.5] * 40) == 0.0
    assert peers.parity_split([1.0, 2.0, 3.0]) == 0.0  # too few runs to tell


def test_paired_summary_reads_each_round_as_a_pair(peers):
    # The peer is 0.1 us slower in every round, while both drift by 1 us over the rounds: the
    # separate medians overlap, the rounds do not.
    lib = [5.0 + i / 100 for i in range(100)]
    peer = [x + 0.1 for x in lib]
    s = peers.paired_summary(lib, peer)
    assert s["rounds"] == 100 and s["verdict"] == "libmoejit faster"
    assert s["lib_minus_peer_us"] == pytest.approx(-0.1)
    assert s["ci95"][0] > 1 and s["peer_over_lib"] > 1
    # Swapped: the peer faster.
    assert peers.paired_summary(peer, lib)["verdict"] == "peer faster"
    # Half the rounds each way: the interval contains 1.
    mixed = [x + (0.1 if i % 2 else -0.1) for i, x in enumerate(lib)]
    assert peers.paired_summary(lib, mixed)["verdict"] == "level (within the interval)"
    assert peers.paired_summary(lib[:4], peer[:4])["verdict"] == "too few rounds"
    with pytest.raises(ValueError):
        peers.paired_summary(lib, peer[:-1])


def paired_entry(lib, peer, ratio, lo, hi, verdict):
    return {"lib": lib, "peer": peer, "rounds": 200, "lib_us": 5.0, "peer_us": 5.0 * ratio,
            "peer_over_lib": ratio, "ci95": [lo, hi], "lib_minus_peer_us": 5.0 - 5.0 * ratio,
            "verdict": verdict}


def test_record_keeps_the_paired_comparisons_and_tables_them(merge_results):
    report = peers_json()
    decode = report["shapes"][0]
    decode["paired"] = [
        paired_entry("libmoejit_token_major", "triton_gather_inv", 1.03, 1.02, 1.04,
                     "libmoejit faster"),
        paired_entry("libmoejit_gather_map", "triton_gather_inv", 0.99, 0.98, 0.995,
                     "peer faster"),
        paired_entry("libmoejit_token_index", "triton_gather_inv", 1.001, 0.99, 1.01,
                     "level (within the interval)"),
        paired_entry("libmoejit_token_index", "torch_index_add", 3.2, 3.1, 3.3,
                     "libmoejit faster"),
    ]
    merged = merge_results.merge(bench_json(), report)
    by_layout = {c["layout"]: c for c in merged["cases"] if c["T"] == 1}
    assert by_layout["gather_map"]["paired"]["triton_gather_inv"]["verdict"] == "peer faster"
    assert set(by_layout["token_index"]["paired"]) == {"triton_gather_inv", "torch_index_add"}
    # The prefill shape had no paired phase: no field, and no row in the table.
    assert all("paired" not in c for c in merged["cases"] if c["T"] == 4096)
    text = merge_results.markdown(merged)
    section = text.split("Paired (peers.py")[1].split("Against the launch-adjusted")[0]
    assert "200 rounds" in section
    rows = [line for line in section.splitlines() if line.startswith("| T")]
    assert rows == ["| T1 K8 H7168 bf16 | 1.030 [1.020, 1.040] faster | 0.990 [0.980, 0.995] "
                    "**slower** | 1.001 [0.990, 1.010] level | 3.200 [3.100, 3.300] faster |"], rows
    # Without a paired phase anywhere: no table.
    assert "Paired (peers.py" not in merge_results.markdown(
        merge_results.merge(bench_json(), peers_json()))


# ---- ab_libs.py: its command line (the comparison itself needs torch and a GPU) ---------------

@pytest.fixture(scope="module")
def ab_libs():
    return bench_tool("ab_libs")


def test_ab_libs_reads_libraries_cases_and_layouts(ab_libs):
    a = ab_libs.parse_args(["--lib", "A=a.so", "--lib", "B=b.so", "--case", "32,8,7168",
                            "--case", "64,2,4096,fp32", "--layout", "gather_map"])
    assert a.lib == [("A", "a.so"), ("B", "b.so")]
    assert a.case == [(32, 8, 7168, "bf16"), (64, 2, 4096, "fp32")]
    assert a.layout == ["gather_map"] and a.rounds == 1000
    assert ab_libs.parse_args(["--lib", "A=a", "--lib", "B=b", "--case", "1,1,1"]).layout == [
        "gather_map", "token_major"]


@pytest.mark.parametrize("argv", [
    ["--lib", "A=a.so", "--case", "32,8,7168"],                      # one library
    ["--lib", "A=a.so", "--lib", "A=b.so", "--case", "32,8,7168"],   # a name twice
    ["--lib", "a.so", "--lib", "B=b.so", "--case", "32,8,7168"],     # no name
    ["--lib", "A=a", "--lib", "B=b", "--case", "32,8"],              # no H
    ["--lib", "A=a", "--lib", "B=b", "--case", "32,8,7168,int8"],    # no such dtype
    ["--lib", "A=a", "--lib", "B=b", "--case", "0,8,7168"],          # T = 0
    ["--lib", "A=a", "--lib", "B=b", "--case", "1,8,7168", "--layout", "scatter"],
    ["--lib", "A=a", "--lib", "B=b", "--case", "1,8,7168", "--rounds", "5"],
])
def test_ab_libs_refuses_bad_command_lines(ab_libs, argv, capsys):
    with pytest.raises(SystemExit) as e:
        ab_libs.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_ab_libs_an_unwritten_output_is_the_worst_error(ab_libs):
    # A library that leaves the poisoned output (NaN error) fails the run, whichever library it
    # is: max() kept 0.0 over a NaN, and such a library passed with "rel_err 0.0e+00".
    nan = float("nan")
    for errors in ([nan, 1.6e-3], [1.6e-3, nan], [nan]):
        worst = ab_libs.worst_error(errors)
        assert worst != worst and not worst < 1e-2
    assert ab_libs.worst_error([1.6e-3, 2e-2, 1.7e-3]) == 2e-2


def test_ab_libs_help_needs_no_torch(ab_libs, capsys):
    with pytest.raises(SystemExit) as e:
        ab_libs.main(["--help"])
    assert e.value.code == 0
    assert "interleaved rounds" in capsys.readouterr().out


def decode_peers_json():
    """peers.py --decode-only: one decode shape, paired in 1000 rounds."""
    return {"date": "2026-12-01T13:14:30Z", "empty_kernel_us": 3.5, "shapes": [
        {"T": 1, "K": 8, "H": 7168, "in_dtype": "bf16", "out_dtype": "bf16",
         "peers": [{"name": "triton_gather_inv", "config": "BLOCK_H=128 num_warps=1"}],
         "paired": [dict(paired_entry("libmoejit_gather_map", "triton_gather_inv", 1.014, 1.0,
                                      1.024, "level (within the interval)"), rounds=1000)]}]}


def test_record_takes_a_second_decode_run_and_tables_it_apart(merge_results):
    report = peers_json()
    decode = decode_peers_json()
    merged = merge_results.merge(bench_json(), report, decode)
    gm = [c for c in merged["cases"] if c["layout"] == "gather_map" and c["T"] == 1][0]
    assert gm["paired_decode"]["triton_gather_inv"]["rounds"] == 1000
    assert "paired" not in gm  # the main run had no paired phase here
    assert merged["peers_decode"]["configs"]["T1 K8 H7168 bf16"]["triton_gather_inv"].startswith(
        "BLOCK_H=128")
    text = merge_results.markdown(merged)
    section = text.split("The decode shapes again")[1].split("Against the launch-adjusted")[0]
    assert "(1000 rounds)" in section
    rows = [line for line in section.splitlines() if line.startswith("| T")]
    assert rows == ["| T1 K8 H7168 bf16 |  | 1.014 [1.000, 1.024] level |  |  |"], rows
    # Without the second run: no such table, and a null in the record.
    plain = merge_results.merge(bench_json(), report)
    assert plain["peers_decode"] is None
    assert "The decode shapes again" not in merge_results.markdown(plain)


def test_a_record_with_only_decode_peers_renders_again(merge_results, tmp_path, capsys,
                                                       monkeypatch):
    # bench.json + --decode-peers, no peers.json: re-rendering the record must keep paired_decode
    # and peers_decode, not take it for a bench JSON and merge it again without them.
    import json
    import sys
    decode = decode_peers_json()
    merged = merge_results.merge(bench_json(), None, decode)
    assert merged["peers"] is None
    assert merge_results.is_merged_record(merged)
    assert not merge_results.is_merged_record(bench_json())
    # A record written before merge() marked its records: known by its peers_decode summary.
    legacy = {k: v for k, v in merged.items() if k != "record"}
    assert merge_results.is_merged_record(legacy)
    for record in (merged, legacy):
        path = tmp_path / "record.json"
        path.write_text(json.dumps(record))
        monkeypatch.setattr(sys, "argv", ["merge_results.py", str(path), "--markdown"])
        assert merge_results.main() == 0
        text = capsys.readouterr().out
        assert text == merge_results.markdown(merged)
        assert "The decode shapes again" in text and "(1000 rounds)" in text
        # The JSON form keeps them too.
        monkeypatch.setattr(sys, "argv", ["merge_results.py", str(path)])
        assert merge_results.main() == 0
        again = json.loads(capsys.readouterr().out)
        gm = [c for c in again["cases"] if c["layout"] == "gather_map" and c["T"] == 1][0]
        assert gm["paired_decode"]["triton_gather_inv"]["rounds"] == 1000
        assert again["peers_decode"] == merged["peers_decode"]


def test_jit_line_without_a_gpu_has_no_module_load_figure(merge_results):
    # moejit-bench without a GPU writes module_load_ms null: not measured.
    bench = bench_json()
    bench["jit"]["module_load_ms"] = None
    text = merge_results.markdown(merge_results.merge(bench, None))
    assert "module load n/a (no GPU)." in text


def test_peers_selects_the_decode_shapes(peers):
    shapes = peers.builtin_shapes(False, True)
    decode = peers.select_shapes(shapes, 64)
    assert [(s["T"], s["K"], s["H"]) for s in decode] == [(1, 8, 7168), (32, 8, 7168),
                                                          (64, 2, 4096)]
    assert peers.select_shapes(shapes, 0) == shapes


class _FakeCuda:
    """torch.cuda stand-in for time_interleaved: a clock that every call advances, events that
    read it, and a log of what was enqueued."""

    def __init__(self):
        self.clock, self.log = 0.0, []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = cuda.clock

            def elapsed_time(self, other):  # ms
                return (other.t - self.t) / 1e3

        self.Event = Event

    def _sleep(self, cycles):
        self.log.append(("sleep", cycles))

    def synchronize(self):
        pass


class _FakeTorch:
    def __init__(self):
        self.cuda = _FakeCuda()


def test_time_interleaved_runs_each_once_per_round_in_random_orders(peers):
    import random
    torch = _FakeTorch()

    class Flush:
        def fill_(self, value):
            torch.cuda.log.append(("fill", value))

    def fn(name, us):
        def run():
            torch.cuda.log.append(("run", name))
            torch.cuda.clock += us
        return run

    fns = {"a": fn("a", 5.0), "b": fn("b", 7.0), "c": fn("c", 6.0)}
    series, orders = peers.time_interleaved(torch, fns, 50, 2, random.Random(1), Flush(), 123)
    assert all(sorted(o) == ["a", "b", "c"] for o in orders) and len(orders) == 50
    assert len({tuple(o) for o in orders}) > 1  # not one fixed order
    assert series == {"a": [5.0] * 50, "b": [7.0] * 50, "c": [6.0] * 50}
    timed = torch.cuda.log[6:]  # after 2 warm-up runs of each
    # Every timed run: the sleep, then a fill with its own byte, then the run.
    assert [e[0] for e in timed[:3]] == ["sleep", "fill", "run"] and timed[0] == ("sleep", 123)
    fills = [v for kind, v in timed if kind == "fill"]
    assert fills == [n & 0xFF for n in range(150)]


# ---- peers.py --drop ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("0", 0.0), ("12.5", 12.5), ("90", 90.0), ("90.0", 90.0),
                                        ("007", 7.0)])
def test_peers_drop_takes_moejit_bench_percentages(peers, text, value):
    assert peers.parse_drop(text) == value


@pytest.mark.parametrize("text", ["91", "90.5", "-1", "+5", "1e1", " 5", "5 ", "nan", "inf", ".5",
                                  "5.", "", "x", "12,5"])
def test_peers_drop_refuses_what_moejit_bench_refuses(peers, text):
    with pytest.raises(peers.argparse.ArgumentTypeError, match="expected a percentage in 0..90"):
        peers.parse_drop(text)


def test_peers_drop_counts_and_bytes_match_moejit_bench(peers):
    # round(P% of T*K), halves away from zero, as std::llround.
    assert peers.dropped_slot_count(32768, 12.5) == 4096
    assert peers.dropped_slot_count(4, 12.5) == 1  # 0.5 -> 1
    assert peers.dropped_slot_count(12, 12.5) == 2  # 1.5 -> 2
    assert peers.dropped_slot_count(128, 0) == 0
    shape = {"T": 4096, "K": 8, "H": 7168, "in_dtype": "bf16", "out_dtype": "bf16"}
    assert peers.with_drops([shape], 0) == [shape]
    (dropped,) = peers.with_drops([shape], 50)
    assert dropped["drop_percent"] == 50 and dropped["dropped_slots"] == 16384
    assert "dropped_slots" not in shape  # the caller's shape is not changed
    # (R - dropped)*H*in + R*8 + T*H*out: the dropped rows are not read, their routing is.
    R = 4096 * 8
    assert peers.minimal_bytes(shape) == R * 7168 * 2 + R * 8 + 4096 * 7168 * 2
    assert peers.minimal_bytes(dropped) == (R - 16384) * 7168 * 2 + R * 8 + 4096 * 7168 * 2


# ---- ab_epilogue.py: its command line (the comparison needs torch and a GPU) -------------------

@pytest.fixture(scope="module")
def ab_epilogue():
    return bench_tool("ab_epilogue")


def test_ab_epilogue_reads_libraries_shapes_and_epilogues(ab_epilogue):
    a = ab_epilogue.parse_args(["--lib", "A=a.so", "--lib", "B=b.so", "--shapes", "prefill",
                                "--epilogue", "norm-fp8", "--rounds", "50"])
    assert a.lib == [("A", "a.so"), ("B", "b.so")]
    assert (a.shapes, a.epilogue, a.rounds, a.layout) == ("prefill", ["norm-fp8"], 50,
                                                          "gather_map")
    d = ab_epilogue.parse_args(["--lib", "A=a", "--lib", "B=b"])
    assert (d.shapes, d.epilogue, d.rounds) == ("decode", ["norm", "norm-fp8"], 300)


@pytest.mark.parametrize("argv", [
    ["--lib", "A=a.so"],                                    # one library
    ["--lib", "A=a.so", "--lib", "A=b.so"],                 # a name twice
    ["--lib", "a.so", "--lib", "B=b.so"],                   # no name
    ["--lib", "A=a", "--lib", "B=b", "--shapes", "all"],    # no such shape set
    ["--lib", "A=a", "--lib", "B=b", "--epilogue", "rms"],  # no such epilogue
    ["--lib", "A=a", "--lib", "B=b", "--rounds", "5"],
])
def test_ab_epilogue_refuses_bad_command_lines(ab_epilogue, argv, capsys):
    with pytest.raises(SystemExit) as e:
        ab_epilogue.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
