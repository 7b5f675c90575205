"""The exceptions flextensor raises.

    FlexTensorError                 base of everything below; catch this to catch them all
    ├── ConfigError (ValueError)    a bad config field, pattern, environment variable or YAML key
    ├── SelectionError (ValueError) the patterns select nothing, or select something unusable
    ├── AlreadyOffloadedError       offload() on a model that is already offloaded
    ├── NotOffloadedError           an introspection call or release() on a model that is not offloaded
    ├── BudgetError                 the memory budget cannot hold what this model needs at this input
    ├── ProfileError (ValueError)   a saved profile is unreadable, of another version, or of another model
    ├── ConcurrentForwardError      a forward entered from a second thread while one runs
    └── BackwardNotSupportedError   a backward pass reached weights that were streamed for inference

Each message names the object at fault, the constraint and what to do.
"""

from __future__ import annotations


class FlexTensorError(Exception):
    """Base class of every error flextensor raises on purpose."""


class ConfigError(FlexTensorError, ValueError):
    """A configuration value is invalid; raised when the config is built."""


class SelectionError(FlexTensorError, ValueError):
    """The include/exclude patterns select nothing usable in this model."""


class AlreadyOffloadedError(FlexTensorError, RuntimeError):
    """offload() was called on a model that flextensor already manages."""


class NotOffloadedError(FlexTensorError, RuntimeError):
    """The model passed is not managed by flextensor."""


class BudgetError(FlexTensorError, RuntimeError):
    """The GPU memory budget is below what the model needs at this input."""


class ProfileError(FlexTensorError, ValueError):
    """A saved profile cannot be used: unreadable, another version, or another model."""


class ConcurrentForwardError(FlexTensorError, RuntimeError):
    """A forward was entered from a second thread while one is running."""


class BackwardNotSupportedError(FlexTensorError, RuntimeError):
    """Backward through streamed weights: flextensor streams weights for inference only."""
