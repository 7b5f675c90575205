"""offload() inside torch.distributed runs: gloo, device="cpu", two and four processes.

Each test starts ``world_size`` processes of this file (``_rank`` below is what each runs), which join one
gloo process group through a rendezvous file, print one JSON line of results and exit. They check:
per-rank plans and profiles (each records its rank and world size), and the shared host store: one
creator, every other rank attached (with real or meta weights), host RAM for the weights under 1.1 x one
copy across all ranks, and no segment left once they exit.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
from flextensor.errors import ProfileError

RANK_TIMEOUT_S = 120


def make_model(width: int, depth: int, meta: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def run_ranks(world_size: int, scenario: str, tmp_path: Path, shm: Path | None = None) -> list[dict]:
    """Start the ranks, wait for all of them, and return each one's JSON result (rank order)."""
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(rank), str(world_size), str(tmp_path), str(shm or "")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world_size)
    ]
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=RANK_TIMEOUT_S)
            assert proc.returncode == 0, f"rank {rank} failed:\n{err[-4000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"ft-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        for leftover in path.iterdir():
            leftover.unlink()
        path.rmdir()


def test_two_ranks_each_plan_and_profile_on_their_own(tmp_path: Path) -> None:
    results = run_ranks(2, "per_rank", tmp_path)
    for rank, result in enumerate(results):
        assert result["equal"] and result["phase"] == "inference"
        assert (result["rank"], result["world_size"]) == (rank, 2)
        # Each rank ran its own batch size, so each profile holds its own input shapes and plan.
        assert result["input_shapes"] == [f"0:({rank + 1}, 16)"]
        assert f"rank {1 - rank} in the profile, {rank} now" in result["other_rank_warning"]

    # A profile of a two-process run does not serve a single-process one.
    model = make_model(16, 4)
    expected = model(torch.ones(1, 16))
    config = flextensor.OffloadConfig(device="cpu", profile=tmp_path / "profile-0.json")
    with pytest.raises(ProfileError, match=r"world_size 2 but this run has world_size 1"):
        flextensor.offload(model, config)
    assert torch.equal(model(torch.ones(1, 16)), expected)


@pytest.mark.parametrize(("world_size", "meta_ranks"), [(2, 0), (4, 3)], ids=["2-replicas", "4-meta"])
def test_ranks_share_one_host_copy(world_size: int, meta_ranks: int, tmp_path: Path, shm: Path) -> None:
    """Two ranks that both loaded the checkpoint; four where ranks 1-3 built the model on meta."""
    results = run_ranks(world_size, f"share:{meta_ranks}", tmp_path, shm)
    assert all(r["equal"] for r in results)
    assert sum(r["created"] for r in results) == 1
    assert len({r["path"] for r in results}) == 1
    assert all(r["mode"] == 0o600 for r in results)
    # Host RAM for the weights across ranks: each rank's anonymous growth, minus its device arena (which
    # a GPU would hold), plus the one segment.
    model_bytes = results[0]["model_bytes"]
    private = sum(r["anon_growth"] - r["device_bytes"] for r in results)
    total = private + results[0]["segment_bytes"]
    assert total < 1.1 * model_bytes, (total / model_bytes, results)
    assert os.listdir(shm) == []  # the last rank to exit removed segment and lock


def _anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Anonymous line in /proc/self/smaps_rollup")


def _rank(scenario: str, rank: int, world_size: int, tmp: Path, shm: str) -> dict:
    """One rank's work; returns what the test checks."""
    import warnings

    import torch.distributed as dist

    from flextensor.host.shared import store as shared_store
    from flextensor.profiles.file import load_profile_file

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    if scenario == "per_rank":
        width = 16
        x = torch.randn(rank + 1, width)
        model = flextensor.offload(make_model(width, 4), flextensor.OffloadConfig(device="cpu"))
        for _ in range(4):
            y = model(x)
        profile_path = tmp / f"profile-{rank}.json"
        flextensor.save_profile(model, profile_path)
        dist.barrier()  # every profile written
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            other = tmp / f"profile-{1 - rank}.json"
            flextensor.offload(make_model(width, 4), flextensor.OffloadConfig(device="cpu", profile=other))
        saved = load_profile_file(profile_path).fingerprint
        result = {
            "equal": torch.equal(y, make_model(width, 4)(x)),
            "phase": flextensor.phase(model),
            "rank": saved.rank,
            "world_size": saved.world_size,
            "input_shapes": list(saved.input_shapes),
            "other_rank_warning": " ".join(str(w.message) for w in caught),
        }
    else:
        shared_store.SHM_DIR = shm
        said: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("flextensor").addHandler(handler)
        logging.getLogger("flextensor").setLevel(logging.INFO)
        meta_ranks = int(scenario.split(":")[1])
        width, depth = 1024, 64  # 64 x 4 MiB of fp32 weights
        meta = rank >= world_size - meta_ranks
        x = torch.randn(2, width)
        dist.barrier()
        before = _anonymous_bytes()
        model = make_model(width, depth, meta=meta)
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu", share_host_memory=True))
        dist.barrier()  # every rank attached: measure all at once
        anon_growth = _anonymous_bytes() - before
        device_bytes = flextensor.status(model).device_bytes_held
        (news,) = [m for m in said if "shared host" in m]
        path = news.split()[-1]
        for _ in range(4):
            y = model(x)
        result = {
            "equal": torch.equal(y, make_model(width, depth)(x)),
            "created": news.startswith("packed"),
            "path": path,
            "mode": os.stat(path).st_mode & 0o777,
            "segment_bytes": os.stat(path).st_blocks * 512,
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "anon_growth": anon_growth,
            "device_bytes": device_bytes,
        }
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    scenario, rank, world_size, tmp, shm = sys.argv[1:6]
    print(json.dumps(_rank(scenario, int(rank), int(world_size), Path(tmp), shm)), flush=True)
