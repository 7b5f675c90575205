"""Patterns -> offload units and the split of parameters into streamed and resident.

Evaluation order (see docs/patterns.md):

1. ``include_patterns`` select candidate modules (never the root). A candidate that never runs its own
   ``forward`` (``nn.ModuleList`` and other pure containers), or that holds more than half of the model's
   parameter bytes, is replaced by its children, recursively.
2. Ancestor guard: in ``named_modules`` order, a candidate whose ancestor is already a unit is skipped.
3. ``exclude_patterns``: a module matched by path or class keeps every parameter under it resident (a
   matched unit or ancestor of units so loses all of them); a matched parameter FQN stays resident.
4. A parameter (or storage) reachable from more than one unit stays resident; so does one reachable from a
   unit and from outside every unit, unless each holder outside is a module with no unit inside it (UMT5's
   ``shared`` beside its unit ``encoder.embed_tokens``): such a holder becomes an *alias* of the unit, whose
   calls load the unit's weights as the unit's own do (see [Note: tied aliases] in phases/discovery.py).
5. A parameter that is a tensor subclass (torchao, quanto quantized weights) stays resident, with a warning
   (see [Note: tensor-subclass weights] in weights/subclasses.py). A unit left with nothing to stream is
   dropped.

Buffers are never offloaded and are not listed. ``select`` reads the model and never modifies it.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from flextensor.common.sizes import format_bytes
from flextensor.config.patterns import (
    class_names,
    is_class_pattern,
    match_exclude,
    match_include,
    validate_pattern,
)
from flextensor.errors import SelectionError
from flextensor.weights.subclasses import is_wrapper_subclass


@dataclass(frozen=True)
class Selection:
    """Which modules stream their weights and which parameters stay resident on the device.

    Parameter names are ``model.named_parameters()`` names (first-seen, deduplicated).
    """

    units: tuple[str, ...]
    """Offload unit module paths, in ``named_modules`` order; never nested."""
    unit_parameters: dict[str, tuple[str, ...]]
    """Unit path -> the parameter FQNs it streams, in ``named_parameters`` order."""
    resident_parameters: tuple[str, ...]
    """Every other parameter FQN of the model, in ``named_parameters`` order."""
    resident_reasons: dict[str, str]
    """FQN -> why a parameter under a unit stays resident (excluded, tied or a tensor subclass)."""
    unit_aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Unit path -> the module paths outside every unit that hold some of its streamed parameters (tied),
    for the units that have any."""
    _unit_by_parameter: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Frozen, so set the derived index through object.__setattr__; it makes unit_of() O(1).
        index = {name: unit for unit, names in self.unit_parameters.items() for name in names}
        object.__setattr__(self, "_unit_by_parameter", index)

    def streamed_parameters(self) -> tuple[str, ...]:
        """All streamed parameter FQNs, unit by unit."""
        return tuple(name for unit in self.units for name in self.unit_parameters[unit])

    def unit_of(self, parameter_name: str) -> str | None:
        """The unit that streams ``parameter_name``, or None if it is resident or unknown."""
        return self._unit_by_parameter.get(parameter_name)

    def __repr__(self) -> str:
        shown = ", ".join(self.units[:4]) + (f", ... (+{len(self.units) - 4})" if len(self.units) > 4 else "")
        return (
            f"Selection({len(self.units)} units streaming {len(self._unit_by_parameter)} parameters, "
            f"{len(self.resident_parameters)} resident; units: {shown or 'none'})"
        )


