"""``load_format="flextensor"``: vLLM's own loader for the weights, flextensor's engine for the memory.

Importing this module registers the loader (``register_model_loader`` lower-cases nothing: the name is
already lower case). The weights load through vLLM's "auto" loader, so every format it reads works;
around it the loader installs :class:`~flextensor.vllm.offloader.FlexTensorOffloader` as vLLM's
offloader before the model is built, and offloads the model before returning it, so the arena and every
resident weight are allocated inside the loader and counted in the model memory that vLLM's KV-cache
sizing subtracts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import vllm
from torch import nn
from vllm.model_executor.model_loader import get_model_loader, register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.offloader import base as offloader_base

from flextensor.config.schema import OffloadConfig
from flextensor.errors import ConfigError, UnsupportedOperationError
from flextensor.vllm.offloader import FlexTensorOffloader

logger = logging.getLogger("flextensor")

__all__ = ["FlexTensorModelLoader", "offload_config_from"]

OPTIONS_KEY = "flextensor"
"""The key of flextensor's options in vLLM's ``additional_config``."""


def offload_config_from(vllm_config: Any) -> OffloadConfig:
    """``OffloadConfig(**additional_config["flextensor"])``, with the device vLLM runs on unless given;
    ConfigError (naming the closest field for an unknown key) on a bad option."""
    additional = vllm_config.additional_config
    if not isinstance(additional, dict):
        additional = {}
    options = additional.get(OPTIONS_KEY, {})
    if not isinstance(options, dict):
        raise ConfigError(
            f'additional_config["{OPTIONS_KEY}"] must be a mapping of OffloadConfig fields to values, '
            f'got {type(options).__name__}: pass e.g. {{"{OPTIONS_KEY}": {{"gpu_memory_budget": "8GiB"}}}}'
        )
    config = OffloadConfig(**options)
    if config.device is None:
        config = OffloadConfig(**{**options, "device": str(vllm_device(vllm_config))})
    return config


def vllm_device(vllm_config: Any) -> torch.device:
    """The device this worker computes on (its own GPU with several ranks)."""
    device = torch.device(vllm_config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def refuse_vllm_offload(vllm_config: Any) -> None:
    """vLLM's own weight offloading (``--cpu-offload-gb``, ``--offload-backend``) and flextensor's would
    both claim the decoder layers: refuse the pair before anything is built."""
    offload = getattr(vllm_config, "offload_config", None)
    set_options = []
    if offload is not None:
        if getattr(offload, "offload_backend", "auto") not in ("auto", "none"):
            set_options.append(f"--offload-backend {offload.offload_backend}")
        uva = getattr(offload, "uva", None)
        if uva is not None and getattr(uva, "cpu_offload_gb", 0) > 0:
            set_options.append(f"--cpu-offload-gb {uva.cpu_offload_gb}")
        prefetch = getattr(offload, "prefetch", None)
        if prefetch is not None and getattr(prefetch, "offload_group_size", 0) > 0:
            set_options.append(f"--offload-group-size {prefetch.offload_group_size}")
    cache = getattr(vllm_config, "cache_config", None)  # where older releases keep cpu_offload_gb
    if cache is not None and getattr(cache, "cpu_offload_gb", 0) > 0 and not set_options:
        set_options.append(f"--cpu-offload-gb {cache.cpu_offload_gb}")
    if set_options:
        raise ConfigError(
            f"--load-format flextensor offloads the weights itself, but vLLM's own offloading is set too "
            f"({', '.join(set_options)}); drop those options and give flextensor's budget instead: "
            f'--additional-config \'{{"{OPTIONS_KEY}": {{"gpu_memory_budget": "8GiB"}}}}\''
        )


def choose_cuda_graph_mode(vllm_config: Any, device: torch.device) -> bool:
    """Keep vLLM's CUDA graphs to those that capture whole forwards; whether any are captured.

    flextensor captures a steady forward with its copies (docs/compile.md); vLLM's piecewise graphs
    capture the stretches between attention calls, and a layer's copies cross those borders. So the
    default, FULL_AND_PIECEWISE, becomes FULL_DECODE_ONLY (decode batches replay full graphs; prefill and
    mixed batches run compiled, without graphs), with a warning; PIECEWISE alone is refused. NONE, FULL
    and FULL_DECODE_ONLY stay. With graphs, each capture follows one uncompiled-graph warm-up forward
    (``cudagraph_num_of_warmups``), so that torch.compile never first compiles inside a capture: the
    learning forwards before it run uncompiled (offloader.run_uncompiled_while_learning)."""
    if device.type != "cuda" or vllm_config.model_config.enforce_eager:
        return False
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    name = str(getattr(mode, "name", mode)).upper()
    if mode is None or name == "NONE":
        return False
    if name == "FULL_AND_PIECEWISE":
        compilation.cudagraph_mode = type(mode).FULL_DECODE_ONLY
        logger.warning(
            "--load-format flextensor: CUDA graphs for decode batches only (cudagraph_mode FULL_DECODE_ONLY "
            "instead of FULL_AND_PIECEWISE): piecewise graphs would cut flextensor's copies at every "
            "attention call; prefill and mixed batches run compiled without CUDA graphs"
        )
    elif name not in ("FULL", "FULL_DECODE_ONLY"):
        raise UnsupportedOperationError(
            f"--load-format flextensor cannot run vLLM's {name} CUDA graphs: they capture the stretches "
            "between attention calls, and flextensor's copies of a layer cross those borders; use "
            "-cc.cudagraph_mode=FULL_DECODE_ONLY "
            '(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}), NONE, or leave the default'
        )
    compilation.cudagraph_num_of_warmups = max(1, getattr(compilation, "cudagraph_num_of_warmups", 0) or 0)
    return True


@register_model_loader("flextensor")
class FlexTensorModelLoader(BaseModelLoader):
    """vLLM's "auto" loader for the weights, with flextensor offloading the decoder layers."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.inner = get_model_loader(dataclasses.replace(load_config, load_format="auto"))

    def download_model(self, model_config: Any) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        self.inner.load_weights(model, model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        refuse_vllm_offload(vllm_config)
        config = offload_config_from(vllm_config)
        device = vllm_device(vllm_config)
        graphs = choose_cuda_graph_mode(vllm_config, device)
        if graphs and "discovery_forwards" not in config.model_fields_set:
            # vLLM captures right after its first forward (a memory estimate) and each later size after
            # one warm-up: one discovery forward, then the warm-up compiles outside the capture.
            config = config.model_copy(update={"discovery_forwards": 1})
        if isinstance(vllm_config.additional_config, dict):
            # additional_config is hashed into vLLM's compile cache: a graph compiled without
            # flextensor's ops must never be reused for this model, nor ours for a plain one.
            vllm_config.additional_config.setdefault(OPTIONS_KEY, {})
        offloader = FlexTensorOffloader(config, device)
        previous = offloader_base.get_offloader()
        offloader_base.set_offloader(offloader)
        try:
            model = self.inner.load_model(vllm_config, model_config, prefix)
            offloader.model = model
            offloader.post_init()
        except BaseException:
            offloader_base.set_offloader(previous)
            raise
        logger.info("vLLM %s: %s loaded and offloaded by flextensor", vllm.__version__, type(model).__name__)
        return model
