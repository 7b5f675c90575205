"""``offload(model, config, weights=PATH)``: a safetensors checkpoint read straight into packs and the device.

[Note: reading a checkpoint into packs]
The usual way to load (``load_file`` then ``load_state_dict``) holds the model in host RAM once as loaded
tensors and once more as packs, and a memory-mapped load adds the checkpoint's page cache, mapped into the
process, on top. Here the model's tensors are matched to the checkpoint's first, from headers alone (every
mismatch is reported before anything is allocated); then each offload unit's pack is allocated and its
tensors' bytes are read with plain ``preadv`` calls straight into it, and every parameter or buffer that
stays on the device is read into a host tensor of its own size and moved there. Reads run in a small
thread pool, a unit (allocate, page-lock, read) per task, so page-locking one unit overlaps reading others.
Each range read is dropped from the page cache at once (``POSIX_FADV_DONTNEED``): with a cold cache the
file's pages would otherwise stay in RAM next to the packs, which cgroup limits count.

[Note: reading while the model runs]
``offload(weights=...)`` waits only for what stays on the device; the units' packs are allocated, the
model's parameters pointed at them, and their reads (page-lock, then read) go on in the background, the
largest unit first (the link probe copies from it) and then in module order, which is close to the order
the first forward needs them. Every access to a pack's bytes waits for that pack's read (see [Note: packs
filled in the background] in host/packs.py), so the first forward computes while later units are still
read: the model is ready after about max(read time, first forward) rather than their sum. A read that
fails raises a CheckpointError at every access to that unit's weights (the forward that needs it,
``state_dict()``, ``release()``), never lets the unit compute with bytes not read.

[Note: what a meta model must provide]
Every parameter and persistent buffer comes from the checkpoint (tied aliases need one of their names
there, as transformers saves them; both there with different values untie them, see host/checkpoint_ties.py).
Non-persistent buffers (rotary tables) are not in checkpoints: a real one is kept; one on the meta device
is computed again by building the model's class once more from its ``config`` (transformers and diffusers
models have one) with parameters on the meta device and buffers real, which is what ``from_pretrained``
computes them with. A meta buffer nothing can fill is an error that says to build the model with
buffers real (``accelerate.init_empty_weights(include_buffers=False)``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flextensor.errors import CheckpointError, PinningError
from flextensor.host.checkpoint_files import Checkpoint, CheckpointTensor, open_checkpoint
from flextensor.host.checkpoint_ties import untied_names
from flextensor.host.packs import PackedParameter, UnitPack, pack_layout
from flextensor.plan.host_plan import pack_bytes

__all__ = ["CheckpointLoad", "plan_checkpoint_load"]

logger = logging.getLogger("flextensor")

READ_THREADS = 8
"""Concurrent reads: enough to keep an NVMe drive's queue busy and to page-lock packs while others are read;
more adds nothing on one drive."""

READ_CHUNK_BYTES = 64 * 2**20
"""Bytes per read call: large enough for sequential throughput, small enough that the page cache a read
fills is dropped soon after."""

DROP_PAGE_CACHE = True
"""Drop each range from the page cache once it is read (see [Note: reading a checkpoint into packs])."""

_SHOWN = 8  # names listed per kind of problem in an error


@dataclass(frozen=True)
class CheckpointLoad:
    """What ``offload(weights=...)`` reads, decided from headers alone.

    ``sources``: id of each model parameter and persistent buffer -> where its bytes are. ``computed``: id of
    each meta non-persistent buffer -> its value, computed again (see [Note: what a meta model must provide]).
    ``untied``: names of tied weights the checkpoint holds with values of their own, and where (packing gives
    each a parameter of its own and adds it to ``sources``; see host/checkpoint_ties.py). ``nbytes`` counts
    them.
    """

    path: Path
    sources: dict[int, CheckpointTensor]
    computed: dict[int, torch.Tensor]
    nbytes: int
    untied: tuple[tuple[str, CheckpointTensor], ...] = ()

    def source_of(self, tensor: torch.Tensor) -> CheckpointTensor:
        return self.sources[id(tensor)]


def plan_checkpoint_load(model: nn.Module, weights: str | os.PathLike[str]) -> CheckpointLoad:
    """Match ``model``'s tensors to the checkpoint at ``weights``; CheckpointError naming every missing,
    unexpected, mis-shaped or mis-typed tensor, and every meta buffer nothing can fill. Reads headers
    (and the bytes of a tied weight held under several names, see host/checkpoint_ties.py); changes
    nothing."""
    checkpoint = open_checkpoint(weights)
    state = model.state_dict(keep_vars=True)  # every persistent name, tied aliases included
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), (tensor, []))[1].append(name)
    missing: list[str] = []
    shapes: list[str] = []  # tensors of another shape (their dtypes named too when those differ as well)
    dtypes: list[tuple[str, torch.dtype]] = []  # tensors of the model's shape in another dtype
    sources: dict[int, CheckpointTensor] = {}
    held_twice: list[tuple[list[str], list[CheckpointTensor]]] = []  # tied names the checkpoint holds twice
    for key, (tensor, names) in groups.items():
        present = [checkpoint.tensors[n] for n in names if n in checkpoint.tensors]
        if not present:
            missing.append(" = ".join(names))
            continue
        if len(present) > 1:
            held_twice.append((names, present))
        for source in present:
            if tuple(tensor.shape) != source.shape:
                both = source.dtype != tensor.dtype
                shapes.append(
                    f"{source.name}: checkpoint {_described(source.dtype, source.shape, both)}, "
                    f"model {_described(tensor.dtype, tuple(tensor.shape), both)}"
                )
            elif tensor.dtype != source.dtype:
                dtypes.append(
                    (f"{source.name}: checkpoint {source.dtype}, model {tensor.dtype}", source.dtype)
                )
        sources[key] = present[0]
    unexpected = _not_ignored(model, [name for name in checkpoint.tensors if name not in state])
    if missing or unexpected or shapes or dtypes:
        raise CheckpointError(_mismatch_message(model, checkpoint, missing, unexpected, shapes, dtypes))
    computed = _computed_buffers(model, state)
    untied = untied_names(model, held_twice)
    nbytes = sum(s.nbytes for s in sources.values()) + sum(s.nbytes for _, s in untied)
    return CheckpointLoad(checkpoint.path, sources, computed, nbytes, untied)


def _not_ignored(model: nn.Module, unexpected: list[str]) -> list[str]:
    """``unexpected`` without the keys the model's class says to ignore (transformers' list of keys older
    checkpoints hold and the model no longer has, e.g. per-layer rotary tables), which are never read."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ignored = [name for name in unexpected if any(re.search(p, name) for p in patterns)]
    if ignored:
        logger.info(
            "not reading %d checkpoint tensor(s) the model ignores: %s", len(ignored), ignored[:_SHOWN]
        )
    skipped = set(ignored)
    return [name for name in unexpected if name not in skipped]