def select(model: nn.Module, include_patterns: Sequence[str], exclude_patterns: Sequence[str]) -> Selection:
    """Resolve ``include_patterns`` and ``exclude_patterns`` against ``model`` into a ``Selection``.

    Warns (``UserWarning``) for each pattern that matches nothing, with the closest real names.
    Raises ``SelectionError`` for a malformed pattern, or when nothing would be streamed.
    """
    include = _checked(include_patterns, "include_patterns")
    exclude = _checked(exclude_patterns, "exclude_patterns")
    # Every path, aliases of shared modules included, so ties and excludes see every way in.
    all_modules = list(model.named_modules(remove_duplicate=False))
    occurrences = [
        (path, _join(path, name), param)
        for path, module in all_modules
        for name, param in module._parameters.items()
        if param is not None
    ]
    _warn_unmatched(include, exclude, all_modules, occurrences)

    units = _guarded_units(model, _candidates(all_modules, include))
    excluded_at = _first_matches(exclude, all_modules)
    canonical = {id(param): name for name, param in model.named_parameters()}

    by_storage: dict[object, list[tuple[str, str, nn.Parameter]]] = {}
    for occurrence in occurrences:
        by_storage.setdefault(_storage_key(occurrence[2]), []).append(occurrence)

    unit_set = frozenset(units)
    streamed: dict[str, str] = {}  # canonical FQN -> unit
    reasons: dict[str, str] = {}
    outside_holders: dict[str, list[str]] = {}  # canonical FQN -> paths holding it outside every unit
    for group in by_storage.values():
        owners = {_owner(path, unit_set) for path, _, _ in group}
        if owners == {None}:
            continue  # no unit reaches it: resident, and the user never asked for it
        outside = [path for path, _, _ in group if _owner(path, unit_set) is None]
        for param in {id(p): p for _, _, p in group}.values():
            name = canonical[id(param)]
            reason = _resident_reason(name, param, group, owners, exclude, excluded_at, unit_set)
            if reason is None:
                (unit,) = owners - {None}  # one unit: anything else gave a reason
                assert unit is not None
                streamed[name] = unit
                outside_holders[name] = outside
            else:
                reasons[name] = reason
    aliases = _aliases(dict(all_modules), streamed, outside_holders, reasons)
    _warn_subclasses(reasons, dict(model.named_parameters()))

    unit_parameters: dict[str, list[str]] = {}
    for name in canonical.values():
        if name in streamed:
            unit_parameters.setdefault(streamed[name], []).append(name)
    kept = tuple(unit for unit in units if unit in unit_parameters)
    if not kept:
        raise SelectionError(_nothing_streamed(model, include, exclude, units))
    return Selection(
        units=kept,
        unit_parameters={unit: tuple(unit_parameters[unit]) for unit in kept},
        resident_parameters=tuple(name for name in canonical.values() if name not in streamed),
        resident_reasons={name: reasons[name] for name in canonical.values() if name in reasons},
        unit_aliases={unit: tuple(aliases[unit]) for unit in kept if aliases.get(unit)},
    )


SUBCLASS_REASON = "a tensor subclass, which flextensor cannot stream"
"""Why a wrapper-subclass weight (torchao, quanto) under a unit stays on the device: see [Note:
tensor-subclass weights] in weights/subclasses.py."""


def _warn_subclasses(reasons: dict[str, str], params: dict[str, nn.Parameter]) -> None:
    """One warning for the weights under units that stay resident for being tensor subclasses: the
    user asked to offload them, and they will hold device memory."""
    kept = [name for name, reason in reasons.items() if reason.startswith(SUBCLASS_REASON)]
    if not kept:
        return
    kinds = sorted({type(params[name]).__name__ for name in kept})
    nbytes = sum(_tensor_bytes(params[name]) for name in kept)
    shown = ", ".join(kept[:3]) + (f", ... (+{len(kept) - 3})" if len(kept) > 3 else "")
    warnings.warn(
        f"{len(kept)} parameter(s) under offload units ({shown}; {format_bytes(nbytes)}) are tensor "
        f"subclasses ({', '.join(kinds)}, e.g. torchao or quanto quantized weights), which flextensor cannot "
        "stream: they stay on the device. To stream them, keep the weights as plain tensors (unquantized, a "
        "float8 dtype, GGUF, bitsandbytes); exclude these modules to silence this warning",
        stacklevel=3,
    )


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a wrapper subclass's inner tensors (quantized data, scales), else its own."""
    if not is_wrapper_subclass(tensor) or not hasattr(tensor, "__tensor_flatten__"):
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__()
    return sum(_tensor_bytes(getattr(tensor, name)) for name in names)


def _checked(patterns: Sequence[str], field_name: str) -> tuple[str, ...]:
    # A bare string would be iterated character by character and select nonsense.
    if isinstance(patterns, str):
        raise SelectionError(f"{field_name} must be a list of patterns, not a string; write [{patterns!r}]")
    try:
        return tuple(validate_pattern(pattern) for pattern in patterns)
    except ValueError as error:
        raise SelectionError(f"{field_name}: {error}") from error


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _ancestors(path: str) -> Iterator[str]:
    """Proper ancestors of a dotted path, outermost first, the root ("") included."""
    yield ""
    parts = path.split(".") if path else []
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def _runs_forward(module: nn.Module) -> bool:
    """Whether the module's class has a forward of its own; pure containers never run one."""
    return type(module).forward is not nn.Module.forward


MAX_UNIT_FRACTION = 0.5
"""A selected module holding more than this share of the model's parameter bytes is split into its
children: streaming it whole would need most of the model on the device at once (``include=["*"]`` on a
``LlamaForCausalLM`` selects ``model``, which holds every decoder layer)."""


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _candidates(all_modules: list[tuple[str, nn.Module]], include: tuple[str, ...]) -> set[int]:
    """ids of modules selected by ``include``; containers and modules too large to stream whole are
    replaced by their children, recursively."""
    chosen: set[int] = set()
    total = _parameter_bytes(all_modules[0][1]) if all_modules else 0

    def add(module: nn.Module) -> None:
        too_large = total > 0 and _parameter_bytes(module) > MAX_UNIT_FRACTION * total
        has_children = any(True for _ in module.children())
        if _runs_forward(module) and not (too_large and has_children):
            chosen.add(id(module))
        else:
            for child in module.children():
                add(child)

    for path, module in all_modules:
        if path and any(match_include(pattern, path, type(module)) for pattern in include):
            add(module)
    return chosen


