"""CPU smoke test of the benchmark suite, so it cannot rot between GPU runs.

The tiny workloads run through exactly the path the GPU runs take: ``python -m benchmarks.run`` starts
one worker process per method, native first, compares every output with native's and writes one JSON
file per workload. The invocations run at the same time to stay well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `benchmarks` is a folder of the repo, not an installed package

from benchmarks.methods import parse_bytes, parse_method  # noqa: E402
from benchmarks.report import format_table, render  # noqa: E402
from benchmarks.run import launch, order_methods, reference_for_this_machine  # noqa: E402

for _pkg in ("transformers", "diffusers", "accelerate", "safetensors"):
    pytest.importorskip(_pkg, reason=f"the benchmark workloads need {_pkg} (pip install -e '.[test]')")

# Every method that runs on a CPU, once: each worker costs ~5 s of imports, so two invocations, not one per
# tiny workload (llama_tiny's prefill step is checked in-process below). flextensor 0.5.0 is listed to
# check its recorded skip: it needs CUDA.
RUNS = {
    "wan_tiny": "native,ours,ours_budget:256KiB,diffusers_group,accelerate,flextensor050,"
    "native/compile=regional,ours_budget:256KiB/compile=regional",
    "llama_tiny_decode": "native,ours,diffusers_group:model",
    "llama_tiny_decode_static": "native,ours",
}
BUILD_FIRST = "llama_tiny_decode"  # this one builds its weights the GPU way: a process of their own
DOC_FIELDS = {"schema", "workload", "description", "device", "created", "link", "build", "settings"}
RUN_FIELDS = {
    "workload", "method", "method_spec", "family", "device", "status", "complete", "versions",
    "weights_bytes", "load_s", "setup_s", "warmup_forwards", "warmup_s", "steady", "phase",
    "steps", "step_times_s", "step_s", "ratio_to_native", "repeatable", "reference",
    "gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "host_rss_peak_bytes", "host_rss_steady_bytes",
    "bytes_streamed_per_step", "bytes_streamed_source", "streamed_GBps",
    "output_match", "output_finite", "output_shape", "output_dtype", "output_sha256", "wall_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench-results")
    procs = {}
    for workload, methods in RUNS.items():
        # A cache per invocation, so that which process builds the weights is known.
        env = dict(os.environ, FLEXTENSOR_BENCH_CACHE=str(tmp_path_factory.mktemp(f"cache-{workload}")))
        cmd = [sys.executable, "-m", "benchmarks.run", "--workload", workload, "--methods", methods]
        cmd += ["--device", "cpu", "--out", str(out), "--threads", "1", "--min-steps", "3"]
        cmd += ["--max-steps", "3", "--build", "first" if workload == BUILD_FIRST else "inline"]
        procs[workload] = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    docs = {}
    for workload, proc in procs.items():
        text, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, text[-3000:]
        line = next(x for x in text.splitlines() if x.startswith("RESULT_FILE="))
        docs[workload] = json.loads(Path(line.split("=", 1)[1]).read_text())
    return docs


@pytest.mark.parametrize("workload", list(RUNS))
def test_every_method_recorded_with_every_field(results: dict[str, dict[str, Any]], workload: str) -> None:
    doc = results[workload]
    assert doc.keys() >= DOC_FIELDS | {"reference", "runs"}
    assert doc["reference"] == "native" and doc["link"] is None  # no link probe on a CPU
    assert [r["method_spec"] for r in doc["runs"]] == order_methods(RUNS[workload].split(","))
    for r in doc["runs"]:
        if r["status"] != "ok":
            continue
        missing = RUN_FIELDS - r.keys()
        assert not missing, f"{r['method']}: missing {sorted(missing)}"
        assert r["steady"] and r["steps"] == 3 and len(r["step_times_s"]) == 3 and r["step_s"] > 0
        assert r["repeatable"] and r["output_finite"]
        assert r["weights_bytes"] > 0 and r["host_rss_peak_bytes"] > 0


@pytest.mark.parametrize("workload", list(RUNS))
def test_outputs_match_native_bitwise(results: dict[str, dict[str, Any]], workload: str) -> None:
    runs = {r["method_spec"]: r for r in results[workload]["runs"]}
    native = runs["native"]
    assert (
        native["status"] == "ok" and native["output_match"] == "reference" and native["ratio_to_native"] == 1
    )
    for spec, r in runs.items():
        if r["status"] == "ok" and r["family"] != "native":
            assert r["output_match"] == "bitwise", f"{spec}: {r['output_match']} {r.get('max_abs_diff')}"
    compiled = runs.get("ours_budget:256KiB/compile=regional")
    if compiled is not None:  # compared with native compiled the same way, not with native eager
        assert compiled["reference"] == "native/compile=regional"


@pytest.mark.parametrize("workload", list(RUNS))
def test_ours_runs_and_reaches_steady_state(results: dict[str, dict[str, Any]], workload: str) -> None:
    for r in results[workload]["runs"]:
        if r["family"] != "ours":
            continue
        assert r["status"] == "ok", f"{r['method']}: {r.get('reason')}\n{r.get('log_tail', '')}"
        assert r["phase"] == "inference"
        # Without a budget the CPU planner may keep a tiny model resident; a tight budget must stream, and
        # the figure must come from the engine's own report of the step.
        assert r["bytes_streamed_source"] == "report"
        if r["method"] == "ours_budget":
            assert r["bytes_streamed_per_step"] > 0
        assert r["impl_file"].startswith(str(REPO / "src")), r["impl_file"]


def test_weights_are_built_once_then_loaded_from_the_cache(results: dict[str, dict[str, Any]]) -> None:
    for workload, doc in results.items():
        built = [r["method"] for r in doc["runs"] if r.get("built")]
        if workload == BUILD_FIRST:
            assert doc["build"]["built"] and doc["build"]["status"] == "ok" and not built
        else:
            assert built == ["native"], built  # the first worker builds, the others load
        paths = {r["cache_path"] for r in doc["runs"] if r["status"] == "ok"}
        assert len(paths) == 1 and Path(paths.pop()).exists()


def test_skips_are_recorded_not_fatal(results: dict[str, dict[str, Any]]) -> None:
    wan = {r["method_spec"]: r for r in results["wan_tiny"]["runs"]}
    assert wan["flextensor050"]["status"] == "skipped" and "CUDA" in wan["flextensor050"]["reason"]
    others = [r for doc in results.values() for r in doc["runs"] if r["family"] != "flextensor050"]
    assert all(r["status"] == "ok" for r in others), [(r["method"], r.get("reason")) for r in others]


def test_a_hanging_worker_is_killed_at_its_timeout(tmp_path: Path) -> None:
    # The path a hanging method takes, without paying for a real worker's imports.
    cmd = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
           "'import time; time.sleep(60)']); time.sleep(60)"]  # fmt: skip
    rc, wall = launch(cmd, dict(os.environ), 1.0, tmp_path / "log")
    assert rc is None and wall < 10


def test_report_renders_tables_and_plots(results: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    docs = list(results.values())
    table = format_table(docs[0])
    assert len(table) == 2 + len(docs[0]["runs"]) and "`ours`" in "\n".join(table)
    text = render(docs, tmp_path / "img", tmp_path / "benchmarks.md")
    for workload in RUNS:
        assert f"### `{workload}`" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # tables only: plots are optional where matplotlib is missing
    names = sorted(p.name for p in (tmp_path / "img").iterdir())  # <workload>-cpu-<timestamp>.png
    assert len(names) == len(RUNS)
    assert all(any(n.startswith(f"{w}-cpu-") for n in names) for w in RUNS), names


def test_llama_prefill_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one tiny workload not run through a worker above: its own inputs and step, in-process.
    import torch
    from benchmarks.workloads import build_empty, get_workload, load_weights, make_inputs, run_step

    monkeypatch.setenv("FLEXTENSOR_BENCH_CACHE", "off")
    w = get_workload("llama_tiny")
    model = build_empty(w)
    assert load_weights(w, model, "cpu")["built"]
    with torch.no_grad():
        out = run_step(model, w, make_inputs(w, "cpu"))
        again = run_step(model, w, make_inputs(w, "cpu"))
    assert out.shape == (1, 1, w.model_kwargs["vocab_size"]) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all() and torch.equal(out, again)


def test_method_specs_and_sizes_parse() -> None:
    ms = parse_method("ours_budget:5.7GiB/timeout=90/max_steps=3")
    assert (ms.name, ms.arg, ms.label, ms.family) == ("ours_budget", "5.7GiB", "ours_budget:5.7GiB", "ours")
    assert ms.option("timeout", 1.0) == 90.0 and ms.option("min_steps", 3) == 3
    assert parse_method("native_ref").family == "native"
    assert parse_method("flextensor050_frac:0.05").family == "flextensor050"
    assert parse_bytes("5.7GiB") == int(5.7 * 2**30) and parse_bytes("24 GB") == 24 * 10**9
    compiled = parse_method("ours_budget:5.7GB/compile=regional/timeout=90")
    assert compiled.label == "ours_budget:5.7GB/compile=regional" and compiled.family == "ours"
    coded = parse_method("ours_budget:8GiB/compression=lossless/timeout=90")
    assert (
        coded.label == "ours_budget:8GiB/compression=lossless" and coded.options["compression"] == "lossless"
    )
    for bad in ("nope", "ours_budget", "ours/steps=3", "ours/compile=fast"):
        with pytest.raises(ValueError):
            parse_method(bad)


def test_a_later_invocation_compares_with_native_from_an_earlier_file(
    results: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``--reference FILE``: an invocation that runs no native takes native's time and output digest from
    an earlier result file (a long workload's peers in a device call of their own); an output that
    differs is reported as such."""
    earlier = results["llama_tiny_decode_static"]
    reference = tmp_path / "earlier.json"
    reference.write_text(json.dumps(earlier))
    altered = json.loads(json.dumps(earlier))
    next(r for r in altered["runs"] if r["method_spec"] == "native")["output_sha256"] = "0" * 64
    other = tmp_path / "altered.json"
    other.write_text(json.dumps(altered))
    found = {}
    for name, path in (("same", reference), ("altered", other)):
        cmd = [sys.executable, "-m", "benchmarks.run", "--workload", "llama_tiny_decode_static"]
        cmd += ["--methods", "ours", "--reference", str(path), "--device", "cpu"]
        cmd += ["--out", str(tmp_path / name), "--threads", "1", "--min-steps", "2", "--max-steps", "2"]
        env = dict(os.environ, FLEXTENSOR_BENCH_CACHE=str(tmp_path / "cache"))
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT_FILE="))
        doc = json.loads(Path(line.split("=", 1)[1]).read_text())
        assert doc["reference"] == f"native ({path.name})"
        (found[name],) = doc["runs"]
    native = next(r for r in earlier["runs"] if r["method_spec"] == "native")
    assert found["same"]["output_match"] == "bitwise"
    assert found["same"]["output_sha256"] == native["output_sha256"]
    assert found["same"]["ratio_to_native"] == round(found["same"]["step_s"] / native["step_s"], 4)
    assert found["altered"]["output_match"] == "differs"