def _described(dtype: torch.dtype, shape: tuple[int, ...], with_dtype: bool) -> str:
    return f"{dtype} {list(shape)}" if with_dtype else str(list(shape))


def _mismatch_message(
    model: nn.Module,
    checkpoint: Checkpoint,
    missing: list[str],
    unexpected: list[str],
    shapes: list[str],
    dtypes: list[tuple[str, torch.dtype]],
) -> str:
    parts = []
    kinds = (
        ("missing", missing),
        ("unexpected", unexpected),
        ("mismatched in shape", shapes),
        ("mismatched in dtype", [what for what, _ in dtypes]),
    )
    for what, names in kinds:
        if names:
            more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
            parts.append(f"{len(names)} {what}: {'; '.join(names[:_SHOWN])}{more}")
    fix = "pass the checkpoint of this model"
    checkpoint_dtypes = {dtype for _, dtype in dtypes}
    if shapes:
        fix = (
            "the model was not built with the configuration the checkpoint was saved with: build it from "
            "the checkpoint's own config (e.g. AutoConfig.from_pretrained on the model's folder), or pass "
            "the checkpoint of this model"
        )
    elif dtypes and not missing and not unexpected and len(checkpoint_dtypes) == 1:
        dtype = checkpoint_dtypes.pop()
        # Not model.to(dtype) for transformers: it casts the float32 rotary tables from_pretrained keeps.
        fix = (
            "build the model in the checkpoint's dtype as its from_pretrained does (on the meta device "
            f"this is free): a transformers model with from_config(config, dtype={dtype}), a diffusers "
            f"one with model.to({dtype})"
        )
    return (
        f"the checkpoint {checkpoint.path} does not match {type(model).__name__}: {' | '.join(parts)}; "
        f"{fix}. Nothing was changed."
    )


