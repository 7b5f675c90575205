"""Parameters and modules of an offloaded model's units replaced between forwards: refused outside editing.

[Note: replaced weights]
A unit's parameters are the objects offload() packed: the hooks point them at the arena, and
``state_dict()`` and ``release()`` read their packs. A parameter or module that replaced one of them
between forwards (``m.weight = nn.Parameter(w)``, ``model.layers[i] = NewLayer()``), or a
reparametrization that takes one out of its module (``torch.nn.utils.weight_norm`` and ``spectral_norm``,
``torch.nn.utils.parametrizations.*``), would leave forwards computing with the newcomer while
``state_dict()`` and ``release()`` kept the packed weight. Two of torch's global registration hooks
(installed at the first offload) see every parameter and module registered in the process; on a module
of an offloaded model, outside ``flextensor.editing`` and outside a forward, a registration that takes a
unit's parameter out of the model is refused before it happens, as ``load_state_dict`` is.

A reparametrization deletes the weight before it registers anything (``weight_norm`` deletes ``weight``,
then registers ``weight_g``; ``register_parametrization`` deletes it, swaps the module's class and
``set_``s the weight to itself, then registers ``parametrizations``): the refusal puts the weight and the
class back first, and discards the in-place writes since the last forward (the weights reload from their
packs), so the model is left as it was and working. Inside ``editing`` these changes are edits like any
other: a parameter that left the model stops streaming, new ones stay on the device (engine/edit_session.py).

Cost: a dictionary lookup per registration anywhere in the process; nothing per forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from flextensor.errors import UnsupportedOperationError
from flextensor.weights.edits import discard_edits, own_class
from flextensor.weights.packing import is_offloaded_module

if TYPE_CHECKING:
    from flextensor.engine.controller import OffloadEngine

__all__ = ["watch_structure"]

_GUARD = "_flextensor_guard"  # see weights/edits.py

_HOLDERS: weakref.WeakKeyDictionary[nn.Module, tuple[type, dict[str, nn.Parameter]]] = (
    weakref.WeakKeyDictionary()
)
"""Every module that holds unit parameters itself -> (its class, name -> parameter), as last seen."""

_installed: list[object] = []


def watch_structure(engine: OffloadEngine) -> None:
    """Note which modules hold ``engine``'s unit parameters (plan time: at offload, after an edit) and
    install the registration hooks once per process."""
    if not _installed:
        _installed.append(register_module_parameter_registration_hook(_on_parameter))
        _installed.append(register_module_module_registration_hook(_on_module))
    held: dict[nn.Module, dict[str, nn.Parameter]] = {}
    for module in engine.model.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) in engine.owner_of:
                held.setdefault(module, {})[key] = param
    for module, params in held.items():
        _HOLDERS[module] = (type(module), params)


def _unit_engine(param: object) -> OffloadEngine | None:
    """The engine that streams ``param``, if it is a unit parameter of a live one."""
    guard = getattr(param, "__dict__", {}).get(_GUARD)
    if guard is None or len(guard) != 2:  # not guarded, or a weight outside every unit
        return None
    engine = guard[0]()
    return engine if engine is not None and id(param) in engine.owner_of else None


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    if torch.compiler.is_compiling():
        return  # inside a traced forward: no change between forwards (nor guards on the map)
    if _GUARD not in param.__dict__ and own_class(type(param)) is not type(param):
        param.__class__ = own_class(type(param))  # nn.Parameter(p) of a guarded p (weights.edits._detach)
    old = module._parameters.get(name)
    leaving = [] if old is None or old is param else [old]
    _check(module, leaving, f"registering parameter {name!r} on")


def _on_module(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    if torch.compiler.is_compiling():
        return
    old = parent._modules.get(name)
    leaving = []
    if old is not None and old is not child and is_offloaded_module(old):
        kept = {id(p) for p in child.parameters()} if child is not None else set()
        leaving = [p for p in old.parameters() if id(p) not in kept]
    _check(parent, leaving, f"{'registering' if old is None else 'replacing'} module {name!r} on")


def _check(module: nn.Module, leaving: Iterable[nn.Parameter], what: str) -> None:
    held = _HOLDERS.get(module)
    missing = {
        key: param
        for key, param in (held[1].items() if held is not None else ())
        if module._parameters.get(key) is not param and _unit_engine(param) is not None
    }
    gone = [*leaving, *missing.values()]
    engines = {id(e): e for e in map(_unit_engine, gone) if e is not None}.values()
    refusing = [e for e in engines if e.editing is None and not e.bracket.running]
    if not refusing:
        return
    if held is not None:
        _put_back(module, held[0], missing)
    for engine in refusing:
        edited, _ = engine.watch.changes()
        if edited:  # the refused call's own set_(), or edits that the next forward would discard anyway
            discard_edits(engine, edited)
            engine.watch.arm(engine.units.values(), accept=True)
    names = [p.__dict__[_GUARD][1] for p in gone if _unit_engine(p) is not None]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise UnsupportedOperationError(
        f"{what} a {type(module).__name__} of an offloaded model would take the offloaded weight(s) "
        f"{shown} out of it: forwards "
        "would compute with what replaces them while state_dict() and release() kept the offloaded ones. "
        "Make the change inside `with flextensor.editing(model): ...` (weight_norm, spectral_norm and "
        "parametrizations too), or call flextensor.release(model) first; nothing was changed"
    )


def _put_back(module: nn.Module, cls: type, missing: dict[str, nn.Parameter]) -> None:
    """Undo what a reparametrization did to ``module`` before the refused registration: the unit
    parameters it deleted, the class ``register_parametrization`` swapped in."""
    for key, param in missing.items():
        if key not in module.__dict__:
            module._parameters[key] = param
    injected = type(module)
    if injected.__bases__ == (cls,) and injected.__name__ == f"Parametrized{cls.__name__}":
        module.__class__ = cls