def test_a_reference_is_taken_only_from_this_machines_gpu_model() -> None:
    """Kernels differ between GPU models (an H100's Wan2.2 frames are not an H200's): of several
    ``--reference`` files the one from this machine's model is used, and none from it is refused before
    any method runs, rather than every output reported as differing."""
    h200 = {"method": "native (a.json)", "gpu": "NVIDIA H200"}
    h100 = {"method": "native (b.json)", "gpu": "NVIDIA H100 80GB HBM3"}
    assert reference_for_this_machine([h200, h100], {"gpu": "NVIDIA H100 80GB HBM3"}) is h100
    assert reference_for_this_machine([h200, h100], {"gpu": "NVIDIA H200"}) is h200
    assert reference_for_this_machine([], {"gpu": "NVIDIA H200"}) is None
    cpu = {"method": "native (c.json)", "gpu": None}
    assert reference_for_this_machine([cpu], None) is cpu
    with pytest.raises(SystemExit, match="no native run on this machine's NVIDIA H100 80GB HBM3"):
        reference_for_this_machine([h200], {"gpu": "NVIDIA H100 80GB HBM3"})
    with pytest.raises(SystemExit, match="GPU model is unknown"):
        reference_for_this_machine([h200], {"error": "link probe failed (status 1)"})


