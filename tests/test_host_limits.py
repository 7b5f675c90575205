"""Detection of what a process may page-lock: cgroup v1/v2 memory limits, RLIMIT_MEMLOCK, WSL, from fake
/proc and /sys trees; and how they become the host budget."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from flextensor.device.host_limits import (
    CGROUP_PINNED_SHARE,
    WSL_PINNED_CAP,
    HostLimits,
    cgroup_memory_limit,
    detect_host_limits,
    in_wsl,
    memlock_limit,
)
from flextensor.device.runtime import resolve_host_budget

GiB = 2**30


def write(root: Path, path: str, text: str) -> None:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_cgroup_v2_limit_of_the_process_cgroup(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/system.slice/job.scope\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/system.slice/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/system.slice/job.scope/memory.max", f"{8 * GiB}\n")
    assert cgroup_memory_limit(tmp_path) == 8 * GiB


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/a/b\n")
    write(tmp_path, "sys/fs/cgroup/a/memory.max", f"{2 * GiB}\n")
    write(tmp_path, "sys/fs/cgroup/a/b/memory.max", "max\n")
    assert cgroup_memory_limit(tmp_path) == 2 * GiB


def test_cgroup_v2_without_a_limit_is_none(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    assert cgroup_memory_limit(tmp_path) is None


def test_cgroup_v2_in_a_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    # A container with its own cgroup namespace may see a path its /sys/fs/cgroup does not have.
    write(tmp_path, "proc/self/cgroup", "0::/../../kubepods/pod1\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", f"{3 * GiB}\n")
    assert cgroup_memory_limit(tmp_path) == 3 * GiB


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "12:cpu,cpuacct:/docker/abc\n7:memory:/docker/abc\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{4 * GiB}\n")
    assert cgroup_memory_limit(tmp_path) == 4 * GiB


def test_cgroup_v1_unlimited_is_none(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "7:memory:/\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_memory_limit(tmp_path) is None


def test_cgroup_v1_path_missing_in_container_reads_the_mount_root(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "7:memory:/docker/abc\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{GiB}\n")
    assert cgroup_memory_limit(tmp_path) == GiB


def test_no_cgroup_files_is_none(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path) is None


def test_memlock_from_getrlimit() -> None:
    assert memlock_limit(lambda _: (8 * 2**20, 8 * 2**20)) == 8 * 2**20
    assert memlock_limit(lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)) is None
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert memlock_limit() == (None if soft == resource.RLIM_INFINITY else soft)


@pytest.mark.parametrize(
    ("release", "wsl"),
    [
        ("5.15.167.4-microsoft-standard-WSL2", True),
        ("4.4.0-19041-Microsoft", True),
        ("6.8.0-49-generic", False),
    ],
)
def test_wsl_detection(tmp_path: Path, release: str, wsl: bool) -> None:
    write(tmp_path, "proc/sys/kernel/osrelease", release + "\n")
    assert in_wsl(tmp_path) is wsl


def test_wsl_detection_without_the_file(tmp_path: Path) -> None:
    assert in_wsl(tmp_path) is False


def test_detect_reads_every_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", f"{16 * GiB}\n")
    write(tmp_path, "proc/sys/kernel/osrelease", "5.15.167.4-microsoft-standard-WSL2\n")
    limits = detect_host_limits(tmp_path)
    assert limits.cgroup_bytes == 16 * GiB and limits.wsl
    assert limits.memlock_bytes == memlock_limit()


def test_pinned_cap_is_the_tightest_limit_and_ignores_memlock() -> None:
    assert HostLimits().pinned_cap() is None
    assert HostLimits(memlock_bytes=65536).pinned_cap() is None  # not enforced on cudaHostRegister
    assert HostLimits(cgroup_bytes=8 * GiB).pinned_cap() == int(CGROUP_PINNED_SHARE * 8 * GiB)
    assert HostLimits(wsl=True).pinned_cap() == WSL_PINNED_CAP
    assert HostLimits(cgroup_bytes=GiB // 4, wsl=True).pinned_cap() == int(CGROUP_PINNED_SHARE * GiB // 4)
    assert "WSL True" in HostLimits(wsl=True).describe()


def test_host_budget_is_the_tighter_of_explicit_and_detected() -> None:
    assert resolve_host_budget(None, None) is None
    assert resolve_host_budget(GiB, None) == GiB
    assert resolve_host_budget(None, HostLimits(wsl=True)) == WSL_PINNED_CAP
    assert resolve_host_budget(GiB, HostLimits(wsl=True)) == WSL_PINNED_CAP
    assert resolve_host_budget(2**20, HostLimits(wsl=True)) == 2**20


def test_probe_result_shows_staged_copies_and_host_limits() -> None:
    import io
    import json

    from rich.console import Console

    from flextensor.observe.probe import CopyMeasurement, PinMeasurement, ProbeResult

    mib = 2**20
    result = ProbeResult(
        "cuda:0",
        "Test GPU",
        (CopyMeasurement("host_to_device", True, 16 * mib, 16 * mib / 20e9),),
        (PinMeasurement("torch pin_memory()", 16 * mib, 0.1),),
        staged=(CopyMeasurement("host_to_device", False, 16 * mib, 16 * mib / 8e9),),
        host_limits=HostLimits(wsl=True).describe(),
    )
    data = json.loads(json.dumps(result.to_dict()))
    assert data["staged"][0]["gbps"] == pytest.approx(8.0) and "WSL True" in data["host_limits"]
    out = io.StringIO()
    Console(file=out, width=160).print(result)
    text = out.getvalue()
    assert "H2D staged" in text and "8.0" in text and "host limits: memlock" in text
