"""One method on one workload, in a process of its own; or the link probe (``--probe-link``).

Started by ``benchmarks.run``. Writes its record (JSON) to ``--result`` after every stage, so a run that
hangs or dies still leaves how far it got, and the output tensor of its last timed step to ``--output``
for the parent to compare against native. Exit status 0 whenever a record was written, OOM included.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .methods import SkipMethod, parse_bytes, parse_method, prepare, unsupported_reason
from .workloads import build_empty, get_workload, load_weights, make_inputs, param_nbytes, run_step


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "diffusers", "accelerate", "safetensors"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _rss_now() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with contextlib.suppress(OSError):
            return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


def _peak_allocated(timer: Any) -> int:
    """``max_memory_allocated``, and with a pipeline's phase timer (which resets it at each phase) the
    peak across those resets since the last call."""
    import torch

    peak = torch.cuda.max_memory_allocated()
    return max(peak, timer.take_highest()) if timer is not None else peak


def _rss_peak() -> int:
    # ru_maxrss is KiB on Linux (bytes on macOS, which this suite does not target).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSplitSampler:
    """Peaks of anonymous and file-backed RSS, sampled from /proc/self/status.

    Weights loaded from safetensors are file-backed pages (page cache mapped into the process): a
    method that copies them into its own buffers shows both in plain RSS, although the file pages are
    clean and reclaimable. The split says which memory is the method's own.
    """

    INTERVAL_S = 0.02

    def __init__(self) -> None:
        self.anon = 0
        self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.anon = max(self.anon, int(line.split()[1]) * 1024)
                elif line.startswith("RssFile:"):
                    self.file = max(self.file, int(line.split()[1]) * 1024)

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self._read()

    def start(self) -> RssSplitSampler:
        self._read()
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._read()
        return {"host_rss_anon_peak_bytes": self.anon, "host_rss_file_peak_bytes": self.file}


class Recorder:
    """The record, rewritten atomically on every ``save`` so the parent can read a partial one."""

    def __init__(self, path: Path, base: dict[str, Any]) -> None:
        self.path = path
        self.rec = base

    def save(self, **fields: Any) -> None:
        self.rec.update(fields)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rec, indent=1, default=str))
        tmp.replace(self.path)

    @classmethod
    def amend(cls, path: str | Path, fields: dict[str, Any]) -> None:
        """Add ``fields`` to the record already written at ``path``."""
        path = Path(path)
        cls(path, json.loads(path.read_text())).save(**fields)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def count_h2d_bytes(step: Callable[[], Any], device: str) -> dict[str, Any]:
    """Host->device bytes of one step, read from the CUDA trace of the torch profiler.

    Method-independent: counts what the copy engines actually moved, whoever issued the copies.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    # Kineto names copies "Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pageable -> Device)", ...
    out = {"h2d_bytes": 0, "h2d_pageable_bytes": 0, "d2h_bytes": 0, "h2d_copies": 0}
    for ev in events:
        if ev.get("cat") != "gpu_memcpy":
            continue
        name, nbytes = ev.get("name", ""), int(ev.get("args", {}).get("bytes", 0))
        if "HtoD" in name:
            out["h2d_bytes"] += nbytes
            out["h2d_copies"] += 1
            if "Pageable" in name:
                out["h2d_pageable_bytes"] += nbytes
        elif "DtoH" in name:
            out["d2h_bytes"] += nbytes
    return out


