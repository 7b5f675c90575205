"""Tied weights that a checkpoint holds under several names with different values.

[Note: a checkpoint that unties tied weights]
A model built with tied weights (``tie_word_embeddings=True``: ``lm_head.weight`` is
``model.embed_tokens.weight``) has one parameter for both names; transformers saves one of them. A
fine-tune that untied the head saves both, with different values, and a config that still says to tie
them then disagrees with its checkpoint. transformers' ``from_pretrained`` (5.x, ``tie_weights``) compares
the two and, when they differ, does not tie them, with a warning: the model gets a head of its own. So
does ``offload(weights=...)``: :func:`untied_names` finds such names (from the headers, then comparing
the bytes of the few tensors held twice), and packing gives each a parameter of its own (put back if
offload fails), so the outputs are ``from_pretrained``'s. A model whose ties transformers does not declare
(``all_tied_weights_keys``) is refused instead: its own code ties them, and which value it means is not
for flextensor to guess.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from torch import nn

from flextensor.errors import CheckpointError
from flextensor.host.checkpoint_files import CheckpointTensor

__all__ = ["untied_names"]

logger = logging.getLogger("flextensor")

COMPARE_CHUNK_BYTES = 16 * 2**20
"""Bytes of each of the two tensors compared at a time: bounded memory for a large embedding."""


def untied_names(
    model: nn.Module, groups: Sequence[tuple[list[str], list[CheckpointTensor]]]
) -> tuple[tuple[str, CheckpointTensor], ...]:
    """(name, its tensor in the checkpoint) for every name that must get a parameter of its own: in each
    group of names of one model tensor (``groups``: the names, and the checkpoint tensors present for them,
    of the model's shape and dtype), those whose values differ from the first present (see [Note: a
    checkpoint that unties tied weights]). CheckpointError when the model does not declare the tie."""
    untied: list[tuple[str, CheckpointTensor]] = []
    declared = getattr(model, "all_tied_weights_keys", None) or {}
    for names, present in groups:
        kept = present[0]
        for source in present[1:]:
            if _same_bytes(kept, source):
                continue
            if declared.get(source.name) != kept.name and declared.get(kept.name) != source.name:
                raise CheckpointError(
                    f"{type(model).__name__} ties {' = '.join(names)} (one parameter), but the checkpoint "
                    f"holds {kept.name!r} and {source.name!r} with different values; build the model with "
                    "them untied, or pass a checkpoint that holds one of them. Nothing was changed."
                )
            logger.warning(
                "the checkpoint holds %s and %s with different values while %s ties them: giving %s a "
                "parameter of its own, as transformers' from_pretrained does; set tie_word_embeddings=False "
                "(or the tie's own setting) in the config to silence this",
                kept.name,
                source.name,
                type(model).__name__,
                source.name,
            )
            untied.append((source.name, source))
    return tuple(untied)


def _same_bytes(a: CheckpointTensor, b: CheckpointTensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes, read in chunks."""
    fa, fb = os.open(a.file, os.O_RDONLY), os.open(b.file, os.O_RDONLY)
    try:
        for done in range(0, a.nbytes, COMPARE_CHUNK_BYTES):
            count = min(COMPARE_CHUNK_BYTES, a.nbytes - done)
            if _read(fa, a, done, count) != _read(fb, b, done, count):
                return False
        return True
    finally:
        os.close(fa)
        os.close(fb)


def _read(fd: int, tensor: CheckpointTensor, offset: int, count: int) -> bytes:
    """``count`` bytes of ``tensor`` from its byte ``offset``."""
    parts, done = [], 0
    while done < count:
        part = os.pread(fd, count - done, tensor.start + offset + done)
        if not part:
            raise CheckpointError(
                f"{tensor.file} ended while reading {tensor.name!r}: it was truncated or replaced while "
                "loading; save it again"
            )
        parts.append(part)
        done += len(part)
    return b"".join(parts)