def _guarded_units(model: nn.Module, chosen: set[int]) -> tuple[str, ...]:
    """The ancestor guard: candidates in module order, minus those under an earlier unit."""
    units: dict[str, None] = {}
    for path, module in model.named_modules():
        if path and id(module) in chosen and not any(a in units for a in _ancestors(path)):
            units[path] = None
    return tuple(units)


def _first_matches(exclude: tuple[str, ...], all_modules: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Module path -> the first exclude pattern matching it by path or class."""
    matches: dict[str, str] = {}
    for path, module in all_modules:
        hit = next((p for p in exclude if match_exclude(p, path, type(module))), None)
        if hit is not None:
            matches[path] = hit
    return matches


def _owner(module_path: str, unit_set: frozenset[str]) -> str | None:
    """The unit whose subtree holds ``module_path``, or None when no unit does."""
    for path in (*_ancestors(module_path), module_path):
        if path in unit_set:
            return path
    return None


def _aliases(
    modules: dict[str, nn.Module],
    streamed: dict[str, str],
    outside_holders: dict[str, list[str]],
    reasons: dict[str, str],
) -> dict[str, dict[str, None]]:
    """Unit -> the modules outside every unit that stand for it (tied weights), one path per module.

    A module holding weights of two units cannot stand for both (a call of it would load one of them):
    those weights stay resident (moved from ``streamed`` to ``reasons``). A second path to a module
    inside a unit is no alias: it is the unit's own module; inside another unit, the weight is shared by
    two units, resident."""
    unit_modules = {id(m): unit for unit in set(streamed.values()) for m in modules[unit].modules()}
    stands_for: dict[int, set[str]] = {}
    for name, unit in streamed.items():
        for path in outside_holders.get(name, ()):
            stands_for.setdefault(id(modules[path]), set()).add(unit)
    for name, unit in list(streamed.items()):
        for path in outside_holders.get(name, ()):
            module = id(modules[path])
            others = stands_for[module] - {unit}
            if unit_modules.get(module, unit) != unit:  # inside another unit, by a second path
                others.add(unit_modules[module])
            if others:
                del streamed[name]
                also = ", ".join(sorted(others))
                reasons[name] = f"tied: also used by {path}, which holds weights of {also} too"
                break
    aliases: dict[str, dict[str, None]] = {}
    seen: dict[str, set[int]] = {}
    for name, unit in streamed.items():
        for path in outside_holders.get(name, ()):
            module = id(modules[path])
            if unit_modules.get(module) == unit or module in seen.setdefault(unit, set()):
                continue
            seen[unit].add(module)
            aliases.setdefault(unit, {})[path] = None
    return aliases


def _can_alias(module_path: str, unit_set: frozenset[str]) -> bool:
    """Whether a module outside every unit may stand for a unit whose weight it holds (tied): not the root
    and no unit inside it, so a call of it is a call of that unit alone."""
    return bool(module_path) and not any(unit.startswith(module_path + ".") for unit in unit_set)


def _storage_key(param: nn.Parameter) -> object:
    """Parameters sharing one storage share a key; meta, empty or exotic tensors key by identity."""
    try:
        if param.device.type != "meta":
            pointer = param.untyped_storage().data_ptr()
            if pointer:  # 0 for empty storages, which would otherwise all look shared
                return (param.device, pointer)
    except (RuntimeError, NotImplementedError, TypeError):
        pass  # tensor subclasses without a plain storage
    return id(param)


def _excluded_by(
    fqn: str, module_path: str, exclude: tuple[str, ...], excluded_at: dict[str, str]
) -> str | None:
    # Outermost match first: "excluded by 'layers.31'" explains more than a match on a leaf inside it.
    for path in (*_ancestors(module_path), module_path):
        if path in excluded_at:
            return excluded_at[path]
    return next((p for p in exclude if match_exclude(p, fqn, None)), None)


def _describe(pattern: str) -> str:
    return f"excluded by {pattern}" if is_class_pattern(pattern) else f"excluded by {pattern!r}"


def _resident_reason(
    name: str,
    param: nn.Parameter,
    group: list[tuple[str, str, nn.Parameter]],
    owners: set[str | None],
    exclude: tuple[str, ...],
    excluded_at: dict[str, str],
    unit_set: frozenset[str],
) -> str | None:
    """Why a parameter reached by a unit stays resident, or None if it streams."""
    home = next(path for path, fqn, _ in group if fqn == name)
    hit = _excluded_by(name, home, exclude, excluded_at)
    if hit is not None:
        return _describe(hit)
    if is_wrapper_subclass(param):
        return f"{SUBCLASS_REASON} ({type(param).__name__})"
    others = list(dict.fromkeys(path or "<root>" for path, fqn, _ in group if fqn != name))
    if len(owners - {None}) > 1:
        return f"tied: also used by {', '.join(others)}"
    outside = {path for path, _, _ in group if _owner(path, unit_set) is None}
    cannot_alias = sorted(path or "<root>" for path in outside if not _can_alias(path, unit_set))
    if cannot_alias:  # a holder with units inside it: its calls span theirs, they cannot load this one
        return f"tied: also used by {', '.join(cannot_alias)}, which holds offload units"
    if len({id(p) for _, _, p in group}) > 1:
        # Streaming one view would neither free the storage nor keep the views consistent.
        views = dict.fromkeys(fqn for _, fqn, p in group if p is not param)
        return f"tied: shares storage with {', '.join(views)}"
    for path, fqn, p in group:  # an alias inside the same unit may be excluded by its own name
        hit = _excluded_by(fqn, path, exclude, excluded_at) if p is param and fqn != name else None
        if hit is not None:
            return _describe(hit)
    return None


def _generalised(path: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn``: suggestions that read like patterns."""
    return ".".join("*" if segment.isdigit() else segment for segment in path.split("."))


def _warn_unmatched(
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    all_modules: list[tuple[str, nn.Module]],
    occurrences: list[tuple[str, str, nn.Parameter]],
) -> None:
    """Warn once per pattern that matches no module (or, for excludes, no parameter) at all."""
    named = [(path, module) for path, module in all_modules if path]
    paths = [path for path, _ in named]
    fqns = [fqn for _, fqn, _ in occurrences]
    classes = list(dict.fromkeys(n for _, m in all_modules for n in class_names(type(m))))
    for kind, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns:
            if kind == "include":
                hit = any(match_include(pattern, path, type(m)) for path, m in named)
            else:
                hit = any(match_exclude(pattern, path, type(m)) for path, m in all_modules) or any(
                    match_exclude(pattern, fqn, None) for fqn in fqns
                )
            if hit:
                continue
            root_only = kind == "include" and match_include(pattern, "", type(all_modules[0][1]))
            if is_class_pattern(pattern):
                pool, what = [f"class:{name}" for name in classes], "module classes"
            else:
                pool = [*paths, *map(_generalised, paths)]
                if kind == "exclude":  # excludes also name parameters, at any depth via "*."
                    pool += [*fqns, *("*." + n.rpartition(".")[2] for n in paths + fqns)]
                what = "names"
            close = difflib.get_close_matches(pattern, list(dict.fromkeys(pool)), n=3)
            hint = f"closest {what}: {', '.join(map(repr, close))}" if close else f"no {what} are close"
            where = " but the root, which is never an offload unit" if root_only else " in this model"
            warnings.warn(f"{kind} pattern {pattern!r} matches nothing{where}; {hint}", stacklevel=3)


def _nothing_streamed(
    model: nn.Module,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    units: tuple[str, ...],
) -> str:
    """The SelectionError message: the patterns, why nothing streams, and names that would work."""
    if not any(True for _ in model.parameters()):
        return (
            f"{type(model).__name__} has no parameters, so there is nothing to offload; offload the model "
            "that holds the weights"
        )
    top = [name for name, _ in model.named_children()]
    # A repeated block list (layers, h, blocks) is what most users want to stream; never suggest a
    # pattern that was just tried.
    lists = [p for p, m in model.named_modules() if p and not _runs_forward(m) and len(m._modules) > 1]
    candidates = [f"{p}.*" for p in lists] + top + ["*"]
    example = next((c for c in candidates if c not in include), None)
    other = f"include_patterns=[{example!r}]" if example is not None else None
    if units:
        why = (
            f"the {len(units)} offload unit(s) found ({', '.join(units[:3])}) keep every parameter "
            "resident (excluded, tied or tensor subclasses): loosen exclude_patterns"
            + (f", or try {other}" if other else "")
        )
    else:
        why = "they select no module that runs a forward" + (f"; try {other}" if other else "")
    n_modules = sum(1 for _ in model.modules())
    return (
        f"include_patterns={list(include)} with exclude_patterns={list(exclude)} stream nothing in "
        f"{type(model).__name__} ({n_modules} modules): {why}. "
        f"Top-level modules: {', '.join(map(repr, top[:8])) or 'none'}"
    )
