"""How each method is set up on a whole pipeline (``wan22_pipeline``): as its library documents for one.

- ``ours``: ``flextensor.offload(pipe, config)``, one call: every component's repeated blocks stream, one
  budget shared across the phases (docs/pipelines.md).
- ``diffusers_model_offload``: ``pipe.enable_model_cpu_offload()``: each component moved whole to the
  device when it runs, the previous one moved back.
- ``diffusers_sequential_offload``: ``pipe.enable_sequential_cpu_offload()``: accelerate's hooks move
  each module's weights to the device at each of its calls and back after it, with no overlap.
- ``diffusers_group``: ``pipe.enable_group_offload`` at block level, one block per group, with streams.
- ``flextensor050``: its Wan2.2 recipe: the two transformers offloaded (their blocks), one manager each,
  the text encoder and the VAE on the device.

The model handed in is a :class:`~benchmarks.pipeline_workload.PipelineModule` with its weights on the CPU.
"""

from __future__ import annotations

from typing import Any

from .methods import MethodSpec, Prepared, _import_ours, _import_peer, _under, parse_bytes

TRANSFORMERS = ("transformer", "transformer_2")
"""The components flextensor 0.5.0's Wan2.2 recipe offloads."""


def prepare_pipeline(
    ms: MethodSpec, model: Any, device: str, nbytes: dict[str, int], peer_path: str | None
) -> Prepared:
    import torch

    pipe = model.pipe
    cuda = device.startswith("cuda")
    if ms.family == "ours":
        return _prepare_ours(ms, model, device, nbytes)
    if ms.family == "diffusers_model_offload":
        if cuda:
            pipe.enable_model_cpu_offload(device=device)
        info = {"config": {"enable_model_cpu_offload": True}}
        return Prepared(model, lambda: None, 1, _every_weight(nbytes), info)
    if ms.family == "diffusers_sequential_offload":
        if cuda:
            pipe.enable_sequential_cpu_offload(device=device)
        info = {"config": {"enable_sequential_cpu_offload": True}}
        return Prepared(model, lambda: None, 1, _every_weight_every_call(model, nbytes), info)
    if ms.family == "diffusers_group":
        kwargs = {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": cuda}
        pipe.enable_group_offload(onload_device=torch.device(device), offload_device="cpu", **kwargs)
        info = {"config": {**kwargs, "offload_device": "cpu", "targets": "<pipeline>"}}
        return Prepared(model, lambda: None, 1, _every_weight(nbytes), info)
    if ms.family == "flextensor050":
        return _prepare_peer(ms, model, device, nbytes, peer_path)
    raise ValueError(f"no pipeline setup for method {ms.spec!r}")


def _every_weight(nbytes: dict[str, int]) -> Any:
    return lambda: (sum(nbytes.values()), "estimate: every weight, once a generation")


PHASE_OF = {"text_encoder": "encode", "vae": "decode"}
"""The timer's phase of each component whose phase is not named after it (the transformers' are)."""


def _every_weight_every_call(model: Any, nbytes: dict[str, int]) -> Any:
    """Each component's weights times its calls in the last generation."""

    def streamed() -> tuple[int | None, str]:
        calls = model.timer.last_step.get("phase_calls", {})
        total = 0
        for name, size in nbytes.items():  # parameter names start with their component's
            component = name.split(".", 1)[0]
            total += size * calls.get(PHASE_OF.get(component, component), 0)
        return total, "estimate: each component's weights at each of its calls"

    return streamed


def _prepare_ours(ms: MethodSpec, model: Any, device: str, nbytes: dict[str, int]) -> Prepared:
    ft = _import_ours()
    kwargs: dict[str, Any] = {"device": device}
    if ms.name == "ours_budget":
        kwargs["gpu_memory_budget"] = ms.arg
    elif ms.name == "ours_frac":
        kwargs["max_gpu_mem_fraction"] = float(ms.arg or 0)
    if "map" in ms.options:
        kwargs["map_embeddings"] = ms.options["map"] == "on"
    pipe = ft.offload(model.pipe, config=ft.OffloadConfig(**kwargs))
    info = {"impl_file": ft.__file__, "impl_version": getattr(ft, "__version__", None), "config": kwargs}

    def streamed() -> tuple[int | None, str]:
        """Each component's streamed bytes per forward, times its forwards in the last generation."""
        calls = model.timer.last_step.get("phase_calls", {})
        total = 0
        for name, component in ft.report(pipe).to_dict().items():
            per_call = sum(u["nbytes"] for u in component["units"] if u["placement"] == "streamed")
            total += per_call * calls.get(PHASE_OF.get(name, name), 0)
        return total, "plan x forwards (uploads when a component lays out again are not counted)"

    def details() -> dict[str, Any]:
        try:
            from flextensor.pipelines.pipeline import pipeline_of

            switches = pipeline_of(pipe)  # how the components switched: at steps, ahead, at a run's end
            counters = {k: getattr(switches, k) for k in ("vacated", "laid_out_ahead", "switched_at_run_end")}
            return {**ft.report(pipe).to_dict(), "pipeline_switches": counters}
        except Exception as exc:  # extra information only: never lose the run over it
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}

    return Prepared(model, lambda: str(ft.phase(pipe)), 0, streamed, info, details)


def _prepare_peer(
    ms: MethodSpec, model: Any, device: str, nbytes: dict[str, int], peer_path: str | None
) -> Prepared:
    import torch

    ft = _import_peer(peer_path)
    kwargs: dict[str, Any] = {"include_patterns": ["blocks.*"]}
    if ms.name == "flextensor050_budget":
        card = torch.cuda.get_device_properties(torch.device(device)).total_memory
        kwargs["max_gpu_mem_fraction"] = round(parse_bytes(ms.arg or "0") / card, 4)
    elif ms.name == "flextensor050_frac":
        kwargs["max_gpu_mem_fraction"] = float(ms.arg or 0)
    for name, component in model.named_children():
        if name not in TRANSFORMERS:
            component.to(device)
    for name in TRANSFORMERS:
        ft.offload(getattr(model, name), config=ft.OffloadConfig(**kwargs), name=name)

    def phase() -> str:
        phases = {str(ft.get_offload_manager(name).phase.value) for name in TRANSFORMERS}
        return "inference" if phases == {"inference"} else "learning"

    def streamed() -> tuple[int | None, str]:
        return _under(nbytes, list(TRANSFORMERS)), "upper bound: every transformer weight, once"

    info = {"impl_file": ft.__file__, "impl_version": ft.__version__, "config": kwargs}
    return Prepared(model, phase, 0, streamed, info)
