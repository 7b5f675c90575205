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
        from flextensor import report

        return report(self.model_runner.get_model()).to_dict()  # type: ignore[attr-defined]
