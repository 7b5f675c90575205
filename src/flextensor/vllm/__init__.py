"""flextensor inside vLLM: ``--load-format flextensor`` (see docs/vllm.md).

``register`` is the ``vllm.general_plugins`` entry point; ``WorkerExtension`` adds ``flextensor_report`` to
vLLM's workers. Nothing here is imported by ``import flextensor``; the modules that import vLLM (loader,
offloader) are imported only when vLLM loads its plugins.
"""

from __future__ import annotations

from flextensor.vllm.worker import WorkerExtension

__all__ = ["LOAD_FORMAT", "WorkerExtension", "register"]

LOAD_FORMAT = "flextensor"


def register() -> None:
    """vLLM's plugin hook: make ``load_format="flextensor"`` known. Called once per vLLM process (main,
    engine core, each worker); importing the loader module registers it, so a second call does nothing."""
    from flextensor.vllm import loader  # noqa: F401
