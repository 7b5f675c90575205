"""Which streamed units the planner copies through the staging ring when the host budget cannot pin them all.

Pure: no torch. See [Note: host budget] in store/host_budget.py for what staging is; this module decides who.

[Note: which units are staged]
A staged copy is slower than a pinned one (a host memcpy into the ring, then the copy; see
``HostPlan.staged_link``), so the planner stages the units where slowness costs least, like it keeps
resident the units where streaming costs most:

1. units copied least often: a streamed unit whose arena range nothing else overwrites is copied once,
   ever, so its speed does not matter after the first step (resident units, copied once too, are never
   pinned at all: they are not in this choice);
2. then the units with the most compute slack: the compute between the unit whose post-hook issues the
   copy and the unit's own start, less the staged copy's time. A unit with slack left hides even the
   slower copy; one without it exposes the difference.

Units are staged in that order until the rest fit the pinned capacity. The choice only ranks; the
simulator then times the configuration with each unit's real copy speed, so the search sees what the
slower copies cost and may keep a unit resident instead (which frees pinned bytes too).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import PlainSerializer

from flextensor.common.json_codec import Bytes, record
from flextensor.common.sizes import align_up
from flextensor.plan.measurements import LinkModel

__all__ = ["HostPlan", "choose_staged"]


@record
@dataclass(frozen=True)
class HostPlan:
    """What the host budget leaves the planner: ``capacity_bytes`` of packs may be pinned (the budget
    less the staging ring and the disk read-ahead buffers); the others copy at ``staged_link``'s speed.
    ``disk_units`` have no host pack (see [Note: disk tier] in host/disk.py): always staged, they copy at
    ``disk_link``'s speed."""

    capacity_bytes: Bytes
    staged_link: LinkModel
    # written sorted: a set's order changes from run to run, and a saved profile's bytes must not
    disk_units: Annotated[frozenset[str], PlainSerializer(sorted, return_type=list[str])] = frozenset()
    disk_link: LinkModel | None = None


def pack_bytes(nbytes: int) -> int:
    """Host bytes a pack of ``nbytes`` holds: whole pages (see host/packs.py)."""
    return align_up(max(nbytes, 1), mmap.PAGESIZE)


def choose_staged(
    order: Sequence[int],
    nbytes: Sequence[int],
    starts: Sequence[float],
    compute: Sequence[float],
    period: float,
    ready_after: Sequence[int | None],
    staged_copy_s: Sequence[float],
    capacity_bytes: int,
    on_disk: frozenset[int] = frozenset(),
) -> frozenset[int]:
    """The units (indices) to stage among the streamed ``order`` (see [Note: which units are staged]).

    Per unit index: ``nbytes`` (what its pack holds: compressed, for a compressed unit), ``starts`` (its
    start in the all-resident timeline) and ``compute`` (its compute time); ``period`` is that
    timeline's length. Per streamed position: ``ready_after`` (the
    position whose post-hook issues its copy, None when it is copied once) and ``staged_copy_s``.
    Units ``on_disk`` hold no pack: they are staged, always, and need no pinned bytes.
    """
    held = {i: pack_bytes(nbytes[i]) for i in order if i not in on_disk}
    pinned = sum(held.values())
    forced = frozenset(i for i in order if i in on_disk)
    if pinned <= capacity_bytes:
        return forced
    ranked = []
    for k, i in enumerate(order):
        if i in on_disk:
            continue
        issuer = ready_after[k]
        if issuer is None:
            ranked.append((0, 0.0, k, i))  # copied once, ever
            continue
        j = order[issuer]
        window = (starts[i] - (starts[j] + compute[j])) % period if period > 0 else 0.0
        ranked.append((1, -(window - staged_copy_s[k]), k, i))
    staged = set(forced)
    for _, _, _, i in sorted(ranked):
        if pinned <= capacity_bytes:
            break
        staged.add(i)
        pinned -= held[i]
    return frozenset(staged)
