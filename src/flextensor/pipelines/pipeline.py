"""Whole pipelines: one ``offload()`` call for a diffusers pipeline or a mapping of named modules.

[Note: one budget for a pipeline]
Every ``nn.Module`` component becomes an offloaded model of its own (its engine learns, plans and streams
it), planned under the pipeline's whole budget. The components of a pipeline run one after another (the
text encoder, then the transformer's steps, Wan2.2's second expert for the low-noise steps, then the VAE),
so the device memory they hold can be shared between those phases: before a component's step begins, the
pipeline makes the others give back the device bytes they hold for their units, least recently run
first, until what stays held plus the starting component's planned peak fits the budget. The peak is
then the largest phase, not the sum of the components. The budget counts what the caller holds too: a
component planned in the first generation plans again before a step at which what is allocated outside
it grew past what its plan left room for (``plan_again_if_crowded``). A component given back lays its
plan out again at its next step (its resident units are uploaded again), so components keep their host copies
(``DeviceStore.keep_packs``). A component that runs every step beside another (a ControlNet) stays laid
out as long as both fit.

Patterns name the component first (``transformer.blocks.*``, ``vae.decoder.up_blocks.*``); ``class:``
patterns apply to every component that has such a module. A component no include pattern names gets
its repeated blocks, and the large modules among the rest, as units (``default_unit_patterns`` in
pipelines/configs.py).

``save_profile(pipe, path)`` writes one file with every component's profile (see pipelines/profile.py);
``OffloadConfig(profile=path)`` given to the pipeline's offload starts every component in steady state.

[Note: the next component ahead]
A pipeline runs its components in runs: the text encoder twice (prompt and negative prompt), the
transformer for each high-noise step, ``transformer_2`` for the low-noise ones, the VAE once. The
pipeline remembers each component's last run, its length and which component followed it. When a
component ends a step that completes a run as long as its last one, the component that followed it then
is laid out at once (``OffloadEngine.lay_out_ahead``), while the device still runs the end of this one:
its resident units upload and its first streamed units copy on its copy stream, so its first step
starts with them in place (``transformer_2`` ready when the switch comes). The stream the layout was
made on then waits for the copy stream: its resident units carry no hooks, and one called directly
before the component's forward must read its upload (a forward on another stream waits for the copy
stream itself). Only when its planned peak fits the budget beside what the finishing component holds
(after the others gave memory back as at a step, which waits for the device as it would then): a layout
ahead never makes the finishing component give its memory back. A wrong guess (a generation with more
steps) costs memory the next step may take back, not correctness.

[Note: the switch at a run's end]
Under a budget that holds one component at a time (Wan2.2 under 8 GiB: the text encoder holds 7 GB, each
expert's step peaks at 6.4 GB) the next component cannot be laid out beside the finishing one. Its step
would then make the finishing one give its memory back and lay itself out, but by then the pipeline has
often waited for the device (Wan2.2 reads the timestep on the host at each step, and the prompt's
length after encoding), so the host's part of the switch, some 30 ms for a 40-block transformer, and
the resident units' uploads ran on an idle GPU: about 50 ms at each expert switch (H100, 2026-12-06).
Instead, at the end of a run as long as its last, the switch is made at once when every give-back and
the layout can be ordered by streams (see [Note: a switch in stream order] in store/stream_order.py): the
others give back what the next step's make-room would take, least recently run first (the finishing
one among them), and the next component lays out on the compute stream, behind the finishing one's
queued kernels. The host's work then hides under the kernels still queued, and the uploads start as soon
as they end. A component that would synchronise to give back (a host budget's ring, compressed packs)
leaves the switch to the step, as before. So does a next component whose layout would hold more than
what is given back for it: until its step, the caller may allocate what no plan counts (a generation's
post-processing, when a mapping's last component hands over to its first, or a diffusers call with
``output_type="latent"`` ending where the VAE came next before), and the switch must not leave less room
for that than the step would. A wrong guess costs the finishing component a layout again at its next
step, not correctness.

The last step of such a run copies nothing in for a next one (``DeviceStore.prefetch_past_end``): the
ring's last units would copy the component's first units in for its next forward, thrown away when it
gives its memory back; the give-back would wait for them, and they would hold up the next component's
uploads on the link (the text encoder's two first blocks, 0.77 GB, 14 ms at each Wan2.2 generation on
an H100). A run longer than the last one loads them when its extra forward needs them.

Never across the end of a call of the pipeline (diffusers pipelines end ``__call__`` with
``maybe_free_model_hooks()``, which flextensor watches): after the VAE the pipeline still post-processes
the video on the device, and the caller may do anything before the next generation, all of it memory
no plan counted. Laying the text encoder out there put 7 GB beside that work and took Wan2.2's peak to
9.06 GB under an 8 GiB budget (H200, 2026-12-05); it also kept those 7 GB held between generations. A
switch once seen across a call's end stays so (a call that raised never reached the method). A mapping
of components has no call to watch, nor does a component you call yourself between calls (a
``vae.decode`` after ``output_type="latent"``): their runs' successors are laid out ahead as they come.

The memory of a layout ahead is taken with the copy stream current: PyTorch's caching allocator hands a
stream only blocks freed on it, so the finishing component's queued compute can never see them written.
The price: once that component gives its layout back, those blocks stay cached for its copy stream, so
the allocator's reserved memory can exceed the budget by the layouts of the components laid out ahead
(allocated memory, what the budget bounds, does not). A layout ahead is skipped when the device has not
that much free outside the cache (``torch.cuda.mem_get_info``): freeing the cache would wait for the
device, which is what the layout ahead avoids.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from flextensor.config.schema import OffloadConfig
from flextensor.errors import ConfigError, NotOffloadedError
from flextensor.pipelines.configs import component_configs, maps_by_default, split_host_budget
from flextensor.pipelines.methods import replace_methods, restore_methods
from flextensor.store.mapping import mapping_by_default

logger = logging.getLogger("flextensor")

__all__ = [
    "PipelineOffload",
    "components_of",
    "offload_pipeline",
    "pipeline_of",
]

_PIPELINE_ATTR = "_flextensor_pipeline"


def components_of(pipe: object) -> dict[str, nn.Module] | None:
    """The ``nn.Module`` components of a diffusers pipeline (its ``components``) or of a mapping of names
    to modules; None when ``pipe`` is neither (a model)."""
    if isinstance(pipe, nn.Module):
        return None
    components = pipe if isinstance(pipe, Mapping) else getattr(pipe, "components", None)
    if not isinstance(components, Mapping):
        return None
    return {name: m for name, m in components.items() if isinstance(m, nn.Module)}


class PipelineOffload:
    """The offloaded components of one pipeline and the budget they share (see the note above)."""

    def __init__(self, pipe: object, components: dict[str, nn.Module], budget_bytes: int | None) -> None:
        self.pipe = pipe
        self.components = components
        self.budget_bytes = budget_bytes
        self._last_run: list[str] = []  # component names, least recently run first
        self.vacated = 0  # times a component gave its device bytes back
        self._run: tuple[str, int] | None = None  # the component running now, and its steps in a row
        # Each one's last run: its length, who came next, whether a call of the pipeline ended between.
        self._runs: dict[str, tuple[int, str, bool]] = {}
        self._call_ended = False  # the pipeline's __call__ ended since the last step (pipelines/methods.py)
        self.laid_out_ahead = 0  # times a component was laid out before its step (see the note)
        self.switched_at_run_end = 0  # times it was, the finished one giving back (see the note)
        self.replaced: dict[str, Any] = {}  # what the instance held under the names replaced (release)

    def engine(self, name: str) -> Any:
        from flextensor.api import engine_of

        return engine_of(self.components[name])

    def before_step(self, name: str) -> None:
        """Component ``name`` begins a step: make room for it among the others."""
        run = self._run
        if run is not None and run[0] == name and not self._call_ended:
            self._run = (name, run[1] + 1)
        else:
            if run is not None:
                # Once seen across a call's end, a switch stays so: a call that raised never reached
                # maybe_free_model_hooks(), and the next one must not lay its first component out ahead.
                known = self._runs.get(run[0])
                across = self._call_ended or (known is not None and known[1] == name and known[2])
                self._runs[run[0]] = (run[1], name, across)
            self._run = (name, 1)
        self._call_ended = False
        if name in self._last_run:
            self._last_run.remove(name)
        self._make_room(name, keep=None)
        self._last_run.append(name)
        self.engine(name).gives_back_after_forward = self._gives_back_after_step(name)

    def _gives_back_after_step(self, name: str) -> bool:
        """Whether the step ``name`` begins ends a run as long as its last one, after which the component
        that followed it then cannot be laid out beside it: ``name`` gives its memory back before it runs
        again (at that run's end, or at the next one's step), so its forward copies nothing in for a next
        one (see [Note: the switch at a run's end])."""
        run, last = self._run, self._runs.get(name)
        if run is None or last is None or last[0] != run[1] or last[1] == name or last[2]:
            return False
        this, following = self.engine(name), self.engine(last[1])
        need = following.planned_peak_bytes()
        limit = self.budget_bytes if self.budget_bytes is not None else following.policy.memory_limit()
        if this.current is None or need is None or limit is None:
            return False
        return this.layout_bytes() + need > limit

    def before_outside_layout(self, name: str) -> None:
        """Component ``name`` lays its plan out for a module of it called directly, outside its steps
        (``text_encoder.get_input_embeddings()(ids)``): the others make room as for a step; which
        component follows which is left as the steps taught it."""
        if name in self._last_run:
            self._last_run.remove(name)
        self._make_room(name, keep=None)
        self._last_run.append(name)

    def held_beside(self, name: str) -> int:
        """Device bytes the components other than ``name`` hold for their units."""
        return sum(self.engine(n).store.device_bytes_held() for n in self.components if n != name)

    def call_ended(self) -> None:
        """The pipeline's ``__call__`` ended: the next step begins the next call (see the note)."""
        self._call_ended = True

    def after_step(self, name: str) -> None:
        """Component ``name`` ended a step: lay out the one expected next if this ends its run."""
        run, last = self._run, self._runs.get(name)
        if run is None or run[0] != name or last is None or last[0] != run[1] or last[1] == name or last[2]:
            return  # not the end of a run as long as the last, or the next one came in the next call
        following = last[1]
        engine = self.engine(following)
        if engine.laid_out or engine.planned_peak_bytes() is None:
            return  # in place already, or still learning (its layout is the forward's to make)
        try:
            if self._make_room(following, keep=name):
                if engine.lay_out_ahead():
                    self.laid_out_ahead += 1
                    logger.debug("pipeline: %s laid out ahead, at the end of %s's run", following, name)
            elif self._switch_in_stream_order(following):
                self.switched_at_run_end += 1
                logger.debug("pipeline: switched from %s to %s at the end of its run", name, following)
        except Exception as exc:  # an optimisation: the step that succeeded must not fail for it
            logger.warning(
                "pipeline: laying %s out ahead failed (%s); it lays out at its step", following, exc
            )

    def _make_room(self, name: str, keep: str | None) -> bool:
        """Make the others give back device memory until ``name``'s planned peak fits the budget beside
        what stays held, the least recently run first; never ``keep`` (and then nothing, unless that
        makes it fit). Whether it fits."""
        starting = self.engine(name)
        limit = self.budget_bytes if self.budget_bytes is not None else starting.policy.memory_limit()
        if limit is None:
            return True
        need = starting.planned_peak_bytes()
        # Components that never ran first (they hold their learning layout from offload() on), then
        # the least recently run.
        never_ran = [n for n in self.components if n not in self._last_run and n != name]
        others = [(n, self.engine(n)) for n in (*never_ran, *self._last_run) if n != name]
        held = sum(e.store.device_bytes_held() for _, e in others)
        if need is None:
            need = limit  # learning: its peak is not known yet
        elif keep is None:  # its step: what the caller holds now beyond what its plan counted
            need += max(0, starting.grown_outside(starting.current, held))
        # A layout ahead (``keep``) goes by the plan's peak alone: what the running component leaves
        # outside at the end of its run is not the next one's step yet (found on the H200: its output,
        # counted as growth, kept every next component from being laid out ahead); the step's own
        # make-room counts what is there then.
        if keep is not None:
            staying = sum(e.store.device_bytes_held() for n, e in others if n == keep or not e.can_vacate())
            if staying + need > limit:
                return False  # giving memory back would not make room: give none back for nothing
        for other_name, other in others:
            if held + need <= limit:
                break
            if other_name == keep:
                continue
            freed = other.vacate()
            if freed:
                held -= freed
                self.vacated += 1
                logger.info("pipeline: %s gave back %d bytes for %s", other_name, freed, name)
        return held + need <= limit

    def _switch_in_stream_order(self, name: str) -> bool:
        """Make room for ``name``'s step now, as its step would, and lay it out, when every give-back and
        the layout are ordered by streams, the layout holds no more than what is given back for it, and
        its plan still fits beside what the caller holds (see [Note: the switch at a run's end]); else
        nothing, and whether it was done."""
        starting = self.engine(name)
        need = starting.planned_peak_bytes()
        limit = self.budget_bytes if self.budget_bytes is not None else starting.policy.memory_limit()
        if need is None or limit is None or not starting.lays_out_in_stream_order():
            return False
        never_ran = [n for n in self.components if n not in self._last_run and n != name]
        others = [(n, self.engine(n)) for n in (*never_ran, *self._last_run) if n != name]
        held = sum(e.store.device_bytes_held() for _, e in others)
        giving_back, given = [], 0
        for other_name, other in others:
            if held + need <= limit:
                break
            if other.store.device_bytes_held():
                if not other.vacates_in_stream_order():
                    return False  # it would wait for the device: the switch stays the step's
                giving_back.append((other_name, other))
                given += other.store.device_bytes_held()
                held -= other.store.device_bytes_held()
        # Never more held until the step than before: what the caller allocates meanwhile (the video's
        # post-processing after the last component) is in no plan. And a plan the step would remake for
        # what the caller holds now is not worth laying out.
        if not giving_back or starting.layout_bytes() > given:
            return False
        # The bytes given back are still allocated until the vacates below: outside, they are not growth
        # (counted so on the H100, the check refused every switch there; a CPU counts no memory).
        if held + need + max(0, starting.grown_outside(starting.current, held + given)) > limit:
            return False
        for other_name, other in giving_back:
            if other.vacate():
                self.vacated += 1
                logger.info("pipeline: %s gave back its memory for %s at a run's end", other_name, name)
        return starting.lay_out_in_stream_order()

    def phase(self) -> str:
        """The least advanced phase of the components: ``inference`` once every one is steady."""
        order = ("discovery", "profiling", "inference")
        phases = [self.engine(n).phase.value for n in self.components]
        return min(phases, key=order.index) if phases else "inference"


def pipeline_of(pipe: object) -> PipelineOffload:
    found = getattr(pipe, _PIPELINE_ATTR, None) if not isinstance(pipe, Mapping) else None
    if found is None and isinstance(pipe, Mapping):
        found = _MAPPINGS.get(id(pipe))
    if found is None:
        raise NotOffloadedError(
            f"this {type(pipe).__name__} is not offloaded by flextensor; call flextensor.offload(pipe) first"
        )
    return found


_MAPPINGS: dict[int, PipelineOffload] = {}
"""Offloaded mappings of components (a dict cannot carry an attribute), by id, until released."""


def offload_pipeline(pipe: Any, config: OffloadConfig) -> Any:
    """Offload every ``nn.Module`` component of ``pipe`` under one budget; returns ``pipe``. A failure
    releases the components already offloaded, leaving the pipeline as it was."""
    from flextensor.api import offload, release_model
    from flextensor.device.runtime import resolve_target

    if getattr(pipe, _PIPELINE_ATTR, None) is not None or id(pipe) in _MAPPINGS:
        from flextensor.errors import AlreadyOffloadedError

        raise AlreadyOffloadedError("this pipeline is already offloaded; call flextensor.release(pipe) first")
    components = components_of(pipe)
    assert components is not None
    components = {n: m for n, m in components.items() if next(m.parameters(), None) is not None}
    if not components:
        raise ConfigError(f"this {type(pipe).__name__} has no module with parameters to offload")
    configs = component_configs(config, components)
    target = resolve_target(config)
    budget = target.budget_bytes
    if target.host_budget_bytes is not None:
        configs = split_host_budget(configs, components, target.host_budget_bytes)
    profiles = None
    if config.profile is not None:  # read and matched to the components before anything changes
        from flextensor.pipelines.profile import load_pipeline_profile

        profiles = load_pipeline_profile(config.profile, set(components))
    pipeline = PipelineOffload(pipe, components, budget)
    done: list[tuple[nn.Module, torch.device]] = []
    try:
        for name, module in components.items():
            device = next(module.parameters()).device
            with mapping_by_default() if maps_by_default(config) else contextlib.nullcontext():
                offload(module, configs[name])
            done.append((module, device))
            engine = pipeline.engine(name)
            engine.component_of = (name, type(pipe).__name__)  # released with the pipeline only
            engine.store.keep_packs = True  # see the note: components lay out in turn
            if profiles is not None:
                _start_from_profile(engine, profiles[name], f"{config.profile}, component {name!r}")
            # Given back before the next component is offloaded: each lays out at its first step, so the
            # peak is one phase's, not the sum of every component's learning arena (offload included).
            engine.vacate()
    except BaseException:
        for module, device in reversed(done):
            release_model(module, device)
        raise
    this = weakref.ref(pipeline)
    for name in components:
        engine = pipeline.engine(name)
        engine.before_step = _pipeline_call(this, PipelineOffload.before_step, name)
        engine.after_step = _pipeline_call(this, PipelineOffload.after_step, name)
        engine.before_outside_layout = _pipeline_call(this, PipelineOffload.before_outside_layout, name)
        engine.held_beside = _pipeline_call(this, PipelineOffload.held_beside, name, default=0)
    if isinstance(pipe, Mapping):
        _MAPPINGS[id(pipe)] = pipeline
    else:
        setattr(pipe, _PIPELINE_ATTR, pipeline)
        pipeline.replaced = replace_methods(pipe, pipeline)
    logger.info("offloaded pipeline %s: %s", type(pipe).__name__, ", ".join(components))
    return pipe


def _start_from_profile(engine: Any, profile: Any, source: str) -> None:
    """Put a component in steady state from its saved profile. Its plan is laid out to check it lands,
    then given back by the caller: components lay out in turn, at their first step (see the note)."""
    from flextensor.profiles.reuse import start_from_loaded_profile

    engine.vacate()  # its learning layout, before the plan's is made
    start_from_loaded_profile(engine, profile, source)


def save_pipeline(pipe: Any, path: Any) -> None:
    """Save every component's profile in one file (``flextensor.save_profile(pipe, path)``)."""
    from flextensor.common.version import __version__
    from flextensor.pipelines.profile import save_pipeline_profile
    from flextensor.profiles.reuse import snapshot_profile

    pipeline = pipeline_of(pipe)
    learning = [n for n in pipeline.components if pipeline.engine(n).current is None]
    if learning:
        raise NotOffloadedError(
            f"nothing to save yet for {', '.join(learning)}: run the pipeline until "
            "flextensor.phase(pipe) == 'inference' (every component has run twice), then save"
        )
    profiles = {name: snapshot_profile(pipeline.engine(name)) for name in pipeline.components}
    save_pipeline_profile(profiles, path, __version__)


def _pipeline_call(
    pipeline: weakref.ref[PipelineOffload], method: Any, name: str, default: Any = None
) -> Any:
    """``method(pipeline, name)`` as an engine's callback, while the pipeline lives (``default`` after)."""

    def call(*_: Any) -> Any:
        target = pipeline()
        return method(target, name) if target is not None else default

    return call


def release_pipeline(pipe: Any, device: Any = None) -> Any:
    from flextensor.api import _ENGINE_ATTR, compiled_original, release_model

    pipeline = pipeline_of(pipe)
    for module in pipeline.components.values():
        # One released by a call interrupted part-way (Ctrl-C) is done: this call finishes the rest.
        if _ENGINE_ATTR in compiled_original(module).__dict__:
            release_model(module, device)
    if isinstance(pipe, Mapping):
        _MAPPINGS.pop(id(pipe), None)
    else:
        restore_methods(pipe, pipeline.replaced)
        delattr(pipe, _PIPELINE_ATTR)
    return pipe
