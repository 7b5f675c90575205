"""Measurements + budget -> Plan: which units stay resident, how big the streaming arena is.

Pure: no torch. The planner searches configurations (resident set, arena size) and scores each with the
simulator (see [Note: what the simulator models] in plan/simulator.py); the Plan type (plan/plan.py) is the
engine's contract.

[Note: planner search]
A configuration is a set of resident units plus an arena multiplier ``k``: the arena holds ``k`` of the
largest *streamed* unit (capped at all streamed units), so making a big unit resident also shrinks the
arena. When every streamed unit fits the arena the configuration is stored as "all resident": the same
bytes, and nothing for the engine to stream.

With a budget, for each multiplier in a fixed ladder (2, 3, 4, 6, 9, ... up to all-fit) two greedy paths
start from "everything streamed" and make units resident one move at a time: one path takes the move
with the best step-time gain per byte added, the other the cheapest move that gains anything (it fills
tight budgets that the first path's big moves overshoot). The simulator's gain estimate (see ``run_streams``'
``want_gain``) ranks the moves; equal estimates go to the unit most crowded by streamed neighbours, which
spreads the streamed units so every copy has compute to hide under. The best ``RESIDENT_TRIALS`` moves
are simulated and the path takes the best of them by simulated gain: the estimate cannot see a move
shift the ring, nor a resident unit delay the step's first copy (see below). Every configuration
simulated is a candidate; the plan is the fastest that fits the budget, ties going to less memory. A
path stops at its first configuration over the budget. The ladder and the greedy orders do not depend
on the budget, so a larger budget only adds candidates: the predicted step time never gets worse as the
budget grows.

Without a budget the planner wants the least memory that runs within ``NO_BUDGET_SLOWDOWN`` of the
all-resident time: from everything streamed through the smallest arena it repeatedly takes whichever
move (grow the arena one rung, or make one of the best few candidates resident) saves the most simulated
time per byte, until the step is within tolerance.

What the step boundary does to plans (see [Note: what the simulator models]): the copies issued after
the last streamed unit's compute, for the next step's first units, hide only under the compute after it
(the tail, resident units): a chain whose tail is shorter than those copies needs a resident unit at its
end, or the units those copies load resident. And the copy stream idles until the first streamed
unit's compute ends, so a resident unit before it delays every copy: when the link is the bottleneck,
residents belong after the first streamed unit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flextensor.common.sizes import align_up, format_bytes
from flextensor.errors import BudgetError
from flextensor.plan.host_plan import HostPlan, choose_staged
from flextensor.plan.layout import UNIT_ALIGNMENT, prefetch_lists, ready_after_for
from flextensor.plan.measurements import Measurements
from flextensor.plan.plan import Plan
from flextensor.plan.simulator import DEFAULT_STEPS, coded_staging_bytes, run_streams, simulate

DOUBLE_BUFFER = 2
"""Smallest arena, in largest streamed units: one unit computes while the next is copied in. Less would
serialise every copy with the compute before it."""

NO_BUDGET_SLOWDOWN = 1.005
"""Without a budget, a plan within this factor of the all-resident step time counts as free: step times
measured on a GPU vary by about this much from run to run, so chasing the last 0.5% would buy memory for
a difference the measurements cannot see."""

ARENA_GROWTH = 1.5
"""Ratio between consecutive arena multipliers on the ladder (2, 3, 4, 6, 9, ...). Lookahead past a few
units rarely changes the step time, so the ladder thins out where it matters little; it keeps the number
of greedy paths logarithmic in the unit count."""

RESIDENT_TRIALS = 3
"""How many of the best-estimated resident moves are simulated at each step of a search. The gain
estimate ranks well but misses layout effects (a unit leaving the ring shifts every later unit, a
resident unit before the first streamed one delays the step's first copy), so a few real simulations
pick the move; more buys little for linear extra cost."""

TIME_TIE_RTOL = 1e-9
"""Step times closer than this (relative) are a tie, broken toward less memory: the simulator's sums in
different orders differ by rounding, not by anything real."""


def _rounded(x: float) -> float:
    """``x`` to 9 significant digits, so that rounding noise does not break ties in rankings."""
    return float(f"{x:.9g}")


@dataclass(frozen=True)
class _Config:
    """One simulated configuration. ``resident`` holds unit indices; ``gain`` is per unit index."""

    resident: frozenset[int]
    arena: int
    step_s: float
    memory: int
    gain: dict[int, float]
    staged: frozenset[int] = frozenset()  # streamed units copied through the staging ring


class _Search:
    """Simulates configurations of one model's measurements, with a cache."""

    def __init__(self, measurements: Measurements, host: HostPlan | None = None) -> None:
        units = measurements.units
        self.measurements = measurements
        self.host = host
        self.staged_copy_s = (
            []
            if host is None
            else [
                host.staged_link.copy_s(u.nbytes)
                if (coded := measurements.coded_load_s(u, host.staged_link)) is None
                else coded
                for u in units
            ]
        )
        self.on_disk = frozenset(
            i for i, u in enumerate(units) if host is not None and u.name in host.disk_units
        )
        if host is not None and host.disk_link is not None:
            for i in self.on_disk:  # through the ring too: the slower of the read and the staged copy
                disk_s = host.disk_link.copy_s(units[i].nbytes)
                self.staged_copy_s[i] = max(self.staged_copy_s[i], disk_s)
        self.names = [u.name for u in units]
        self.nbytes = [u.nbytes for u in units]
        self.host_nbytes = [  # what each pack holds on the host (compressed: its coded bytes)
            u.coded_nbytes if u.coded_nbytes is not None and measurements.decode_bps else u.nbytes
            for u in units
        ]
        self.padded = [align_up(u.nbytes, UNIT_ALIGNMENT) for u in units]
        self.compute = [u.compute_s for u in units]
        self.gaps = [u.gap_before_s for u in units]
        self.copy_s = [measurements.load_s(u) for u in units]  # coded when held compressed
        self.staging_nbytes = [  # 0: loaded raw
            u.staging_nbytes if measurements.coded_load_s(u) is not None else 0 for u in units
        ]
        self.fixed = measurements.baseline_bytes + measurements.activation_peak_bytes
        self.total = sum(self.padded)
        self.compute_s = measurements.compute_s
        # Each unit's start in the all-resident timeline: where it sits in the step, in compute time.
        self.at: list[float] = []
        clock = 0.0
        for u in units:
            clock += u.gap_before_s
            self.at.append(clock)
            clock += u.compute_s
        self.everything = frozenset(range(len(units)))
        self._cache: dict[tuple[frozenset[int], int], _Config] = {}

    def arena_for(self, resident: frozenset[int], mult: int | None) -> int:
        """The arena of multiplier ``mult`` (None: all streamed fit) for this resident set."""
        streamed = [p for i, p in enumerate(self.padded) if i not in resident]
        fit = sum(streamed)
        if mult is None or not streamed:
            return fit
        return min(mult * max(streamed), fit)

    def evaluate(self, resident: frozenset[int], mult: int | None) -> _Config:
        arena = self.arena_for(resident, mult)
        if arena >= self.total - sum(self.padded[i] for i in resident):
            # Every streamed unit fits: the same bytes as keeping them resident, and simpler to run.
            resident, arena = self.everything, 0
        key = (resident, arena)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        order = [i for i in range(len(self.names)) if i not in resident]
        ready_after = ready_after_for([self.nbytes[i] for i in order], arena)
        position = [-1] * len(self.names)
        for k, i in enumerate(order):
            position[i] = k
        copy_s = [self.copy_s[i] for i in order]
        staged: frozenset[int] = frozenset()
        if self.host is not None:  # see [Note: which units are staged]
            staged_copy_s = [self.staged_copy_s[i] for i in order]
            staged = choose_staged(
                order,
                self.host_nbytes,
                self.at,
                self.compute,
                self.compute_s,
                ready_after,
                staged_copy_s,
                self.host.capacity_bytes,
                self.on_disk,
            )
            copy_s = [staged_copy_s[k] if i in staged else copy_s[k] for k, i in enumerate(order)]
        trace = run_streams(
            self.compute,
            self.gaps,
            self.measurements.tail_s,
            position,
            copy_s,
            ready_after,
            prefetch_lists(ready_after),
            steps=DEFAULT_STEPS,
            cyclic=True,
            want_gain=True,
        )
        assert trace.gain is not None
        staging = coded_staging_bytes([self.staging_nbytes[i] for i in order])
        config = _Config(
            resident=resident,
            arena=arena,
            step_s=trace.step_s,
            memory=self.fixed + sum(self.padded[i] for i in resident) + arena + staging,
            gain={i: trace.gain[k] for k, i in enumerate(order)},
            staged=staged,
        )
        self._cache[key] = config
        return config

    def _crowding(self, streamed: list[int]) -> dict[int, float]:
        """Per streamed unit, the compute time between its streamed neighbours (cyclic).

        The ranking's tie-break: with equal gains, making the most crowded unit resident spreads the
        streamed ones evenly, so every copy has compute to hide under. Without it the picks cluster,
        leaving the copy stream idle through a run of resident units and then behind after it.
        """
        count = len(streamed)
        period = self.compute_s or 1.0
        crowding: dict[int, float] = {}
        for idx, i in enumerate(streamed):
            before = self.at[streamed[idx - 1]]
            after = self.at[streamed[(idx + 1) % count]]
            crowding[i] = (after - before) % period if count > 2 else period
        return crowding

    def resident_moves(
        self, config: _Config, mult: int | None, cheapest: bool = False
    ) -> list[tuple[frozenset[int], int]]:
        """Moves worth making next, best first, as (units to make resident, bytes the move adds).

        A move is one streamed unit, or every unit of the largest streamed size at once: the arena is
        sized by the largest streamed unit, so it shrinks only when all of them leave, which no single
        move shows (an embedding and an LM head of one size, say). Ranked by estimated gain per byte
        added; a move that adds no bytes (the arena shrinks at least as much as the units take) ranks
        first when it gains time or saves memory. Moves after which every streamed unit fits are left
        out: that configuration is the all-resident one, which the ladder's last rung evaluates anyway,
        and jumping to it would end a greedy path at the model's full size.
        """
        streamed = [i for i in range(len(self.names)) if i not in config.resident]
        if not streamed:
            return []
        crowding = self._crowding(streamed)
        sizes = sorted({self.padded[i] for i in streamed}, reverse=True)
        largest = sizes[0]
        tops = frozenset(i for i in streamed if self.padded[i] == largest)
        fit = sum(self.padded[i] for i in streamed)
        candidates = [frozenset((i,)) for i in streamed]
        if 1 < len(tops) < len(streamed):
            candidates.append(tops)
        ranked: list[tuple[tuple[float, ...], frozenset[int], int]] = []
        padded, gains = self.padded, config.gain
        next_size = sizes[1] if len(sizes) > 1 else 0
        for units in candidates:
            single = len(units) == 1
            if single:
                (first,) = units
                taken = padded[first]
                gain = gains.get(first, 0.0)
            else:
                first = min(units)
                taken = sum(padded[i] for i in units)
                gain = sum(gains.get(i, 0.0) for i in units)
            new_fit = fit - taken
            # The arena shrinks to the next size only when every unit of the largest size leaves.
            new_largest = next_size if units == tops else largest
            arena = new_fit if mult is None else min(mult * new_largest, new_fit)
            if arena >= new_fit:
                continue
            added = taken + arena - config.arena
            if gain <= 0 and added >= 0:
                continue  # neither faster nor smaller, as far as the estimate tells
            spread = _rounded(crowding[first]) if single else 0.0
            if cheapest:
                ranked.append(((float(added), -_rounded(gain), spread, first), units, added))
            elif added <= 0:
                ranked.append(((0.0, -_rounded(gain), float(added), first), units, added))
            else:
                ranked.append(((1.0, -_rounded(gain / added), spread, first), units, added))
        ranked.sort(key=lambda r: r[0])
        return [(units, added) for _, units, added in ranked]


def _better(a: _Config, b: _Config | None) -> bool:
    """Is ``a`` a better plan than ``b``: faster beyond a rounding tie, else less memory."""
    if b is None:
        return True
    if a.step_s < b.step_s * (1 - TIME_TIE_RTOL):
        return True
    if b.step_s < a.step_s * (1 - TIME_TIE_RTOL):
        return False
    return (a.memory, len(a.resident)) < (b.memory, len(b.resident))


def _multipliers(search: _Search) -> list[int | None]:
    """The arena ladder: multiples of the largest unit from DOUBLE_BUFFER up to all-fit (None)."""
    ladder: list[int | None] = []
    largest = max(search.padded, default=0)
    k = DOUBLE_BUFFER
    while largest and k * largest < search.total:
        ladder.append(k)
        k = max(k + 1, int(k * ARENA_GROWTH))
    ladder.append(None)
    return ladder


def _score(current: _Config, candidate: _Config, cheapest: bool = False) -> tuple[float, ...]:
    """Rank a simulated move from ``current`` to ``candidate``: lowest first.

    Moves that save time and add no bytes come first, then those that save time, by time saved per byte
    added (``cheapest``: by bytes added). When nothing saves time the cheapest move ranks first, so a
    search still climbs toward all-fit.
    """
    saved = current.step_s - candidate.step_s
    if saved <= current.step_s * TIME_TIE_RTOL:
        saved = 0.0
    added = candidate.memory - current.memory
    if saved > 0 and added <= 0:
        return (0.0, -saved, float(added))
    if saved > 0:
        return (1.0, float(added) if cheapest else -saved / added, -saved)
    return (2.0, float(added), candidate.step_s)


def _search_budget(search: _Search, budget: int) -> _Config:
    """The fastest configuration within ``budget`` among the greedy paths (see [Note: planner search])."""
    best: _Config | None = None
    floor = search.compute_s * (1 + TIME_TIE_RTOL)  # no configuration runs faster than its compute
    for mult, cheapest in itertools.product(_multipliers(search), (False, True)):
        config = search.evaluate(frozenset(), mult)
        while config.memory <= budget:
            if _better(config, best):
                best = config
            if config.step_s <= floor:
                break
            resident_bytes = search.fixed + sum(search.padded[i] for i in config.resident)
            if best is not None and best.step_s <= floor and resident_bytes >= best.memory:
                break  # every later configuration on this path is no faster and uses more memory
            moves = search.resident_moves(config, mult, cheapest)[:RESIDENT_TRIALS]
            if not moves:
                break
            options = [search.evaluate(config.resident | units, mult) for units, _ in moves]
            for option in options:  # the moves not taken are candidates too
                if option.memory <= budget and _better(option, best):
                    best = option
            config = min(options, key=lambda o, c=config: _score(c, o, cheapest))
    if best is None:  # cannot happen once the minimal configuration fits; kept for a clear failure
        least = search.evaluate(frozenset(), _multipliers(search)[0]).memory
        raise BudgetError(
            f"no configuration fits the budget of {format_bytes(budget)}",
            needed_bytes=least,
            budget_bytes=budget,
        )
    return best


def _search_no_budget(search: _Search) -> _Config:
    """The least memory within NO_BUDGET_SLOWDOWN of the all-resident time (see [Note: planner search])."""
    target = search.compute_s * NO_BUDGET_SLOWDOWN
    ladder = _multipliers(search)
    rung = 0
    config = search.evaluate(frozenset(), ladder[rung])
    # Each round grows the arena a rung or adds a resident unit, so this ends within len(ladder) + units
    # rounds; at the top of the ladder everything fits and the step is the compute time.
    while config.step_s > target:
        options: list[tuple[_Config, int]] = []
        if rung + 1 < len(ladder):
            options.append((search.evaluate(config.resident, ladder[rung + 1]), rung + 1))
        for units, _ in search.resident_moves(config, ladder[rung])[:RESIDENT_TRIALS]:
            options.append((search.evaluate(config.resident | units, ladder[rung]), rung))
        if not options:  # nothing streams any more (cannot be slow then); stop rather than spin
            break
        config, rung = min(options, key=lambda o, c=config: _score(c, o[0]))
    return config


def minimal_need_bytes(measurements: Measurements) -> tuple[int, int]:
    """(bytes the smallest plan needs, bytes in flight): everything streamed, two largest in flight (and
    the staging buffer of coded loads)."""
    units = measurements.units
    padded = [align_up(u.nbytes, UNIT_ALIGNMENT) for u in units]
    in_flight = min(DOUBLE_BUFFER * max(padded, default=0), sum(padded))
    in_flight += coded_staging_bytes(
        [u.staging_nbytes for u in units if measurements.coded_load_s(u) is not None]
    )
    need = measurements.baseline_bytes + measurements.activation_peak_bytes + in_flight
    return need, in_flight


def plan_offload(
    measurements: Measurements, budget_bytes: int | None = None, host: HostPlan | None = None
) -> Plan:
    """Choose resident units and the arena size for ``measurements`` (see [Note: planner search]).

    ``host``: the pinned capacity a host budget leaves and the staged copies' speed; the plan then names
    the streamed units it copies through the staging ring (see [Note: which units are staged]).

    With ``budget_bytes``: the fastest simulated plan whose peak fits the budget, ties toward less
    memory; raises BudgetError when even streaming everything through two of the largest units does not
    fit. Without: the least memory whose step is within NO_BUDGET_SLOWDOWN of the all-resident time.
    """
    need, in_flight = minimal_need_bytes(measurements)
    if budget_bytes is not None and budget_bytes < need:
        short, needed = format_bytes(budget_bytes), format_bytes(need)
        if short == needed:  # a few bytes short: without the bytes it would read "5.30 below 5.30"
            short, needed = f"{short} ({budget_bytes} bytes)", f"{needed} ({need} bytes)"
        raise BudgetError(
            f"budget {short} is below the {needed} this model needs at this input: activations "
            f"{format_bytes(measurements.activation_peak_bytes)}, the two largest units in flight "
            f"{format_bytes(in_flight)}, weights that never stream and other tensors on the device "
            f"{format_bytes(measurements.baseline_bytes)}; raise the budget (of an offloaded model: "
            "flextensor.set_budget(model, size)), offload more modules or free what else the process holds "
            "on the device",
            needed_bytes=need,
            budget_bytes=budget_bytes,
        )
    search = _Search(measurements, host)
    if not measurements.units:
        config = search.evaluate(frozenset(), None)
    elif budget_bytes is None:
        config = _search_no_budget(search)
    else:
        config = _search_budget(search, budget_bytes)
    names = search.names
    plan = Plan(
        resident=tuple(names[i] for i in range(len(names)) if i in config.resident),
        streamed=tuple(names[i] for i in range(len(names)) if i not in config.resident),
        arena_bytes=config.arena,
        budget_bytes=budget_bytes,
        staged=tuple(names[i] for i in range(len(names)) if i in config.staged),
        coded=tuple(
            names[i] for i in range(len(names)) if i not in config.resident and search.staging_nbytes[i]
        ),
    )
    prediction = simulate(
        plan,
        measurements,
        staged_link=None if host is None else host.staged_link,
        disk_link=None if host is None else host.disk_link,
        disk_units=frozenset() if host is None else host.disk_units,
    )
    return Plan(
        resident=plan.resident,
        streamed=plan.streamed,
        arena_bytes=plan.arena_bytes,
        predicted_step_s=prediction.step_s,
        predicted_peak_bytes=prediction.peak_bytes,
        budget_bytes=budget_bytes,
        staged=plan.staged,
        coded=plan.coded,
    )


def residents_within(
    resident: dict[str, int], streamed: list[int], room: int, arena_floor: int = 0
) -> set[str]:
    """Which of the ``resident`` units (name -> bytes) to keep so that they and the provisional arena of
    the rest (``streamed`` sizes plus the units not kept; at least ``arena_floor`` bytes) fit ``room``.

    Greedy: each step streams the unit whose move saves the most bytes (moving a unit larger than every
    streamed one grows the arena too), until the layout fits or no move saves anything; a layout that
    still does not fit gives way to streaming everything if that holds less.
    """
    kept = {name: align_up(nbytes, UNIT_ALIGNMENT) for name, nbytes in resident.items()}
    padded = [align_up(s, UNIT_ALIGNMENT) for s in streamed]
    total, largest = sum(padded), max(padded, default=0)

    def held(kept_bytes: int, total: int, largest: int) -> int:
        return kept_bytes + max(min(2 * largest, total), arena_floor)  # as provisional_arena_bytes

    kept_bytes = sum(kept.values())
    now = held(kept_bytes, total, largest)
    while kept and now > room:
        moves = {n: held(kept_bytes - b, total + b, max(largest, b)) for n, b in kept.items()}
        name = min(moves, key=lambda n: (moves[n], n))
        if moves[name] >= now:
            break
        size = kept.pop(name)
        kept_bytes, total, largest, now = kept_bytes - size, total + size, max(largest, size), moves[name]
    if now > room and held(0, total + kept_bytes, max(largest, *kept.values(), 0)) < now:
        return set()
    return set(kept)