def profile_step(
    step: Callable[[], Any], device: str, trace_dir: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One more step under torch.profiler (env FLEXTENSOR_BENCH_PROFILE=summary, or =<dir> to also write
    the Chrome trace to ``<dir>/<workload>-<method>.json.gz``: large for a long step); returned,
    flextensor's named ranges (the steady forward's waits and prefetches, and the plan-time layouts,
    uploads and vacates of a pipeline's switches) as count and host milliseconds per kind."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        _sync(device)
    kinds: dict[str, list[float]] = {}
    for event in prof.events():
        if event.name.startswith("flextensor."):
            kind = event.name.split(" ")[0]
            entry = kinds.setdefault(kind, [0, 0.0])
            entry[0] += 1
            entry[1] += event.cpu_time_total / 1000.0
    ranges = {k: {"count": n, "host_ms": round(ms, 3)} for k, (n, ms) in kinds.items()}
    if trace_dir == "summary":
        return {"ranges": ranges}
    os.makedirs(trace_dir, exist_ok=True)
    name = f"{args.workload}-{args.method.replace('/', '_').replace(':', '_')}.json.gz"
    prof.export_chrome_trace(os.path.join(trace_dir, name))
    return {"trace": os.path.join(trace_dir, name), "ranges": ranges}


def save_output(out: torch.Tensor, path: Path) -> str:
    """Save ``out`` as .npy for the parent, which compares without importing torch (numpy has no
    bfloat16: its bits are saved as int16 and the dtype goes in the record)."""
    import numpy as np

    t = out.detach().to("cpu").contiguous()
    arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    with path.open("wb") as fh:
        np.save(fh, arr)
    return str(t.dtype).removeprefix("torch.")


def build_cache(workload: str, device: str, result: Path) -> None:
    """Generate and save the weight cache in a process of its own, so that no method's measurements
    (host RSS above all: saving holds a second copy) include the build."""
    w = get_workload(workload)
    info = load_weights(w, build_empty(w), device)
    result.write_text(json.dumps({**info, "status": "ok"}, indent=1))


def probe_link(result: Path) -> None:
    """Host->device copy speed, pinned (256 MiB copies: the figure achieved GB/s is set against) and
    pageable, and device->host pinned. Decimal GB/s, as the anchors."""
    size = 256 << 20
    dev = torch.device("cuda")
    dst = torch.empty(size, dtype=torch.uint8, device=dev)

    def gbps(src: torch.Tensor, dst: torch.Tensor, reps: int) -> float:
        for _ in range(2):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return round(reps * size / (time.perf_counter() - t) / 1e9, 2)

    pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(size, dtype=torch.uint8)
    props = torch.cuda.get_device_properties(dev)
    out = {
        "h2d_pinned_GBps": gbps(pinned, dst, 16),
        "h2d_pageable_GBps": gbps(pageable, dst, 8),
        "d2h_pinned_GBps": gbps(dst, pinned, 16),
        "copy_bytes": size,
        "gpu": torch.cuda.get_device_name(dev),
        "gpu_total_bytes": props.total_memory,
        "cuda": torch.version.cuda,
    }
    result.write_text(json.dumps(out, indent=1))


def run(args: argparse.Namespace) -> None:
    sampler = RssSplitSampler().start()
    try:
        _run(args)
    finally:
        split = sampler.stop()
        with contextlib.suppress(Exception):
            Recorder.amend(args.result, split)


def _run(args: argparse.Namespace) -> None:
    ms = parse_method(args.method)
    w = get_workload(args.workload)
    device = args.device
    cuda = device.startswith("cuda")
    rec = Recorder(
        Path(args.result),
        {
            "workload": w.name,
            "method": ms.label,
            "method_spec": ms.spec,
            "family": ms.family,
            "device": device,
            "status": "started",
            "complete": False,
            "pid": os.getpid(),
            "versions": _versions(),
        },
    )
    rec.save()
    reason = unsupported_reason(ms, w, device)
    if reason:
        rec.save(status="skipped", reason=reason, complete=True)
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    cap = w.memory_cap_bytes if cuda and ms.name != "native_ref" else None
    if cuda and "cap" in ms.options:
        cap = parse_bytes(ms.options["cap"])
    if cuda:
        gpu = torch.device(device)
        if gpu.index is None:  # set_per_process_memory_fraction needs an index
            gpu = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(gpu).total_memory
        rec.save(gpu=torch.cuda.get_device_name(gpu), gpu_total_bytes=total)
        if cap is not None:
            # Stand in for a smaller card: the caching allocator refuses to go past the cap.
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), gpu)
    rec.save(memory_cap_bytes=cap)

    model = build_empty(w)
    nbytes = param_nbytes(model)
    weights = sum(nbytes.values())
    rec.save(weights_bytes=weights, params=len(nbytes))
    if ms.family == "native" and cap is not None and weights > cap:
        rec.save(
            status="does_not_fit",
            reason=f"weights alone are {weights / 1e9:.2f} GB, over the {cap / 2**30:.0f} GiB cap",
            complete=True,
        )
        return

    stage = "load"
    try:
        rec.save(**load_weights(w, model, device))
        stage = "inputs"
        inputs = make_inputs(w, device)
        _sync(device)
        with torch.no_grad():
            stage = "setup"
            t_setup = time.perf_counter()
            prep = prepare(ms, model, w, device, nbytes, args.peer_path)
            _sync(device)
            rec.save(setup_s=round(time.perf_counter() - t_setup, 3), **prep.info)

            stage = "warmup"
            max_warmup = int(ms.option("max_warmup", args.max_warmup))
            forwards, phase = 0, None
            while True:
                out = run_step(prep.model, w, inputs)
                _sync(device)
                forwards += 1
                phase = prep.phase()
                steady = forwards >= prep.min_warmup if phase is None else phase == "inference"
                rec.save(warmup_forwards=forwards, phase=phase)
                if steady or forwards >= max_warmup:
                    break
            timer = getattr(model, "timer", None)  # a pipeline's phase timer (pipeline_workload.py)
            rec.save(
                steady=steady,
                warmup_s=round(time.perf_counter() - t_setup, 3),  # from setup start: offload() included
                gpu_peak_allocated_warmup_bytes=_peak_allocated(timer) if cuda else None,
            )

            stage = "steps"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            min_steps = int(ms.option("min_steps", args.min_steps))
            max_steps = int(ms.option("max_steps", args.max_steps))
            budget = ms.option("step_budget", args.step_budget)
            times: list[float] = []
            phases: list[dict[str, Any]] = []  # a pipeline's per-phase times and peaks, each timed step
            first: torch.Tensor | None = None
            repeatable = True
            while len(times) < min_steps or (len(times) < max_steps and sum(times) < budget):
                _sync(device)
                t = time.perf_counter()
                out = run_step(prep.model, w, inputs)
                _sync(device)
                times.append(time.perf_counter() - t)
                if timer is not None:
                    phases.append(timer.last_step)
                    rec.save(phase_steps=phases)
                if first is None:
                    # On the host: a CUDA graph's next replay overwrites its outputs, and a copy on the GPU
                    # would count against the method's memory (a pipeline's frames are 0.2 GB).
                    first = out.detach().to("cpu", copy=True)
                else:
                    repeatable = repeatable and torch.equal(first, out.detach().cpu())
                rec.save(step_times_s=[round(x, 6) for x in times])
            median = statistics.median(times)
            rec.save(
                steps=len(times),
                step_s=round(median, 6),
                repeatable=repeatable,
                gpu_peak_allocated_bytes=_peak_allocated(timer) if cuda else None,
                gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None,
                gpu_allocated_steady_bytes=torch.cuda.memory_allocated() if cuda else None,
                host_rss_steady_bytes=_rss_now(),
                output_finite=bool(torch.isfinite(out.float()).all()),
                output_shape=list(out.shape),
            )
            rec.save(output_dtype=save_output(out, Path(args.output)))
            del first
            trace_dir = os.environ.get("FLEXTENSOR_BENCH_PROFILE")
            if trace_dir:
                stage = "profile"
                rec.save(
                    profile=profile_step(lambda: run_step(prep.model, w, inputs), device, trace_dir, args)
                )

            stage = "streamed"
            if prep.details is not None:
                rec.save(method_details=prep.details())
            streamed, source = prep.streamed()
            rec.save(
                bytes_streamed_plan=streamed,
                bytes_streamed_plan_source=source,
                bytes_streamed_per_step=streamed,
                bytes_streamed_source=source,
            )
            if cuda and args.count_copies and median > args.count_copies_max_step:
                rec.save(copies_measured={"skipped": f"step {median:.1f} s > {args.count_copies_max_step} s"})
            elif cuda and args.count_copies:
                stage = "count_copies"
                try:
                    counted = count_h2d_bytes(lambda: run_step(prep.model, w, inputs), device)
                    rec.save(copies_measured=counted)
                    if counted["h2d_copies"]:  # a trace without copy events means the counter saw none
                        rec.save(
                            bytes_streamed_per_step=counted["h2d_bytes"], bytes_streamed_source="profiler"
                        )
                except Exception as exc:  # the count is extra: never lose the run over it
                    rec.save(copies_measured={"error": f"{type(exc).__name__}: {exc}"[:500]})
            per_step = rec.rec["bytes_streamed_per_step"]
            rec.save(streamed_GBps=round(per_step / median / 1e9, 3) if per_step else 0.0)
        rec.save(status="ok", complete=True)
    except SkipMethod as exc:
        rec.save(status="skipped", reason=str(exc), stage=stage, complete=True)
    except torch.OutOfMemoryError as exc:
        rec.save(status="oom", stage=stage, reason=str(exc).splitlines()[0][:500], complete=True)
    except Exception as exc:
        rec.save(
            status="error",
            stage=stage,
            reason=f"{type(exc).__name__}: {exc}"[:1000],
            traceback=traceback.format_exc()[-4000:],
            complete=True,
        )
    finally:
        # A pipeline's phase timer resets the peak at each phase and keeps the highest itself.
        across_phases = getattr(getattr(model, "timer", None), "highest_ever", 0)
        any_peak = max(torch.cuda.max_memory_allocated(), across_phases) if cuda else None
        rec.save(
            host_rss_peak_bytes=_rss_peak(),
            gpu_peak_allocated_any_bytes=any_peak,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--probe-link", action="store_true", help="measure the host<->device link and exit")
    p.add_argument("--build", action="store_true", help="build the workload's weight cache and exit")
    p.add_argument("--workload")
    p.add_argument("--method")
    p.add_argument("--device", default="cuda")
    p.add_argument("--result", required=True, help="where to write the JSON record")
    p.add_argument("--output", help="where to save the output tensor of the last timed step")
    p.add_argument("--peer-path", help="the --target folder flextensor 0.5.0 was installed into")
    p.add_argument("--min-steps", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--step-budget", type=float, default=5.0, help="seconds of timed steps past min-steps")
    p.add_argument("--max-warmup", type=int, default=30)
    p.add_argument("--count-copies", action="store_true", help="count H2D bytes of one extra step (CUDA)")
    p.add_argument(
        "--count-copies-max-step", type=float, default=5.0, help="no count past this step time (s)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.probe_link:
        probe_link(Path(args.result))
        return 0
    if args.build:
        build_cache(args.workload, args.device, Path(args.result))
        return 0
    if not (args.workload and args.method and args.output):
        p.error("--workload, --method and --output are required")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
