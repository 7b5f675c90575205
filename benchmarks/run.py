"""Run one workload under every method, each in its own process, and write one JSON result file.

    python -m benchmarks.run --workload wan20 --device cuda --out benchmarks/results/
    python -m benchmarks.run --workload llama32 --methods native,ours,ours_budget:8GiB,accelerate/max_steps=3

Native (the reference) runs first; every other method's output is compared with it: ``bitwise`` or
the largest absolute difference. ``--reference FILE`` takes native's run from an earlier invocation's
file instead, where this one runs no native (its time, and its output by SHA-256: every run records
``output_sha256``), so that a long workload's peers need not run native again in each device call. Each
method's process gets a timeout, and the whole invocation a
deadline (``--deadline``), past which remaining methods are recorded as skipped: one full comparison
fits one 10-minute call on the GPU machine. The file is rewritten after every method, so a killed
invocation still leaves everything finished so far. The table printed last is the report's table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .methods import parse_method, unsupported_reason
from .workloads import WORKLOADS, cache_path, get_workload

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
SCHEMA = "flextensor-bench/1"


def default_peer_path() -> str | None:
    """``FLEXTENSOR_BENCH_PEER``, else the first of /tmp/peer and benchmarks/.peer that holds flextensor."""
    if os.environ.get("FLEXTENSOR_BENCH_PEER"):
        return os.environ["FLEXTENSOR_BENCH_PEER"]
    for cand in (Path("/tmp/peer"), REPO / "benchmarks" / ".peer"):
        if (cand / "flextensor" / "__init__.py").exists():
            return str(cand)
    return None


def worker_env(family: str) -> dict[str, str]:
    """The environment of a worker: ours' ``src`` first on the path, except for the 0.5.0 peer, whose
    own folder the worker puts first and from whose path ours' ``src`` is removed (same import name)."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if Path(p).resolve() != SRC]
    if family != "flextensor050":
        parts.insert(0, str(SRC))
    parts.insert(0, str(REPO))  # so `-m benchmarks.worker` resolves from any cwd
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # The worker leads its own process group: end it and anything it started, and nothing else.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Run ``cmd`` with a timeout; returns (exit status or None on timeout, seconds)."""
    t0 = time.perf_counter()
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
    return rc, time.perf_counter() - t0


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_method(spec: str, args: argparse.Namespace, tmp: Path, timeout: float) -> dict[str, Any]:
    ms = parse_method(spec)
    safe = "".join(c if c.isalnum() else "_" for c in ms.spec)
    result, output, log = tmp / f"{safe}.json", tmp / f"{safe}.npy", tmp / f"{safe}.log"
    cmd = [sys.executable, "-m", "benchmarks.worker", "--workload", args.workload, "--method", ms.spec]
    cmd += ["--device", args.device, "--result", str(result), "--output", str(output)]
    cmd += ["--min-steps", str(args.min_steps), "--max-steps", str(args.max_steps)]
    cmd += ["--step-budget", str(args.step_budget), "--max-warmup", str(args.max_warmup)]
    cmd += ["--threads", str(args.threads)]
    if args.peer_path:
        cmd += ["--peer-path", args.peer_path]
    if args.count_copies and args.device.startswith("cuda"):
        cmd += ["--count-copies", "--count-copies-max-step", str(args.count_copies_max_step)]
    timeout = min(timeout, ms.option("timeout", args.timeout))
    rc, wall = launch(cmd, worker_env(ms.family), timeout, log)
    try:
        rec: dict[str, Any] = json.loads(result.read_text())
    except (OSError, json.JSONDecodeError):
        rec = {"workload": args.workload, "method": ms.label, "method_spec": ms.spec, "family": ms.family}
    rec["wall_s"] = round(wall, 2)
    rec["output_path"] = str(output) if output.exists() else None
    if rc is None and not rec.get("complete"):
        rec.update(status="timeout", reason=f"no result within {timeout:.0f} s (stage {rec.get('stage')})")
    elif not rec.get("complete"):
        rec.update(status="error", reason=f"worker exited with status {rc} before finishing")
    if rec.get("status") not in ("ok", "skipped", "does_not_fit"):
        rec["log_tail"] = _tail(log)
    return rec


