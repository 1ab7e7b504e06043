"""Shrinking a failing trace: ``minimize`` and its passes.

A failure is shrunk on traces, not on Hypothesis's choices: each candidate
is a trace (fewer steps, smaller arguments, a smaller pool) replayed through
the step seam, kept where it fails on the same invariant.  ``fuzz`` calls it
on every failure it reports.
"""

from __future__ import annotations

import itertools
import json

import attrs

from state_machines.config import Config
from state_machines.harness import Step, build
from state_machines.harness.family import builds_fresh
from state_machines.harness.machines import EXTEND_TOKENS_PAGES, MAX_PAGES
from state_machines.runs.coverage import ENDS_A_REQUEST, FREES_A_REQUEST
from state_machines.runs.trace import (
    ENTRY,
    FLAG,
    LIST,
    OFFSET,
    POOL,
    PROMPT,
    REQ,
    REQS,
    RULES,
    SLOTS,
    SPAN,
    StepNotApplicable,
    Trace,
    TraceError,
    arg_kinds,
    int_bounds,
    optional_args,
    replay,
    returns_kind,
)

# The fewest pages a pool ``minimize`` halves down to may have.
MIN_SHRINK_PAGES = 2


def shrink_configs(trace: Trace, run: Config, sizes: tuple[int | None, ...]) -> tuple[Config, ...]:
    """The configurations ``minimize`` tries ``trace`` on, simplest first
    (but a smaller pool is simpler still, where ``minimize`` settles):
    in the run's own pool shape (size, need_sort, rows of ``run``), then at
    each smaller size, smallest first: those an example could draw, and the
    halves of the smallest pool, down to ``MIN_SHRINK_PAGES`` pages, with
    the size midway between each half and the pool it halved (each only
    where it builds and checks out fresh); then keeping the trace's own
    need_sort and rows, at the run's size and the smaller ones; then, where
    the trace's pool is larger than the run's, each size an example draws
    between the two, smallest first, in the run's shape and then the
    trace's; last, the run's own need_sort and rows at the trace's size.  A halved
    pool no example draws is still one ``--size`` pins, and a smaller pool
    fills in fewer steps.  A run whose size is pinned (``sizes`` holds only
    its own, ``None``) is not halved: the user chose that pool."""
    own = attrs.evolve(trace.config, size=run.size, need_sort=run.need_sort, rows=run.rows)
    drawn = attrs.evolve(trace.config, size=run.size)
    smaller = {s for s in sizes if s is not None and s < own.pool_size}
    half, ps = min(smaller | {own.pool_size, trace.config.pool_size}), own.page_size
    while smaller and (half := (top := half) // 2 // ps * ps) >= MIN_SHRINK_PAGES * ps:
        # A pool the target refuses, or whose fresh census already disagrees,
        # would pass a failure of building off as the bug's (drawn sizes are
        # probed the same way).  Midway too: page-interleave merge-on-total's
        # failure met on 10 pages a class scales onto 3 (size 12) at its
        # length, not onto 4 or 2, and shrinks from 6 steps to the known 3.
        for size in {half, (half + top) // 2 // ps * ps}:
            if builds_fresh(attrs.evolve(own, size=size)):
                smaller.add(size)
    smaller = sorted(smaller)
    # Where the trace's pool is larger than the run's, the sizes an example
    # draws between the two, smallest first: a failure that needs a bigger
    # pool (a fresh census wrong from 24 pages on, met at 64) may need no
    # more than the smallest of them.
    between = sorted(s for s in sizes if s is not None and own.pool_size < s < trace.config.pool_size)
    # The run's own need_sort and rows at the trace's size too, where that
    # is larger than the run's pool: a failure that needs a bigger pool
    # (the fresh census of 64 pages, say) keeps the shape it was drawn in.
    found = [*(c for base in (own, drawn) for c in (base, *(attrs.evolve(base, size=s) for s in smaller))),
             *(attrs.evolve(base, size=s) for s in between for base in (own, drawn)),
             attrs.evolve(own, size=trace.config.size)]
    return tuple(dict.fromkeys(found))


def _scaled(steps: tuple[Step, ...], config: Config, smaller: Config, rounding: str = "down") -> tuple[Step, ...]:
    """``steps`` for the pool of ``smaller``: each amount of slots or span
    (an alloc's or a free's ``n``, an extend's tokens; not an offset), and
    a resize's pages of the pool, scaled down by the ratio of the two
    pools, rounded down to its multiple (``rounding``: or up, or to the
    nearest, a half up), at least its lowest.  One amount that filled the
    pool fills the smaller one too; several may not (rounding down leaves
    room, rounding up may ask more than is left; to the nearest, 4 and 6
    of 10 slots are 2 and 2 of 4)."""
    out = []
    for step in steps:
        kinds, args = arg_kinds(step.rule), dict(step.args)
        for key, value in step.args.items():
            unit = kinds.get(key, "").removeprefix(LIST)
            if unit not in (SLOTS, SPAN, POOL) or isinstance(value, bool):
                continue
            lo, _, multiple = int_bounds(unit, smaller)
            per = config.pool_size * multiple
            # The amount in multiples of the smaller pool, as (numerator, denominator) to round.
            top, bottom = {"down": (0, 1), "up": (per - 1, 1), "near": (per, 2)}[rounding]
            scale = [max(lo, (v * smaller.pool_size * bottom + top) // (per * bottom) * multiple)
                     for v in (value if isinstance(value, list) else [value])]
            args[key] = scale if isinstance(value, list) else scale[0]
        out.append(attrs.evolve(step, args=args) if args != step.args else step)
    return tuple(out)


def _fails_like(candidate: Trace, invariant: str | None) -> Trace | None:
    """``candidate`` replayed, re-recorded, where it fails on ``invariant``; else None.

    Only the same invariant: a shorter trace failing on another is not
    taken.  ``fuzz`` reports one failure per invariant, and one target can
    hold two bugs (sglang 0.5.17: flag drift and aliasing), so a trade could
    fold the second into the first and hide it; and a crash
    (``allocator_raised``) or a hang must not come back as a wrong answer,
    nor the other way, for they are fixed in different places."""
    try:
        again = replay(candidate)
    except Exception:  # noqa: BLE001 - the change broke the trace itself,
        # e.g. a later step names what it deleted, or a group now nests
        return None
    return Trace.from_violation(again) if again is not None and again.invariant == invariant else None


def _smaller_ints(value: int, lo: int, multiple: int) -> list[int]:
    """Values below ``value`` to try in its place, smallest first: the
    lowest allowed, half, one unit less (each a multiple where it must be)."""
    half = max(lo, value // 2 // multiple * multiple)
    return sorted({v for v in (lo, half, value - multiple) if lo <= v < value})


def _smaller_prompts(value: int, lo: int) -> list[int]:
    """Prompts below ``value`` (``trace.PROMPT``: a decimal digit a page) to
    try in its place, smallest first: the lowest, its first pages alone,
    and one page's token lowered by one or to 1.  Each is a prompt wherever
    ``value`` is; ``_smaller_ints``'s half and one less mostly are not
    (321: 160 and 320, a 0 in each), which left 321 nothing but the lowest."""
    digits = str(value)
    out = {lo} | {int(digits[:k]) for k in range(1, len(digits))}
    for j, d in enumerate(digits):
        for lower in {"1", str(int(d) - 1)}:
            if "1" <= lower < d:
                out.add(int(digits[:j] + lower + digits[j + 1 :]))
    return sorted(v for v in out if lo <= v < value)


def _scalings(steps: tuple[Step, ...], config: Config, other: Config):
    """``steps`` scaled (``_scaled``) onto ``other``'s pool rounded down,
    up and to the nearest, in turn, where it is smaller than ``config``'s;
    else none."""
    if other.pool_size < config.pool_size:
        for rounding in ("down", "up", "near"):
            yield _scaled(steps, config, other, rounding)


def _smaller_values(value: int, kind: str, config: Config) -> list[int]:
    """``_smaller_ints`` for an integer of ``kind``, or ``_smaller_prompts`` for a prompt."""
    lo, _, multiple = int_bounds(kind, config)
    return _smaller_prompts(value, lo) if kind == PROMPT else _smaller_ints(value, lo, multiple)


def _lowered_together(steps: tuple[Step, ...], config: Config):
    """``steps`` with a prompt that several steps share lowered in all of
    them at once, to each value ``_smaller_prompts`` gives, smallest first.
    Requests of one prompt share its prefix in the caller's cache, and
    sglang 0.5.17's latent duplicate (``--caller radix --groups all``) fails
    only while they do, so lowering either alone parts them: seed 0 stopped
    at ``prompt=321`` twice, where both at 1 fail too.  Prompts only, in
    the cheap passes: an amount two steps share means nothing shared.  Any
    two integer arguments lowered at once come last, where every pass is
    stuck (``_two_lowered``)."""
    shared: dict[tuple, list[int]] = {}
    for i, step in enumerate(steps):
        for key, kind in arg_kinds(step.rule).items():
            value = step.args.get(key)
            if kind == PROMPT and isinstance(value, int) and not isinstance(value, bool):
                shared.setdefault((step.rule, key, kind, value), []).append(i)
    for (_, key, kind, value), at in shared.items():
        if len(at) < 2:
            continue
        for v in _smaller_values(value, kind, config):
            yield tuple(attrs.evolve(s, args={**s.args, key: v}) if i in at else s for i, s in enumerate(steps))


def _int_places(steps: tuple[Step, ...]) -> list[tuple[int, str, int | None, str]]:
    """``(i, key, j, kind)``: each integer argument of ``steps`` (``j``
    None), and each integer of a list argument (its index ``j``)."""
    places = []
    for i, step in enumerate(steps):
        for key, kind in arg_kinds(step.rule).items():
            value = step.args.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                places.append((i, key, None, kind))
            elif isinstance(value, list) and kind.startswith(LIST) and all(isinstance(v, int) for v in value):
                places += [(i, key, j, kind.removeprefix(LIST)) for j in range(len(value))]
    return places


def _two_lowered(steps: tuple[Step, ...], config: Config):
    """``steps`` with two integer arguments lowered at once, each to a value
    ``_smaller_values`` gives (each pair to both lowest first, then to the
    others in order): a failure that needs the two
    in step (0.5.23's dsv4-hisparse at page size 16 fails on an extend of
    24 tokens and a device buffer of 2 pages, and on 8 and 1, but on
    neither lowered alone) is left where each alone stops."""

    def at(step: Step, key: str, j: int | None):
        return step.args[key] if j is None else step.args[key][j]

    def put(step: Step, key: str, j: int | None, v: int) -> Step:
        value = v if j is None else [*step.args[key][:j], v, *step.args[key][j + 1 :]]
        return attrs.evolve(step, args={**step.args, key: value})

    pairs = []
    for (i, key, j, kind), (k, key2, j2, kind2) in itertools.combinations(_int_places(steps), 2):
        values = [(v, v2) for v in _smaller_values(at(steps[i], key, j), kind, config)
                  for v2 in _smaller_values(at(steps[k], key2, j2), kind2, config)]
        pairs.append(((i, key, j), (k, key2, j2), values))
    # Both lowest first for every pair, then the rest: the budget reaches
    # every pair's first try however many places the trace has.
    for first in (True, False):
        for (i, key, j), (k, key2, j2), values in pairs:
            for v, v2 in values[:1] if first else values[1:]:
                out = list(steps)
                out[i] = put(out[i], key, j, v)
                out[k] = put(out[k], key2, j2, v2)
                yield tuple(out)


def _made_before(steps: tuple[Step, ...], i: int) -> dict[str, list[str]]:
    """``{REQ: [...], ENTRY: [...]}``: the names ``steps[:i]`` create, earliest first."""
    made: dict[str, list[str]] = {REQ: [], ENTRY: []}
    for step in steps[:i]:
        if step.returns:
            made.setdefault(returns_kind(step.rule), []).append(step.returns)
    return made


def _smaller_args(step: Step, config: Config, steps: tuple[Step, ...] = (), i: int | None = None):
    """Each copy of ``step`` (``steps[i]`` where ``i`` is given) with one
    argument made simpler: an optional one left out, integers toward
    their lowest (a prompt to smaller prompts, ``_smaller_prompts``), or
    to a smaller value the same argument has in another of ``steps`` (two
    prompts made one), list elements each the same way,
    True to False, a request or entry named by one made earlier, a batch
    without one of its requests."""
    made = _made_before(steps, i) if i is not None else {}
    optional = optional_args(step.rule)
    for key, kind in arg_kinds(step.rule).items():
        value = step.args.get(key)
        if key in optional and value is not None:
            yield attrs.evolve(step, args={k: v for k, v in step.args.items() if k != key})
        if isinstance(value, bool):
            if value:
                yield attrs.evolve(step, args={**step.args, key: False})
        elif isinstance(value, int):
            seen = {s.args[key] for s in steps if s.rule == step.rule and isinstance(s.args.get(key), int)}
            for v in sorted(set(_smaller_values(value, kind, config)) | {v for v in seen if v < value}):
                yield attrs.evolve(step, args={**step.args, key: v})
        elif isinstance(value, list) and kind.startswith(LIST) and all(isinstance(v, int) for v in value):
            lo, _, multiple = int_bounds(kind.removeprefix(LIST), config)
            for j, item in enumerate(value):
                for v in _smaller_ints(item, lo, multiple):
                    yield attrs.evolve(step, args={**step.args, key: [*value[:j], v, *value[j + 1 :]]})
        elif kind in (REQ, ENTRY) and value in made.get(kind, ()):
            for earlier in made[kind][: made[kind].index(value)]:
                yield attrs.evolve(step, args={**step.args, key: earlier})
        elif kind == REQS and isinstance(value, list) and len(value) > 1:
            for j in range(len(value)):
                # The batch without its j-th request, and the parallel list
                # of integers (``extend``'s tokens) without its j-th entry.
                yield attrs.evolve(step, args={
                    k: v[:j] + v[j + 1 :] if isinstance(v, list) and len(v) == len(value) else v
                    for k, v in step.args.items()
                })


def _simplicity(step: Step) -> tuple:
    """The order replacing one step by another must descend in, so that the
    minimiser ends: one that creates nothing, then fewer arguments, then the
    rule's name, then the values."""
    return (returns_kind(step.rule) is not None, len(step.args), step.rule, json.dumps(step.args, sort_keys=True))


def _candidate_steps(rules: tuple[str, ...], config: Config, made: dict[str, list[str]], ints: set[int]):
    """Steps of ``rules`` in their simplest forms, simplest first: each
    integer at its lowest or one of ``ints`` (values the replaced steps
    had), each flag either way, each request or entry one of the three
    latest ``made``, a batch of one, an optional argument left out or given."""
    found = []
    for rule in rules:
        options = []
        for key, kind in arg_kinds(rule).items():
            if kind in (REQ, ENTRY):
                values = made.get(kind, [])[-3:]
            elif kind == REQS:
                values = [[r] for r in made.get(REQ, [])[-3:]]
            elif kind == FLAG:
                values = [False, True]
            else:
                try:
                    lo, hi, multiple = int_bounds(kind.removeprefix(LIST), config)
                except TraceError:
                    values = []
                else:
                    # Each value rounded up to the unit's multiple: a page where an extend took a token.
                    up = {-(-v // multiple) * multiple for v in ints}
                    # No more than one draw of the rule takes (a sum of two steps' may be).
                    hi = min(hi, _CARRIED.get((rule, key), hi) * config.page_size)
                    values = sorted({lo} | {v for v in up if lo <= v <= hi})
                    values = [[v] for v in values] if kind.startswith(LIST) else values
            if key in optional_args(rule):
                values = [None, *values]
            options.append((key, values))
        for combo in itertools.product(*(values for _, values in options)):
            found.append(Step(rule, {key: v for (key, _), v in zip(options, combo) if v is not None}))
    return sorted(found, key=_simplicity)


def _other_frees(steps: tuple[Step, ...], i: int, rules: tuple[str, ...], config: Config, made: dict[str, list[str]],
                 had: set[str]):
    """Simpler steps in place of ``steps[i]`` where it frees a request's
    pages (``FREES_A_REQUEST``): each other such rule the trace lacks (not
    in ``had``), naming what the step names, its amounts those of the steps
    that make or name it, itself among them (a rematch's segment free as a
    ``free_segment`` of the request's tail, whose slots the allocs that
    grew it give)."""
    step = steps[i]
    # A step whose entry a later step names cannot go (a rematch that cached a prefix).
    if step.rule not in FREES_A_REQUEST or _named_later(steps, i):
        return []
    named = _refs(step)
    amounts = _ints_in([s for s in steps if s.returns in named or _refs(s) & named])
    others = tuple(r for r in rules if r in FREES_A_REQUEST and r not in had)
    return [c for c in _candidate_steps(others, config, made, amounts)
            if _simplicity(c) < _simplicity(step) and _refs(c) & named]


def _unneeded(steps: tuple[Step, ...], i: int, named: set[str]) -> tuple[Step, ...]:
    """``steps`` without every step before index ``i`` that acts on one of
    ``named`` or makes one, unless a later step of ``steps`` names what it
    makes (a batch step goes whole)."""
    def needed(k: int) -> bool:
        step = steps[k]
        if not (_refs(step) | {step.returns}) & named:
            return True
        return _named_later(steps, k)
    return tuple(s for k, s in enumerate(steps) if k >= i or needed(k))


def _pruned(steps: tuple[Step, ...], i: int, named: set[str]) -> tuple[Step, ...]:
    """``_unneeded`` again until it deletes nothing: a step it deletes may
    have been the last to name what an earlier one made (a ``rematch``
    deleted leaves the ``alloc`` of its request unnamed)."""
    while len(fewer := _unneeded(steps, i, named)) < len(steps):
        i -= len(steps) - len(fewer)
        steps = fewer
    return steps


def _ints_in(steps) -> set[int]:
    out = set()
    for step in steps:
        for value in step.args.values():
            if isinstance(value, int) and not isinstance(value, bool):
                out.add(value)
            elif isinstance(value, list):
                out |= {v for v in value if isinstance(v, int)}
    return out


def _pair_ints(steps) -> set[int]:
    """The integers of ``steps`` (``_ints_in``), and each sum of one from
    the first step and one from the second: one step in place of two may
    take what both took (two extends of one request as one)."""
    ints = _ints_in(steps)
    if len(steps) == 2:
        ints |= {a + b for a in _ints_in(steps[:1]) for b in _ints_in(steps[1:])}
    return ints


def _refs(step: Step) -> set[str]:
    """The requests and entries ``step`` names in its arguments."""
    kinds = arg_kinds(step.rule)
    return {name for key, value in step.args.items() if kinds.get(key) in (REQ, ENTRY, REQS)
            for name in (value if isinstance(value, list) else [value])}


def _named_later(steps: tuple[Step, ...], i: int) -> bool:
    """Whether ``steps[i]`` makes a request or entry a later step names."""
    made = steps[i].returns
    return bool(made) and any(made in _refs(s) for s in steps[i + 1 :])


def _runnable_rules(config: Config) -> tuple[str, ...]:
    """The rules a trace on ``config`` may hold: those its state has and runs here."""
    try:
        state = build(config)
    except Exception:  # noqa: BLE001 - no state, no rules to offer
        return ()
    return tuple(r for r in RULES if callable(getattr(state, r, None)) and state.why_not(r) is None)


def _rows_retargeted(steps: tuple[Step, ...], config: Config):
    """``steps`` with one ``overwrite_row`` aimed at another of the
    configuration's rows, each in turn (after ``_without`` a later request
    may sit in the row an earlier one left)."""
    for i, step in enumerate(steps):
        if step.rule == "overwrite_row":
            for row in range(config.rows):
                if row != step.args["row"]:
                    yield (*steps[:i], attrs.evolve(step, args={**step.args, "row": row}), *steps[i + 1 :])


def _without(steps: tuple[Step, ...], name: str) -> tuple[Step, ...]:
    """``steps`` as if ``name`` (a request or entry) had never been made:
    the step that made it and every step naming it go, and it leaves each
    list of requests it is in, with its entry in the step's parallel list
    of integers (``extend``'s tokens); a step left with an empty list goes."""
    out = []
    for step in steps:
        if step.returns == name or name in step.args.values():
            continue
        args = dict(step.args)
        for key, value in step.args.items():
            if isinstance(value, list) and name in value:
                i = value.index(name)
                for other, items in step.args.items():
                    if isinstance(items, list) and len(items) == len(value):
                        args[other] = items[:i] + items[i + 1 :]
        if any(isinstance(v, list) and not v for k, v in args.items() if step.args[k]):
            continue
        out.append(attrs.evolve(step, args=args) if args != step.args else step)
    return tuple(out)


# The quantities a request is grown by, and the most pages one step of the
# machine's rule draws for each: what ``_carried`` may move between steps.
_CARRIED = {("alloc", "n"): MAX_PAGES, ("extend", "tokens"): EXTEND_TOKENS_PAGES}


def _arg_bounds(rule: str, key: str, config: Config) -> tuple[int, int, int]:
    """``int_bounds`` of ``rule``'s integer argument ``key`` (each item's, for a list)."""
    return int_bounds(arg_kinds(rule)[key].removeprefix(LIST), config)


def _one_draw(rule: str, key: str, config: Config) -> int:
    """The most slots one draw of ``rule``'s ``key`` (one of ``_CARRIED``)
    takes: its bound, and no more than ``_CARRIED``'s pages.  The cap of
    ``_spread`` (the carries), ``_hoisted``, ``_rematches_recast`` and
    ``_prefix_folded``; ``_growth_hoisted`` takes the bound.  With the
    bound here too, over the 408-shrink sweep (shrink seeds 0-5 of the 68
    built-in and bench bugs), no shrink ended shorter and one a step
    longer (token alias seed 3's ``no_page_freed_twice``, 5 to 6)."""
    return min(_arg_bounds(rule, key, config)[1], _CARRIED[rule, key] * config.page_size)


def _carried(steps: tuple[Step, ...], name: str, config: Config, backward: bool = False) -> tuple[Step, ...]:
    """``_without(steps, name)``, with the slots its deleted steps asked for
    (``alloc``'s ``n``, its share of an ``extend``'s tokens) added to the
    remaining steps of the same rule and argument, earliest first (latest
    first with ``backward``), each up to what one draw of the rule takes
    (``_CARRIED``, in pages); what does not fit is dropped.  Two requests
    that only filled the pool become one: the pool still fills."""
    moved: dict[tuple[str, str], int] = {}
    for step in steps:
        gone = step.returns == name or name in step.args.values()
        listed = next((v.index(name) for v in step.args.values() if isinstance(v, list) and name in v), None)
        for key, value in step.args.items():
            if (step.rule, key) not in _CARRIED:
                continue
            if gone and isinstance(value, int):
                moved[step.rule, key] = moved.get((step.rule, key), 0) + value
            elif not gone and listed is not None and isinstance(value, list):
                moved[step.rule, key] = moved.get((step.rule, key), 0) + value[listed]
    return _spread(_without(steps, name), moved, config, backward)


def _spread(steps: tuple[Step, ...], moved: dict[tuple[str, str], int], config: Config,
            backward: bool = False) -> tuple[Step, ...]:
    """``steps`` with the slots of ``moved`` (``{(rule, argument): slots}``,
    keys of ``_CARRIED``) added to their steps of that rule and argument,
    earliest first (latest first with ``backward``), each up to what one
    draw of the rule takes, in whole multiples of the argument's unit;
    what does not fit is dropped."""
    moved, out = dict(moved), list(steps)
    order = range(len(out) - 1, -1, -1) if backward else range(len(out))
    for i in order:
        step = out[i]
        args = dict(step.args)
        for key, value in step.args.items():
            left = moved.get((step.rule, key), 0)
            if not left:
                continue
            multiple = _arg_bounds(step.rule, key, config)[2]
            cap = _one_draw(step.rule, key, config)
            values = value if isinstance(value, list) else [value]
            grown = []
            for v in values:
                more = max(0, min(left, cap - v)) // multiple * multiple
                grown.append(v + more)
                left -= more
            moved[step.rule, key] = left
            args[key] = grown if isinstance(value, list) else grown[0]
        out[i] = attrs.evolve(step, args=args) if args != step.args else step
    return tuple(out)


def _resize_carried(steps: tuple[Step, ...], config: Config, backward: bool = False):
    """``steps`` without one ``resize`` that took pages off the pool, each in
    turn, those pages added to the requests' ``alloc`` instead
    (``_spread``, earliest first, or latest with ``backward``): a request
    that holds the pages the resize took fills the pool as well, and the
    resize goes."""
    # The pages the pool holds before each step: the last resize's, else the configuration's.
    pages = config.pool_size // config.page_size
    for i, step in enumerate(steps):
        if step.rule != "resize":
            continue
        gone, pages = pages - step.args["pages"], step.args["pages"]
        if gone > 0:
            yield _spread((*steps[:i], *steps[i + 1 :]), {("alloc", "n"): gone * config.page_size}, config, backward)


def _compensated(steps: tuple[Step, ...], name: str, config: Config):
    """``_without(steps, name)`` with one argument changed to make up for
    the room ``name`` took, each in turn: a ``resize`` to as many pages
    fewer as the request held at its last step (when ``_size_before``
    knows), one page fewer or one more; or an amount of slots or span
    (an element of a list too) raised to what one draw takes (the
    machine's ``MAX_PAGES`` pages, at most its bound).  Two changes at
    once: a request that only took room goes while the pool stays as full,
    where neither change alone fails (merge-on-total: the second of two
    load-backs goes and the first takes a draw's most).  Among them are a
    pool made larger and a free made bigger, which make up for nothing;
    each costs one replay."""
    yield from _raised(_without(steps, name), config, _size_before(steps, name, len(steps)))


def _deleted_raised(steps: tuple[Step, ...], config: Config):
    """``steps`` without one step, each in turn, and with one argument of a
    step before it changed as ``_compensated`` changes one (an amount set
    to one draw's most, a ``resize`` a page either way): the earlier step
    takes on what the deleted one did (merge-on-total: an alloc raised to
    a draw's most where an extend grew the request into the pool's last
    free page).  Strictly shorter; about as many candidates as the trace
    has steps times the amounts before them, so ``minimize`` tries them
    last among its dearer moves."""
    for i in range(1, len(steps)):
        if not steps[i].returns:  # a request's own step: ``_compensated``'s
            yield from _raised((*steps[:i], *steps[i + 1 :]), config, None, before=i)


def _evictions_recast(steps: tuple[Step, ...], rules: tuple[str, ...], config: Config):
    """``steps`` with one ``evict`` made a free of a request made before it
    (a rule of ``FREES_A_REQUEST`` in its simplest forms,
    ``_candidate_steps``: each amount at its lowest, a request among the
    three latest made, live or not) and one argument of a step before it
    changed as ``_compensated`` changes one (an amount set to one draw's
    most, a ``resize`` a page either way): a request then holds enough to
    free a page where the entry was evicted and still have what later
    steps free, and the entry's steps may go (ThirdGroup as walk seed 0
    met it after 2026-12-06: the first of three groups evicts an entry,
    where the known trace frees a page of its one request in the first two
    and finishes it in the third).  None where no argument before the
    eviction can change: the swap alone, a free no simpler than an
    eviction, is not tried."""
    frees = tuple(r for r in rules if r in FREES_A_REQUEST)
    for i, step in enumerate(steps):
        if step.rule != "evict":
            continue
        for free in _candidate_steps(frees, config, _made_before(steps, i), set()):
            if _refs(free):
                yield from _raised((*steps[:i], free, *steps[i + 1 :]), config, None, before=i)


def _rematches_recast(steps: tuple[Step, ...], config: Config):
    """``steps`` with one ``rematch`` that freed a duplicate span made a
    ``free_segment`` of the request's slots from 0 to its end and an
    ``overwrite_row`` (each row in turn), one step longer, the request's
    alloc grown by a page, or to one draw's most (``_one_draw``; never as
    it was: the rematch freed those pages already).  A rematch frees only
    the whole pages it duplicates (a 1-page request's one page), where a
    segment bug may need a segment over two pages (multi-ended
    segment-view as bench shrink seed 0 met it: two 1-page requests
    rematched onto one entry in a group free its page twice, where the
    known trace frees a 2-page segment and overwrites the row).  Kept only
    where deletions then end shorter.  Only a rematch whose new entry (its
    return) no later step names, of a request a plain ``alloc`` made and
    only ``alloc``, ``free``, ``extend`` or ``decode`` named before it
    (``_size_before``): so it has no prefix, and its slots start at 0."""
    ps, most = config.page_size, _one_draw("alloc", "n", config)
    for i, step in enumerate(steps):
        if step.rule != "rematch" or not step.args.get("dup") or _named_later(steps, i):
            continue
        req = step.args["req"]
        made = next((k for k, s in enumerate(steps[:i]) if s.returns == req), None)
        held = _size_before(steps, req, i)  # None unless a plain alloc made it
        if made is None or held is None:
            continue
        n = steps[made].args["n"]
        for grown in sorted({n + ps, most}):
            if not n < grown <= most:
                continue
            alloc = attrs.evolve(steps[made], args={"n": grown})
            segment = Step("free_segment", {"req": req, "start": 0, "n": held + grown - n})
            for row in range(config.rows):
                yield (*steps[:made], alloc, *steps[made + 1 : i], segment, Step("overwrite_row", {"row": row}),
                       *steps[i + 1 :])


def _raised(out: tuple[Step, ...], config: Config, held: int | None, before: int | None = None):
    """``out`` with one argument changed, each in turn (``_compensated``'s
    changes; ``held``, where known, the slots the deleted request held),
    only in its first ``before`` steps where given."""
    ps = config.page_size
    for i, step in enumerate(out[:before]):
        kinds = arg_kinds(step.rule)
        for key, value in step.args.items():
            unit = kinds.get(key, "").removeprefix(LIST)
            if isinstance(value, bool) or unit not in (SLOTS, SPAN, POOL):
                continue
            lo, hi, multiple = int_bounds(unit, config)
            if unit == POOL:
                values = {value - 1, value + 1} | ({value - -(-held // ps)} if held and held > 0 else set())
            else:
                values = {min(hi, MAX_PAGES * ps) // multiple * multiple}
            for v in sorted(v for v in values if lo <= v <= hi):
                for j, item in enumerate(value if isinstance(value, list) else [value]):
                    if v != item:
                        grown = [*value[:j], v, *value[j + 1 :]] if isinstance(value, list) else v
                        yield (*out[:i], attrs.evolve(step, args={**step.args, key: grown}), *out[i + 1 :])


def _renamed(step: Step, old: str, new: str) -> Step | None:
    """``step`` naming request ``new`` wherever it named ``old``.  A batch
    that names both keeps ``new`` once, with ``old``'s entry of the step's
    parallel list of integers added to its own (``extend``'s tokens: one
    request grows by what both grew by); None where there is no such list
    (a ``decode`` grows each request it names by one)."""
    args = dict(step.args)
    for key, value in step.args.items():
        if isinstance(value, list) and old in value:
            if new not in value:
                args[key] = [new if v == old else v for v in value]
                continue
            i, j = value.index(old), value.index(new)
            # The step's lists of integers, one entry a request (the rule's declared kinds).
            kinds = arg_kinds(step.rule)
            lists = [k for k, v in step.args.items() if k != key and kinds.get(k, "").startswith(LIST)
                     and len(v) == len(value)]
            if not lists:
                return None
            for other in lists:
                items = list(step.args[other])
                items[j] += items[i]
                args[other] = items[:i] + items[i + 1 :]
            args[key] = value[:i] + value[i + 1 :]
        elif value == old:
            args[key] = new
    return attrs.evolve(step, args=args) if args != step.args else step


def _merged(steps: tuple[Step, ...], first: str, second: str, freeing: bool = False) -> tuple[Step, ...] | None:
    """``steps`` with request ``second`` made part of ``first``, made
    earlier: ``second``'s plain ``admit`` goes, its plain ``alloc`` grows
    ``first`` instead where it stood (``alloc(n, req=first)``), every later
    step names ``first``, and each ``finish`` or ``finish_segments`` of
    ``first`` before ``second``'s last step goes (the one request lives
    on), or, with ``freeing``, is made a ``free`` of as many slots as
    ``first`` held there (``_size_before``), so the group it stood in
    still frees (bench.bugs:ThirdGroup as shrink seed 4 met it: two
    requests where the known trace has one, whose free in the second of
    three groups was the first's finish).  None where the two cannot
    merge: a step names both in one batch, or ``second`` was made another
    way; and with ``freeing``, where ``second`` was not admitted (its
    alloc stays, so the merge is no shorter), no finish went, or what
    ``first`` held there is unknown."""
    uses = [i for i, step in enumerate(steps) if second in (step.returns, *step.args.values())
            or any(isinstance(v, list) and second in v for v in step.args.values())]
    if first == second or not uses:
        return None
    out, freed = [], False
    for i, step in enumerate(steps):
        if step.returns == second:
            if step.rule == "admit" and not step.args:
                continue
            if freeing or step.rule != "alloc" or set(step.args) != {"n"}:
                return None
            out.append(Step("alloc", {"n": step.args["n"], "req": first}))
            continue
        if step.rule in ENDS_A_REQUEST and step.args.get("req") == first and i < uses[-1]:
            if freeing and not freed:
                # ``first`` ends once; ``freed`` says it did, so a merge no
                # different from the plain one is not offered (below).
                held = _size_before(steps, first, i)
                if not held:
                    return None
                out.append(Step("free", {"req": first, "n": held}))
                freed = True
            continue
        out.append(_renamed(step, second, first))
    return None if None in out or (freeing and not freed) else tuple(out)


def _size_before(steps: tuple[Step, ...], name: str, i: int) -> int | None:
    """The slots request ``name`` holds before ``steps[i]``, counted from the
    steps that grow or shrink it (``alloc``, ``free``, ``extend``,
    ``decode``); None where another step names it (its size unknown here)."""
    size = 0
    for step in steps[:i]:
        batch = next((v for v in step.args.values() if isinstance(v, list) and name in v), None)
        if step.returns == name and step.rule == "alloc" and set(step.args) == {"n"}:
            size = step.args["n"]
        elif step.rule == "alloc" and step.args.get("req") == name:
            size += step.args["n"]
        elif step.rule == "free" and step.args.get("req") == name:
            size -= step.args["n"]
        elif step.rule == "extend" and batch is not None:
            size += step.args["tokens"][batch.index(name)]
        elif step.rule == "decode" and batch is not None:
            size += 1
        elif step.returns == name or name in step.args.values() or batch is not None:
            return None
    return size


def _hoisted(steps: tuple[Step, ...], first: str, second: str, config: Config,
             shifted: bool = False) -> tuple[Step, ...] | None:
    """``steps`` with request ``second`` made part of ``first`` from the
    start: ``first``'s plain ``alloc`` takes ``second``'s slots too (up to
    what one draw of the rule takes), ``second``'s plain ``alloc`` goes,
    every later step names ``first``, and each ``finish`` of either before
    the merged request's last step frees only the slots that request held
    (``free(req=first, n=...)``).  Where ``_merged`` grows ``first`` at the
    point ``second`` was made, this leaves later groups only frees: three
    groups of alloc, finish become one alloc and three groups of a free.
    With ``shifted``, an offset into ``second`` (a ``free_segment``'s
    ``start``) moves past the slots ``first``'s alloc took, where
    ``second``'s now lie; None where no step names one, or where ``first``
    has grown or shrunk by then (its growth lies after ``second``'s slots,
    a free of its tail takes them).  None where they cannot merge so: either
    not made by a plain ``alloc``, ``second`` made first, a step names both
    in one batch, or the slots do not fit one draw."""
    made = {step.returns: i for i, step in enumerate(steps) if step.returns in (first, second)}
    if first == second or set(made) != {first, second} or made[first] > made[second]:
        return None
    if any(steps[made[x]].rule != "alloc" or set(steps[made[x]].args) != {"n"} for x in (first, second)):
        return None
    total = steps[made[first]].args["n"] + steps[made[second]].args["n"]
    if total > _one_draw("alloc", "n", config):
        return None
    names = (first, second)
    uses = [i for i, step in enumerate(steps) if any(x in (step.returns, *step.args.values()) for x in names)
            or any(isinstance(v, list) and x in v for v in step.args.values() for x in names)]
    # Each offset into ``second``, by step: its slots lie after ``first``'s.
    offsets, first_n = {}, steps[made[first]].args["n"]
    if shifted:
        offsets = {i: keys for i, step in enumerate(steps) if step.args.get("req") == second
                   if (keys := [k for k, kind in arg_kinds(step.rule).items() if kind == OFFSET])}
        if not offsets or any(_size_before(steps, first, i) != first_n for i in offsets):
            return None
    out = []
    for i, step in enumerate(steps):
        if i in offsets:
            step = attrs.evolve(step, args={**step.args, **{k: step.args[k] + first_n for k in offsets[i]}})
        if i == made[first]:
            out.append(attrs.evolve(step, args={"n": total}))
            continue
        if i == made[second]:
            continue
        whose = step.args.get("req") if step.rule == "finish" else None
        if whose in names and i < uses[-1]:
            size = _size_before(steps, whose, i)
            if not size:
                return None
            out.append(Step("free", {"req": first, "n": size}))
            continue
        out.append(_renamed(step, second, first))
    return None if None in out else tuple(out)


def _refitted(steps: tuple[Step, ...], config: Config) -> tuple[Step, ...]:
    """``steps`` with each ``free_segment`` of a request whose size there is
    known (``_size_before``) made to end on the request's last page again,
    as the step requires, at the same slot of that page: after a change to
    how much the request holds, the segment fits it once more (it starts
    no later than that page)."""
    ps, out = config.page_size, list(steps)
    for i, step in enumerate(steps):
        if step.rule != "free_segment":
            continue
        size = _size_before(tuple(out), step.args["req"], i)
        if not size:
            continue
        end = (size - 1) // ps * ps + (step.args["start"] + step.args["n"] - 1) % ps + 1
        start = min(step.args["start"], (end - 1) // ps * ps)
        out[i] = attrs.evolve(step, args={**step.args, "start": start, "n": end - start})
    return tuple(out)


def _and_refitted(steps: tuple[Step, ...], config: Config, below: tuple[Step, ...] | None = None):
    """``steps``, then ``_refitted(steps)`` where that differs, and where
    ``below`` is given, its amounts in all less than ``below``'s: a pass
    that lowers an argument takes the refit for a request made smaller,
    never a segment raised back (a segment free of 17 lowered to 8, then
    refitted to end on its request's last page again, 24: the minimiser
    walked 17, 24, 28, ... 18, each as long, helper-87's trace)."""
    yield steps
    if (refit := _refitted(steps, config)) != steps and (below is None or _amount(refit) < _amount(below)):
        yield refit


def _amount(steps: tuple[Step, ...]) -> int:
    """The sum of the integer arguments of ``steps``, list elements too."""
    total = 0
    for step in steps:
        for value in step.args.values():
            for v in value if isinstance(value, list) else (value,):
                if isinstance(v, int) and not isinstance(v, bool):
                    total += v
    return total


def _growth_hoisted(steps: tuple[Step, ...], config: Config):
    """``steps`` with one step that grows a single request made by a plain
    ``alloc`` or ``admit`` (``alloc(n, req=...)``, a one-request ``extend``
    or ``decode``) deleted and its slots taken by that step, an ``alloc``
    (an admit is an alloc of nothing), each in turn, where they fit an
    alloc's bound in a trace (``_arg_bounds``: a row's slots), which may be
    more than one of the walk's draws takes (``_one_draw``: BigFree's alloc
    of 9, where the walk grew the request a draw at a time); or one
    ``free`` of the request's last slots deleted and that alloc made as
    much smaller, where a page is left.  The merges (``_merged``,
    ``_hoisted``) and carries (``_carried``) still stop at one draw (not
    measured without that cap)."""
    made = {step.returns: i for i, step in enumerate(steps)
            if (step.rule, set(step.args)) in (("alloc", {"n"}), ("admit", set()))}
    cap = _arg_bounds("alloc", "n", config)[1]
    for i, step in enumerate(steps):
        if step.rule == "alloc" and set(step.args) == {"n", "req"}:
            name, more = step.args["req"], step.args["n"]
        elif step.rule in ("extend", "decode") and len(step.args["reqs"]) == 1:
            name, more = step.args["reqs"][0], step.args["tokens"][0] if step.rule == "extend" else 1
        elif step.rule == "free":
            # A tail free: the request held that much less from its alloc on.
            name, more = step.args["req"], -step.args["n"]
        else:
            continue
        if name not in made or made[name] > i:
            continue
        at = made[name]
        # An alloc takes whole pages: the slots it grows by round up to one.
        grown = -(-(steps[at].args.get("n", 0) + more) // config.page_size) * config.page_size
        if config.page_size <= grown <= cap:
            alloc = Step("alloc", {"n": grown}, name)
            yield from _and_refitted((*steps[:at], alloc, *steps[at + 1 : i],
                                      *steps[i + 1 :]), config)


def _prefix_folded(steps: tuple[Step, ...], config: Config):
    """``steps`` with one request made on a cached prefix (``alloc`` or
    ``admit`` with ``prefix``) made by a plain ``alloc`` instead, its slots
    grown by each whole number of pages in turn, up to what one draw of
    the rule takes: the request holds as much without the cache entry,
    whose request and ``rematch`` can then go.  After each, the same with
    the plain ``alloc`` of the request whose ``rematch`` made the entry
    made as much smaller (at least a page left): the pages the two shared
    are held twice now, and the pool stays as full as it was.  After each
    folded candidate (before the smaller donor's), the same with the
    earlier steps that make or act on the entry or the request whose
    ``rematch`` made it deleted, where no later step needs what they make
    (``_pruned``; the ``rematch`` and that request's ``alloc`` among them):
    on a pool the two filled, the bigger ``alloc`` fits only once they are
    gone (hisparse's alloc of 4, its rematch and an alloc of 4 on the
    prefix, on a pool of 8, as one alloc of 8)."""
    cap, ps = _one_draw("alloc", "n", config), config.page_size
    made = {step.returns: i for i, step in enumerate(steps) if step.returns}
    for i, step in enumerate(steps):
        if step.rule not in ("alloc", "admit") or "prefix" not in step.args or "req" in step.args:
            continue
        n, cached = step.args.get("n", 0), made.get(step.args["prefix"])
        donor = made.get(steps[cached].args.get("req")) if cached is not None and steps[cached].rule == "rematch" else None
        if donor is not None and (steps[donor].rule, set(steps[donor].args)) != ("alloc", {"n"}):
            donor = None
        named = {step.args["prefix"]} | ({steps[cached].args["req"]} if donor is not None else set())
        for more in range(ps, cap - n + 1, ps):
            folded = (*steps[:i], Step("alloc", {"n": n + more}, step.returns), *steps[i + 1 :])
            yield folded
            if len(pruned := _pruned(folded, i, named)) < len(folded):
                yield pruned
            if donor is not None and steps[donor].args["n"] - more >= ps:
                yield (*folded[:donor], attrs.evolve(steps[donor], args={"n": steps[donor].args["n"] - more}),
                       *folded[donor + 1 :])


def _finish_deferred(steps: tuple[Step, ...], rules: tuple[str, ...], config: Config):
    """``steps`` where a request finishes while an entry its ``rematch``
    cached holds its prefix, and a later ``evict`` frees the entry: the
    finish deleted (where the entry held all the request had left:
    bench.bugs:ThirdGroup as walk seed 1 met it on 2026-12-07), or made a
    free of the request (each simplest form of a rule of
    ``FREES_A_REQUEST`` that leaves the request live: not a finish, a
    ``finish_segments`` or a rematch; its amounts those of the steps that
    make or name the request), the eviction the request's finish, and the
    earlier steps that make or act on the entry deleted where no later step
    needs what they make (``_pruned``): candidates meant to free the same
    slots at the same steps with no cache between (a free of the tail the
    entry did not hold, then the rest), each one step shorter at least, and
    replayed as every candidate is (unified-mamba prepare-closes-group as a walk met it
    with an 80-step first example: a finish in a group and an eviction after
    the group closed, where the known trace frees the request's tail in the
    group and finishes it after)."""
    kinds = FREES_A_REQUEST - ENDS_A_REQUEST - {"rematch"}
    frees = tuple(r for r in rules if r in kinds)
    made = {step.returns: k for k, step in enumerate(steps) if step.returns}
    for j, step in enumerate(steps):
        entry = step.args.get("entry") if step.rule == "evict" else None
        cached = made.get(entry)
        if cached is None or steps[cached].rule != "rematch":
            continue
        req = steps[cached].args.get("req")
        finished = Step("finish", {"req": req})
        finish = next((i for i in range(cached + 1, j) if steps[i] == finished), None)
        if finish is None:
            continue
        amounts = _ints_in([s for s in steps if s.returns == req or req in _refs(s)])
        # Each free names the request, however many were made after it.
        # No free first: where the entry held all the request had left.
        for free in (None, *_candidate_steps(frees, config, {REQ: [req], ENTRY: []}, amounts)):
            kept = (free,) if free is not None else ()
            recast = (*steps[:finish], *kept, *steps[finish + 1 : j], finished, *steps[j + 1 :])
            if len(pruned := _pruned(recast, j, {entry})) < len(recast):
                yield pruned


def _key(config: Config, steps: tuple[Step, ...]) -> tuple:
    """``steps`` on ``config`` as a key: a trace's memo in ``minimize``."""
    return config, json.dumps([step.to_dict() for step in steps], sort_keys=True)


# Steps the dearer passes of ``minimize`` may replay, all told: a bound on
# its time that keeps it deterministic (a clock would not).  Only their own
# replays count: cheap passes on a long trace once left them nothing.
DEAR_STEPS = 6000
# Steps ``minimize``'s split pass, the dearest, may replay besides.
SPLIT_STEPS = 1500
# Steps ``minimize``'s pass of two moves at once may replay besides.  It
# runs on every trace once the others are stuck, so each shrink pays about
# this much at most for it (checked between candidates: a descent from a
# kept one may run past it): over the 157 failures captured from the
# bench's bugs it added a median of 12 steps (at most 2,822) to the 1,521
# median each shrink replayed (measured before a fold that passes was
# tried with a later step made another: that comes last and can take the
# rest of the budget).
PAIR_STEPS = 2000
# Steps ``minimize``'s last pass, two arguments lowered at once, may replay
# besides: it too runs on every trace once the others are stuck.
LOWER_STEPS = 1000
# Steps ``paired`` may replay, besides, on a fold that applies with one
# later step made another, before its moves: after them it found nothing
# where the moves took the whole budget (unified-swa segment-queues-view,
# seeds 0 and 1, once free_nothing was a rule: a grow and a finish in a
# group, 6 steps, where an overwrite of the row makes 5 at 6,000 to 10,000
# steps of PAIR_STEPS; on its own budget it took between 100 and 300).
REPLACE_STEPS = 1000


def _moved(steps: tuple[Step, ...]):
    """``(j, steps')``: ``steps`` with one step moved to another place
    ``j``, each in turn, nearest places first."""
    seen = {_key(None, steps)}
    for distance in range(1, len(steps)):
        for i in range(len(steps)):
            for j in (i - distance, i + distance):
                if 0 <= j < len(steps):
                    rest = steps[:i] + steps[i + 1 :]
                    moved = (*rest[:j], steps[i], *rest[j:])
                    if (key := _key(None, moved)) not in seen:
                        seen.add(key)
                        yield j, moved


def minimize(trace: Trace, stop=None, configs: tuple[Config, ...] = ()) -> Trace:
    """The shortest, then simplest, trace found near ``trace`` that still
    fails on the same invariant: deterministic, replaying each candidate
    through the step seam.

    To a fixed point, cheap passes first: move the trace onto the first of
    ``configs`` (the run's own pool, then smaller ones) before its own that
    it still fails on, if any, or onto a smaller one with the amounts
    scaled to it (``_scaled``: rounded down, up or to the nearest; no
    longer); delete a request or entry with every step
    that names it (``_without``); delete runs of 8, 4, 2 and 1 steps
    (strictly shorter: a replay's teardown may close a group with an
    ``end`` of its own, which would give back the step deleted); delete a
    request and let other allocs carry its slots (``_carried``); merge two
    requests into one, where the second was made (``_merged``: the first's
    finish before the second's last step dropped) or from
    the first's alloc on (``_hoisted``; the second's segment offsets as they
    were, or moved past the first's slots), an extend of both growing the one by
    both's tokens (``_renamed``); make a request on a cached prefix
    by a plain alloc as big, the alloc of the entry's request perhaps as
    much smaller, or the earlier steps that make or act on the entry or
    its request deleted where no later step needs what they make
    (``_prefix_folded``); make a request's finish a free of its tail (or
    delete it) and a later eviction of the entry its rematch cached the
    request's finish,
    the entry's steps deleted (``_finish_deferred``); let a
    request's alloc (or admit) take what a later step grew it by, or give
    up what a later free of its tail gave back (``_growth_hoisted``); make each argument
    simpler (``_smaller_args``; no longer), a later segment free of a
    request made smaller refitted to it (``_refitted``); lower a prompt
    several steps share in all of them at once (``_lowered_together``).  Where those change nothing,
    the dearer ones, until one succeeds: delete a request or entry and
    make up for the room it took, a resize made smaller or an amount
    raised (``_compensated``); undo a resize, the allocs holding its pages
    (``_resize_carried``); merge two requests,
    the first's finish made a free of what it held (``_merged(freeing=True)``); delete one step on another of
    ``configs`` (strictly shorter, so in any order); put one step of one
    of their own rules (``_candidate_steps``, its amounts perhaps the sum
    of theirs) in place of two adjacent ones; put one simpler step of a
    rule the trace has, naming a request or entry the step named, in place
    of it (a group's free by a rematch made a finish), or for a free of a
    request's pages one of another such rule the trace lacks, its amounts
    also those of the steps naming the request (``_other_frees``: a
    rematch's segment free made a ``free_segment``); swap two adjacent steps where
    ``descend`` then ends shorter; make an eviction a free of a request made
    before it, an amount before it raised (``_evictions_recast``), or a
    rematch a ``free_segment`` and an ``overwrite_row``, its request grown
    (``_rematches_recast``), kept likewise; put one simple step of another rule in
    place of two adjacent ones; delete two steps apart; put any other
    simple step in place of one it is simpler than (``_simplicity``), which can
    let the cheap passes cut again; last, delete one step and change an
    amount of a step before it to one draw's most (``_deleted_raised``).  These stop, between candidates, once
    they have replayed ``DEAR_STEPS`` steps in all (a swap's or a recast's ``descend``
    counted; the cheap passes' replays not).  Then ``split``: one step as two, kept where deletions
    from there end shorter than ``best``, as it is or with the earlier steps that
    act on what the one step named deleted at once (``_unneeded``; its own
    budget, ``SPLIT_STEPS``).  Last, where
    all of those are stuck, ``paired``: two moves at once, a step moved and
    a new one put next to it, or a growth folded into its alloc, a step
    that then no longer applies deleted or made simpler, or, last, where
    the fold applies but does not fail, a later step made a simple step of
    any rule (its own budget,
    ``PAIR_STEPS``); after it, two integer arguments lowered at once
    (``_two_lowered``; ``LOWER_STEPS``).  Only a
    failure on the same invariant counts (``_fails_like``).  At the fixed
    point, ``settled``: the trace onto the smallest pool of ``configs`` it
    fails on as long, with its amounts scaled or not (the passes move a
    trace between pools both ways, so it could end on any); where that
    replay fails sooner, the passes again from there.  Each kept candidate is re-recorded,
    so names run ``req_0``, ``req_1``, ... again.  ``stop()``, when given,
    is asked before each replay; true raises ``KeyboardInterrupt``.
    """

    def runnable() -> tuple[str, ...]:
        """The rules a trace on ``best``'s pool may hold (``_runnable_rules``), found once a pool."""
        if best.config not in rules:
            rules[best.config] = _runnable_rules(best.config)
        return rules[best.config]

    def check(candidate: Trace) -> Trace | None:
        """``candidate`` re-recorded where it fails on the invariant (each replayed once)."""
        if stop is not None and stop():
            raise KeyboardInterrupt("stop requested")
        key = _key(candidate.config, candidate.steps)
        if key not in tried:
            tried[key] = _fails_like(candidate, best.invariant)
            spent[0] += len(candidate.steps)
        return tried[key]

    def attempt(candidate: Trace, shorter: bool) -> bool:
        nonlocal best
        again = check(candidate)
        if again is None or len(again.steps) > len(best.steps) - shorter:
            return False
        # A trace that was ``best`` once is never taken again: moves that
        # keep the length (a segment refitted) cannot then cycle.
        key = _key(again.config, again.steps)
        if key in been:
            return False
        been.add(key)
        best = again
        return True

    def cheap() -> bool:
        changed = False
        for config in configs:
            if config == best.config:
                break  # those after it come later in ``configs``'s order (a smaller pool: below, and ``settled``)
            if attempt(attrs.evolve(best, config=config), shorter=False):
                changed = True
                break
        for config in configs:
            # A smaller pool with the amounts scaled down to it, no longer:
            # rounded down, or up or to the nearest (two requests that
            # filled the pool fill the smaller one, and may merge there).
            # A move at the same length may later be undone by the run's
            # own pool (the first loop); ``been`` keeps a trace from
            # coming back, so neither repeats, and ``settled`` ends it on
            # the simplest shape it fails on.
            if any(attempt(attrs.evolve(best, config=config, steps=steps), shorter=False)
                   for steps in _scalings(best.steps, best.config, config)):
                changed = True
                break
        for name in [step.returns for step in best.steps if step.returns]:
            # A request and all it touched at once: deleting the step that
            # made it alone breaks every later step that names it.
            if name in {step.returns for step in best.steps}:
                without = _without(best.steps, name)
                # Without a request, later ones may take other rows: an
                # overwrite of the row it freed then names another row.
                changed |= any(attempt(attrs.evolve(best, steps=steps), shorter=True)
                               for steps in (without, *_rows_retargeted(without, best.config)))
        for width in (8, 4, 2, 1):
            i = 0
            while i + width <= len(best.steps):
                if attempt(attrs.evolve(best, steps=best.steps[:i] + best.steps[i + width :]), shorter=True):
                    changed = True
                else:
                    i += 1
        for name in [step.returns for step in best.steps if step.returns]:
            # A request the failure needs only for the slots it holds: other
            # allocs take them on (after the plain deletions, which keep more).
            if name in {step.returns for step in best.steps}:
                changed |= any(attempt(attrs.evolve(best, steps=_carried(best.steps, name, best.config, back)), shorter=True)
                               for back in (False, True))
        # A request on a prefix made plain, as big: the prefix's steps may go next.
        changed |= any(attempt(attrs.evolve(best, steps=steps), shorter=False)
                       for steps in list(_prefix_folded(best.steps, best.config)))
        # A finish and an eviction of the entry cached from its request made
        # a tail free and the finish, with no entry: one step fewer at least.
        changed |= any(attempt(attrs.evolve(best, steps=steps), shorter=True)
                       for steps in list(_finish_deferred(best.steps, runnable(), best.config)))
        # A request grown later, made big enough at once: one step fewer.
        changed |= any(attempt(attrs.evolve(best, steps=steps), shorter=True)
                       for steps in list(_growth_hoisted(best.steps, best.config)))
        for first, second in itertools.combinations([s.returns for s in best.steps if returns_kind(s.rule) == REQ and s.returns], 2):
            # Two requests as one: one finish and one admit fewer.
            names = {step.returns for step in best.steps}
            if first in names and second in names:
                changed |= any(attempt(attrs.evolve(best, steps=merged), shorter=True)
                               for merged in (_merged(best.steps, first, second),
                                              _hoisted(best.steps, first, second, best.config),
                                              _hoisted(best.steps, first, second, best.config, shifted=True))
                               if merged is not None)
        for i in range(len(best.steps)):
            # A smaller argument may change which steps follow; ``best`` is re-read each time.
            # A request made smaller takes its later segment frees along (``_refitted``).
            while i < len(best.steps) and any(
                attempt(attrs.evolve(best, steps=steps), shorter=False)
                for step in _smaller_args(best.steps[i], best.config, best.steps, i)
                for steps in _and_refitted((*best.steps[:i], step, *best.steps[i + 1 :]), best.config, best.steps)
            ):
                changed = True
        # A value several steps share, lowered in all at once: one alone may part them.
        changed |= any(attempt(attrs.evolve(best, steps=steps), shorter=False)
                       for lowered in list(_lowered_together(best.steps, best.config))
                       for steps in _and_refitted(lowered, best.config, best.steps))
        return changed

    def dear() -> bool:
        steps = best.steps
        allowed = runnable()
        # Another pool shape of ``configs`` where the failure needs a step
        # fewer (a smaller pool fills sooner); strictly shorter, so in any order.
        # A request or entry deleted, the room it took made up for
        # (``_compensated``): strictly shorter, and few candidates.
        candidates = [(best.config, c, True) for name in [s.returns for s in steps if s.returns]
                      for c in _compensated(steps, name, best.config)]
        # A resize undone, the requests holding its pages instead (after
        # those: a resize and fewer requests may be shorter still).
        candidates += [(best.config, c, True) for back in (False, True)
                       for c in _resize_carried(steps, best.config, back)]
        # Two requests merged, the first's finish a free that keeps its
        # group freeing (``_merged(freeing=True)``): here, not among the
        # cheap passes, where taking it early led the token alias mutant's
        # README failure onto another path, shrunk on a larger pool.
        candidates += [(best.config, c, True) for first, second in itertools.combinations(
            [s.returns for s in steps if returns_kind(s.rule) == REQ and s.returns], 2)
            if (c := _merged(steps, first, second, freeing=True)) is not None]
        candidates += [(config, steps[:i] + steps[i + 1 :], True)
                       for config in configs if config != best.config for i in range(len(steps))]
        # Two adjacent steps as one of their own rules first (two segment
        # frees as one): few candidates, where one pair alone of another
        # rule may offer thousands (``reserve``'s five arguments).
        merges, near, others = [], [], []
        had = {s.rule for s in steps}
        for width in (2, 1):
            for i in range(len(steps) - width + 1):
                replaced, made = steps[i : i + width], _made_before(steps, i)
                names = {returns_kind(s.rule): s.returns for s in replaced if s.returns}
                for step in _candidate_steps(allowed, best.config, made, _pair_ints(replaced)):
                    if width == 1 and _simplicity(step) >= _simplicity(replaced[0]):
                        continue
                    step = attrs.evolve(step, returns=names.get(returns_kind(step.rule)))
                    own = width > 1 and step.rule in {s.rule for s in replaced}
                    # One step in place of one, of a rule the trace has and
                    # naming a request or entry the step it replaces names.
                    close = width == 1 and step.rule in had and _refs(step) & _refs(replaced[0])
                    (merges if own else near if close else others).append(
                        (best.config, (*steps[:i], step, *steps[i + width :]), width > 1))
                if width == 1:
                    near += [(best.config, (*steps[:i], step, *steps[i + 1 :]), False)
                             for step in _other_frees(steps, i, allowed, best.config, made, had)]
            if width == 2:
                pairs = itertools.combinations(range(len(steps)), 2)
                others += [(best.config, steps[:i] + steps[i + 1 : j] + steps[j + 1 :], True)
                           for i, j in pairs if j > i + 1]
        # Two adjacent steps swapped, kept only where deletions then end
        # shorter (``descend``): a free moved into a group lets the step
        # that queued the free there go.
        swaps = [(*steps[:i], steps[i + 1], steps[i], *steps[i + 2 :]) for i in range(len(steps) - 1)
                 if steps[i] != steps[i + 1]]
        # One step deleted, an earlier amount raised to take on what it did:
        # many candidates on a long trace, so last.
        others += [(best.config, c, True) for c in _deleted_raised(steps, best.config)]
        # An eviction made a free of a request, an amount before it raised
        # (``_evictions_recast``), or a rematch the segment free and the
        # overwrite it does (``_rematches_recast``): as long as the trace or
        # longer, so kept only where deletions then end shorter, as a swap
        # is; few candidates, so before the others, which can spend the
        # budget first.
        recast = [(None, c, None) for c in _evictions_recast(steps, allowed, best.config)]
        recast += [(None, c, None) for c in _rematches_recast(steps, best.config)]
        for config, candidate, shorter in (*candidates, *merges, *near, *((None, s, None) for s in swaps), *recast,
                                           *others):
            if spent[2] > DEAR_STEPS:
                return False
            before = spent[0]
            kept = descended(candidate) if config is None else attempt(
                attrs.evolve(best, config=config, steps=candidate), shorter)
            # Only this pass's replays count against its budget: the cheap
            # passes run to their fixed point whatever they cost.
            spent[2] += spent[0] - before
            if kept:
                return True
        return False

    def descended(steps: tuple[Step, ...]) -> bool:
        """Whether ``steps``, where they fail, ``descend`` to a trace shorter
        than ``best``, and take it."""
        nonlocal best
        if steps == best.steps:
            return False
        found = check(attrs.evolve(best, steps=steps))
        if found is None:
            return False
        found = descend(found)
        key = _key(found.config, found.steps)
        if len(found.steps) >= len(best.steps) or key in been:
            return False
        been.add(key)
        best = found
        return True

    def runs(steps: tuple[Step, ...]) -> bool:
        """Whether ``steps`` replay as a program (they may fail, or pass)."""
        # Whether steps run depends on the pool too (rows, bounds): ``best``
        # may have moved to another since.
        key = _key(best.config, steps)
        if stop is not None and stop():
            raise KeyboardInterrupt("stop requested")
        if key not in valid:
            spent[1] += len(steps)
            try:
                replay(attrs.evolve(best, steps=steps))
                valid[key] = True
            except Exception:  # noqa: BLE001 - a name the new step does not make, a group that nests
                valid[key] = False
        return valid[key]

    def descend(found: Trace) -> Trace:
        """``found`` with requests (``_without``, rows retargeted) and single
        steps deleted, greedily, while it still fails."""
        while True:
            withouts = [_without(found.steps, s.returns) for s in found.steps if s.returns]
            cuts = [c for w in withouts for c in (w, *_rows_retargeted(w, found.config))]
            cuts += [found.steps[:i] + found.steps[i + 1 :] for i in range(len(found.steps))]
            shorter = next((t for c in cuts if (t := check(attrs.evolve(found, steps=c))) is not None
                            and len(t.steps) < len(found.steps)), None)
            if shorter is None:
                return found
            found = shorter

    def split() -> bool:
        """One step as two: each step, last first, in place of a simpler
        candidate (``_candidate_steps``) that acts on a request or entry it
        names, if it names one, and still leaves a program; then one more
        candidate after that, of a rule no step of the trace has (rows: any),
        simplest first; where that fails, ``descend`` from it and keep what
        comes out shorter than ``best`` (``descended``), and where it fails
        but descends no shorter, the same with the earlier steps that act on
        or make what the one step named, but not those whose name a later
        step uses, deleted at once (``_unneeded``).  One step that does two things
        (``rematch`` frees a view and rewrites the row) becomes the two, and
        then the steps only the one needed can go.  Stops once
        ``SPLIT_STEPS`` steps in all have been replayed."""
        steps, config = best.steps, best.config
        ints = _ints_in(steps) | set(range(config.rows))
        new_rules = tuple(r for r in rules[config] if r not in {step.rule for step in steps})
        for i in reversed(range(len(steps))):
            kind, refs = returns_kind(steps[i].rule), _refs(steps[i])
            firsts = []
            for a in _candidate_steps(rules[config], config, _made_before(steps, i), _ints_in(steps[i : i + 1])):
                if _simplicity(a) >= _simplicity(steps[i]) or (refs and not refs & _refs(a)):
                    continue
                a = attrs.evolve(a, returns=steps[i].returns if returns_kind(a.rule) == kind else None)
                if spent[1] > SPLIT_STEPS:
                    return False
                if runs((*steps[:i], a, *steps[i + 1 :])):
                    firsts.append(a)
            seconds = [_candidate_steps(new_rules, config, _made_before((*steps[:i], a), i + 1), ints) for a in firsts]
            # The simplest second steps first, after each first step in turn.
            for j in range(max(map(len, seconds), default=0)):
                for a, after in zip(firsts, seconds):
                    if j >= len(after) or returns_kind(after[j].rule) is not None:
                        continue  # a new name later steps do not use
                    if spent[1] > SPLIT_STEPS:
                        return False
                    before = spent[0]
                    two = (*steps[:i], a, after[j], *steps[i + 1 :])
                    kept = descended(two)
                    if not kept and refs and tried.get(_key(config, two)) is not None:
                        # Failing, but descending from it ends no shorter
                        # than ``best``: the steps that acted on what the
                        # one step named may need to go together (an extend
                        # of the request and the entry a rematch cached from it).
                        cut = _unneeded(two, i, refs)
                        kept = cut != two and descended(cut)
                    # Replays for this pass count against its own budget only.
                    spent[1], spent[0] = spent[1] + spent[0] - before, before
                    if kept:
                        return True
        return False

    def outcome(steps: tuple[Step, ...]) -> Trace | int | None:
        """``steps`` on ``best``'s pool re-recorded where they fail on the
        invariant, else the index of the first step that does not apply
        there, else None (they pass, or fail another way)."""
        key = _key(best.config, steps)
        if tried.get(key) is not None:
            return tried[key]  # a failure another pass replayed already
        if key not in broken:
            if stop is not None and stop():
                raise KeyboardInterrupt("stop requested")
            spent[0] += len(steps)
            spent[3] += len(steps)
            broken[key] = tried[key] = None
            try:
                again = replay(attrs.evolve(best, steps=steps))
            except StepNotApplicable as exc:
                broken[key] = exc.step
            except Exception:  # noqa: BLE001 - a name no step makes: not a step to mend
                pass
            else:
                if again is not None and again.invariant == best.invariant:
                    tried[key] = Trace.from_violation(again)
        return tried[key] or broken[key]

    def paired() -> bool:
        """Two moves at once, where neither alone makes the trace shorter:
        a step moved (``_moved``) where it still fails, then one step of a
        rule the trace lacks put just before or after it; or a step that
        grows a request folded into its alloc (``_growth_hoisted``).  Where
        a step after the change no longer applies, that step goes, or (for
        a fold) a simpler step takes its place (``_candidate_steps``);
        where a fold applies but does not fail on the invariant, one later
        step is made a simple step of any rule (``replaced``: before the
        moves on its own budget, ``REPLACE_STEPS``, and after them on what
        they left); what then fails is kept where ``descend`` ends shorter
        than ``best``.  Run only where every other pass is stuck; stops once
        ``PAIR_STEPS`` steps in all have been replayed."""
        steps, config = best.steps, best.config
        new_rules = tuple(r for r in rules[config] if r not in {step.rule for step in steps})
        ints = _ints_in(steps)

        def descended_here(found: tuple[Step, ...]) -> bool:
            """``descended(found)``, its replays counted against this pass's budget too."""
            before = spent[0]
            kept = descended(found)
            spent[3] += spent[0] - before
            return kept

        def mended(candidate: tuple[Step, ...], after: int, simpler: bool) -> bool:
            """Whether ``candidate``, or it with its first step after index
            ``after`` that does not apply deleted (or made simpler), fails
            and descends to shorter than ``best`` (and take that)."""
            found = outcome(candidate)
            if isinstance(found, int) and found > after:
                k = found
                fixes = [candidate[:k] + candidate[k + 1 :]]
                if simpler:
                    fixes += [(*candidate[:k], attrs.evolve(s, returns=None), *candidate[k + 1 :])
                              for s in _candidate_steps(rules[config], config, _made_before(candidate, k),
                                                        _ints_in(candidate[k : k + 1]))
                              if returns_kind(s.rule) is None and _simplicity(s) < _simplicity(candidate[k])]
                for fix in fixes:
                    if spent[3] > PAIR_STEPS:
                        return False
                    if isinstance(again := outcome(fix), Trace):
                        found = again
                        break
            return isinstance(found, Trace) and descended_here(found.steps)

        def replaced(candidate: tuple[Step, ...], after: int, spent_up=lambda: spent[3] > PAIR_STEPS) -> bool:
            """Whether a fold ``candidate`` (one step shorter than ``best``)
            that applies but does not fail on the invariant fails on it with
            one step after index ``after`` made a simple step of any rule,
            and descends to shorter than ``best`` (and take that): the
            request grown at once may fail by another path, an overwrite of
            its row where a grow and a finish did.  A step whose name a later
            step uses is left."""
            if outcome(candidate) is not None:
                return False
            for k in range(after + 1, len(candidate)):
                if _named_later(candidate, k):
                    continue
                for s in _candidate_steps(rules[config], config, _made_before(candidate, k),
                                          _ints_in(candidate[k : k + 1])):
                    if returns_kind(s.rule) is not None or s == candidate[k]:
                        continue
                    if spent_up():
                        return False
                    if isinstance(again := outcome((*candidate[:k], s, *candidate[k + 1 :])), Trace) \
                            and descended_here(again.steps):
                        return True
            return False

        # Each fold, with where it first differs from ``steps``.
        folds = [(candidate, next((i for i, (a, b) in enumerate(zip(candidate, steps)) if a != b), len(candidate)))
                 for candidate in _growth_hoisted(steps, config)]
        for candidate, at in folds:
            if spent[3] > PAIR_STEPS:
                break  # the tries below have a budget of their own
            if mended(candidate, at, simpler=True):
                return True
        # A fold that still applies, one later step made another, first on
        # a budget of its own (``REPLACE_STEPS``), so that the moves, which
        # it must not starve, do not starve it either.
        before, kept = spent[3], False
        for candidate, at in folds:
            if spent[5] > REPLACE_STEPS:
                break
            start = spent[3]
            kept = replaced(candidate, at, lambda: spent[5] + spent[3] - start > REPLACE_STEPS)
            spent[5] += spent[3] - start
            if kept:
                break
        spent[3] = before  # charged to REPLACE_STEPS alone
        if kept:
            return True
        for j, moved in _moved(steps):
            if spent[3] > PAIR_STEPS:
                return False
            found = outcome(moved)
            if isinstance(found, Trace) and len(found.steps) < len(steps):
                # Shorter already (a move the passes do not make): take it.
                if descended_here(found.steps):
                    return True
                continue
            if not isinstance(found, Trace) or len(found.steps) > len(steps):
                continue
            for at in (j + 1, j):
                for step in _candidate_steps(new_rules, config, _made_before(moved, at), ints):
                    if returns_kind(step.rule) is not None:
                        continue  # a new name later steps do not use
                    if spent[3] > PAIR_STEPS:
                        return False
                    if mended((*moved[:at], step, *moved[at:]), at, simpler=False):
                        return True
        # Last, as the dearest: the same on what the moves left of their budget.
        for candidate, at in folds:
            if spent[3] > PAIR_STEPS:
                return False
            if replaced(candidate, at):
                return True
        return False

    def lowered() -> bool:
        """Two integer arguments lowered at once (``_two_lowered``), a later
        segment free refitted, where it still fails: the last pass, run only
        where every other is stuck; stops once ``LOWER_STEPS`` steps in all
        have been replayed."""
        for candidate in _two_lowered(best.steps, best.config):
            for steps in _and_refitted(candidate, best.config, best.steps):
                if spent[4] > LOWER_STEPS:
                    return False
                before = spent[0]
                kept = attempt(attrs.evolve(best, steps=steps), shorter=False)
                spent[4] += spent[0] - before
                if kept:
                    return True
        return False

    def settled() -> Trace:
        """``best`` on the simplest shape of ``configs`` it fails on as
        long, as it is or with its amounts scaled (``_scalings``): the
        smaller pool the simpler, and of one size the earlier in
        ``configs``.  The passes move a trace between shapes at one
        length both ways (onto the run's own pool, and onto a smaller
        one), which lets them shrink it where one shape stalls; ``been``
        keeps them from coming back, so a trace could end on whichever
        shape it reached last (token alias on 4 slots, one row, where 2
        slots fail as long).  The replay may fail sooner on the new
        shape: that shorter trace, re-recorded."""
        order = {config: i for i, config in enumerate(configs)}

        def rank(config: Config) -> tuple[int, int]:
            return config.pool_size, order.get(config, len(order))

        for config in sorted(configs, key=rank):
            if rank(config) >= rank(best.config):
                break
            for steps in (best.steps, *_scalings(best.steps, best.config, config)):
                again = check(attrs.evolve(best, config=config, steps=steps))
                if again is not None and len(again.steps) <= len(best.steps):
                    return again
        return best

    best = trace
    rules: dict[Config, tuple[str, ...]] = {}
    # Each candidate replayed once (its outcome kept), and the steps replayed so far.
    tried: dict[tuple, Trace | None] = {}
    # Steps replayed by all passes, by ``split``, ``dear``, ``paired``,
    # ``lowered`` and ``paired``'s first try of a fold made to fail (each its own budget).
    spent = [0, 0, 0, 0, 0, 0]
    valid: dict[tuple, bool] = {}
    broken: dict[tuple, int | None] = {}
    been = {_key(trace.config, trace.steps)}
    while True:
        while cheap() or dear() or split() or paired() or lowered():
            pass
        final = settled()
        if len(final.steps) == len(best.steps):
            return final
        # Shorter on a simpler shape: the passes again, from there.
        best = final
        been.add(_key(best.config, best.steps))
