"""Safetensors checkpoints on disk: which files a path means, and where each tensor's bytes are in them.

A path given to ``offload(..., weights=PATH)`` is one of:

- a ``.safetensors`` file;
- a ``*.safetensors.index.json`` file (a sharded checkpoint: its ``weight_map`` names the shards);
- a folder holding one of those in the layouts transformers and diffusers write: ``model.safetensors``
  or ``model.safetensors.index.json`` (transformers), ``diffusion_pytorch_model.safetensors`` or
  ``diffusion_pytorch_model.safetensors.index.json`` (diffusers), or any single ``*.safetensors`` file.
  When both of a library's names are there, the one its ``from_pretrained`` reads is read, with a
  warning: the file for transformers, the index for diffusers.

The safetensors format: 8 bytes of little-endian header length, a JSON header mapping each tensor name to
its ``dtype``, ``shape`` and ``data_offsets`` (begin, end, relative to the end of the header), then the
data. The ``safetensors`` library reads tensors but does not say where their bytes are, and flextensor
reads the bytes itself (straight into its packs), so the header is parsed here, and checked as strictly as
the library does: a corrupt header is a :class:`~flextensor.errors.CheckpointError` naming the file.
Nothing here reads tensor data or allocates more than the headers.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from flextensor.errors import CheckpointError

__all__ = ["Checkpoint", "CheckpointTensor", "open_checkpoint"]

logger = logging.getLogger("flextensor")

MAX_HEADER_BYTES = 100 * 2**20
"""The largest JSON header accepted (the safetensors library's own limit): a bigger length field means a
corrupt or foreign file, and reading it would allocate that much."""

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# The names the libraries give a checkpoint in a model's folder, in the order their from_pretrained looks
# for them: transformers takes model.safetensors before the index (a sharded save followed by a whole one
# into the same folder leaves the index, whose shards it removed), diffusers takes the index first.
_FOLDER_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
)


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a checkpoint: its file and its bytes ``[start, start + nbytes)`` in that file."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    """Every tensor of a checkpoint by name, and the files they are in."""

    path: Path
    files: tuple[Path, ...]
    tensors: dict[str, CheckpointTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self.tensors)} tensors in {len(self.files)} file(s))"


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Find the files ``path`` means and read their headers; CheckpointError when anything is off."""
    path = Path(path)
    files = checkpoint_files(path)
    tensors: dict[str, CheckpointTensor] = {}
    for file in files:
        for tensor in read_header(file):
            if tensor.name in tensors:
                raise CheckpointError(
                    f"tensor {tensor.name!r} is in both {tensors[tensor.name].file.name} and {file.name} of "
                    f"{path}; a checkpoint holds each tensor once: remove the stray shard"
                )
            tensors[tensor.name] = tensor
    return Checkpoint(path, files, tensors)


def checkpoint_files(path: Path) -> tuple[Path, ...]:
    """The safetensors files ``path`` (a file, an index or a model folder) names, in a stable order."""
    if not path.exists():
        raise CheckpointError(f"weights={str(path)!r} does not exist; pass a .safetensors file or a folder")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _shards_of(path)
        if path.suffix != ".safetensors":
            raise CheckpointError(
                f"weights={str(path)!r} is not a .safetensors file (nor a *.safetensors.index.json); "
                "flextensor reads safetensors checkpoints only: convert it with safetensors.torch.save_file"
            )
        return (path,)
    standard = [name for name in _FOLDER_NAMES if (path / name).is_file()]
    if standard:
        return _standard_checkpoint(path, standard)
    indexes = sorted(p.name for p in path.glob("*.safetensors.index.json"))
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if len(indexes) == 1:
        return _shards_of(path / indexes[0])
    if not indexes and len(files) == 1:
        return (path / files[0],)
    found = indexes or files
    if not found:
        raise CheckpointError(
            f"folder {str(path)!r} holds no .safetensors file; pass the folder of the model itself (e.g. "
            "the 'transformer' subfolder of a diffusers pipeline) or a .safetensors file"
        )
    raise CheckpointError(
        f"folder {str(path)!r} holds several checkpoints ({', '.join(found[:6])}) and none under the "
        f"standard names ({', '.join(_FOLDER_NAMES)}); pass the one to load as weights="
    )


def _standard_checkpoint(folder: Path, names: list[str]) -> tuple[Path, ...]:
    """The checkpoint of ``folder`` that its library's from_pretrained loads: the first of ``names`` (in
    _FOLDER_NAMES order), with a warning when its library's other name is there too."""
    chosen = names[0]
    library = "transformers" if chosen.startswith("model.") else "diffusers"
    other = next((n for n in names[1:] if n.startswith(chosen.split(".")[0] + ".")), None)
    if other is not None:
        logger.warning(
            "%s holds both %s and %s; reading %s, as %s' from_pretrained does (the other may be left from "
            "an earlier save: remove it, or pass the file to load as weights=)",
            folder,
            chosen,
            other,
            chosen,
            library,
        )
    if chosen.endswith(".index.json"):
        return _shards_of(folder / chosen)
    return (folder / chosen,)


def _shards_of(index: Path) -> tuple[Path, ...]:
    names = sorted(set(_weight_map(index).values()))
    missing = [name for name in names if not (index.parent / name).is_file()]
    if missing:
        whole = index.parent / index.name.removesuffix(".index.json")
        hint = (
            f" (or, if the index is left from an earlier sharded save, pass {str(whole)!r} as weights=)"
            if whole.is_file()
            else ""
        )
        raise CheckpointError(
            f"index {str(index)!r} names shard(s) that are not there: {', '.join(missing[:6])}; "
            f"the download is incomplete: download it again{hint}"
        )
    return tuple(index.parent / name for name in names)


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index (tensor name -> shard file name), checked."""
    what = "a JSON object with a 'weight_map' object from tensor names to shard file names"
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"index {str(index)!r} is not a safetensors index ({what}): {error}") from error
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"index {str(index)!r} is not a safetensors index ({what}): it has no 'weight_map' object"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(
                f"index {str(index)!r} is not a safetensors index ({what}): its 'weight_map' maps "
                f"{name!r} to {shard!r}, not to a shard's file name; save the checkpoint again or "
                "re-download it"
            )
    return weight_map


def read_header(file: Path) -> list[CheckpointTensor]:
    """The tensors of one safetensors file, with absolute byte ranges; checked against the file's size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(file, f"it has {size} bytes, fewer than the 8 of the header length")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise _corrupt(file, f"its header length field says {length} bytes, and the file has {size}")
            raw = f.read(length)
    except OSError as error:
        raise CheckpointError(f"cannot read {file}: {error}") from error
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise _corrupt(file, f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _corrupt(file, "its header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + length
    tensors = [_tensor(file, name, entry, data_start, size) for name, entry in header.items()]
    _check_no_overlap(file, tensors)
    return tensors


def _tensor(file: Path, name: str, entry: object, data_start: int, size: int) -> CheckpointTensor:
    try:
        assert isinstance(entry, dict)
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        assert all(isinstance(d, int) and d >= 0 for d in shape)
        assert isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
    except (AssertionError, KeyError, TypeError, ValueError) as error:
        raise _corrupt(
            file, f"its entry for {name!r} is not {{dtype, shape, data_offsets}}: {entry!r}"
        ) from error
    if dtype_name not in DTYPES:
        raise CheckpointError(
            f"tensor {name!r} of {file} has dtype {dtype_name}, which flextensor cannot read "
            f"(it reads {', '.join(DTYPES)})"
        )
    dtype = DTYPES[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise _corrupt(
            file, f"{name!r} has shape {shape} of {dtype_name} ({nbytes} bytes) in {end - begin} bytes"
        )
    if data_start + end > size:
        raise _corrupt(
            file, f"{name!r} ends at byte {data_start + end}, past the file's end ({size}): truncated?"
        )
    return CheckpointTensor(name, file, dtype, tuple(shape), data_start + begin, nbytes)


def _check_no_overlap(file: Path, tensors: list[CheckpointTensor]) -> None:
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise _corrupt(file, f"tensors {first!r} and {second!r} overlap")


def _corrupt(file: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{file} is not a valid safetensors file: {why}; save it again or re-download it")
