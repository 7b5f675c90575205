"""Load time (issue 15, Must 6): ``offload(weights=...)`` against native's load + ``.to()``, each in a process
of its own, with the workload's checkpoint (a safetensors file on local disk) warm or cold in the page cache.

    python -m benchmarks.load --workload wan20                 # warm page cache (default)
    python -m benchmarks.load --workload wan20 --cold          # each run's file pages dropped first
    python -m benchmarks.load --workload wan_tiny --device cpu # smoke test
    python -m benchmarks.load --methods ours_host:8GiB@5.7GB --cold  # 8 GiB of host memory, the rest
                                                               # from disk; 5.7 GB of GPU memory

Per run it prints and writes (``--result``, JSON): ``ours``: model built on the meta device, then
``offload(model, OffloadConfig(device=...), weights=FILE)`` timed (it returns while the units are still
read, see docs/loading.md), then forwards until steady state (``ready_s`` = build + offload + those
forwards) and one steady step;
``ours_host:SIZE[@GPU]``: the same under ``host_memory_budget=SIZE`` (and ``gpu_memory_budget=GPU``):
what does not fit streams from the file (the disk tier); its steady step is the median of three, with the
bytes kept on disk;
``native``: ``load_file`` + ``load_state_dict(assign=True)`` + ``.to(device)``, then two forwards
(``ready_s`` = all of it). Both: host RSS peak (anonymous and file-backed split), GPU memory peak. With
``--cold``, the disk's sequential read speed is measured too (one reader, 64 MiB reads, pages dropped
before and as read). The file is the benchmark suite's weight cache (``FLEXTENSOR_BENCH_CACHE``), built
first in a process of its own when missing. Nothing here is imported by flextensor.

``--touch-host-memory GIB`` first maps and touches that much host memory, twice, and prints both rates.
The H200 machine is a virtual machine whose RAM is backed on its first touch, at about 2 GB/s: until its
memory has been touched once, every process that allocates fresh memory (our packs; not native, which
reads the page cache in place) pays that, which a bare-metal host does not. The second pass shows the rate
once backed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GB = 1e9
READ_BYTES = 64 * 2**20


def drop_file_pages(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache (no root needed for one file's pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path: Path, drop: bool) -> float:
    """Read ``path`` sequentially in 64 MiB reads; GB/s. ``drop``: evict each range once read."""
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    total = 0
    t0 = time.perf_counter()
    try:
        while n := os.readv(fd, [view]):
            if drop:
                os.posix_fadvise(fd, total, n, os.POSIX_FADV_DONTNEED)
            total += n
    finally:
        os.close(fd)
    return total / GB / (time.perf_counter() - t0)


def touch_host_memory(nbytes: int) -> tuple[float, float]:
    """Map ``nbytes`` of anonymous memory in 1 GiB pieces and populate them for writing, then unmap; twice.
    GB/s of each pass (see the module's note on ``--touch-host-memory``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    populate_write = 23  # MADV_POPULATE_WRITE, Linux 5.14
    piece = 2**30
    rates = []
    for _ in range(2):
        maps = []
        t0 = time.perf_counter()
        for _ in range(nbytes // piece):
            m = mmap.mmap(-1, piece)
            address = ctypes.addressof(ctypes.c_char.from_buffer(m))
            if libc.madvise(address, piece, populate_write) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
            maps.append(m)
        rates.append(len(maps) * piece / GB / max(time.perf_counter() - t0, 1e-9))
        for m in maps:
            m.close()
    return rates[0], rates[1]


# -- the measured process ---------------------------------------------------------------------------------


def child(method: str, workload: str, device: str, path: Path, result: Path) -> None:
    import resource

    import torch

    from benchmarks.worker import RssSplitSampler
    from benchmarks.workloads import build_empty, get_workload, make_inputs, run_step

    w = get_workload(workload)
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # Imports outside the timings: both methods pay them once per process, whatever they load.
    if w.kind == "wan":
        from diffusers import WanTransformer3DModel  # noqa: F401
    else:
        from transformers import LlamaForCausalLM  # noqa: F401
    from safetensors.torch import load_file

    import flextensor

    record: dict[str, Any] = {"method": method, "workload": workload, "device": device, "file": str(path)}
    sampler = RssSplitSampler().start()
    t0 = time.perf_counter()
    model = build_empty(w)  # parameters on meta (float32), buffers real
    forwards: list[dict[str, Any]] = []
    if method.startswith("ours"):
        host_budget, _, gpu_budget = method.partition(":")[2].partition("@")
        # bf16 parameters as in the checkpoint; the real buffers (rotary tables) stay as built
        model._apply(lambda t: t.to(torch.bfloat16) if t.device.type == "meta" else t)
        t1 = time.perf_counter()
        config = flextensor.OffloadConfig(
            device=device, host_memory_budget=host_budget or None, gpu_memory_budget=gpu_budget or None
        )
        model = flextensor.offload(model, config, weights=path)
        sync()
        t2 = time.perf_counter()
        nbytes = sum(u.nbytes for u in flextensor.status(model).units)
        record.update(build_s=t1 - t0, offload_s=t2 - t1, streamable_bytes=nbytes)
        inputs = make_inputs(w, device)
        with torch.inference_mode():
            for _ in range(8):
                t = time.perf_counter()
                run_step(model, w, inputs)
                sync()
                forwards.append({"s": time.perf_counter() - t, "phase_after": flextensor.phase(model)})
                if forwards[-1]["phase_after"] == "inference" and len(forwards) >= 2:
                    learning = [f["s"] for f in forwards[:-1]]
                    break
            else:
                learning = [f["s"] for f in forwards]
        record["ready_s"] = t2 - t0 + sum(learning)
        steady = [forwards[-1]["s"]]
        with torch.inference_mode():
            for _ in range(2 if host_budget else 0):
                t = time.perf_counter()
                run_step(model, w, inputs)
                sync()
                steady.append(time.perf_counter() - t)
        record["steady_step_s"] = sorted(steady)[len(steady) // 2]
        record["steady_steps_s"] = steady
        st = flextensor.status(model)
        record.update(
            host_pinned_bytes=st.host_pinned_bytes,
            disk_bytes=st.disk_bytes,
            disk_reads_ahead=st.disk_reads_ahead,
            disk_reads_inline=st.disk_reads_inline,
            streamed_bytes=sum(u.nbytes for u in st.units if u.placement == "streamed"),
        )
    else:
        t1 = time.perf_counter()
        model.load_state_dict(load_file(str(path)), strict=False, assign=True)
        t2 = time.perf_counter()
        model.to(device)
        sync()
        t3 = time.perf_counter()
        record.update(build_s=t1 - t0, load_s=t2 - t1, to_s=t3 - t2)
        inputs = make_inputs(w, device)
        with torch.inference_mode():
            for _ in range(2):
                t = time.perf_counter()
                run_step(model, w, inputs)
                sync()
                forwards.append({"s": time.perf_counter() - t})
        record["ready_s"] = t3 - t0 + sum(f["s"] for f in forwards)
    record["forwards"] = forwards
    record.update(sampler.stop())
    record["host_rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cuda:
        record["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    result.write_text(json.dumps(record, indent=1))


# -- the parent: no torch here ------------------------------------------------------------------------------


def _run(args: list[str], timeout: float) -> None:
    env = {**os.environ, "FT_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "benchmarks.load", *args], check=True, env=env, timeout=timeout)


def weights_file(workload: str, device: str, tmp: Path) -> Path:
    """The suite's weight cache of ``workload``, built in a process of its own when missing."""
    out = tmp / "build.json"
    env = {**os.environ, "FT_PROGRESS": "0"}
    cmd = [sys.executable, "-m", "benchmarks.worker", "--build", "--workload", workload, "--device", device]
    subprocess.run([*cmd, "--result", str(out)], check=True, env=env, timeout=600)
    info = json.loads(out.read_text())
    if not info.get("cache_path"):
        raise SystemExit(
            "the weight cache is off (FLEXTENSOR_BENCH_CACHE=off): this benchmark needs the file"
        )
    return Path(info["cache_path"])


def _summary(r: dict[str, Any], nbytes: int) -> str:
    gib = 2**30
    rss = (
        f"RSS peak {r['host_rss_peak_bytes'] / gib:.1f} GiB (anon {r['host_rss_anon_peak_bytes'] / gib:.1f}, "
        f"file {r['host_rss_file_peak_bytes'] / gib:.1f})"
    )
    steps = ", ".join(f"{f['s']:.2f}" for f in r["forwards"])
    if r["method"].startswith("ours_host"):
        return (
            f"{r['method']}: ready {r['ready_s']:.2f} s, steady step {r['steady_step_s']:.3f} s "
            f"(steps {', '.join(f'{s:.3f}' for s in r['steady_steps_s'])}), "
            f"{r['disk_bytes'] / GB:.2f} GB on disk "
            f"(reads ahead {r['disk_reads_ahead']}, inline {r['disk_reads_inline']}), "
            f"{r['host_pinned_bytes'] / GB:.2f} GB pinned, {r['streamed_bytes'] / GB:.2f} GB streamed; {rss}"
        )
    if r["method"] == "ours":
        return (
            f"ours:   offload(weights=) returns in {r['offload_s']:.2f} s (units read on in the background), "
            f"ready {r['ready_s']:.2f} s = {nbytes / GB / r['ready_s']:.1f} GB/s of weights, "
            f"forwards [{steps}] s; {rss}"
        )
    return (
        f"native: load {r['load_s']:.2f} s + .to() {r['to_s']:.2f} s, ready {r['ready_s']:.2f} s "
        f"(load + .to() + 2 forwards [{steps}] s); {rss}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="wan20")
    p.add_argument("--device", default="cuda")
    p.add_argument("--methods", default="ours,native")
    p.add_argument("--cold", action="store_true", help="drop the file's pages before each run")
    p.add_argument("--result", help="write every record here (JSON)")
    p.add_argument("--touch-host-memory", type=float, default=0, metavar="GIB", help="see the module's note")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--child-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.workload, args.device, Path(args.file), Path(args.child_result))
        return 0
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        path = weights_file(args.workload, args.device, tmp)
        nbytes = path.stat().st_size
        print(f"{args.workload}: {path} ({nbytes / GB:.2f} GB), {'cold' if args.cold else 'warm'} page cache")
        records: dict[str, Any] = {"workload": args.workload, "file_bytes": nbytes, "cold": args.cold}
        if args.touch_host_memory:  # in a process of its own: a child inherits its parent's peak RSS
            touch = [
                sys.executable,
                "-c",
                "import benchmarks.load as b; "
                f"print(*b.touch_host_memory({int(args.touch_host_memory * 2**30)}))",
            ]
            first, again = map(
                float,
                subprocess.run(touch, check=True, capture_output=True, text=True, timeout=600).stdout.split(),
            )
            records["host_first_touch_GBps"], records["host_touch_again_GBps"] = first, again
            print(f"host memory touched: {first:.1f} GB/s the first time, {again:.1f} GB/s again")
        if args.cold:
            drop_file_pages(path)
            records["disk_read_GBps"] = read_through(path, drop=True)
            print(f"disk: sequential read {records['disk_read_GBps']:.2f} GB/s (one reader, 64 MiB reads)")
        for method in args.methods.split(","):
            if args.cold:
                drop_file_pages(path)
            else:
                print(f"warming the page cache: {read_through(path, drop=False):.1f} GB/s")
            out = tmp / f"{method}.json"
            cmd = [
                "--child",
                method,
                "--workload",
                args.workload,
                "--device",
                args.device,
                "--file",
                str(path),
            ]
            _run([*cmd, "--child-result", str(out)], timeout=900)
            records[method] = json.loads(out.read_text())
            print(_summary(records[method], nbytes), flush=True)
        if args.result:
            Path(args.result).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
