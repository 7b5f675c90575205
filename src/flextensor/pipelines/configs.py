"""What each component of a pipeline gets from the pipeline's one config: its unit patterns (the ones
named with its name first, or by default its repeated blocks and its large modules), its entry methods,
and its share of the host budget (see [Note: one budget for a pipeline] in pipelines/pipeline.py)."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from flextensor.common.sizes import align_up, format_bytes
from flextensor.config.patterns import is_class_pattern
from flextensor.config.schema import OffloadConfig
from flextensor.errors import ConfigError, HostBudgetError
from flextensor.host.packs import PAGE, pack_layout
from flextensor.host.staging import staging_layout
from flextensor.weights.selection import select

__all__ = ["component_configs", "default_unit_patterns", "maps_by_default", "split_host_budget"]


REST_UNIT_FRACTION = 8
"""A module outside a component's blocks is a unit when it holds at least 1/8 of the largest block's
weights: those are what a phase's budget misses (a Wan2.2 expert's ``condition_embedder``, 0.45 GB beside
0.68 GB blocks; a text encoder's token embedding). The smaller ones (Wan's ``patch_embedding`` and
``proj_out``, 0.6 MB each; norms, scale tables, a VAE's convolutions) hold too little to matter together,
cost a hook call per forward each, and are the modules most often read directly rather than called, which
a unit first read that way on a later code path would answer with another unit's bytes."""


