"""What this machine lets a process page-lock: the memlock limit, the cgroup's memory limit, WSL.

Read once when ``offload()`` resolves its target (see :func:`detect_host_limits`); the host budget
(store/host_budget.py) turns them into the bytes it may pin. Every reader takes the filesystem root it reads
from, so tests give it a fake ``/proc`` and ``/sys``.

[Note: which limits bound pinning]
* The cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, the tightest of the
  process's cgroup and its ancestors): page-locked memory is charged to the cgroup and can never be
  reclaimed, while the page cache a checkpoint read fills is charged too. Pinning all of the limit would
  leave the kernel nothing to reclaim but the page cache and the OOM killer the rest, so at most
  ``CGROUP_PINNED_SHARE`` of it is pinned.
* WSL2: CUDA under WSL2 refuses page-locking beyond a cap that no file reports (users report 0.5 to
  1 GiB, containers under WSL2 about 500 MB). ``WSL_PINNED_CAP`` stays under the lowest report; a
  ``cudaHostRegister`` that still fails leaves that unit pageable, with a warning.
* ``RLIMIT_MEMLOCK`` (``ulimit -l``) is detected and reported, but bounds nothing by default: the NVIDIA
  driver does not charge ``cudaHostRegister`` to it (containers pin gigabytes under Docker's 8 MiB
  default), so capping at it would make every copy slower for no reason. Set ``host_memory_budget`` to
  bound pinning explicitly.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flextensor.common.sizes import format_bytes

__all__ = [
    "CGROUP_PINNED_SHARE",
    "WSL_PINNED_CAP",
    "HostLimits",
    "cgroup_memory_limit",
    "detect_host_limits",
    "in_wsl",
    "memlock_limit",
]

CGROUP_PINNED_SHARE = 0.75
"""Share of the cgroup's memory limit that may be page-locked (see [Note: which limits bound pinning]):
the rest stays for the process's own pageable memory (Python, torch, pageable packs) and the page cache,
which the cgroup also charges."""

WSL_PINNED_CAP = 448 * 2**20
"""Page-locked bytes allowed under WSL2 (see [Note: which limits bound pinning]): below the ~500 MB at
which pinning fails in containers under WSL2, the lowest cap users report."""

_CGROUP_UNLIMITED = 1 << 60
"""cgroup v1 reports "no limit" as a huge page-rounded number (9223372036854771712); anything above this
is no limit."""


def memlock_limit(getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit) -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, None when unlimited."""
    soft, _ = getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _limit_value(text: str | None) -> int | None:
    """A cgroup limit file's value in bytes; None for no limit, an unreadable file or junk."""
    if text is None or text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _CGROUP_UNLIMITED else value


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """The process's (v2 path, v1 memory path) from ``/proc/self/cgroup``."""
    v2 = v1 = None
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _tightest(base: Path, path: str, filename: str) -> int | None:
    """The smallest limit in ``filename`` from ``base/path`` up to ``base``. A container with its own
    cgroup namespace sees a path its mount does not have: then only ``base`` itself is read."""
    limits = []
    directory = base / path.strip("/")
    if not directory.is_dir():
        directory = base
    while True:
        value = _limit_value(_read(directory / filename))
        if value is not None:
            limits.append(value)
        if directory == base or base not in directory.parents:
            break
        directory = directory.parent
    return min(limits, default=None)


def cgroup_memory_limit(root: Path = Path("/")) -> int | None:
    """The memory limit of this process's cgroup (v2, else v1) in bytes, None when there is none."""
    v2, v1 = _cgroup_paths(root)
    if v2 is not None:
        limit = _tightest(root / "sys/fs/cgroup", v2, "memory.max")
        if limit is not None:
            return limit
    if v1 is not None:
        return _tightest(root / "sys/fs/cgroup/memory", v1, "memory.limit_in_bytes")
    return None


def in_wsl(root: Path = Path("/")) -> bool:
    """Whether this is Linux under WSL: its kernel release names Microsoft (``...-microsoft-standard-WSL2``
    and the like)."""
    release = (_read(root / "proc/sys/kernel/osrelease") or "").lower()
    return "microsoft" in release or "wsl" in release


@dataclass(frozen=True)
class HostLimits:
    """The limits found on this machine (see [Note: which limits bound pinning]).

    ``memlock_bytes``: the soft RLIMIT_MEMLOCK (None: unlimited), reported only. ``cgroup_bytes``: the
    cgroup's memory limit (None: none). ``wsl``: running under WSL.
    """

    memlock_bytes: int | None = None
    cgroup_bytes: int | None = None
    wsl: bool = False

    def pinned_cap(self) -> int | None:
        """The most bytes to page-lock on this machine, None when nothing bounds it."""
        caps = []
        if self.cgroup_bytes is not None:
            caps.append(int(CGROUP_PINNED_SHARE * self.cgroup_bytes))
        if self.wsl:
            caps.append(WSL_PINNED_CAP)
        return min(caps, default=None)

    def describe(self) -> str:
        """One line for logs and ``flextensor probe``."""
        memlock = "unlimited" if self.memlock_bytes is None else format_bytes(self.memlock_bytes)
        cgroup = "none" if self.cgroup_bytes is None else format_bytes(self.cgroup_bytes)
        cap = self.pinned_cap()
        pinned = "no cap" if cap is None else f"cap {format_bytes(cap)}"
        return f"memlock {memlock} (not enforced by CUDA), cgroup limit {cgroup}, WSL {self.wsl}: {pinned}"


def detect_host_limits(root: Path = Path("/")) -> HostLimits:
    """Read every limit once (cheap: a few small files)."""
    return HostLimits(memlock_bytes=memlock_limit(), cgroup_bytes=cgroup_memory_limit(root), wsl=in_wsl(root))
