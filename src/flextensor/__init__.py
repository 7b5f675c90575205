# Import rules (tests/test_import_rules.py checks them; its KNOWN_VIOLATIONS lists today's exceptions).
# Each package may import only the packages above it in this table, itself, and ``errors``:
#
#   common     sizes, json codec + atomic write, log, progress
#   codec      the bf16 codec
#   config     the schema, env / YAML sources, patterns
#   plan       no torch: Plan, planner, simulator, ring layout, measurements, host plan
#   device     runtime and CPU stand-ins, raw CUDA calls, link probes, host limits
#   host       pack kinds, staging ring, checkpoint reading; host.shared: the node-shared copy
#   store      units, the device store, range copies, nesting, mapping, stream order, coded loads
#   weights    selection, packing, streamed weights from outside, edits and their guards
#   phases     learning, discovery, profiling, steady, timeline
#   hooks      model hooks, their functions, forward bracket, compiled custom ops
#   engine     the controller and its parts, status, edit session, budgets
#   profiles   saved profiles
#   pipelines  whole pipelines
#   api        the public verbs
#   observe    report, trace, probe
#   vllm       the vLLM plugin (an integration on the public verbs, as the CLI is)
#   cli        the command and the demo
#
# This file (the package root) may import anything.
"""flextensor: run PyTorch models larger than the GPU's memory.

Selected weights live in pinned host RAM and stream to the GPU just before the module that reads them
runs, prefetched on a side stream so the copies hide under compute. Importing this package does not
touch CUDA.

The public surface is ``flextensor.__all__``, ``flextensor.codec`` and ``flextensor.vllm``; every other
module path is private and may move.

The data path, one package each: ``weights`` (patterns -> offload units -> host packs of ``host``),
``phases`` (discovery and profiling in the first forwards, then the steady-state step), ``plan``
(measurements -> ``Plan``: planner, simulator, ring layout), ``store`` (the device store and the units'
placement), ``hooks`` (what runs around each module), ``engine`` (the controller: what each forward's
start and end decide), ``observe`` (report, trace).
"""

from __future__ import annotations

from flextensor.api import (
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
from flextensor.common.log import configure_logging
from flextensor.common.version import __version__
from flextensor.config.schema import OffloadConfig
from flextensor.config.sources import load_config
from flextensor.engine.status import OffloadStatus, UnitStatus
from flextensor.errors import (
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
from flextensor.observe.report import report
from flextensor.observe.trace import trace
from flextensor.weights.edits import editing

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
