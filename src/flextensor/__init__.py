"""flextensor: run PyTorch models larger than the GPU's memory.

Selected weights live in pinned host RAM and stream to the GPU just before the module that reads them
runs, prefetched on a side stream so the copies hide under compute. Importing this package does not
touch CUDA.
"""

from __future__ import annotations

from .api import (
    offload,
    offload_units,
    offloaded_parameters,
    phase,
    record_next_step,
    release,
    resident_parameters,
    save_profile,
)
from .config import OffloadConfig, load_config
from .errors import (
    AlreadyOffloadedError,
    BackwardNotSupportedError,
    BudgetError,
    ConcurrentForwardError,
    ConfigError,
    FlexTensorError,
    NotOffloadedError,
    ProfileError,
    SelectionError,
)
from .log import configure_logging
from .reporting import report
from .tracing import trace

__version__ = "0.1.0"

configure_logging()  # the "flextensor" logger: quiet unless FT_LOG_LEVEL is set

__all__ = [
    "AlreadyOffloadedError",
    "BackwardNotSupportedError",
    "BudgetError",
    "ConcurrentForwardError",
    "ConfigError",
    "FlexTensorError",
    "NotOffloadedError",
    "OffloadConfig",
    "ProfileError",
    "SelectionError",
    "__version__",
    "load_config",
    "offload",
    "offload_units",
    "offloaded_parameters",
    "phase",
    "record_next_step",
    "release",
    "report",
    "resident_parameters",
    "save_profile",
    "trace",
]
