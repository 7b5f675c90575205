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

    def flextensor_save_profile(self, path: str) -> str:
        """``flextensor.save_profile(model, path)`` of this worker's model (after a steady step); a
        ``{rank}`` in ``path`` becomes the worker's rank, for engines with several. Returns the path
        written; pass it back as ``"profile"`` under ``"flextensor"`` to start from it next time."""
        from flextensor import save_profile

        written = path.format(rank=getattr(self, "rank", 0))
        save_profile(self.model_runner.get_model(), written)  # type: ignore[attr-defined]
        return written