def test_whole_pipeline_workload_runs_every_method_and_times_each_phase(tmp_path: Path) -> None:
    """``wan22_pipeline``'s tiny twin through the same worker path: one generation a step, per-phase times
    and calls recorded, every method's frames bitwise native's."""
    methods = ",".join(
        [
            "native",
            "ours_budget:600KiB",
            "ours_budget:600KiB/map=off",
            "diffusers_group",
            "diffusers_model_offload",
            "diffusers_sequential_offload",
            "accelerate",
        ]
    )
    cmd = [sys.executable, "-m", "benchmarks.run", "--workload", "wan22_pipeline_tiny", "--methods", methods]
    cmd += ["--device", "cpu", "--out", str(tmp_path), "--threads", "1"]
    cmd += ["--min-steps", "2", "--max-steps", "2"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT_FILE="))
    runs = {r["method_spec"]: r for r in json.loads(Path(line.split("=", 1)[1]).read_text())["runs"]}
    assert runs["accelerate"]["status"] == "skipped"  # benchmarked on single models only
    del runs["accelerate"]
    for spec, r in runs.items():
        assert r["status"] == "ok", f"{spec}: {r.get('reason')}"
        assert r["output_match"] in ("reference", "bitwise"), f"{spec}: {r.get('max_abs_diff')}"
        last = r["phase_steps"][-1]
        # Guidance doubles each expert's forwards; the sampling shift puts two of the four steps on each.
        assert last["phase_calls"] == {"encode": 2, "transformer": 4, "transformer_2": 4, "decode": 1}
        assert set(last["phase_s"]) == {"encode", "transformer", "transformer_2", "decode"}
        between = last["between_s"]  # by transition, from the generation's start to its return
        assert {"start->encode", "encode->transformer", "transformer->transformer_2", "decode->end"} <= set(
            between
        ), between
        assert all(s >= 0 for s in between.values()), between
    ours = runs["ours_budget:600KiB"]
    assert ours["phase"] == "inference" and ours["bytes_streamed_per_step"] > 0
    assert ours["method_details"]["pipeline_switches"]["vacated"] > 0  # how its components switched
    assert runs["ours_budget:600KiB/map=off"]["config"]["map_embeddings"] is False
    # Sequential offload moves each component at each of its calls; model offload each once a generation.
    sequential = runs["diffusers_sequential_offload"]["bytes_streamed_per_step"]
    whole = runs["diffusers_model_offload"]["bytes_streamed_per_step"]
    assert whole < sequential < 4 * 2 * whole  # the experts run 4 times each, the rest fewer


def test_load_benchmark_records_both_methods(tmp_path: Path) -> None:
    """benchmarks/load.py, the load-time comparison the lead runs on the GPU, on a tiny workload."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
        "FLEXTENSOR_BENCH_CACHE": str(tmp_path / "cache"),
    }
    result = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "benchmarks.load", "--workload", "wan_tiny", "--device", "cpu"]
    run = subprocess.run(
        [*cmd, "--result", str(result)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(result.read_text())
    assert record["ours"]["offload_s"] > 0 and record["ours"]["forwards"][-1]["phase_after"] == "inference"
    assert record["native"]["load_s"] > 0 and len(record["native"]["forwards"]) == 2
    assert "GB/s" in run.stdout


def test_the_phase_timer_keeps_the_peak_across_its_per_phase_resets(monkeypatch) -> None:
    """Each phase resets the allocator's peak (to measure its own): the peak reached before a phase, in a
    switch or between components, is kept by the timer and reported by take_highest()."""
    from types import SimpleNamespace

    import torch
    from benchmarks import pipeline_workload
    from torch import nn

    device = {"peak": 0}
    monkeypatch.setattr(pipeline_workload, "_peak", lambda: device["peak"])
    monkeypatch.setattr(pipeline_workload, "_reset_peak", lambda: device.update(peak=0))

    class Allocates(nn.Module):
        def __init__(self, nbytes: int) -> None:
            super().__init__()
            self.nbytes = nbytes

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            device["peak"] = max(device["peak"], self.nbytes)
            return x

    vae = SimpleNamespace(decode=lambda x: x)
    parts = {"text_encoder": Allocates(3), "transformer": Allocates(4), "transformer_2": Allocates(2)}
    pipe = SimpleNamespace(**parts, vae=vae)
    timer = pipeline_workload.PhaseTimer(pipe)
    x = torch.zeros(1)
    timer.begin_step()
    device["peak"] = 9  # before the first phase (a layout)
    pipe.text_encoder(x)
    device["peak"] = 6  # between phases (a switch)
    pipe.transformer(x)
    pipe.transformer_2(x)
    pipe.vae.decode(x)
    timer.end_step()
    peaks = timer.last_step["phase_peak_allocated_bytes"]
    assert peaks == {"encode": 3, "transformer": 4, "transformer_2": 2, "decode": 0}
    assert timer.take_highest() == 9 and timer.take_highest() == 0 and timer.highest_ever == 9
