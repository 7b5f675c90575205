"""The functions flextensor hooks on an offloaded model and its units, and the marks they read.

One of each serves every model and unit, so that Dynamo, when it inlines them into a compiled forward,
sees the same code everywhere (see [Note: compiled hot path] in hooks/compiled_ops.py). Each finds what it
needs in plain attributes of the hooked module (:func:`mark`, :func:`unmark`): its model's :class:`ModelHooks`
(hooks/model_hooks.py), which owns the handles and does the work, and the constants the compiled ops carry.
:func:`entry_point` brackets a method other than forward (a VAE's ``decode``) as a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame

from flextensor.hooks import compiled_ops as compiled
from flextensor.hooks.compiled_ops import written_inputs, written_outputs

__all__ = [
    "alias_post_hook",
    "alias_pre_hook",
    "entry_point",
    "input_signature",
    "mark",
    "mark_alias",
    "model_post_hook",
    "model_pre_hook",
    "step_signature",
    "unit_post_hook",
    "unit_pre_hook",
    "unmark",
]

_HOOKS, _MODEL_ID, _TOKEN, _SPARE, _UNIT, _WEIGHTS, _ALIAS, _ALIAS_CALLS = (
    "_flextensor_hooks",
    "_flextensor_model_id",
    "_flextensor_token",
    "_flextensor_spare",
    "_flextensor_unit",
    "_flextensor_weights",
    "_flextensor_alias",
    "_flextensor_alias_calls",
)
"""Attributes a hooked module carries for the hook functions: its model's hooks object and id, the ops'
token and spare tensors, (unit modules and their aliases) the unit's index and its parameters' names in
the module, and (aliases) the alias's path and, per call running, whether it stands for the unit."""


def mark(module: nn.Module, hooks: Any, unit_index: int | None = None, weights: tuple[str, ...] = ()) -> None:
    """What the hook functions read from a hooked module: its model's ``hooks`` (a ModelHooks) and the
    compiled ops' constants, and for a unit's module or alias the unit's index and its parameters' names
    in the module."""
    values = module.__dict__
    values[_HOOKS], values[_MODEL_ID] = hooks, hooks.model_id
    values[_TOKEN], values[_SPARE] = hooks.token, hooks.spare
    if unit_index is not None:
        values[_UNIT], values[_WEIGHTS] = unit_index, weights


def mark_alias(module: nn.Module, path: str) -> None:
    """``module`` holds some of a unit's weights (a tied alias) at ``path``."""
    module.__dict__[_ALIAS] = path


def unmark(module: nn.Module) -> None:
    for name in (_HOOKS, _MODEL_ID, _TOKEN, _SPARE, _UNIT, _WEIGHTS, _ALIAS, _ALIAS_CALLS):
        module.__dict__.pop(name, None)


def unit_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():  # see [Note: compiled hot path] in hooks/compiled_ops.py
        if getattr(module, _HOOKS).order_by_inputs:
            written = written_inputs(args, kwargs, getattr(module, _SPARE))
        else:
            written = [module.get_parameter(name) for name in getattr(module, _WEIGHTS)]
        token = getattr(module, _TOKEN)
        torch.ops.flextensor.unit_pre(written, token, getattr(module, _MODEL_ID), getattr(module, _UNIT))
        return
    values = module.__dict__
    values[_HOOKS].run_unit_pre(values[_UNIT])


def alias_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A unit's pre-hook on a module holding some of its weights (see [Note: tied aliases] in
    phases/discovery.py). Whether the call stands for the unit is decided here and kept for the post-hook, so
    the unit's pre and post always come in pairs."""
    if torch.compiler.is_compiling():
        unit_pre_hook(module, args, kwargs)
        return
    values = module.__dict__
    calls = values.setdefault(_ALIAS_CALLS, [])
    calls.append(False)  # pushed first: a pre that raises leaves a False for its post (always_call)
    calls[-1] = values[_HOOKS].run_alias_pre(values[_UNIT], values[_ALIAS])


