"""Offloaded models under ``torch.compile``: the hot path as custom ops the compiler keeps in order.

[Note: compiled hot path]
Dynamo meets flextensor's hooks in one of two ways, and neither puts the engine's Python into a graph:

* A hook called by PyTorch's own module-call code is a frame of its own: ``torch.compile(model)``,
  ``model.compile()`` and ``block.compile()`` all run hooks outside the compiled frame. Those hook
  functions' code is marked skipped (:func:`skip_hook_frames`), so they run eagerly, exactly as
  without compile.
* A hook inlined into a traced frame (a unit's hooks when its parent is compiled as a whole, the model's
  hooks when the model is part of a larger compiled module) calls a custom op instead:
  ``flextensor::unit_pre`` before the unit's forward and ``flextensor::unit_post`` after it.

  The pre op is declared to write the unit's weights, so every kernel that reads a weight comes after
  it, even one that reads nothing else (inductor otherwise fuses ``bias * 3 + temb`` of every block into
  one kernel at the graph's start, before those weights arrive). Nothing is written: inductor calls the
  op in place and copies nothing, because no kernel reads a weight before it. That needs each parameter
  to be an input of its own: weights viewing one arena would be aliased inputs, which AOTAutograd merges
  into a synthetic base (copying the arena), so each parameter has its own storage object over the
  arena's bytes (units.Unit.point_parameters).
  The post op is declared to write the unit's output tensors (not its weights: those were read before
  it, so inductor would clone them and copy them back into the arena at the graph's end), so every
  kernel that produces the output comes before it: every tensor of the output, however deeply nested
  (:func:`written_outputs`), a view by the tensor it views (its base, whose bytes those kernels write;
  once for the two slices of one tensor that Flux's single-stream blocks return). Left out, a view or a
  nested tensor ordered nothing: inductor fused the kernels behind it into the next unit's, after the
  next copies (wrong outputs). Inductor passes the base to the op in place, copying nothing. A kernel of
  a unit whose result leaves the unit other than through its output (an in-place write to an input) is
  ordered by the token alone.
  Both ops write a per-model token, so they keep the forward's order among themselves.

  That the pre op runs on the weights themselves is inductor's doing (it re-inplaces the op). A backend
  without that pass (``aot_eager``) runs it on copies taken before the weights arrive, computes with those
  copies and writes them back into the arena at the graph's end, over other units' weights: silently wrong
  outputs (NaN in a CPU check of the tiny Wan2.2 transformer, 2026-12-06). The pre op checks that the
  unit's first non-empty weight lies in its device bytes and raises ``UnsupportedOperationError``
  otherwise, before the unit runs, ending the forward as a failed pre-hook does: one pointer comparison
  per unit.

  Their fake implementations do nothing; at run time they call the same Python as the eager hooks, found
  through the engine id and unit index they carry as constants (constants, not tensors: a graph holds
  every unit it traced, so nothing multiplies per unit, and CUDA graphs see no extra inputs).

The forwards that need eager Python around every torch call (discovery, and the first forward from a
saved profile, see phases/discovery.py) run uncompiled: the model's pre-hook switches Dynamo's frame
evaluation off for that forward and its post-hook switches it back (see hooks.functions.model_pre_hook). The
profiling forward runs compiled, so the plan is made for the compiled compute.

A graph compiled without flextensor's hooks would run without them: once Dynamo is loaded (at offload(),
or at the first forward after a torch.compile call) flextensor turns on Dynamo's guards on module hooks
(``torch._dynamo.config.skip_nnmodule_hook_guards = False``) and drops the graphs cached for the model's
module classes, so such a graph is recompiled, never reused.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

logger = logging.getLogger("flextensor")

__all__ = [
    "CompiledRuns",
    "force_eager",
    "guard_hooks_if_compiling",
    "mark_static",
    "register",
    "skip_hook_frames",
    "written_inputs",
    "written_outputs",
]


class CompiledRuns(Protocol):
    """What the ops call on the hooks of the model they belong to."""

    def run_unit_pre(
        self, index: int, in_graph: bool = False, weights: list[torch.Tensor] | None = None
    ) -> None: ...

    def run_unit_post(self, index: int) -> None: ...

    def run_model_begin(self, signature: str) -> None: ...

    def run_model_end(self) -> None: ...


_MODELS: dict[int, weakref.ref[Any]] = {}
"""Engine id -> the hooks object of an offloaded model, for the ops' implementations."""

_next_id = [0]


def register(runs: CompiledRuns) -> int:
    """An id for ``runs`` that compiled graphs carry as a constant (never reused in this process)."""
    _next_id[0] += 1
    _MODELS[_next_id[0]] = weakref.ref(runs)
    return _next_id[0]


def unregister(model_id: int) -> None:
    _MODELS.pop(model_id, None)


def _runs(model_id: int) -> CompiledRuns:
    runs = _MODELS.get(model_id)
    target = None if runs is None else runs()
    if target is None:
        from flextensor.errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            "a compiled graph ran flextensor's hooks for a model that is no longer offloaded; compile the "
            "model again after flextensor.release(model) (torch._dynamo.reset() drops old graphs)"
        )
    return target


@torch.library.custom_op("flextensor::unit_pre", mutates_args=("weights", "token"))
def unit_pre(weights: list[torch.Tensor], token: torch.Tensor, model_id: int, index: int) -> None:
    """The unit's weights are ready (or are made ready) before any kernel that reads them."""
    _runs(model_id).run_unit_pre(index, in_graph=True, weights=weights)


