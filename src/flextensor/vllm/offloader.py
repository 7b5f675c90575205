"""flextensor as vLLM's offloader (``vllm.model_executor.offloader.BaseOffloader``).

vLLM asks the installed offloader for three things, and this class answers them with flextensor's engine:

* ``wrap_modules``: ``make_layers`` hands it each decoder layer as it is built. Those layers are the
  units. On a CUDA device their parameters move to host memory at once, so the device never holds the
  whole model while it is built (the weights then load into host memory). On a CPU, vLLM would copy
  each linear layer's weight into an opaque oneDNN handle after loading and drop the parameter, leaving
  nothing to stream: the layers' linears are marked to keep their weight and call ``F.linear``.
* ``post_init``: once the model is loaded, ``flextensor.offload`` packs the units into (pinned) host
  memory and allocates the arena. The loader calls it (vLLM's CPU runner and 0.26's V2 GPU runner never
  do); a GPU runner may call it again: the second call does nothing.
* One layout for every step: its plan is made as if the link were the bottleneck (decode), and serves
  prefill steps too (Engine.keep_one_layout); a layout per step shape would move the resident layers at
  every switch between prefill and decode.
* The budget: vLLM sizes its KV cache from the memory the model holds after loading, so the budget covers
  the weights alone, and on a GPU the loader holds the budget's bytes in reserve until vLLM has measured
  them; flextensor's next layout frees them (budget.py).
* ``sync_prev_onload`` / ``join_after_forward``: vLLM's CUDA-graph wrappers call them before a capture or
  replay, and inside a capture after the captured forward. Before the first capture the engine ends its
  learning with a plan and keeps that layout for every batch size from then on (vLLM warms each size up
  once, then captures it; see [Note: captured forwards] in engine/cuda_graphs.py). Then the compute stream
  waits for flextensor's copy stream (and for the decode stream of compressed loads), so copies queued
  before land first, and a capture never ends with either stream forked. GPU only: on CPU vLLM never
  calls them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.offloader.base import BaseOffloader

from flextensor.api import engine_of, offload, release
from flextensor.config.schema import OffloadConfig
from flextensor.errors import BudgetError
from flextensor.profiles.reuse import start_from_profile
from flextensor.vllm.budget import count_weights_only, hold_budget_in_reserve

__all__ = [
    "FlexTensorOffloader",
    "keep_linear_weights",
    "run_uncompiled_while_learning",
]


def run_uncompiled_while_learning(model: nn.Module) -> None:
    """The forwards in which flextensor learns the model (discovery, checking) need eager Python around
    every torch call. vLLM calls its compiled modules (``@support_torch_compile``) through its own
    dispatcher, which Dynamo's frame switch does not reach: those forwards set the modules'
    ``do_not_compile`` flag (read at every call, in every vLLM release) and clear it afterwards.
    Registered after flextensor's own hooks, so the engine has chosen the forward's step already."""
    compiled = [m for m in model.modules() if isinstance(m.__dict__.get("do_not_compile"), bool)]
    if not compiled:
        return
    engine = engine_of(model)
    switched: list[nn.Module] = []

    def before(module: nn.Module, args: tuple) -> None:
        if engine.runs_eager():
            for inner in compiled:
                if not inner.do_not_compile:
                    inner.do_not_compile = True
                    switched.append(inner)

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        while switched:
            switched.pop().do_not_compile = False

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after, always_call=True)


def keep_linear_weights(layer: nn.Module) -> None:
    """On a CPU, make the unquantized linears of ``layer`` keep their weight parameter (vLLM's flag for
    layers whose GEMM it does not prepack), so that flextensor streams it and the linear reads it."""
    for module in layer.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True


class FlexTensorOffloader(BaseOffloader):
    """Collects the decoder layers while vLLM builds the model, then offloads it with flextensor."""

    def __init__(self, config: OffloadConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.layers: list[nn.Module] = []
        self.model: nn.Module | None = None
        self.offloaded = False

    # vLLM 0.26 calls wrap_modules(generator); later versions pass prefix= too.
    def wrap_modules(self, modules_generator: Iterable[nn.Module], prefix: str = "") -> list[nn.Module]:
        layers = []
        for layer in modules_generator:
            if self.device.type == "cpu":
                keep_linear_weights(layer)
            else:
                # Off the device as soon as built: only one layer at a time is ever there.
                for param in layer.parameters():
                    param.data = param.data.to("cpu")
            layers.append(layer)
        self.layers += layers
        return layers

    def unit_patterns(self, model: nn.Module) -> tuple[str, ...]:
        """Module paths of the layers ``make_layers`` handed over, as include patterns."""
        wanted = {id(layer) for layer in self.layers}
        names = tuple(name for name, module in model.named_modules() if id(module) in wanted)
        if len(names) != len(wanted):
            from flextensor.errors import UnsupportedModelError

            raise UnsupportedModelError(
                f"{type(model).__name__}: {len(wanted) - len(names)} of the {len(wanted)} decoder layers "
                "vLLM built are not modules of the model it returned; name its layers in "
                '"include_patterns" under "flextensor" in additional_config'
            )
        return names

    def post_init(self) -> None:
        """Offload the model (once; later calls do nothing)."""
        if self.offloaded or self.model is None:
            return
        model, config = self.model, self.config
        if "include_patterns" not in config.model_fields_set:
            if not self.layers:
                from flextensor.errors import UnsupportedModelError

                raise UnsupportedModelError(
                    f"vLLM built {type(model).__name__} without make_layers, so flextensor does not know its "
                    'decoder layers; name them in "include_patterns" under "flextensor" in additional_config'
                )
            config = config.model_copy(update={"include_patterns": self.unit_patterns(model)})
        # The profile is adopted once the budget counts the weights alone: a profile planned for another
        # budget is planned again here, and must not count the KV cache its measurements saw.
        try:
            offload(model, config.model_copy(update={"profile": None}))
        except BudgetError as error:  # below the units in flight (engine/budgets.py): say what it counts here
            raise BudgetError(
                f"{error} (under vLLM the budget counts the weights alone, those outside the layers too; "
                "vLLM sizes the KV cache and activations from what is left)",
                needed_bytes=error.needed_bytes,
                budget_bytes=error.budget_bytes,
            ) from None
        engine = engine_of(model)
        # vLLM's compiled graphs read some weights through .data (its RMSNorm): order the compiled ops by
        # the layers' activations (see compiled.written_inputs), and give the parameters their own class
        # back: Dynamo cannot trace the .data guard of weights/edits.py (a served model is not edited in
        # place, so nothing is lost by it).
        engine.hooks.order_by_inputs = True
        engine.unguard_parameters()
        try:
            engine.keep_alias_weights_resident("which vLLM reads outside the forward (compute_logits)")
            count_weights_only(model)
            engine.keep_one_layout()  # prefill and decode steps alternate, and CUDA graphs keep it anyway
            if config.profile is not None:
                start_from_profile(engine, config.profile)
            hold_budget_in_reserve(model)
        except BaseException:
            release(model, device="cpu")  # vLLM drops the model: free its pinned packs and arena now
            raise
        self.offloaded = True
        run_uncompiled_while_learning(model)

    def _copy_stream(self) -> Any | None:
        if not self.offloaded or self.model is None or self.device.type != "cuda":
            return None
        return engine_of(self.model).runtime.copy_stream

    def sync_prev_onload(self) -> None:
        copy = self._copy_stream()
        if copy is None:
            return
        compute = torch.cuda.current_stream(self.device)
        if not torch.cuda.is_current_stream_capturing():
            assert self.model is not None
            engine = engine_of(self.model)
            engine.prepare_for_captures()
            if engine.store.coded_loads is not None:  # compressed loads decode on a stream of their own
                engine.store.coded_loads.fence(compute)
        compute.wait_stream(copy)

    def join_after_forward(self) -> None:
        copy = self._copy_stream()
        if copy is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(copy)
        assert self.model is not None
        coded_loads = engine_of(self.model).store.coded_loads
        if coded_loads is not None:
            # Compressed loads decode on a stream of their own: a capture must end joined to it too.
            coded_loads.fence(compute)
