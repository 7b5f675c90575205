"""Units whose weights the device reads in place from page-locked host memory (``map_embeddings``).

[Note: mapped units]
A token embedding is read a few rows a call: a text encoder's (UMT5-XXL: 2.1 GB, 256384 x 4096 bf16)
is resident or streamed whole for the few hundred rows its prompt needs, which under a tight budget
costs its room on the device and, at each of a pipeline's switches, its upload (H100, 2026-12-06:
Wan2.2's encoder uploads 7.1 GB at each generation's start, 2.1 GB of them the embedding). A unit made
only of ``nn.Embedding`` modules is instead *mapped*: its pinned host pack stays where it is, and its
parameters view that memory through the device's address space (``cudaHostGetDevicePointer``), so the
gather kernel reads the rows it needs over the link. It holds no device bytes and uploads nothing; the
plans count it as neither resident nor streamed bytes (``Plan.mapped``, a subset of ``Plan.resident``:
laid out as a resident unit, with no hooks), and the room it leaves goes to other units. The learning
layouts hold it in place too (``OffloadEngine._lay_out_to_learn``): their arena is sized for the other
units, and its compute is timed as it will run, reading host memory.

Only where the pack stays pinned and whole on the host: no host budget (its ring may unpin packs), no
compressed or disk packs, no weights still being read from a checkpoint, no packs shared between
processes. And only embeddings: a weight also read by another kind of module (an LM head tied to the
embedding) would be read whole over the link at each call. On a CPU the pack is the device memory
already: the unit's parameters view the pack itself, the same path with nothing to map.

A pipeline's components map by default (``map_embeddings`` left unset; see pipelines/configs.py): then
only vocabulary-sized tables (``VOCABULARY_ROWS``), of which a call reads a small share, and quietly:
what is not mapped is logged, not warned about.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

import torch
from torch import nn

from flextensor.host.packs import UnitPack
from flextensor.store.units import Unit

__all__ = ["VOCABULARY_ROWS", "device_view", "mapping_by_default", "mark_mapped_units", "why_not_mapped"]

logger = logging.getLogger("flextensor")

VOCABULARY_ROWS = 16384
"""Rows of the smallest table a default mapping maps: a token vocabulary (UMT5's 256384, CLIP's 49408),
of which a prompt reads a few hundred rows. A smaller table (positions, classes) may be read whole at
each call, over the link; resident, it costs nothing per call."""

_BY_DEFAULT: ContextVar[bool] = ContextVar("flextensor_mapping_by_default", default=False)


@contextlib.contextmanager
def mapping_by_default() -> Iterator[None]:
    """Within: ``map_embeddings`` is on by default, not asked for (see the note)."""
    token = _BY_DEFAULT.set(True)
    try:
        yield
    finally:
        _BY_DEFAULT.reset(token)


def why_not_mapped(unit: Unit, model: nn.Module) -> str | None:
    """Why ``unit`` cannot be mapped on its own terms (None: it can): every module holding one of its
    weights, inside the unit or outside it (a tied alias), must be an ``nn.Embedding``."""
    mine = {id(param) for _, param, _ in unit.parameters}
    for path, module in model.named_modules():
        holds = any(id(p) in mine for p in module._parameters.values() if p is not None)
        if holds and not isinstance(module, nn.Embedding):
            return f"{path or 'the model'} ({type(module).__name__}) reads its weights"
    return None


def mark_mapped_units(
    units: Iterable[Unit],
    model: nn.Module,
    device: torch.device,
    shared: bool,
    host_budget: bool,
    compressed: bool,
) -> list[str]:
    """Give the units of ``model`` that can be mapped (``map_embeddings=True``) their device view and
    return their names; logs why those made only of embeddings are not, and warns when none is. At
    offload(), before any layout."""
    by_default = _BY_DEFAULT.get()
    level = logging.INFO if by_default else logging.WARNING  # not asked for: nothing to warn about
    candidates = []
    for unit in units:  # made only of embeddings; of them, those whose weights another module reads say why
        holders = [m for m in unit.module.modules() if any(p is not None for p in m._parameters.values())]
        if not holders or not all(isinstance(m, nn.Embedding) for m in holders):
            continue  # (a UMT5 layer's relative attention bias is an embedding in a layer)
        if by_default and any(m.num_embeddings < VOCABULARY_ROWS for m in holders):
            continue
        reason = why_not_mapped(unit, model)
        if reason is None:
            candidates.append(unit)
        else:
            logger.log(level, "unit %s is not mapped: %s", unit.name, reason)
    blocker = (
        "share_host_memory=True (packs in a shared segment)"
        if shared
        else "a host_memory_budget (packs may be unpinned or staged)"
        if host_budget
        else "compression (packs are held compressed)"
        if compressed
        else None
    )
    if not candidates or blocker is not None:
        why = blocker or "no offload unit is made only of nn.Embedding modules"
        if candidates or not by_default:  # a component without a vocabulary is no news
            logger.log(level, "map_embeddings=True maps nothing: %s", why)
        return []
    mapped = []
    for unit in candidates:
        pack = unit.pack
        if pack is None or pack.disk or pack.coded:
            logger.log(level, "unit %s is not mapped: its pack is not held whole in host memory", unit.name)
            continue
        pack.wait_read()  # offload(weights=...): the embedding's read (the largest unit, read first)
        if device.type == "cuda" and not pack.pinned:
            logger.log(level, "unit %s is not mapped: its pack is not page-locked (pinned_memory)", unit.name)
            continue
        try:
            unit.mapped = device_view(pack, device)
        except Exception as exc:  # a runtime without the mapping: the unit is offloaded as usual
            logger.warning("unit %s is not mapped, it is offloaded as usual: %s", unit.name, exc)
            continue
        mapped.append(unit.name)
    if mapped:
        logger.info("mapped unit(s), read in place from page-locked host memory: %s", ", ".join(mapped))
    return mapped


def device_view(pack: UnitPack, device: torch.device) -> torch.Tensor:
    """``pack``'s bytes (pinned, its own memory) as a uint8 tensor of ``device`` over the same memory: on
    a CPU its buffer itself; on CUDA the buffer's mapping into the device's address space, which keeps
    the memory page-locked for as long as a tensor over it lives. Raises RuntimeError when the runtime
    gives no mapping, or the device does not read the pack's bytes through it."""
    buffer = pack.buffer
    if device.type != "cuda":
        return buffer
    from flextensor.device.cudart import loaded_cudart_path

    path = loaded_cudart_path()
    if path is None:
        raise RuntimeError("the CUDA runtime PyTorch uses was not found among the process's libraries")
    cudart = ctypes.CDLL(path)
    pointer = ctypes.c_void_p()
    with torch.cuda.device(device):
        host = ctypes.c_void_p(buffer.data_ptr())
        error = cudart.cudaHostGetDevicePointer(ctypes.byref(pointer), host, 0)
        if error or not pointer.value:
            raise RuntimeError(f"cudaHostGetDevicePointer failed with error {error}: the pack is not mapped")
        array = _DeviceArray(pointer.value, buffer.numel(), buffer)
        view = torch.as_tensor(array, device=device)
    if view.device.type != "cuda" or view.data_ptr() != pointer.value:
        raise RuntimeError("torch copied the mapping to device memory instead of viewing it")
    # Once, at offload(): the device reads the first and last bytes as the host holds them.
    ends = [slice(0, 64), slice(max(0, buffer.numel() - 64), buffer.numel())]
    if any(not torch.equal(view[end].cpu(), buffer[end]) for end in ends):
        raise RuntimeError("the device does not read the pack's bytes through its mapping")
    # Tensors over the mapping hold ``array`` (torch keeps the interface's object for the tensor's
    # life): a state_dict() held past release() must not read memory the driver let go of.
    pack.hand_pinning_to(array)
    return view


class _DeviceArray:
    """A device pointer to ``nbytes`` bytes, as ``torch.as_tensor`` takes one (the CUDA array interface);
    holds ``owner``, the host memory behind it, for as long as the tensor made from it lives."""

    def __init__(self, pointer: int, nbytes: int, owner: torch.Tensor) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }
