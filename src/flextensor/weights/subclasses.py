"""Parameters that are tensor subclasses (torchao, optimum-quanto quantized weights): kept on the device.

[Note: tensor-subclass weights]
A wrapper subclass (``torch.Tensor._make_wrapper_subclass``: torchao's ``Int8Tensor`` / ``Float8Tensor``,
quanto's ``WeightQBytesTensor``) keeps its values in inner tensors (``qdata``, ``scale``, ...). The engine
points a streamed parameter at its pack and its arena range with ``param.data = view``; on a wrapper
subclass that assignment is silently ignored (the inner tensors stay where they were), so such a weight
would neither stream nor move: it would crash the forward on another device, or stay on the GPU while the
report called it streamed. Selection therefore keeps these parameters resident (with a warning that
names them), and moving one to the device swaps the whole tensor (``torch.utils.swap_tensors``, as
``nn.Module.to`` does for them), which keeps the parameter object and so its ties and the user's
references. Parameter subclasses over a storage of their own (diffusers' ``GGUFParameter``, whose
``quant_type`` stays on the parameter object; bitsandbytes' ``Params4bit`` and ``Int8Params``, whose
scales stay on it too) are not wrapper subclasses, and they stream; their ``state_dict()`` entries are
their kept host copies presented as the same class, attributes included (weights/access.py), as the
model's own ``state_dict()`` gives them.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flextensor.errors import UnsupportedModelError, UnsupportedOperationError

__all__ = ["check_swappable", "is_wrapper_subclass", "refuse_subclass_checkpoint", "set_parameter_value"]


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` keeps its values in inner tensors rather than a storage of its own, so that
    ``tensor.data = ...`` cannot re-point it."""
    if is_traceable_wrapper_subclass(tensor):
        return True
    try:
        tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # "an invalid python storage": a wrapper's
        return True
    return False


def set_parameter_value(param: nn.Parameter, value: torch.Tensor, name: str = "a parameter") -> None:
    """Make ``param`` (the same object) hold ``value``: ``param.data = value`` for plain tensors, a swap
    of the whole tensor for wrapper subclasses (see [Note: tensor-subclass weights])."""
    if not is_wrapper_subclass(param) and not is_wrapper_subclass(value):
        param.data = value
        return
    replacement = nn.Parameter(value, requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, replacement)
    except RuntimeError as error:  # weak references (a compiled graph's guards), extra uses
        raise UnsupportedModelError(
            f"cannot move {name}, a {type(param).__name__} (a tensor subclass), to {value.device}: {error}; "
            f"move it there before offload() (e.g. the module that holds it), or exclude it from offloading"
        ) from error


def check_swappable(param: nn.Parameter) -> None:
    """Raise UnsupportedOperationError if ``param`` is a wrapper subclass that a swap would refuse (weak
    references to it), so a caller can refuse before changing anything."""
    if is_wrapper_subclass(param) and weakref.getweakrefs(param):
        raise UnsupportedOperationError(
            f"cannot move a {type(param).__name__} parameter (a tensor subclass) while something holds a "
            "weak reference to it (a compiled graph's guards, e.g.: reset them with torch._dynamo.reset()); "
            "release the model without device=, then move it"
        )


def refuse_subclass_checkpoint(model: nn.Module) -> None:
    """``offload(weights=...)`` reads plain tensors into parameters; a wrapper subclass cannot take one
    (its inner tensors would keep their old values): refused before anything changes."""
    names = [name for name, param in model.named_parameters() if is_wrapper_subclass(param)]
    if names:
        raise UnsupportedModelError(
            f"{len(names)} parameter(s) ({', '.join(names[:3])}) are tensor subclasses (e.g. torchao "
            "quantized weights), which offload(weights=...) cannot read a checkpoint into; load the "
            "weights first and call offload() without weights="
        )
