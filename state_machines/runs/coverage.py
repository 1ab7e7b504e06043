"""Coverage you can read: per rule, how often it ran and how often its
precondition blocked it; per dangerous interleaving, how often it happened.

A ``Coverage`` probe hangs on a ``RunRecord`` (``record.probe``); the
machine calls ``before`` and ``after`` around each step and ``failed`` on a
violation.  Interleavings are detected from the step about to run and the
live state (group open, which rows were freed as views inside the group),
never from the allocator's private fields, except the census containers
``free_pages`` / ``release_pages`` that sglang's allocators also have.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from attrs import frozen
from hypothesis import currently_in_test_context, event, target

from state_machines.config import Config
from state_machines.harness.machines import machine_rules


@frozen
class Interleaving:
    """An order of steps that a known bug class needs."""

    name: str
    summary: str
    # Config fields it needs, e.g. {"need_sort": True}; else not applicable.
    needs: tuple = ()
    # A step it needs the target to run (``Lockstep.runs``), known once a state is built.
    step: str | None = None
    # What it needs the allocator to show for the counter to see it, known
    # once a state is built (a predicate on the allocator), or None.
    shown_by: Callable | None = None

    def applies_to(self, config: Config) -> bool:
        # Each is an order of the simulated caller's steps; a --caller run has its own steps.
        return config.caller == "harness" and all(check(config) for check in self.needs)


def waiting_pages(allocator) -> int | None:
    """How many freed pages ``allocator`` keeps apart until an alloc runs
    short and merges them: its ``release_pages`` (the built-ins, sglang to
    0.5.22), or its ``staged_pages``, a list of tensors (0.5.23's
    ``PagedTokenToKVPoolAllocator``, whose ``release_pages`` is None);
    None where it keeps neither."""
    release = getattr(allocator, "release_pages", None)
    if release is not None:
        return len(release)
    staged = getattr(allocator, "staged_pages", None)
    return None if staged is None else sum(len(part) for part in staged)


def _applies(interleaving: Interleaving, config: Config, state) -> bool:
    """Whether ``interleaving`` can show in an example of ``config`` on
    ``state``'s target: its config needs hold, and the target runs the step
    it needs (``Lockstep.runs``)."""
    step, shown_by = interleaving.step, interleaving.shown_by
    return (interleaving.applies_to(config) and (step is None or (hasattr(state, "runs") and state.runs(step)))
            and (shown_by is None or shown_by(getattr(state, "allocator", None))))


# The steps that free a request's slots, a row view among them (``rematch``
# only where it frees a duplicated span): the first step of the group orders.
FREES_A_REQUEST = frozenset({"free", "free_segment", "finish", "finish_segments", "rematch"})
# Those of them that end the request (its row given back).
ENDS_A_REQUEST = frozenset({"finish", "finish_segments"})

INTERLEAVINGS = (
    Interleaving("group_free_overwrite_end", "in one group: free of a row view, overwrite of that row, end", step="begin"),
    Interleaving("rematch_in_group", "a rematch that frees a duplicated span, inside a group", step="begin"),
    Interleaving("end_without_group", "free_group_end() with no group open", step="end"),
    Interleaving("end_after_end", "a second end after a group that queued frees", step="begin"),
    Interleaving("evict_in_group", "a cache eviction inside a group", step="begin"),
    Interleaving(
        "segment_ends_mid_page", "free_segment ending mid-page", needs=(lambda c: c.page_size > 1,)
    ),
    Interleaving(
        "alloc_merged_release",
        "an alloc ran short of free pages and merged release pages",
        needs=(lambda c: c.need_sort,), shown_by=lambda allocator: waiting_pages(allocator) is not None,
    ),
    Interleaving("alloc_short", "an alloc the pool could not serve"),
    Interleaving(
        "extend_continues_partial_page", "an extend of a request whose last page is partly used",
        needs=(lambda c: c.page_size > 1,), step="extend",
    ),
    Interleaving(
        "extend_mixed_batch", "one extend batch of requests with pages of their own and fresh ones, with none", step="extend"
    ),
)
NEEDS_TEXT = {
    "segment_ends_mid_page": "--page-size > 1",
    "alloc_merged_release": "--need-sort, and an allocator whose held-back frees the counter reads: release_pages or staged_pages",
    "extend_continues_partial_page": "--page-size > 1 and a target that runs extend",
    "extend_mixed_batch": "a target that runs extend",
}


class Coverage:
    """Counts rules and interleavings over any number of Hypothesis runs.

    ``flush(snapshot)`` is called at most every ``flush_every_s``; ``should_stop()``
    is asked after each step and, when true, the run is stopped with
    ``KeyboardInterrupt`` (the one exception Hypothesis neither shrinks nor
    saves to its database).
    """

    def __init__(self, config: Config, *, flush=None, flush_every_s: float = 0.5, should_stop=None, on_failure=None,
                 use_hypothesis: bool = True):
        self.config = config
        # Those needing a step join once a state shows the target runs it.
        self.applicable = [i.name for i in INTERLEAVINGS if i.applies_to(config) and i.step is None]
        self._steps_known = False
        self.ran: Counter = Counter()
        self.blocked: Counter = Counter()
        self.checks = 0
        self.seen: Counter = Counter()
        self.examples = 0
        self.steps = 0
        self.failures_seen: set[str] = set()
        self._flush = flush
        self._flush_every_s = flush_every_s
        self._last_flush = time.monotonic()
        self._should_stop = should_stop
        self._on_failure = on_failure
        self._hypothesis = use_hypothesis
        # The machine's guarded rules, and every rule's name, once seen.
        self._rules: list | None = None
        self._all_rules: set[str] = set()
        self._state = None
        self._hits_this_example = 0

    # -- hooks the machine calls --

    def before(self, machine, name: str, call: dict) -> None:
        state = machine.state
        if state is not self._state:
            self._new_example(state)
        if name == "teardown":
            return
        self.steps += 1
        self.ran[name] += 1
        if not self.applicable:
            return  # a --caller run: its steps are not the simulated caller's orders
        for hit in self._interleavings(state, name, call):
            self._hit(hit)

    def after(self, machine, name: str) -> None:
        if name == "teardown":
            # The fuzz run's random walk (runs/walk.py) runs outside any Hypothesis test.
            if self._hypothesis and currently_in_test_context():
                # Hypothesis's targeted phase steers toward examples that hit more.
                target(float(self._hits_this_example), label="dangerous interleavings")
            return
        self._count_blocked(machine)
        now = time.monotonic()
        if self._flush is not None and now - self._last_flush >= self._flush_every_s:
            self._last_flush = now
            self._flush(self.snapshot())
        if self._should_stop is not None and self._should_stop(bool(self.failures_seen)):
            raise KeyboardInterrupt("stop requested")

    def failed(self, machine, exc) -> None:
        first = exc.invariant not in self.failures_seen
        self.failures_seen.add(exc.invariant)
        if first and self._on_failure is not None:
            self._on_failure(exc)

    # -- detection --

    def _new_example(self, state) -> None:
        self._state = state
        if not self._steps_known:
            self._steps_known = True
            self.applicable = [i.name for i in INTERLEAVINGS if _applies(i, self.config, state)]
        if state.config != self.config:
            # An example may draw a pool shape the run's configuration lacks
            # (need_sort on): an order that needs it applies from then on.
            new = {i.name for i in INTERLEAVINGS if i.name not in self.applicable and _applies(i, state.config, state)}
            if new:
                self.applicable = [i.name for i in INTERLEAVINGS if i.name in new or i.name in self.applicable]
        self.examples += 1
        self._hits_this_example = 0
        # Rows freed as views inside the open group, and those overwritten since.
        self._freed_rows: set[int] = set()
        self._overwritten: set[int] = set()
        self._group_queued = False
        self._last_group_queued = False

    def _hit(self, name: str) -> None:
        self.seen[name] += 1
        self._hits_this_example += 1
        if self._hypothesis and currently_in_test_context():
            event(f"interleaving: {name}")

    def _interleavings(self, state, name, call):
        ps = state.page_size
        in_group = state.in_group
        if name == "begin":
            self._freed_rows, self._overwritten = set(), set()
            self._group_queued = self._last_group_queued = False
        elif name == "end":
            if not in_group:
                yield "end_without_group"
                if self._last_group_queued:
                    yield "end_after_end"
            else:
                if self._overwritten:
                    yield "group_free_overwrite_end"
                self._last_group_queued = self._group_queued
                self._freed_rows, self._overwritten = set(), set()
        elif name in FREES_A_REQUEST:
            request = state.model.requests.get(call["req"].rid)
            if request is None:
                return
            frees_view = name != "rematch" or call.get("dup", 0) > 0
            if name in ENDS_A_REQUEST:
                frees_view = bool(request.own)
            if name == "free_segment" and ps > 1 and (call["start"] + call["n"]) % ps:
                yield "segment_ends_mid_page"
            if in_group and frees_view:
                self._group_queued = True
                self._freed_rows.add(request.row)
                if name == "rematch":
                    # rematch overwrites the span it just freed: the aliasing bug's own order.
                    self._overwritten.add(request.row)
                    yield "rematch_in_group"
        elif name == "overwrite_row":
            if call["row"] in self._freed_rows:
                self._overwritten.add(call["row"])
        elif name == "evict":
            if in_group:
                self._group_queued = True
                yield "evict_in_group"
        elif name == "admit":
            # A request on a prefix writes the cache's slots into the first free row.
            if call.get("prefix") is not None and state.free_rows() and state.free_rows()[0] in self._freed_rows:
                self._overwritten.add(state.free_rows()[0])
        elif name in ("decode", "extend"):
            requests = [state.model.requests.get(r.rid) for r in call["reqs"]]
            requests = [r for r in requests if r is not None]
            for request in requests:
                # The step writes the request's row: an overwrite of a row freed as a view.
                if request.row in self._freed_rows:
                    self._overwritten.add(request.row)
            if name == "extend":
                if ps > 1 and any(r.spare for r in requests):
                    yield "extend_continues_partial_page"
                if any(r.own for r in requests) and any(not r.own for r in requests):
                    yield "extend_mixed_batch"
        elif name == "alloc":
            want = call["n"] // ps
            if state.model.num_free < want:
                yield "alloc_short"
            if call.get("req") is None and state.free_rows():
                # A new request writes into the first free row: an overwrite of it.
                row = state.free_rows()[0]
                if row in self._freed_rows:
                    self._overwritten.add(row)
            alloc = state.allocator
            free = getattr(alloc, "free_pages", None)
            if state.config.need_sort and free is not None and (waiting_pages(alloc) or 0) > 0 and len(free) < want:
                yield "alloc_merged_release"

    def _count_blocked(self, machine) -> None:
        if self._rules is None:
            self._rules = [r for r in machine_rules(type(machine)) if r.guard is not None]
            self._all_rules = {r.name for r in machine_rules(type(machine))}
        self.checks += 1
        for rule in self._rules:
            if not rule.applies(machine):
                self.blocked[rule.name] += 1

    # -- reporting --

    def snapshot(self) -> dict:
        """The counts so far, as plain data (summed across workers by ``merge``)."""
        rules = set(self.ran) | set(self.blocked) | self._all_rules
        return {
            "examples": self.examples,
            "steps": self.steps,
            "checks": self.checks,
            "rules": {r: {"ran": self.ran[r], "blocked": self.blocked[r]} for r in sorted(rules)},
            "interleavings": {i: self.seen[i] for i in self.applicable},
        }


def merge(snapshots) -> dict:
    """The sum of several ``Coverage.snapshot()`` dicts."""
    total = {"examples": 0, "steps": 0, "checks": 0, "rules": {}, "interleavings": {}}
    for snap in snapshots:
        for key in ("examples", "steps", "checks"):
            total[key] += snap[key]
        for rule, counts in snap["rules"].items():
            mine = total["rules"].setdefault(rule, {"ran": 0, "blocked": 0})
            mine["ran"] += counts["ran"]
            mine["blocked"] += counts["blocked"]
        for name, count in snap["interleavings"].items():
            total["interleavings"][name] = total["interleavings"].get(name, 0) + count
    return total


def shares(total: dict, disabled=()) -> tuple[int, int, int, int]:
    """(rules seen, rules, interleavings seen, interleavings applicable);
    a rule in ``disabled`` is none of the rules."""
    rules = {rule: c for rule, c in total["rules"].items() if rule not in disabled}
    inter = total["interleavings"]
    return (
        sum(1 for c in rules.values() if c["ran"]),
        len(rules),
        sum(1 for c in inter.values() if c),
        len(inter),
    )


def never_reached(total: dict) -> list[str]:
    return [name for name, count in total["interleavings"].items() if not count]


def summary_table(total: dict, config: Config, disabled: dict[str, str] | None = None) -> str:
    """The coverage part of the end-of-run summary, as aligned text; a rule
    in ``disabled`` (rule: why) says so, not that it was blocked."""
    lines = []
    steps = max(total["steps"], 1)
    checks = max(total["checks"], 1)
    disabled = disabled or {}
    rules = sorted(set(total["rules"]) | set(disabled))  # a disabled step the machine never offers too
    width = max([15, *map(len, rules)]) + 1  # device_buffer_pages ran into its count
    lines.append(f"  {'rule':<{width}}{'ran':>10}{'share':>8}{'blocked':>10}{'of checks':>11}")
    for rule in rules:
        if rule in disabled:
            lines.append(f"  {rule:<{width}}{'disabled':>10}  ({disabled[rule]})")
            continue
        c = total["rules"][rule]
        lines.append(
            f"  {rule:<{width}}{c['ran']:>10,}{100 * c['ran'] / steps:>7.1f}%{c['blocked']:>10,}{100 * c['blocked'] / checks:>10.1f}%"
        )
    examples = max(total["examples"], 1)
    named = max([28, *(len(i.name) + 1 for i in INTERLEAVINGS)])  # extend_continues_partial_page ran into its count
    lines.append(f"  {'interleaving':<{named}}{'count':>10}{'per 1k examples':>17}")
    for inter in INTERLEAVINGS:
        if inter.name in total["interleavings"]:
            count = total["interleavings"][inter.name]
            lines.append(f"  {inter.name:<{named}}{count:>10,}{1000 * count / examples:>17.1f}")
        else:
            need = "--caller harness: an order of its steps" if config.caller != "harness" else NEEDS_TEXT.get(inter.name, "?")
            lines.append(f"  {inter.name:<{named}}{'n/a':>10}  (needs {need})")
    missing = never_reached(total)
    if missing:
        lines.append("  NEVER REACHED: " + ", ".join(missing) + " (this run proves nothing about them)")
    return "\n".join(lines)
