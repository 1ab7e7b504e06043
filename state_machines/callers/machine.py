"""The Hypothesis rules of a ``--caller`` run: what a scheduler may do next.

Each rule draws small integers and turns them into a step of
``CallerLockstep``; its guard is the step's precondition (the scheduler's
admission checks stand in here), so running out of memory never
half-mutates state and no example is thrown away.
"""

from __future__ import annotations

from typing import Callable

from hypothesis.stateful import RuleBasedStateMachine

from state_machines.callers.adapters import tree_sizes
from state_machines.callers.lockstep import ALPHABET, MAX_WAITING, CallerLockstep, max_new_tokens
from state_machines.config import Config
from state_machines.harness.machines import PICKS, FreeGroupMachine, RunRecord, _pick, draws


class CallerMachine(RuleBasedStateMachine):
    """Requests arrive, prefill, decode, are evicted, retracted, aborted."""

    config: Config = Config()
    record: RunRecord = RunRecord()
    build: Callable[[Config], CallerLockstep]

    # The example's start (Hypothesis's set-up only where its engine runs
    # it), counting, the probe and the teardown are the core machine's; so
    # are the pool shapes (``machine_for`` offers a caller none but its own).
    __init__ = FreeGroupMachine.__init__
    _do, _do_as = FreeGroupMachine._do, FreeGroupMachine._do_as
    teardown = FreeGroupMachine.teardown
    __repr__ = FreeGroupMachine.__repr__
    draws_shape = False
    shapes = FreeGroupMachine.__dict__["shapes"]

    @draws(guard=lambda s: len(s.waiting) < MAX_WAITING, first=(1, ALPHABET), second=(0, ALPHABET),
           third=(0, ALPHABET), out=(1, 9))
    def arrive(self, first, second, third, out):
        # Pages of tokens 1..3; a 0 ends the prompt, so it shrinks to one page.
        digits = [first] + ([second] + ([third] if third else []) if second else [])
        prompt = int("".join(map(str, digits)))
        self._do("arrive", prompt, min(out, max_new_tokens(self.state.page_size)))

    @draws(guard=lambda s: s.swa and len(s.waiting) < MAX_WAITING, first=(1, ALPHABET), second=(0, ALPHABET),
           out=(1, 17))
    def arrive_long(self, first, second, out):
        # An SWA cache's request long enough for its window to slide past what the tree holds.
        prompt = first * 10 + second if second else first
        self._do_as("arrive_long", "arrive", prompt, min(out, max_new_tokens(self.state.page_size, swa=True)))

    @draws(guard=lambda s: s.runs("chunked_prefill") and s._why_not_chunk(1) is None, pages=(1, 3))
    def chunked_prefill(self, pages):
        # A chunk budget that memory covers (a page more than the chunk, as prefill asks).
        self._do("chunked_prefill", min(pages, self.state.guard_budget() // self.state.page_size - 1))

    @draws(guard=lambda s: s.chunked is None and s.waiting and s.pool.available_size() > 0)
    def prefill(self):
        self._do("prefill")

    @draws(guard=lambda s: s.can_decode())
    def decode(self):
        self._do("decode", self.state.refs(self.state.running))

    @draws(guard=lambda s: tree_sizes(s.cache)[0] > 0, pages=(1, 4))
    def evict_tokens(self, pages):
        self._do("evict_tokens", pages * self.state.page_size)

    @draws(guard=lambda s: s.swa and s.running)
    def slide_windows(self):
        self._do("slide_windows")

    @draws(guard=lambda s: s.running, which=PICKS)
    def retract(self, which):
        self._do("retract", _pick(self.state.refs(self.state.running), which))

    @draws(guard=lambda s: s.abortable(), which=PICKS)
    def abort(self, which):
        self._do("abort", _pick(self.state.abortable(), which))
