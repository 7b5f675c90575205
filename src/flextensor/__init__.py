"""flextensor: run PyTorch models larger than the GPU's memory.

Selected weights live in pinned host RAM and stream to the GPU just before the module that reads them
runs, prefetched on a side stream so the copies hide under compute. Importing this package does not
touch CUDA.

The data path, one module each: ``selection`` (patterns -> offload units), ``packing`` (units -> host
packs, ``host_store`` / ``shared_store``), ``discovery`` and ``profiling`` (the first forwards),
``planner`` with ``simulator`` and ``layout`` (measurements -> ``plan``), ``slots`` and ``steady`` (the
device store and the steady-state hot path), ``learning`` (the phases and when each has learned
enough), ``engine`` (the controller: what each forward's start and end decide), ``weight_access``
(streamed weights as ``state_dict``/``release`` see them), ``weight_edits`` (in-place edits),
``reporting`` / ``tracing``.
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
    set_budget,
    status,
)
from .config import OffloadConfig
from .config_sources import load_config
from .errors import (
    AlreadyOffloadedError,
    BackwardNotSupportedError,
    BudgetError,
    CheckpointError,
    ConcurrentForwardError,
    ConfigError,
    DeviceError,
    FlexTensorError,
    HostBudgetError,
    NoCudaError,
    NotOffloadedError,
    PinningError,
    PlanError,
    ProfileError,
    SelectionError,
    SharedMemoryError,
    UnsupportedModelError,
    UnsupportedOperationError,
)
from .log import configure_logging
from .reporting import report
from .status import OffloadStatus, UnitStatus
from .tracing import trace
from .weight_edits import editing

__version__ = "0.1.0"

configure_logging()  # the "flextensor" logger: quiet unless FT_LOG_LEVEL is set

__all__ = [
    "AlreadyOffloadedError",
    "BackwardNotSupportedError",
    "BudgetError",
    "CheckpointError",
    "ConcurrentForwardError",
    "ConfigError",
    "DeviceError",
    "FlexTensorError",
    "HostBudgetError",
    "NoCudaError",
    "NotOffloadedError",
    "OffloadConfig",
    "OffloadStatus",
    "PinningError",
    "PlanError",
    "ProfileError",
    "SelectionError",
    "SharedMemoryError",
    "UnitStatus",
    "UnsupportedModelError",
    "UnsupportedOperationError",
    "__version__",
    "editing",
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
    "set_budget",
    "status",
    "trace",
]
