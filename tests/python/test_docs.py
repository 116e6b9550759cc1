"""The performance figures users read come from the benchmark record: docs/performance.md's
tables and the README's table are checked against tools/bench/results/h200.json as
tools/bench/merge_results.py renders it. A new record means updating both (and this keeps them
from drifting apart). No GPU, no torch."""
import importlib.util
import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rendered():
    spec = importlib.util.spec_from_file_location(
        "merge_results", REPO / "tools" / "bench" / "merge_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = json.loads((REPO / "tools" / "bench" / "results" / "h200.json").read_text())
    return module.markdown(record)


def tables(text):
    """Every markdown table in text, as one string each."""
    return [block.strip() for block in re.split(r"\n\s*\n", text)
            if block.lstrip().startswith("|")]


def test_performance_md_tables_are_the_records(rendered):
    text = (REPO / "docs" / "performance.md").read_text()
    current = text[text.index("## Current figures"):text.index("## Method")]
    found = tables(current)
    assert len(found) >= 5
    for table in found:
        assert table in rendered, "a table in docs/performance.md is not the record's:\n" + table


def test_readme_table_is_the_records(rendered):
    # The README's rows: "| decode T1 K8 H7168 bf16 | token-major | gather map | token index |
    # Triton gather | index_add_ |", from the record's one-harness table (its first five figures).
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Performance"):]
    rows = [line for line in section.splitlines() if re.match(r"\| (decode|prefill) T", line)]
    assert 1 <= len(rows) <= 8
    one_harness = next(t for t in tables(rendered) if "Triton / token_major" in t.splitlines()[0]
                       and "libmoejit token_major" in t.splitlines()[0])
    record = {}
    for line in one_harness.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        record[cells[0]] = [c.split(" ")[0] for c in cells[1:6]]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        case = cells[0].split(" ", 1)[1]
        assert case in record, f"README case {case!r} is not in the record"
        assert cells[1:6] == record[case], f"README row {row!r} differs from the record"