def alias_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if torch.compiler.is_compiling():
        return unit_post_hook(module, args, kwargs, output)
    calls = module.__dict__.get(_ALIAS_CALLS)
    if not calls or not calls.pop():
        return None
    return unit_post_hook(module, args, kwargs, output)


def unit_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if torch.compiler.is_compiling():
        outputs = written_outputs(output, getattr(module, _SPARE))
        token = getattr(module, _TOKEN)
        torch.ops.flextensor.unit_post(outputs, token, getattr(module, _MODEL_ID), getattr(module, _UNIT))
        return None
    values = module.__dict__
    return values[_HOOKS].run_unit_post(values[_UNIT], output)


def model_pre_hook(module: nn.Module, args: tuple, kwargs: dict, entry: str | None = None) -> None:
    if torch.compiler.is_compiling():  # the model is part of a larger compiled module
        signature = "|".join(step_signature(args, kwargs, entry))
        torch.ops.flextensor.model_begin(getattr(module, _TOKEN), getattr(module, _MODEL_ID), signature)
        return
    hooks = module.__dict__[_HOOKS]
    if hooks.model_begin(step_signature(args, kwargs, entry)):
        # Switched off here, in this frame, not in a function it calls: Dynamo restores its callback when
        # a skipped frame returns (see [Note: compiled hot path] in hooks/compiled_ops.py).
        previous = _set_eval_frame(False)
        if previous is None or previous is False:
            _set_eval_frame(previous)  # not inside a compiled call, but its modules may be compiled
            hooks.stance = compiled.force_eager()
        else:
            hooks.eval_frame = previous


def model_post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    if torch.compiler.is_compiling():
        torch.ops.flextensor.model_end(getattr(module, _TOKEN), getattr(module, _MODEL_ID))
        return
    hooks = module.__dict__[_HOOKS]
    previous = hooks.model_end(output)
    if previous is not None:
        _set_eval_frame(previous)
    if hooks.stance is not None and not hooks._controller.bracket.running:
        stance, hooks.stance = hooks.stance, None
        stance.__exit__(None, None, None)


def _bucket(n: int) -> int:
    """Round a dimension up to a power of two: a decode loop whose mask grows by one each step re-plans
    log2(length) times, not every step."""
    return 1 << max(0, int(n) - 1).bit_length()


def input_signature(args: tuple, kwargs: dict) -> tuple[str, ...]:
    """Bucketed shapes of the tensors passed to the model's forward: what the plan's activations depend
    on. Each dimension is rounded up to a power of two (see _bucket)."""
    shapes = [
        f"{i}:{tuple(map(_bucket, a.shape))}" for i, a in enumerate(args) if isinstance(a, torch.Tensor)
    ]
    shapes += [
        f"{k}:{tuple(map(_bucket, v.shape))}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)
    ]
    return tuple(shapes)


def step_signature(args: tuple, kwargs: dict, entry: str | None) -> tuple[str, ...]:
    """The inputs a step's plan is chosen by; a step entered through another method than forward (a VAE's
    decode) is a signature of its own, since it runs other modules."""
    signature = input_signature(args, kwargs)
    return signature if entry is None else (f"method={entry}", *signature)


def entry_point(module: nn.Module, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method of the offloaded ``module``) bracketed as a step, as forward is by the
    module's pre/post hooks: a pipeline calls ``vae.decode()``, never ``vae()``."""

    @functools.wraps(method)
    def entered(*args: Any, **kwargs: Any) -> Any:  # its name is hooks.bracket.ENTRY_WRAPPER
        model_pre_hook(module, args, kwargs, name)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            model_post_hook(module, args, None)  # sees the exception in sys.exc_info(): a failed step
            raise
        model_post_hook(module, args, output if output is not None else True)
        return output

    return entered