def _computed_buffers(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Values for the model's meta non-persistent buffers (see [Note: what a meta model must provide])."""
    persistent = {id(t) for t in state.values()}
    wanted = {
        name: buf
        for name, buf in model.named_buffers(remove_duplicate=False)
        if buf.device.type == "meta" and id(buf) not in persistent
    }
    if not wanted:
        return {}
    twin = _buffer_twin(model)
    twin_buffers = dict(twin.named_buffers(remove_duplicate=False)) if twin is not None else {}
    computed: dict[int, torch.Tensor] = {}
    unfilled = []
    for name, buf in wanted.items():
        value = twin_buffers.get(name)
        if value is None or value.device.type == "meta" or value.shape != buf.shape:
            unfilled.append(name)
        else:
            computed[id(buf)] = value.to(buf.dtype)  # the model's dtype: it may have been .to(dtype) on meta
    if unfilled:
        raise CheckpointError(
            f"buffer(s) {', '.join(unfilled[:_SHOWN])} of {type(model).__name__} are on the meta device, "
            "are not saved in checkpoints, and flextensor cannot compute them (it rebuilds transformers and "
            "diffusers models from their config); build the model with its buffers real, e.g. under "
            "accelerate.init_empty_weights(include_buffers=False) instead of torch.device('meta')"
        )
    return computed


def _buffer_twin(model: nn.Module) -> nn.Module | None:
    """The model's class built again from its config with meta parameters and real buffers, or None."""
    config = getattr(model, "config", None)
    cls = type(model)
    if config is None:
        return None
    from_config = getattr(cls, "from_config", None)  # diffusers' ModelMixin
    try:
        with _parameters_on_meta():
            if callable(from_config):
                return from_config(config)
            if hasattr(cls, "config_class"):  # transformers' PreTrainedModel
                return cls(config)
    except Exception as error:  # the class may want more than its config; then nothing can fill the buffers
        logger.debug("could not rebuild %s to compute its buffers: %s", cls.__name__, error)
    return None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# -- reading -------------------------------------------------------------------------------------------


def unit_layout(
    load: CheckpointLoad, named: Sequence[tuple[str, torch.Tensor]]
) -> tuple[tuple[PackedParameter, ...], int]:
    """The pack layout of a unit read from the checkpoint: its tensors contiguous, as they are stored."""
    placeholders = []
    for name, param in named:
        source = load.source_of(param)
        placeholders.append((name, torch.empty(source.shape, dtype=source.dtype, device="meta")))
    return pack_layout(placeholders)


def read_checkpoint(
    load: CheckpointLoad,
    units: Sequence[tuple[str, Sequence[tuple[str, torch.Tensor]]]],
    resident: Sequence[torch.Tensor],
    pin: bool,
    device: torch.device,
    advance: Callable[[int], None],
    host_budget_bytes: int | None = None,
) -> tuple[list[UnitPack], dict[int, torch.Tensor]]:
    """Read every ``resident`` tensor onto ``device``, and start reading every unit into a new pack, but
    those a ``host_budget_bytes`` cannot hold, which stay on disk (see [Note: disk tier] in host/disk.py).
    With ``pin``, the readers page-lock the packs (``UnitPack.reader_pins``) when the budget holds them
    all, or when the units it cannot hold stay on disk (every pack then fits beside the ring and the
    read-ahead buffers); a budget too small for the ring pins nothing (HostBudget.start raises).

    Returns the packs (in ``units`` order), whose reads go on in the background (see [Note: reading while
    the model runs]), and id(resident tensor) -> its value on ``device``, all read. On a failure before it
    returns, every pack is freed (its read stopped or waited for) and the error raised; nothing in the
    model has changed.
    """
    from flextensor.host.disk import CheckpointFiles, DiskPack, choose_disk_units

    reads = _Reads(load)
    packs: list[UnitPack] = []
    try:
        layouts = [unit_layout(load, named) for _, named in units]
        disk = choose_disk_units([nbytes for _, nbytes in layouts], host_budget_bytes)
        held = sum(pack_bytes(nbytes) for _, nbytes in layouts)
        pin = pin and (host_budget_bytes is None or held <= host_budget_bytes or bool(disk))
        files = CheckpointFiles(sorted({s.file for s in load.sources.values()})) if disk else None
        for index, ((name, named), (entries, nbytes)) in enumerate(zip(units, layouts, strict=True)):
            if index in disk:
                assert files is not None
                sources = [load.source_of(param) for _, param in named]
                packs.append(DiskPack(name, entries, nbytes, sources, files))
            else:
                packs.append(UnitPack(name, entries, nbytes, pin=False))  # locked by its reader
                packs[-1].reader_pins = pin
        # What offload() waits for goes first: the tensors kept on the device, then the largest unit (the
        # link probe copies from it as soon as offload() has laid out); then the units in module order.
        # Queued behind the units, the resident reads made offload() wait for nearly the whole file.
        values = {id(t): reads.submit(_read_tensor, load, reads.fds, t, device) for t in resident}
        host = [i for i in range(len(units)) if i not in disk]
        order = sorted(host, key=lambda i: -packs[i].nbytes)[:1]
        order += [i for i in host if i not in order]
        for index in order:
            named = units[index][1]
            pack = packs[index]
            pack.read_in_background(reads.submit(_read_unit, load, reads.fds, pack, named, pin, device))
        for tensor in resident:
            values[id(tensor)] = values[id(tensor)].result()
            advance(load.source_of(tensor).nbytes)
    except BaseException:
        for pack in packs:
            pack.free()
        raise
    finally:
        reads.no_more()
    return packs, values  # type: ignore[return-value]


class _Reads:
    """The read threads and open files of one checkpoint; the files close once the last read ends."""

    def __init__(self, load: CheckpointLoad) -> None:
        self.fds: dict[Path, int] = {}
        try:
            for file in sorted({source.file for source in load.sources.values()}):
                self.fds[file] = os.open(file, os.O_RDONLY)
        except BaseException:
            self._close()
            raise
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="flextensor-read")
        self._lock = threading.Lock()
        self._running = 0
        self._submitting = True

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        with self._lock:
            self._running += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._ended)
        return future

    def _ended(self, _: Future) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0 and not self._submitting
        if last:
            self._close()

    def no_more(self) -> None:
        """Every read is submitted: the threads end, and the files close, when the reads have."""
        with self._lock:
            self._submitting = False
            last = self._running == 0
        self._pool.shutdown(wait=False)
        if last:
            self._close()

    def _close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)


