"""The methods of a diffusers pipeline that flextensor replaces on the instance while it offloads it.

- ``pipe.to(...)`` runs through every component; one that refused after others converted would leave a
  half-converted pipeline, so every component is checked first: a no-op move goes through, a real one
  is refused before anything changes.
- diffusers' CPU-offload helpers would move the components behind flextensor's back: refused.
- ``maybe_free_model_hooks()``, which every diffusers pipeline calls at the end of ``__call__``, tells
  the pipeline that a generation ended (see [Note: the next component ahead] in pipelines/pipeline.py), then
  runs as before.

Each replacement is an attribute of the instance (``pipe.__dict__``): :func:`restore_methods` removes
them, and puts back what the instance held under those names before (another library's patch).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flextensor.errors import UnsupportedOperationError

if TYPE_CHECKING:
    from flextensor.pipelines.pipeline import PipelineOffload

REFUSED_METHODS = (
    "enable_model_cpu_offload",
    "enable_sequential_cpu_offload",
    "enable_group_offload",
)
"""Pipeline methods that would move an offloaded pipeline's components behind flextensor's back."""

CALL_END_METHOD = "maybe_free_model_hooks"
"""What a diffusers pipeline calls last in ``__call__`` (its hook to reset CPU-offload hooks)."""


def replace_methods(pipe: Any, pipeline: PipelineOffload) -> dict[str, Any]:
    """Guard ``pipe.to``, refuse the CPU-offload helpers and watch the end of each call (see above).
    Returns what the instance itself held under the replaced names, for :func:`restore_methods`."""
    names = ("to", *REFUSED_METHODS, CALL_END_METHOD)
    before = {name: pipe.__dict__[name] for name in names if name in pipe.__dict__}
    this = weakref.ref(pipeline)  # the pipe holds these; the pipeline holds the pipe
    pipe.__dict__["to"] = _guarded_to(pipe.to, this)
    for method in REFUSED_METHODS:
        if hasattr(pipe, method):
            pipe.__dict__[method] = _refused(method)
    call_end = getattr(pipe, CALL_END_METHOD, None)
    if callable(call_end):
        pipe.__dict__[CALL_END_METHOD] = _noting_call_end(call_end, this)
    return before


def restore_methods(pipe: Any, before: dict[str, Any]) -> None:
    for name in ("to", *REFUSED_METHODS, CALL_END_METHOD):
        pipe.__dict__.pop(name, None)
    pipe.__dict__.update(before)


def _noting_call_end(original: Callable[..., Any], pipeline: weakref.ref[PipelineOffload]) -> Any:
    def maybe_free_model_hooks(*args: Any, **kwargs: Any) -> Any:
        target = pipeline()
        if target is not None:
            target.call_ended()
        return original(*args, **kwargs)

    return maybe_free_model_hooks


def _guarded_to(original_to: Callable[..., Any], pipeline: weakref.ref[PipelineOffload]) -> Any:
    def to(*args: Any, **kwargs: Any) -> Any:
        target = pipeline()
        if target is None:
            return original_to(*args, **kwargs)
        dtype, device = _move_target(args, kwargs)
        for name, module in target.components.items():
            engine = target.engine(name)
            param = next(module.parameters())
            if dtype is not None and dtype != param.dtype:
                raise UnsupportedOperationError(
                    f"pipe.to({dtype}) would convert the offloaded {name}, whose weights live in "
                    "flextensor's host packs: nothing was converted; convert the pipeline before "
                    "flextensor.offload(pipe), or flextensor.release(pipe) first"
                )
            if device is not None and not _same_device(torch.device(device), engine.runtime.device):
                raise UnsupportedOperationError(
                    f"pipe.to({str(device)!r}) would move the offloaded {name} off {engine.runtime.device}, "
                    "where flextensor streams its weights: nothing was moved; call "
                    "flextensor.release(pipe) first to move it"
                )
        return original_to(*args, **kwargs)

    return to


def _refused(method: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOperationError(
            f"pipe.{method}() on a pipeline flextensor offloads would move its components behind it; "
            "flextensor already keeps the weights in host RAM and streams them, so drop the call (or "
            "flextensor.release(pipe) first)"
        )

    return refuse


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    return requested.type == actual.type and requested.index in (None, actual.index)


def _move_target(args: tuple, kwargs: dict) -> tuple[torch.dtype | None, Any]:
    """(dtype, device) of a ``pipe.to(...)`` call, each None when not given."""
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (str, torch.device, int)):
            device = arg
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return dtype, device