def default_unit_patterns(module: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of ``module``, the children of each outermost ``nn.ModuleList`` whose children
    hold parameters (a transformer's blocks, a text encoder's layers, a VAE's down and up blocks, the one
    block of LTX-2's connectors), and the large modules among the rest: those that hold no block and at
    least :data:`REST_UNIT_FRACTION` of the largest block's weights (a transformer's embedders, a text
    encoder's token embedding); ``("*",)`` when it has no blocks (see docs/patterns.md for what ``*``
    selects).

    The large ones are units so that a pipeline's component gives them back between its phases: Wan2.2's
    condition embedders are 0.45 GB an expert, and a text encoder's token embedding can outweigh its
    layers (UMT5-XXL's is 2.1 GB, a layer 0.39 GB)."""
    found: list[str] = []
    largest_block = 0
    for path, child in module.named_modules():
        if not path or not isinstance(child, nn.ModuleList):
            continue
        if any(path.startswith(outer + ".") for outer in found):
            continue  # inside a block already found
        blocks = [c for c in child.children() if next(c.parameters(), None) is not None]
        if blocks:  # one block is a unit too: descending into it would cut it into its layers
            found.append(path)
            largest_block = max(largest_block, *(_nbytes(b.parameters()) for b in blocks))
    if not found:
        return ("*",)
    rest: list[str] = []

    def collect(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if path in found:
                continue
            if any(outer.startswith(path + ".") for outer in found):
                collect(path + ".", child)  # holds blocks: its other children are the rest
            elif REST_UNIT_FRACTION * _nbytes(child.parameters()) >= largest_block:
                rest.append(path)

    collect("", module)
    return (*(f"{path}.*" for path in found), *_deepest_holders(module, rest))


def _deepest_holders(module: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` less those whose every weight another of them holds deeper: weights tied between modules
    (UMT5's ``shared`` and ``encoder.embed_tokens``) stream with the nested module, which is the one that
    runs, and the holder on top becomes its alias (see [Note: tied aliases] in phases/discovery.py); two units
    holding one weight would keep it on the device."""
    holder: dict[int, str] = {}
    for path in paths:
        for param in module.get_submodule(path).parameters():
            known = holder.get(id(param))
            if known is None or path.count(".") > known.count("."):
                holder[id(param)] = path
    return [path for path in paths if path in holder.values()]


def _nbytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _split_patterns(patterns: tuple[str, ...], names: set[str], field: str) -> dict[str, list[str]]:
    """Patterns by the component they name (``transformer.blocks.*`` -> transformer: ``blocks.*``);
    class patterns under every component."""
    by_component: dict[str, list[str]] = {name: [] for name in names}
    for pattern in patterns:
        if is_class_pattern(pattern):
            for found in by_component.values():
                found.append(pattern)
            continue
        head, _, rest = pattern.partition(".")
        if head not in names or not rest:
            raise ConfigError(
                f"{field}: {pattern!r} names no component of the pipeline; start each pattern with a "
                f"component's name ({', '.join(sorted(names))}), e.g. '{sorted(names)[0]}.blocks.*', "
                "or use a class: pattern"
            )
        by_component[head].append(rest)
    return by_component


def _has_class(module: nn.Module, pattern: str) -> bool:
    from flextensor.config.patterns import class_names

    wanted = set(class_names(pattern))
    return any(type(m).__name__ in wanted for m in module.modules())


def component_configs(config: OffloadConfig, components: dict[str, nn.Module]) -> dict[str, OffloadConfig]:
    """Each component's config: the pipeline's, with that component's patterns and entry methods."""
    names = set(components)
    default_include = "include_patterns" not in config.model_fields_set
    include = (
        {n: [] for n in names}
        if default_include
        else _split_patterns(config.include_patterns, names, "include_patterns")
    )
    exclude = _split_patterns(config.exclude_patterns, names, "exclude_patterns")
    explicit_entries = "entry_methods" in config.model_fields_set
    for method in config.entry_methods if explicit_entries else ():
        if not any(callable(getattr(type(m), method, None)) for m in components.values()):
            raise ConfigError(f"entry_methods names {method!r}, a method no component of the pipeline has")
    configs = {}
    for name, module in components.items():
        own = [p for p in include[name] if not is_class_pattern(p) or _has_class(module, p)]
        entries = tuple(m for m in config.entry_methods if callable(getattr(type(module), m, None)))
        configs[name] = config.model_copy(
            update={
                "include_patterns": tuple(own) or default_unit_patterns(module),
                "exclude_patterns": tuple(exclude[name]),
                "entry_methods": entries,
                "profile": None,  # the pipeline's file holds every component's: see offload_pipeline
                "map_embeddings": config.map_embeddings or maps_by_default(config),
            }
        )
    return configs


def maps_by_default(config: OffloadConfig) -> bool:
    """Whether a pipeline's components map their token embeddings without being asked: unless
    ``map_embeddings`` is set, or a setting that keeps packs from staying pinned and whole is (see
    [Note: mapped units] in store/mapping.py). A text encoder's vocabulary is read a few hundred rows a
    prompt: mapped, Wan2.2's 2.1 GB table takes no room under the budget and crosses the link at no
    generation's start (H100, 2026-12-06: the encoder's phase 0.16 -> 0.088 s)."""
    return (
        "map_embeddings" not in config.model_fields_set
        and not config.share_host_memory
        and config.compression == "off"
        and config.pinned_memory is not False
    )


def split_host_budget(
    configs: dict[str, OffloadConfig], components: dict[str, nn.Module], host_budget: int
) -> dict[str, OffloadConfig]:
    """Share the host budget between the components by their weights' bytes: every component's packs are
    held at once (unlike their device bytes, which they hold in turn)."""
    sizes = {n: sum(p.numel() * p.element_size() for p in m.parameters()) for n, m in components.items()}
    total = sum(sizes.values()) or 1
    _check_host_shares(configs, components, sizes, host_budget)
    return {
        n: c.model_copy(update={"host_memory_budget": max(1, host_budget * sizes[n] // total)})
        for n, c in configs.items()
    }


def _check_host_shares(
    configs: dict[str, OffloadConfig],
    components: dict[str, nn.Module],
    sizes: dict[str, int],
    host_budget: int,
) -> None:
    """HostBudgetError, before anything changes, when a component's share of ``host_budget`` can hold
    neither all its packs nor the staging ring the rest is copied through (see store/host_budget.py); it names
    the component and the host budget the whole pipeline needs, not that component's share."""
    total = sum(sizes.values()) or 1
    worst: tuple[int, str, int] | None = None
    for name, module in components.items():
        held = _unit_pack_bytes(module, configs[name])
        if not held or not sizes[name]:
            continue
        slot, slots = staging_layout(max(nbytes for nbytes, _ in held))
        least = min(sum(pages for _, pages in held), slot * slots)  # all its packs, or else the ring
        pipeline_needs = -(-least * total // sizes[name])
        if worst is None or pipeline_needs > worst[0]:
            worst = (pipeline_needs, name, least)
    if worst is None or host_budget >= worst[0]:
        return
    needed, name, least = worst
    share = max(1, host_budget * sizes[name] // total)
    raise HostBudgetError(
        f"host_memory_budget {format_bytes(host_budget)} ({host_budget} bytes) is too small for this "
        f"pipeline: it is shared between the components by their weights' bytes, and component {name!r} "
        f"gets {format_bytes(share)} of it, which holds neither its packs nor the {format_bytes(least)} "
        f"staging ring its other weights are copied through; give the pipeline a host_memory_budget of at "
        f"least {format_bytes(needed)} ({needed} bytes), or leave it unset",
        needed_bytes=needed,
        budget_bytes=host_budget,
    )


def _unit_pack_bytes(module: nn.Module, config: OffloadConfig) -> list[tuple[int, int]]:
    """(bytes, page-rounded bytes held) of each unit pack ``offload()`` would build for ``module``."""
    with warnings.catch_warnings():  # offload() warns of what it selects itself, once
        warnings.simplefilter("ignore")
        selection = select(module, config.include_patterns, config.exclude_patterns)
    params = dict(module.named_parameters(remove_duplicate=False))
    packs = []
    for unit in selection.units:
        nbytes = pack_layout([(n, params[n]) for n in selection.unit_parameters[unit]])[1]
        packs.append((nbytes, align_up(max(nbytes, 1), PAGE)))
    return packs
