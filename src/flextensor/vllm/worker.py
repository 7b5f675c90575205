"""The methods flextensor adds to vLLM's workers (``worker_extension_cls``), for ``collective_rpc``."""

from __future__ import annotations

from typing import Any

__all__ = ["WorkerExtension"]


class WorkerExtension:
    """Pass ``worker_extension_cls="flextensor.vllm.WorkerExtension"`` to ``LLM`` or ``vllm serve``; then
    ``llm.collective_rpc("flextensor_report")`` returns each rank's report. vLLM mixes this class into its
    worker, so ``self`` is the worker and ``self.model_runner`` its model runner."""

    def flextensor_report(self) -> dict[str, Any]:
        """``flextensor.report(model).to_dict()`` of this worker's model (needs a steady step: one generate
        call after the engine started is enough)."""
        from flextensor.observe.report import report

        return report(self.model_runner.get_model()).to_dict()  # type: ignore[attr-defined]

    def flextensor_device_memory(self) -> dict[str, int]:
        """This worker's device memory as PyTorch's caching allocator counts it, in bytes: ``allocated``
        now, its ``peak`` since the worker started, and ``reserved`` (allocated plus cached). Works with
        any load format, so offloading methods can be compared at equal memory. Zeros on a CPU."""
        import torch

        device = getattr(self, "device", None)
        if device is None or torch.device(device).type != "cuda":
            return {"allocated": 0, "peak": 0, "reserved": 0}
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "peak": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
        }

    def flextensor_runtime(self) -> dict[str, Any]:
        """How vLLM runs this worker's model, whatever the load format: its model ``runner`` and installed
        ``offloader`` (class names), its CUDA-graph mode (``cudagraph_mode``, after the loader's choice,
        see docs/vllm.md) and how many graphs it has captured in this process (``cuda_graphs_captured``).
        A way to check that an offloading option took effect (vLLM 0.26's V2 runner ignores its own)."""
        from vllm.compilation.counter import compilation_counter
        from vllm.model_executor.offloader.base import get_offloader

        mode = self.vllm_config.compilation_config.cudagraph_mode  # type: ignore[attr-defined]
        return {
            "runner": type(self.model_runner).__name__,  # type: ignore[attr-defined]
            "offloader": type(get_offloader()).__name__,
            "cudagraph_mode": getattr(mode, "name", str(mode)),
            "cuda_graphs_captured": compilation_counter.num_cudagraph_captured,
        }

    def flextensor_save_profile(self, path: str) -> str:
        """``flextensor.save_profile(model, path)`` of this worker's model (after a steady step); a
        ``{rank}`` in ``path`` becomes the worker's rank, for engines with several. Returns the path
        written; pass it back as ``"profile"`` under ``"flextensor"`` to start from it next time."""
        from flextensor.api import save_profile

        written = path.format(rank=getattr(self, "rank", 0))
        save_profile(self.model_runner.get_model(), written)  # type: ignore[attr-defined]
        return written