def probe_link(args: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    if not args.device.startswith("cuda") or args.no_link_probe:
        return None
    result = tmp / "link.json"
    cmd = [sys.executable, "-m", "benchmarks.worker", "--probe-link", "--result", str(result)]
    rc, _ = launch(cmd, worker_env("native"), 90, tmp / "link.log")
    try:
        return json.loads(result.read_text())  # type: ignore[no-any-return]
    except (OSError, json.JSONDecodeError):
        return {"error": f"link probe failed (status {rc}): {_tail(tmp / 'link.log', 800)}"}


def _load_output(path: str) -> Any:
    import numpy as np

    return np.load(path, allow_pickle=False)


def _as_float32(arr: Any, dtype: str) -> Any:
    import numpy as np

    if dtype == "bfloat16":  # bf16 bits are the top half of a float32's
        return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def build_first(args: argparse.Namespace, tmp: Path, time_left: float) -> dict[str, Any] | None:
    """Build the weight cache in its own process before any method runs, unless it is there already
    (or caching is off: then every worker generates the weights itself)."""
    w = get_workload(args.workload)
    on = "cuda" if args.device.startswith("cuda") else "cpu"
    path = cache_path(w, on)
    if path is None:
        return {
            "cache_path": None,
            "built": False,
            "reason": "FLEXTENSOR_BENCH_CACHE=off: each worker generates",
        }
    if path.exists():
        return {"cache_path": str(path), "built": False}
    if args.build == "inline" or (args.build == "auto" and on == "cpu"):
        return {"cache_path": str(path), "built": False, "reason": "built by the first worker"}
    result = tmp / "build.json"
    cmd = [sys.executable, "-m", "benchmarks.worker", "--build", "--workload", w.name]
    cmd += ["--device", args.device, "--result", str(result)]
    rc, wall = launch(cmd, worker_env("native"), min(args.timeout * 2, time_left), tmp / "build.log")
    try:
        info: dict[str, Any] = json.loads(result.read_text())
    except (OSError, json.JSONDecodeError):
        info = {
            "status": "error",
            "reason": f"build failed (status {rc})",
            "log_tail": _tail(tmp / "build.log"),
        }
    info["wall_s"] = round(wall, 2)
    return info


def compare(rec: dict[str, Any], ref: dict[str, Any] | None) -> None:
    """Output and time against the reference run (native, or native_ref where native cannot run).

    numpy, not torch: the parent stays a light process (outputs are a few MB at most).
    """
    if rec.get("status") != "ok":
        return
    if rec.get("output_path") and "output_sha256" not in rec:
        rec["output_sha256"] = output_digest(rec["output_path"])
    if ref is None:
        return
    rec["reference"] = ref["method"]
    rec["ratio_to_native"] = round(rec["step_s"] / ref["step_s"], 4) if ref.get("step_s") else None
    if rec is ref:
        rec["output_match"] = "reference"
        return
    if not ref.get("output_path") and rec.get("output_sha256") and ref.get("output_sha256"):
        # A reference from an earlier invocation's file: only its digest is left, so no difference figures.
        same = rec["output_sha256"] == ref["output_sha256"]
        rec["output_match"] = "bitwise" if same else "differs"
        return
    if not (rec.get("output_path") and ref.get("output_path")):
        rec["output_match"] = "missing"
        return
    a, b = _load_output(rec["output_path"]), _load_output(ref["output_path"])
    da, db = rec.get("output_dtype"), ref.get("output_dtype")
    if a.shape != b.shape or da != db:
        rec["output_match"] = f"shape/dtype differ: {a.shape} {da} vs {b.shape} {db}"
    elif a.tobytes() == b.tobytes():
        rec["output_match"] = "bitwise"
    else:
        import numpy as np

        diff = np.abs(_as_float32(a, str(da)) - _as_float32(b, str(db)))
        rec["output_match"] = "differs"
        rec["max_abs_diff"] = float(np.nan_to_num(diff, nan=np.inf).max())
        rec["mismatch_fraction"] = round(float((a != b).mean()), 6)


def output_digest(path: str) -> str:
    """SHA-256 of an output's dtype, shape and bytes: what ``--reference`` compares across invocations."""
    array = _load_output(path)
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


def reference_from_file(path: str, workload: str) -> dict[str, Any]:
    """Native's run (uncompiled, ok, with an output digest) of ``workload`` in an earlier result file."""
    doc = json.loads(Path(path).read_text())
    if doc.get("workload") != workload:
        raise SystemExit(f"--reference {path}: a {doc.get('workload')} file, not {workload}")
    for run in doc.get("runs", []):
        if run.get("family") != "native" or run.get("status") != "ok":
            continue
        if "compile" not in parse_method(run["method_spec"]).options:
            if not run.get("output_sha256"):
                raise SystemExit(f"--reference {path}: its native run has no output_sha256 (an older file)")
            kept = ("method", "method_spec", "step_s", "output_sha256", "output_shape", "output_dtype")
            ref = {k: run.get(k) for k in kept}
            ref["method"] = f"{run['method']} ({Path(path).name})"
            ref["gpu"] = (doc.get("link") or {}).get("gpu")
            return ref
    raise SystemExit(f"--reference {path}: no native run that finished")


def reference_for_this_machine(
    refs: list[dict[str, Any]], link: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The first of ``refs`` whose native ran on this machine's GPU model: kernels differ between models
    (an H100's Wan2.2 frames are not an H200's), so a reference from another model would report every
    method's output as differing, and its time is not this machine's."""
    if not refs:
        return None
    if link and link.get("error"):
        why = link["error"]
        raise SystemExit(f"--reference: this machine's GPU model is unknown (the link probe failed): {why}")
    gpu = (link or {}).get("gpu")
    for ref in refs:
        if ref.get("gpu") == gpu:
            return ref
    found = ", ".join(f"{r['method']} on {r.get('gpu') or 'no GPU'}" for r in refs)
    raise SystemExit(
        f"--reference: no native run on this machine's {gpu or 'device (no GPU)'} ({found}); run native "
        "here, or pass a file from this GPU model too (--reference may be given once per model)"
    )


def order_methods(specs: list[str]) -> list[str]:
    # References first: everyone else is compared with them.
    refs = [s for s in specs if parse_method(s).family == "native"]
    return refs + [s for s in specs if s not in refs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", help="see --list")
    p.add_argument("--list", action="store_true", help="print the workloads and their default methods")
    p.add_argument("--methods", help="comma-separated method specs (default: the workload's list)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for the JSON file")
    p.add_argument("--min-steps", type=int, default=3, help="timed steady steps, at least")
    p.add_argument("--max-steps", type=int, default=10, help="timed steady steps, at most")
    p.add_argument("--step-budget", type=float, default=5.0, help="s of timed steps before stopping past min")
    p.add_argument("--max-warmup", type=int, default=30, help="forwards to reach steady state, at most")
    p.add_argument("--timeout", type=float, default=180.0, help="s per method's process (load included)")
    p.add_argument("--deadline", type=float, default=540.0, help="s for the whole invocation")
    p.add_argument(
        "--build",
        choices=("auto", "first", "inline"),
        default="auto",
        help="weight cache: built by a process of its own before the methods (first), by the first worker "
        "(inline), or first on cuda and inline on cpu (auto, default)",
    )
    p.add_argument(
        "--reference",
        action="append",
        default=[],
        help="an earlier result file of this workload whose native run is the reference, where this "
        "invocation runs none (outputs compared by SHA-256); repeatable: the file from this machine's GPU "
        "model is used, and none from it is an error",
    )
    p.add_argument("--jobs", type=int, default=1, help="methods at once after the reference (CPU only)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per worker (0: default)")
    p.add_argument("--peer-path", default=default_peer_path(), help="flextensor 0.5.0's --target folder")
    p.add_argument(
        "--no-count-copies",
        dest="count_copies",
        action="store_false",
        help="skip the extra profiled step that counts host-to-device bytes (CUDA)",
    )
    p.add_argument(
        "--count-copies-max-step",
        type=float,
        default=5.0,
        help="no profiled step for methods slower than this (s/step): their bytes are estimated",
    )
    p.add_argument("--no-link-probe", action="store_true")
    p.add_argument("--keep-outputs", action="store_true", help="keep the worker folder (outputs, logs)")
    p.add_argument("--quiet", action="store_true", help="no table at the end")
    args = p.parse_args(argv)

    if args.list:
        for name, wl in WORKLOADS.items():
            print(f"{name}: {wl.description}\n    methods: {','.join(wl.methods)}")
        return 0
    if not args.workload:
        p.error("--workload is required (see --list)")
    t_start = time.perf_counter()
    w = get_workload(args.workload)
    specs = order_methods([s for s in (args.methods.split(",") if args.methods else w.methods) if s.strip()])
    for s in specs:
        parse_method(s)  # fail on a typo now, not after minutes of other methods
    file_refs = [reference_from_file(path, w.name) for path in args.reference]
    if args.jobs > 1 and args.device.startswith("cuda"):
        p.error("--jobs > 1 only on cpu: GPU timings need the machine to themselves")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    out_path = out_dir / f"{w.name}-{args.device.replace(':', '')}-{now:%Y%m%d-%H%M%S}.json"
    tmp = Path(tempfile.mkdtemp(prefix=f"ftbench-{w.name}-"))
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "workload": w.name,
        "description": w.description,
        "unit": w.unit,
        "memory_cap_bytes": w.memory_cap_bytes,
        "device": args.device,
        "created": now.isoformat(timespec="seconds"),
        "argv": sys.argv if argv is None else ["benchmarks.run", *argv],
        "host": {"hostname": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet",)},
        "link": None,
        "build": None,
        "runs": [],
    }

    def save() -> None:
        tmp_out = out_path.with_suffix(".tmp")
        tmp_out.write_text(json.dumps(doc, indent=1, default=str))
        tmp_out.replace(out_path)

    doc["link"] = probe_link(args, tmp)
    save()
    file_ref = reference_for_this_machine(file_refs, doc["link"])
    link = (doc["link"] or {}).get("h2d_pinned_GBps")

    def remaining() -> float:
        return args.deadline - (time.perf_counter() - t_start)

    doc["build"] = build_first(args, tmp, remaining() - 30)
    save()

    ref: dict[str, Any] | None = None
    compiled_refs: dict[str, dict[str, Any]] = {}  # compile mode -> native compiled that way

    def finish(rec: dict[str, Any]) -> None:
        # Compared as soon as it ends: a call killed later still leaves ratios and output checks. A
        # compiled method is compared with native compiled the same way, where that ran.
        mode = parse_method(rec["method_spec"]).options.get("compile")
        compare(rec, compiled_refs.get(mode, ref) if mode else ref)
        if link and rec.get("streamed_GBps") is not None:
            rec["link_fraction"] = round(rec["streamed_GBps"] / link, 4)
        if not args.quiet:
            line = f"[{time.perf_counter() - t_start:6.1f}s] {rec['method']}: {rec.get('status')}"
            if rec.get("status") == "ok":
                peak = rec.get("gpu_peak_allocated_bytes")
                line += f" {rec['step_s']:.4f} s/step, x{rec.get('ratio_to_native') or float('nan'):.3f}"
                line += f", peak {peak / 1e9:.2f} GB" if peak else ""
                line += f", output {rec.get('output_match')}"
            print((line + f" {rec.get('reason', '')}")[:240], flush=True)

    def one(spec: str) -> dict[str, Any]:
        ms = parse_method(spec)
        left = remaining() - 5
        skip = unsupported_reason(ms, w, args.device)  # decided here: no process for a known skip
        if skip is None and left < 20:
            skip = f"deadline: {max(0.0, left + 5):.0f} s left of {args.deadline:.0f}"
        if skip is not None:
            return {
                "workload": w.name,
                "method": ms.label,
                "method_spec": spec,
                "family": ms.family,
                "device": args.device,
                "status": "skipped",
                "reason": skip,
                "complete": True,
            }
        return run_method(spec, args, tmp, left)

    records: dict[str, dict[str, Any]] = {}

    def record(spec: str, rec: dict[str, Any]) -> None:
        records[spec] = rec
        doc["runs"] = [records[k] for k in specs if k in records]
        save()

    refs = [s for s in specs if parse_method(s).family == "native"]
    rest = [s for s in specs if s not in refs]
    for s in refs:
        record(s, one(s))
    # The reference is native where it ran, else native_ref (native did not fit under the cap).
    ok_refs = [s for s in refs if records[s].get("status") == "ok"]
    plain = [s for s in ok_refs if "compile" not in parse_method(s).options]
    ref = records[plain[0]] if plain else None
    if ref is None:
        ref = file_ref
    for s in ok_refs:
        mode = parse_method(s).options.get("compile")
        if mode is not None:
            compiled_refs.setdefault(mode, records[s])
    doc["reference"] = ref["method"] if ref else None
    for s in refs:
        finish(records[s])
    if args.jobs > 1:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for s, rec in zip(rest, pool.map(one, rest), strict=True):
                finish(rec)
                record(s, rec)
    else:
        for s in rest:
            rec = one(s)
            finish(rec)
            record(s, rec)

    runs = [records[s] for s in specs]
    if not args.keep_outputs:  # only now: every comparison reads the reference's file
        for r in runs:
            r.pop("output_path", None)
    doc["runs"] = runs
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    save()
    if not args.keep_outputs:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        doc["worker_dir"] = str(tmp)
        save()
    if not args.quiet:
        from .report import format_table

        print("\n".join(format_table(doc)))
        print(f"\nwrote {out_path}")
    print(f"RESULT_FILE={out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
