"""Tables and time-against-memory plots from ``benchmarks/results/**/*.json`` into the benchmark pages.

    python -m benchmarks.report                      # docs/benchmarks.md and docs/benchmarks-log.md
    python -m benchmarks.report --include-cpu --docs /tmp/b.md --log /tmp/l.md --img /tmp/img   # smoke too

``docs/benchmarks.md`` gets the current table of each workload on each GPU model: the newest invocation
that measured one of our methods (``current_results``). ``docs/benchmarks-log.md`` gets every result
file's table, newest first. Only the part of each page between the two GENERATED markers is rewritten;
the text around it is hand-written and stays. Plots need matplotlib (Agg backend); without it the tables
are still written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BEGIN = "<!-- BEGIN GENERATED RESULTS (python -m benchmarks.report) -->"
END = "<!-- END GENERATED RESULTS -->"
ORDER = ("wan20", "llama32", "llama32_decode_b1", "llama32_decode_b32", "wan40")
COLORS = {
    "native": "black",
    "ours": "tab:blue",
    "flextensor050": "tab:orange",
    "diffusers_group": "tab:green",
    "accelerate": "tab:red",
}


def _gb(x: Any) -> str:
    if x is None:
        return ""
    return f"{x / 1e9:.2f}" if x >= 1e8 or x == 0 else f"{x / 1e9:.2g}"  # tiny (smoke) sizes stay readable


def _s(x: Any) -> str:
    if x is None:
        return ""
    return f"{x:.3f}" if x >= 0.1 else f"{x * 1000:.1f} ms"


def _status_text(r: dict[str, Any]) -> str:
    status = r.get("status", "?")
    if status == "ok":
        return "ok" if r.get("steady", True) else "ok (not steady)"
    if status == "does_not_fit":
        return "does not fit"
    reason = str(r.get("reason", "")).replace("|", "/").replace("\n", " ")
    return f"{status}: {reason[:90]}" if reason else status


def _output_text(r: dict[str, Any]) -> str:
    match = r.get("output_match")
    if match == "differs":
        return f"max diff {r.get('max_abs_diff', float('nan')):.3g}"
    if match is None:
        return ""
    return "(reference)" if match == "reference" else str(match)


def format_table(doc: dict[str, Any]) -> list[str]:
    """The markdown table of one result file: one row per method, in the order they ran."""
    link = (doc.get("link") or {}).get("h2d_pinned_GBps")
    head = (
        "| method | status | step time (s) | vs native | peak alloc GB | peak reserved GB | host RSS peak GB "
        "| streamed GB/step | GB/s (of link) | forwards / s to steady | output |"
    )
    lines = [head, "|" + " --- |" * 11]
    for r in doc.get("runs", []):
        ok = r.get("status") == "ok"
        ratio = r.get("ratio_to_native")
        gbps = r.get("streamed_GBps")
        rate = ""
        if ok and r.get("bytes_streamed_per_step"):
            rate = f"{gbps:.1f}" + (f" ({gbps / link:.0%})" if link else "")
        streamed = _gb(r.get("bytes_streamed_per_step")) if ok else ""
        if ok and r.get("bytes_streamed_source") not in (None, "profiler", "report"):
            streamed += "*"  # not measured: a plan or an estimate (see bytes_streamed_source)
        warm = f"{r.get('warmup_forwards')} / {r.get('warmup_s'):.1f}" if ok and r.get("warmup_s") else ""
        cells = [
            f"`{r.get('method')}`",
            _status_text(r),
            _s(r.get("step_s")) if ok else "",
            f"{ratio:.3f}" if ratio is not None else "",
            _gb(r.get("gpu_peak_allocated_bytes")) if ok else "",
            _gb(r.get("gpu_peak_reserved_bytes")) if ok else "",
            _gb(r.get("host_rss_peak_bytes"))
            + (f" ({_gb(r['host_rss_file_peak_bytes'])} file)" if r.get("host_rss_file_peak_bytes") else ""),
            streamed,
            rate,
            warm,
            _output_text(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(doc: dict[str, Any], path: Path) -> bool:
    """Step time against peak allocated GPU memory, one point per method and budget, native marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pts = [r for r in doc.get("runs", []) if r.get("status") == "ok" and r.get("step_s")]
    if not pts:
        return False
    cpu = not str(doc.get("device", "")).startswith("cuda")
    xkey = "host_rss_peak_bytes" if cpu else "gpu_peak_allocated_bytes"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, r in enumerate(sorted(pts, key=lambda r: r["step_s"])):
        fam = r.get("family", "")
        native = fam == "native"
        x, y = (r.get(xkey) or 0) / 1e9, r["step_s"]
        ax.scatter(
            [x],
            [y],
            s=160 if native else 55,
            marker="*" if native else "o",
            color=COLORS.get(fam, "tab:gray"),
            edgecolors="black" if native else "none",
            zorder=3,
        )
        # Alternate label sides so neighbours (same memory, close times) do not print over each other.
        ax.annotate(
            r["method"], (x, y), textcoords="offset points", xytext=(7, 5 if i % 2 else -10), fontsize=8
        )
        if native:
            ax.axhline(y, color="black", lw=0.6, ls=":", zorder=1)
    cap = doc.get("memory_cap_bytes")
    if cap and not cpu:
        ax.axvline(cap / 1e9, color="tab:red", lw=0.8, ls="--", zorder=1)
        ax.annotate(
            f"cap {cap / 2**30:.0f} GiB",
            (cap / 1e9, ax.get_ylim()[1]),
            fontsize=8,
            color="tab:red",
            xytext=(3, -12),
            textcoords="offset points",
        )
    ys = [r["step_s"] for r in pts]
    if max(ys) / max(min(ys), 1e-9) > 8:
        ax.set_yscale("log")  # llama32: 0.13 s native next to 14 s for a poor offloader
    ax.set_xlabel("peak host RSS (GB)" if cpu else "peak allocated GPU memory (GB)")
    ax.set_ylabel("step time (s, median)")
    xs = [(r.get(xkey) or 0) / 1e9 for r in pts] + ([cap / 1e9] if cap and not cpu else [])
    ax.set_xlim(0, max(xs) * 1.3 or 1)  # room on the right for the labels
    left_out = [f"{r.get('method')} ({_status_text(r)[:40]})" for r in doc.get("runs", []) if r not in pts]
    if left_out:
        fig.text(0.01, 0.01, "not plotted: " + "; ".join(left_out), fontsize=7, color="dimgray", wrap=True)
    ax.set_title(
        f"{doc['workload']} on {(doc.get('link') or {}).get('gpu') or doc.get('device')}: "
        "time against memory (lower left is better)",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    fig.tight_layout(rect=(0, 0.05 if left_out else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def gpu_of(doc: dict[str, Any]) -> str:
    """The GPU model a result was measured on (its device where no link was probed: CPU smoke runs)."""
    return str((doc.get("link") or {}).get("gpu") or doc.get("device"))


def current_section(doc: dict[str, Any], img_dir: Path, docs_path: Path) -> list[str]:
    """One result on the current page: which card, when, from which file; the link and the table."""
    link = doc.get("link") or {}
    created = str(doc.get("created", ""))[:16].replace("T", " ")
    source = f"From `{doc['_file']}`" if doc.get("_file") else "From one invocation"
    if link.get("h2d_pinned_GBps"):
        source += f"; link {link['h2d_pinned_GBps']} GB/s pinned"
    out = [
        f"### `{doc['workload']}` on {gpu_of(doc)} ({created})",
        f"{source}; reference `{doc.get('reference')}`.",
        "",
    ]
    return out + format_table(doc) + [""] + _plot_lines(doc, img_dir, docs_path)


def _plot_lines(doc: dict[str, Any], img_dir: Path, docs_path: Path) -> list[str]:
    stamp = "".join(c for c in str(doc.get("created", ""))[:16] if c.isdigit())
    png = img_dir / f"{doc['workload']}-{str(doc['device']).replace(':', '')}-{stamp}.png"
    if not plot(doc, png):
        return []
    rel = os.path.relpath(png, docs_path.parent)
    return [f"![{doc['workload']}: step time against peak memory]({rel})", ""]


def section(doc: dict[str, Any], img_dir: Path, docs_path: Path) -> list[str]:
    """One result in the log: as ``current_section`` with the workload's description."""
    link = doc.get("link") or {}
    created = str(doc.get("created", ""))[:16].replace("T", " ")
    out = [f"### `{doc['workload']}` ({gpu_of(doc)}, {created})", ""]
    out += [doc.get("description", ""), ""]
    if link.get("h2d_pinned_GBps"):
        out += [
            f"Link: host-to-device {link['h2d_pinned_GBps']} GB/s pinned, "
            f"{link.get('h2d_pageable_GBps')} GB/s pageable (256 MiB copies). "
            f"Reference for outputs and ratios: `{doc.get('reference')}`.",
            "",
        ]
    return out + format_table(doc) + [""] + _plot_lines(doc, img_dir, docs_path)


def newest_results(results: Path, include_cpu: bool) -> list[dict[str, Any]]:
    """Every result file under ``results`` (its subfolders too: ``h100/``), grouped by workload and GPU
    model, newest first within each; GPU ones only unless ``include_cpu``. Each invocation keeps its own
    table: ratios are only valid against the reference run of the same invocation (or its --reference)."""
    found: list[dict[str, Any]] = []
    for f in sorted(results.rglob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict) or str(doc.get("schema", "")).split("/")[0] != "flextensor-bench":
            continue
        if not include_cpu and not str(doc.get("device", "")).startswith("cuda"):
            continue
        doc["_file"] = (f.relative_to(REPO) if REPO in f.parents else f.relative_to(results)).as_posix()
        found.append(doc)
    rank = {w: i for i, w in enumerate(ORDER)}
    found.sort(key=lambda d: str(d.get("created", "")), reverse=True)
    return sorted(found, key=lambda d: (rank.get(d["workload"], len(ORDER)), d["workload"], gpu_of(d)))


def _measured_ours(doc: dict[str, Any]) -> bool:
    return any(r.get("family") == "ours" and r.get("status") == "ok" for r in doc.get("runs", []))


def current_results(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of ``newest_results``, one per (workload, GPU model): the newest invocation in which one of our
    methods finished (a newer one that ran only peers, or whose runs of ours failed, is in the log), else
    the newest."""
    chosen: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:  # newest first within each group
        key = (doc["workload"], gpu_of(doc))
        held = chosen.get(key)
        if held is None or (_measured_ours(doc) and not _measured_ours(held)):
            chosen[key] = doc
    return [doc for doc in docs if chosen.get((doc["workload"], gpu_of(doc))) is doc]


def render(docs: list[dict[str, Any]], img_dir: Path, docs_path: Path, current: bool = False) -> str:
    """The generated part of a page: the columns' legend, then one section per result (``current``: the
    current page's form, which names the file and leaves the workload's description to the page)."""
    if not docs:
        return "No GPU results yet: run `python -m benchmarks.run` on a GPU machine, then this report.\n"
    lines = [
        "Columns: median of the timed steady steps; *vs native* = that median over the reference's median in "
        "the same invocation; peak memory over the timed steps (`max_memory_allocated` / "
        "`max_memory_reserved`); host RSS peak of the method's process (`ru_maxrss`, loading included; in "
        "brackets the peak of its file-backed part: the checkpoint's page cache mapped by safetensors, "
        "clean and reclaimable); "
        "streamed bytes per steady step, counted from the CUDA trace of one extra step (marked * when "
        "only the method's plan or an estimate was available) and that over the step time; forwards and "
        "seconds from the start of setup to the first steady step.",
        "",
    ]
    for doc in docs:
        lines += (current_section if current else section)(doc, img_dir, docs_path)
    return "\n".join(lines)


def write_docs(docs_path: Path, body: str) -> None:
    text = docs_path.read_text() if docs_path.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{body.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        _, post = rest.split(END, 1)
        text = pre + block + post
    else:
        text = text.rstrip() + "\n\n## Results\n\n" + block + "\n"
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"), help="the current page")
    p.add_argument("--log", default=str(REPO / "docs" / "benchmarks-log.md"), help="the page of every result")
    p.add_argument("--img", default=str(REPO / "docs" / "img"))
    p.add_argument("--include-cpu", action="store_true", help="also CPU (smoke) results")
    args = p.parse_args(argv)
    docs = newest_results(Path(args.results), args.include_cpu)
    current = current_results(docs)
    write_docs(Path(args.docs), render(current, Path(args.img), Path(args.docs), current=True))
    write_docs(Path(args.log), render(docs, Path(args.img), Path(args.log)))
    print(f"wrote {args.docs} ({len(current)} current results) and {args.log} ({len(docs)} result files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