def _read_unit(
    load: CheckpointLoad,
    fds: dict[Path, int],
    pack: UnitPack,
    named: Sequence[tuple[str, torch.Tensor]],
    pin: bool,
    device: torch.device,
) -> None:
    try:
        pack.fault_in()  # nothing has written it yet (see [Note: fault pages in before page-locking])
        if pin:
            if device.type == "cuda":
                # Page-locking registers the memory with the calling thread's current device; a pool
                # thread starts on device 0, whatever the target.
                torch.cuda.set_device(device)
            try:
                pack.pin(by_reader=True)
            except PinningError as refused:  # the system allows less than the budget (WSL2, cgroups)
                logger.warning("%s; unit %s is copied from pageable memory", refused, pack.unit)
        if pack.nbytes:
            dest = memoryview(pack.unread_buffer.numpy())
            for entry, (_, param) in zip(pack.entries, named, strict=True):
                source = load.source_of(param)
                _read_into(fds[source.file], source, dest[entry.offset : entry.offset + entry.nbytes])
    except Exception as error:
        raise CheckpointError(
            f"reading the weights of offload unit {pack.unit!r} from {load.path} failed ({error}); this "
            "model cannot run: build it again and offload it from a readable checkpoint"
        ) from error


def _read_tensor(
    load: CheckpointLoad, fds: dict[Path, int], tensor: torch.Tensor, device: torch.device
) -> torch.Tensor:
    source = load.source_of(tensor)
    host = torch.empty(source.shape, dtype=source.dtype, device="cpu")
    if source.nbytes:
        _read_into(fds[source.file], source, memoryview(host.reshape(-1).view(torch.uint8).numpy()))
    return host if device.type == "cpu" else host.to(device)


def _read_into(fd: int, source: CheckpointTensor, dest: memoryview) -> None:
    """Read ``source``'s bytes into ``dest`` with plain reads (no mapping); drop them from the page cache."""
    done = 0
    while done < source.nbytes:
        offset = source.start + done
        n = os.preadv(fd, [dest[done : done + READ_CHUNK_BYTES]], offset)
        if n <= 0:
            raise CheckpointError(
                f"{source.file} ended while reading {source.name!r} (byte {offset} of the file): it was "
                "truncated or replaced while loading; save it again"
            )
        if DROP_PAGE_CACHE and hasattr(os, "posix_fadvise"):  # Linux; macOS has no fadvise
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        done += n
