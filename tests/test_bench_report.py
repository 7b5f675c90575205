"""The benchmark pages' generated parts: docs/benchmarks.md holds the current table of each workload on
each GPU model, docs/benchmarks-log.md every result file's, both as ``python -m benchmarks.report`` writes
them from benchmarks/results/."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import BEGIN, END, current_results, newest_results, render  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CURRENT = ROOT / "docs" / "benchmarks.md"
LOG = ROOT / "docs" / "benchmarks-log.md"


def _generated(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{path.name} has no generated part"
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def _without_plots(text: str) -> str:
    """Plot links appear only where matplotlib was installed when the page was generated."""
    lines = [line for line in text.strip().splitlines() if not line.startswith("![")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def test_the_pages_hold_what_the_report_generates(tmp_path: Path) -> None:
    docs = newest_results(RESULTS, include_cpu=False)
    current = render(current_results(docs), tmp_path, CURRENT, current=True)
    every = render(docs, tmp_path, LOG)
    stale = "stale: run `python -m benchmarks.report` and commit both pages"
    assert _without_plots(_generated(CURRENT)) == _without_plots(current), f"docs/benchmarks.md is {stale}"
    assert _without_plots(_generated(LOG)) == _without_plots(every), f"docs/benchmarks-log.md is {stale}"


def test_the_current_page_has_one_table_per_workload_and_gpu() -> None:
    headings = re.findall(r"^### `(\w+)` on (.+) \(\d{4}-\d\d-\d\d \d\d:\d\d\)$", _generated(CURRENT), re.M)
    assert len(headings) == len(set(headings)) > 0
    assert {gpu for _, gpu in headings} >= {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    dated = re.findall(
        r"^## .*\b(?:H100|H200)\b.*\d{4}-\d\d-\d\d.*$", CURRENT.read_text(encoding="utf-8"), re.M
    )
    assert not dated, f"dated sections belong in docs/benchmarks-log.md: {dated}"


def _doc(workload: str, gpu: str, created: str, *methods: tuple[str, str]) -> dict[str, Any]:
    runs = [{"method": m, "family": m.split("_")[0], "status": status} for m, status in methods]
    return {"workload": workload, "device": "cuda", "created": created, "link": {"gpu": gpu}, "runs": runs}


def test_current_results_pick_the_newest_run_of_ours_per_workload_and_gpu() -> None:
    old_h200 = _doc("wan20", "H200", "2026-12-01", ("native", "ok"), ("ours", "ok"))
    peers_only = _doc("wan20", "H200", "2026-12-03", ("native", "ok"), ("accelerate", "ok"))
    ours_failed = _doc("wan20", "H200", "2026-12-04", ("native", "ok"), ("ours", "timeout"))
    h100 = _doc("wan20", "H100", "2026-12-02", ("native", "ok"), ("ours", "ok"))
    only_peers_ever = _doc("llama32", "H200", "2026-12-02", ("native", "ok"), ("accelerate", "ok"))
    docs = [ours_failed, peers_only, old_h200, h100, only_peers_ever]  # newest first per group
    assert current_results(docs) == [old_h200, h100, only_peers_ever]
