"""The exceptions flextensor raises.

    FlexTensorError                       base of everything below; catch this to catch them all
    ├── ConfigError (ValueError)          a bad config field, pattern, environment variable or YAML key
    ├── SelectionError (ValueError)       the patterns select nothing, or select something unusable
    ├── UnsupportedModelError (TypeError) the object cannot be offloaded as it is (not a module, sparse or
    │                                     meta weights, another offloader's hooks, a submodule of an
    │                                     offloaded model)
    ├── AlreadyOffloadedError             offload() on a model that is already offloaded
    ├── NotOffloadedError                 an introspection call or release() on a model that is not offloaded
    ├── UnsupportedOperationError         something done to an offloaded model that would detach or corrupt
    │                                     its weights (a dtype conversion, load_state_dict, jit.trace, pickle)
    ├── BudgetError                       the memory budget cannot hold what this model needs at this input
    │   └── HostBudgetError               the host memory budget cannot hold even the staging ring
    ├── PlanError (ValueError)            a plan, layout or measurement that is inconsistent in itself
    ├── ProfileError (ValueError)         a saved profile is unreadable, of another version or model
    ├── CheckpointError (ValueError)      weights= names no checkpoint, a corrupt one, or one that does not
    │                                     fit the model (missing, unexpected, mis-shaped or mis-typed tensors)
    ├── PinningError                      the OS refused to page-lock host memory (memlock limit)
    ├── SharedMemoryError                 the node-wide shared host copy cannot be created or attached
    ├── ConcurrentForwardError            a forward entered from a second thread while one runs
    ├── BackwardNotSupportedError         a backward pass reached weights that were streamed for inference
    ├── NoCudaError                       a CUDA-only command (``flextensor probe``) without a CUDA device
    ├── DeviceError                       a CUDA call of the streaming hot path failed (the runtime's message)
    └── CodecError (ValueError)           a compressed stream that cannot be decoded as asked (corrupt index,
                                          wrong output, no decoder for its device)

Each message names the object at fault, the constraint and what to do.
"""

from __future__ import annotations


class FlexTensorError(Exception):
    """Base class of every error flextensor raises on purpose."""


class ConfigError(FlexTensorError, ValueError):
    """A configuration value is invalid; raised when the config is built."""


class SelectionError(FlexTensorError, ValueError):
    """The include/exclude patterns select nothing usable in this model."""


class UnsupportedModelError(FlexTensorError, TypeError):
    """The object given cannot be offloaded as it is; the message says what to change first."""


class AlreadyOffloadedError(FlexTensorError, RuntimeError):
    """offload() was called on a model that flextensor already manages."""


class NotOffloadedError(FlexTensorError, RuntimeError):
    """The model passed is not managed by flextensor."""


class UnsupportedOperationError(FlexTensorError, RuntimeError):
    """An operation on an offloaded model that would detach its weights from flextensor's buffers."""


class BudgetError(FlexTensorError, RuntimeError):
    """The GPU memory budget is below what the model needs at this input.

    ``needed_bytes``: the least budget that would do (for what is known when it is raised);
    ``budget_bytes``: the budget refused. A program can raise its budget by the difference
    (``flextensor.set_budget``) without parsing the message."""

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes

    def __reduce__(self) -> tuple:  # pickled (across processes) with its numbers
        return (_budget_error, (type(self), str(self), self.needed_bytes, self.budget_bytes))


class HostBudgetError(BudgetError):
    """The host memory budget cannot hold the staging ring that pageable weights are copied through
    (``needed_bytes``: the host budget that would)."""


def _budget_error(cls: type[BudgetError], message: str, needed: int, budget: int) -> BudgetError:
    return cls(message, needed_bytes=needed, budget_bytes=budget)


class PlanError(FlexTensorError, ValueError):
    """A plan, layout or set of measurements contradicts itself (a flextensor bug or a hand edit)."""


class ProfileError(FlexTensorError, ValueError):
    """A saved profile cannot be used: unreadable, another version, or another model."""


class CheckpointError(FlexTensorError, ValueError):
    """The checkpoint given as ``weights=`` cannot be read, or does not match the model."""


class PinningError(FlexTensorError, RuntimeError):
    """Host memory could not be page-locked (``cudaHostRegister`` refused it)."""


class SharedMemoryError(FlexTensorError, RuntimeError):
    """The shared host copy of the weights cannot be created, attached or waited for."""


class ConcurrentForwardError(FlexTensorError, RuntimeError):
    """A forward was entered from a second thread while one is running."""


class BackwardNotSupportedError(FlexTensorError, RuntimeError):
    """Backward through streamed weights: flextensor streams weights for inference only."""


class NoCudaError(FlexTensorError, RuntimeError):
    """A command that needs a CUDA device ran without one."""


class DeviceError(FlexTensorError, RuntimeError):
    """A CUDA call flextensor made itself (a copy, an event record or wait) failed."""


class CodecError(FlexTensorError, ValueError):
    """A compressed weight stream cannot be encoded or decoded as asked (see flextensor.codec)."""
