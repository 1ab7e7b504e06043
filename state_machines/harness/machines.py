"""The Hypothesis state machine over one ``Lockstep`` configuration.

Rules draw small integers and turn them into a concrete step on the live
state (which request, how many pages); the step itself, and every check
after it, lives in ``Lockstep``.  Preconditions keep a rule from running
where it cannot apply, so no example is thrown away.
"""

from __future__ import annotations

import time
from typing import Any

from attrs import define, field
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from state_machines.config import Config
from state_machines.harness.lockstep import InvariantViolation, Lockstep

# How many pages one alloc or free takes at most.
MAX_PAGES = 4
# Indices into the live requests / cache entries, reduced modulo their count.
picks = st.integers(0, 3)


@define
class RunRecord:
    """What a fuzz run saw, for progress lines, stats and the bench."""

    started: float = field(factory=time.monotonic)
    examples: int = 0
    steps: int = 0
    rule_counts: dict[str, int] = field(factory=dict)
    first_failure_s: float | None = None
    examples_to_failure: int | None = None
    steps_to_failure: int | None = None
    # An observer with before/after/failed(machine, ...) hooks around each
    # step, e.g. ``coverage.Coverage``; None costs nothing.
    probe: Any = None

    def saw_failure(self) -> None:
        if self.first_failure_s is None:
            self.first_failure_s = time.monotonic() - self.started
            self.examples_to_failure = self.examples
            self.steps_to_failure = self.steps


def _pick(items, index):
    return items[index % len(items)]


class FreeGroupMachine(RuleBasedStateMachine):
    """Requests, a prefix cache and free groups over one allocator.

    Subclassed per configuration by ``machine_for``; ``config`` and
    ``record`` are set there.
    """

    config: Config = Config()
    record: RunRecord = RunRecord()

    def __init__(self) -> None:
        super().__init__()
        self.record.examples += 1
        self.state = Lockstep.build(self.config)

    def _do(self, name: str, fn, *args, **kwargs):
        self.record.steps += 1
        self.record.rule_counts[name] = self.record.rule_counts.get(name, 0) + 1
        probe = self.record.probe
        if probe is not None:
            probe.before(self, name, args, kwargs)
        try:
            result = fn(*args, **kwargs)
        except InvariantViolation as exc:
            self.failed = True
            self.record.saw_failure()
            if probe is not None:
                probe.failed(self, exc)
            raise
        if probe is not None:
            probe.after(self, name)
        return result

    @rule(pages=st.integers(1, MAX_PAGES), who=st.integers(0, 8))
    def alloc(self, pages, who):
        # who: 0 starts a request; 1..4 extends a live one; 5..8 starts one
        # on a cached prefix.  One draw, and it shrinks toward a new request.
        s = self.state
        live = s.live()
        if (1 <= who <= 4 and live) or not s.free_rows():
            if not live:
                return
            req = _pick(live, who)
            pages = min(pages, s.room(req))
            if pages:
                self._do("alloc", s.alloc, pages * s.page_size, req=req)
            return
        entries = [e for e in s.entries() if len(s.model.cache[e.eid].pages) < s.config.row_pages]
        entry = _pick(entries, who) if who > 4 and entries else None
        if entry is not None:
            pages = min(pages, s.config.row_pages - len(s.model.cache[entry.eid].pages))
        self._do("alloc", s.alloc, pages * s.page_size, prefix=entry)

    @precondition(lambda self: not self.state.in_group)
    @rule()
    def begin(self):
        self._do("begin", self.state.begin)

    @precondition(lambda self: self.state.with_own_pages())
    @rule(which=picks, pages=st.integers(1, MAX_PAGES))
    def free(self, which, pages):
        req = _pick(self.state.with_own_pages(), which)
        pages = min(pages, len(self.state.model.requests[req.rid].own))
        self._do("free", self.state.free, req, pages * self.state.page_size)

    @precondition(lambda self: self.state.with_own_pages())
    @rule(which=picks, start=st.integers(0, 15), trim=st.integers(0, 7))
    def free_segment(self, which, start, trim):
        s = self.state
        req = _pick(s.with_own_pages(), which)
        request = s.model.requests[req.rid]
        start_page = len(request.prefix) + start % len(request.own)
        end = len(request.pages) * s.page_size - trim % s.page_size
        self._do("free_segment", s.free_segment, req, start_page * s.page_size, end - start_page * s.page_size)

    @precondition(lambda self: self.state.stale_rows())
    @rule(row=picks)
    def overwrite_row(self, row):
        # Only rows holding stale slot ids beyond their live part: zeroing a
        # clean row tests nothing, and would crowd out the steps that matter.
        self._do("overwrite_row", self.state.overwrite_row, _pick(self.state.stale_rows(), row))

    @precondition(lambda self: self.state.with_own_pages())
    @rule(which=picks, dup=st.integers(0, MAX_PAGES), entry=picks)
    def rematch(self, which, dup, entry):
        s = self.state
        req = _pick(s.with_own_pages(), which)
        dup = min(dup, len(s.model.requests[req.rid].own))
        donors = [e for e in s.entries() if len(s.model.cache[e.eid].pages) >= dup] if dup else []
        if not donors:
            dup = 0
        self._do("rematch", s.rematch, req, dup, _pick(donors, entry) if donors else None)

    @precondition(lambda self: self.state.evictable())
    @rule(which=picks)
    def evict(self, which):
        self._do("evict", self.state.evict, _pick(self.state.evictable(), which))

    @precondition(lambda self: self.state.live())
    @rule(which=picks)
    def finish(self, which):
        self._do("finish", self.state.finish, _pick(self.state.live(), which))

    # Always enabled, also with no group open (the repeated end of PR 36739).
    # A precondition here would thin it out, but then deleting a `begin`
    # while shrinking disables the `end` after it, and traces shrink worse.
    @rule()
    def end(self):
        self._do("end", self.state.end)

    def teardown(self):
        # After a failure the state is already wrong; checking it again would
        # chain a second report onto the first.
        if hasattr(self, "state") and not getattr(self, "failed", False):
            self._do("teardown", self.state.teardown)


def machine_for(config: Config, record: RunRecord | None = None) -> type[FreeGroupMachine]:
    """A ``FreeGroupMachine`` bound to ``config``.  Its name spells the
    configuration, so the example database keeps configurations apart."""
    from state_machines.harness.family import base_machine_for

    # The target decides the rules: its family, and whether it has alloc_decode.
    base = base_machine_for(Lockstep.build(config))
    name = base.__name__ + "_" + "".join(c if c.isalnum() else "_" for c in config.label())
    return type(name, (base,), {"config": config, "record": record or RunRecord()})