@unit_pre.register_fake
def _(weights: list[torch.Tensor], token: torch.Tensor, model_id: int, index: int) -> None:
    return None


@torch.library.custom_op("flextensor::unit_post", mutates_args=("outputs", "token"))
def unit_post(outputs: list[torch.Tensor], token: torch.Tensor, model_id: int, index: int) -> None:
    """The unit's compute is issued: its range may be refilled after it, the next copies may start."""
    _runs(model_id).run_unit_post(index)


@unit_post.register_fake
def _(outputs: list[torch.Tensor], token: torch.Tensor, model_id: int, index: int) -> None:
    return None


@torch.library.custom_op("flextensor::model_begin", mutates_args=("token",))
def model_begin(token: torch.Tensor, model_id: int, signature: str) -> None:
    """The outermost forward of an offloaded model begins, inside a larger compiled region."""
    _runs(model_id).run_model_begin(signature)


@model_begin.register_fake
def _(token: torch.Tensor, model_id: int, signature: str) -> None:
    return None


@torch.library.custom_op("flextensor::model_end", mutates_args=("token",))
def model_end(token: torch.Tensor, model_id: int) -> None:
    """The outermost forward of an offloaded model ends, inside a larger compiled region."""
    _runs(model_id).run_model_end()


@model_end.register_fake
def _(token: torch.Tensor, model_id: int) -> None:
    return None


def force_eager() -> Any:
    """``torch.compiler.set_stance("force_eager")`` when Dynamo is loaded (modules of the model compiled
    on their own, ``block.compile()``), else None; ``__exit__`` on what it returns restores the stance."""
    if "torch._dynamo" not in sys.modules:
        return None
    return torch.compiler.set_stance("force_eager")


def written_outputs(output: Any, spare: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the post op declares written: every tensor of a unit's output, however deeply it sits
    in tuples, lists and dicts (a ModelOutput), each view by the tensor it views (its ``_base``: the
    kernels that produce a view's bytes write its base), each base once; ``[spare]`` when there are none.
    A weight is left out (nothing of the unit produced it, and declared written it would be copied back
    into the arena at the graph's end). Traced by Dynamo."""
    found: list[torch.Tensor] = []
    _collect_written(output, found)
    return found if found else [spare]


def _collect_written(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        base = value._base
        tensor = value if base is None else base
        if isinstance(tensor, nn.Parameter):
            return
        for seen in found:
            if seen is tensor:
                return
        found.append(tensor)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_written(item, found)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect_written(item, found)


def written_inputs(args: tuple, kwargs: dict, spare: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the pre op declares written when the model's hooks order by inputs: the unit's
    floating-point tensor arguments that are no views, ``[spare]`` when there are none. Traced by Dynamo.

    vLLM's compiler reads some weights through ``.data`` (its RMSNorm), which AOTAutograd refuses on a
    parameter an op mutated while tracing under inference mode; ordering by the activation instead keeps
    every kernel that computes on it after the op (what vLLM's own prefetching offloader declares too).
    Integer inputs (positions) are left out: they are read before the op by earlier units, so declaring
    them written would make inductor clone them."""
    found = [
        tensor
        for tensor in (*args, *kwargs.values())
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor._base is None
    ]
    return found if found else [spare]


_skipped = [False]


def skip_hook_frames(
    everything_eager: Iterable[Callable[..., Any]], frame_only: Iterable[Callable[..., Any]]
) -> None:
    """Make Dynamo run these functions eagerly when it meets them as frames of their own (it still inlines
    them into frames it traces): ``everything_eager`` with every frame they call, ``frame_only`` by
    themselves (what they switch in Dynamo's frame evaluation then outlasts them: a skipped frame with
    its callees skipped gets Dynamo's callback restored when it returns). Through torch's C extension:
    importing torch._dynamo costs ~70 MiB and seconds, which a model never compiled should not pay."""
    if _skipped[0]:
        return
    from torch._C._dynamo import eval_frame

    action = eval_frame._FrameAction
    recursive = eval_frame._FrameExecStrategy(action.SKIP, action.SKIP)
    alone = eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT)
    for function in everything_eager:
        eval_frame.set_code_exec_strategy(function.__code__, recursive)
    for function in frame_only:
        eval_frame.set_code_exec_strategy(function.__code__, alone)
    _skipped[0] = True


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell CUDA-graph trees (``mode="reduce-overhead"``) that the ops' token and spare keep their
    address: inputs the ops write would otherwise make them skip the graph."""
    import torch._dynamo

    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor, guard=False)


_guarding = [False]


def guard_hooks_if_compiling(model: nn.Module) -> bool:
    """Once Dynamo is loaded (a torch.compile call, before or after offload()): guard compiled graphs on
    module hooks and drop those already compiled for ``model``'s module classes (compiled without
    flextensor's hooks, they would run without them). Returns whether Dynamo is loaded. Cheap when not."""
    if "torch._dynamo" not in sys.modules:
        return False
    import torch._dynamo
    from torch._C._dynamo.eval_frame import reset_code

    if not _guarding[0] and torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        logger.info(
            "torch._dynamo.config.skip_nnmodule_hook_guards set to False: compiled graphs are guarded on "
            "module hooks, so that none compiled without flextensor's hooks runs an offloaded model"
        )
    _guarding[0] = True
    for cls in {type(m) for m in model.modules()}:
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is not None:
            reset_code(code)
    return True
