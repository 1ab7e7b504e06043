"""The Hypothesis state machine over one ``Lockstep`` configuration.

Rules draw small integers and turn them into a concrete step on the live
state (which request, how many pages); the step itself, and every check
after it, lives in ``Lockstep``.  Preconditions keep a rule from running
where it cannot apply, so no example is thrown away.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable

import attrs
from attrs import define, field, frozen
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from state_machines.config import Config
from state_machines.harness.lockstep import InvariantViolation
from state_machines.harness.steps import STEPS

# How many pages one alloc or free takes at most.
MAX_PAGES = 4
# Indices into the live requests / cache entries, reduced modulo their count.
PICKS = (0, 3)
# Pool sizes in pages an example may run on where ``--size`` pins none.  The
# first (None) is the configuration's own pool, 10 pages, which a shrunk
# example heads for; 4 is exhausted in a step or two, 64 holds more than
# every row together (bugs that need many free pages).
POOL_PAGES = (None, 4, 24, 64)
# Rows of req_to_token an example may run on where the configuration asks
# for none but the default 4: the first (None) is its own, where a shrunk
# example heads; 1 row serves one request at a time, 16 many at once.
POOL_ROWS = (None, 1, 16)


@frozen
class PoolShapes:
    """The pool shapes an example may run on: each of ``sizes``, ``sorts``
    (need_sort) and ``row_counts`` holds the run's own (``None``) first,
    then the others its target builds with."""

    sizes: tuple[int | None, ...] = (None,)
    sorts: tuple[bool | None, ...] = (None,)
    row_counts: tuple[int | None, ...] = (None,)


# The run's own pool shape only: a machine that draws none.
OWN_SHAPE = PoolShapes()


class BudgetSpent(KeyboardInterrupt):
    """An example asked to start past ``RunRecord.cap``: the run's budget is
    spent.  A ``KeyboardInterrupt``, since Hypothesis stops on one without
    saving the example to its database or shrinking it (any other exception
    would be saved as a failure); ``runner.fuzz`` catches it."""


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
    # step, e.g. ``coverage.Coverage``; None costs nothing.  ``before`` gets
    # the step's arguments by name, or ``{}`` where the probe's
    # ``reads_call`` is false.
    probe: Any = None
    # Examples this record may count before a failure: one more raises
    # ``BudgetSpent`` instead of starting (``start_example``); None: no cap.
    cap: int | None = None
    # Whether the last example ended in an error (``ended``).
    raised: bool = False

    def start_example(self) -> None:
        """Count an example about to start; ``BudgetSpent`` instead where
        ``cap`` examples are counted, none failed and the last did not
        raise (after a failure, or any error, Hypothesis replays the
        failing example once more to report it)."""
        if self.cap is not None and self.examples >= self.cap and self.first_failure_s is None and not self.raised:
            raise BudgetSpent(f"{self.cap} examples run")
        self.raised = False
        self.examples += 1

    def ended(self, exc: BaseException | None) -> None:
        """An example ended, raising ``exc`` (None: it ran through).  An
        error Hypothesis reports counts (a harness bug: an invariant
        violation is ``saw_failure``'s); its overrun (``StopTest``, a
        ``BaseException``) and a rejected example do not."""
        self.raised = isinstance(exc, Exception) and not isinstance(exc, UnsatisfiedAssumption)

    def saw_failure(self) -> None:
        if self.first_failure_s is None:
            self.first_failure_s = time.monotonic() - self.started
            self.examples_to_failure = self.examples
            self.steps_to_failure = self.steps


@frozen
class MachineRule:
    """A machine rule as declared: what it draws and when it may run.  The
    Hypothesis rule is made from it, and so are coverage's blocked counts
    and the bench's random baseline, so none reads Hypothesis internals."""

    name: str
    # argument -> inclusive (low, high) of integers, or ``bool``
    draws: dict
    # state -> whether the rule can run; None: always
    guard: Callable[[Any], bool] | None
    # The rule's body, a plain method: (machine, **drawn arguments).
    body: Callable[..., Any] | None = None

    def applies(self, machine) -> bool:
        return self.guard is None or bool(self.guard(machine.state))

    def strategies(self) -> dict:
        """Each argument's strategy, in a fixed order."""
        return {k: st.booleans() if r is bool else st.integers(*r) for k, r in sorted(self.draws.items())}


def draws(guard: Callable[[Any], bool] | None = None, **ranges):
    """Declare a machine rule: each argument an integer drawn from an
    inclusive ``(low, high)`` range, or a boolean (``bool``); it runs only
    where ``guard(state)`` holds (a Hypothesis precondition)."""

    def decorate(fn):
        declared = MachineRule(fn.__name__, dict(ranges), guard, fn)
        made = rule(**declared.strategies())(fn)
        if guard is not None:
            made = precondition(lambda self: guard(self.state))(made)
        made.machine_rule = declared
        return made

    return decorate


def machine_rules(machine_cls) -> list[MachineRule]:
    """The rules a machine class declares, by name."""
    # Read from the class dicts, not getattr: Hypothesis's ``TestCase``
    # attribute builds a new class on every read (about 0.5 ms).
    own: dict[str, Any] = {}
    for klass in reversed(machine_cls.__mro__):
        own.update(vars(klass))
    found = (getattr(own[name], "machine_rule", None) for name in sorted(own))
    return [r for r in found if r is not None]


def _pick(items, index):
    return items[index % len(items)]


class FreeGroupMachine(RuleBasedStateMachine):
    """Requests, a prefix cache and free groups over one allocator.

    Subclassed per configuration by ``family.machine_for``; ``config``,
    ``record`` and ``build`` (config -> state) are set there.
    """

    config: Config = Config()
    record: RunRecord = RunRecord()
    build: Callable[[Config], Any]
    # Whether an example's first step (``PoolShapeRule.draw_shape``) draws its
    # pool shape among ``shapes()`` and builds the state then: where the
    # configuration leaves some of size, need_sort and rows open.
    draws_shape: bool = False
    # () -> PoolShapes: the shapes that build, probed on the first call and
    # kept (``machine_for``).  Probing builds the target in every shape, so
    # it waits until Hypothesis (or a shrink's pool sizes) asks: the walk
    # draws without it (``shape_drawn``).
    shape_probe: Callable[[], PoolShapes] = staticmethod(lambda: OWN_SHAPE)
    # (config, random.Random, refused=None) -> config in a pool shape drawn
    # as an index into each of ``shapes()`` would be, probing only a shape an
    # example refused (``family.drawn_shape``; None where that shape fails as
    # a whole): the walk's draw.
    shape_drawn: Callable[..., Config | None] = staticmethod(
        lambda config, rng, refused=None: None if refused is not None else config)

    def __init__(self, engine: bool = True, with_state: bool = True) -> None:
        """An example, counted on the record.  ``engine``: Hypothesis runs
        it, so it gets Hypothesis's own set-up, which only Hypothesis's
        engine reads (the rules it draws among, bundles, a printer); the
        walk's examples and the bench baseline's leave it out, as it costs
        95 µs on a machine class's first example (``machine_for`` makes a
        class a run) and 10 µs on each after.  Its state is built here
        unless its first step draws the pool shape, or ``with_state`` is
        false (the caller sets it: a replay of a saved trace).  Named, not
        ``super()``: ``CallerMachine`` shares it."""
        self.record.start_example()
        if engine:
            RuleBasedStateMachine.__init__(self)
        if with_state and not self.draws_shape:
            self.state = self.build(self.config)

    def __repr__(self) -> str:
        # Hypothesis's own reads what its set-up made, which ``engine=False`` leaves out.
        return f"{type(self).__name__}()"

    @classmethod
    def shapes(cls) -> PoolShapes:
        """The pool shapes an example may run on (probed on the first call)."""
        return cls.shape_probe()

    @classmethod
    def shaped(cls, config: Config, size: int, need_sort: int = 0, rows: int = 0) -> Config:
        """``config`` in the pool shape of the indices ``size``, ``need_sort``
        and ``rows`` into ``shapes()`` (0 each: its own, probing nothing)."""
        if not (size or need_sort or rows):
            return config
        shapes = cls.shapes()
        changes = {"size": shapes.sizes[size], "need_sort": shapes.sorts[need_sort], "rows": shapes.row_counts[rows]}
        return attrs.evolve(config, **{k: v for k, v in changes.items() if v is not None})

    def _do(self, name: str, *args, **kwargs):
        """Run the harness step ``name``, counted and shown to the probe."""
        return self._do_as(name, name, *args, **kwargs)

    def _do_as(self, rule: str, name: str, *args, **kwargs):
        """``_do(name, ...)`` for the machine rule ``rule``, which runs the
        step ``name`` (``arrive_long``, an ``arrive`` with a longer prompt):
        counted and shown to the probe as ``rule``."""
        self.record.steps += 1
        self.record.rule_counts[rule] = self.record.rule_counts.get(rule, 0) + 1
        probe = self.record.probe
        if probe is not None:
            # Binding the arguments by name costs a few µs a step: only for a probe that reads them.
            reads = getattr(probe, "reads_call", True) and name in STEPS
            probe.before(self, rule, STEPS[name].bind(args, kwargs) if reads else {})
        try:
            result = getattr(self.state, name)(*args, **kwargs)
        except InvariantViolation as exc:
            self.failed = True
            self.record.saw_failure()
            if probe is not None:
                probe.failed(self, exc)
            raise
        if probe is not None:
            probe.after(self, rule)
        return result

    @draws(pages=(1, MAX_PAGES), who=(0, 8))
    def alloc(self, pages, who):
        # who: 0 starts a request; 1..4 extends a live one; 5..8 starts one
        # on a cached prefix.  One draw, and it shrinks toward a new request.
        s = self.state
        live = s.allocatable()
        if (1 <= who <= 4 and live) or not s.free_rows():
            if not live:
                return
            req = _pick(live, who)
            pages = min(pages, s.room(req))
            if pages:
                self._do("alloc", pages * s.page_size, req=req)
            return
        entries = [e for e in s.entries() if len(s.model.cache[e.eid].pages) < s.config.row_pages]
        entry = _pick(entries, who) if who > 4 and entries else None
        if entry is not None:
            pages = min(pages, s.config.row_pages - len(s.model.cache[entry.eid].pages))
        self._do("alloc", pages * s.page_size, prefix=entry)

    @draws(guard=lambda s: not s.in_group)
    def begin(self):
        self._do("begin")

    @draws(guard=lambda s: s.any_with_own_pages(), which=PICKS, pages=(1, MAX_PAGES))
    def free(self, which, pages):
        req = _pick(self.state.with_own_pages(), which)
        pages = min(pages, len(self.state.model.requests[req.rid].own))
        self._do("free", req, pages * self.state.page_size)

    @draws(guard=lambda s: s.any_with_own_pages(), which=PICKS, start=(0, 15), trim=(0, 7))
    def free_segment(self, which, start, trim):
        s = self.state
        req = _pick(s.with_own_pages(), which)
        request = s.model.requests[req.rid]
        start_page = len(request.prefix) + start % len(request.own)
        end = len(request.pages) * s.page_size - trim % self.segment_trim_room(request)
        self._do("free_segment", req, start_page * s.page_size, end - start_page * s.page_size)

    @draws(guard=lambda s: s.empty_frees and s.any_live(), which=PICKS, how=(0, 5))
    def free_empty_span(self, which, how):
        self._do("free_empty_span", _pick(self.state.live(), which), how)

    def segment_trim_room(self, request) -> int:
        """How many choices a segment's end has below the request's
        page-aligned end (``trim`` is taken modulo it): anywhere in its last
        page here; a family whose caller never cuts into written tokens
        narrows it."""
        return self.state.page_size

    @draws(guard=lambda s: s.stale_rows(), row=PICKS)
    def overwrite_row(self, row):
        # Only rows holding stale slot ids beyond their live part: zeroing a
        # clean row tests nothing, and would crowd out the steps that matter.
        self._do("overwrite_row", _pick(self.state.stale_rows(), row))

    @draws(guard=lambda s: s.any_with_own_pages(), which=PICKS, dup=(0, MAX_PAGES), entry=PICKS)
    def rematch(self, which, dup, entry):
        s = self.state
        req = _pick(s.with_own_pages(), which)
        dup = min(dup, len(s.model.requests[req.rid].own))
        donors = [e for e in s.entries() if len(s.model.cache[e.eid].pages) >= dup] if dup else []
        if not donors:
            dup = 0
        self._do("rematch", req, dup, _pick(donors, entry) if donors else None)

    @draws(guard=lambda s: s.any_evictable(), which=PICKS)
    def evict(self, which):
        self._do("evict", _pick(self.state.evictable(), which))

    @draws(guard=lambda s: s.any_live(), which=PICKS)
    def finish(self, which):
        self._do("finish", _pick(self.state.live(), which))

    # Always enabled, also with no group open (the repeated end of PR 36739).
    # A precondition here would thin it out, but then deleting a `begin`
    # while shrinking disables the `end` after it, and traces shrink worse.
    @draws()
    def end(self):
        self._do("end")

    def teardown(self):
        # Hypothesis calls this in a ``finally``: what the example raised, if anything, is still in flight here.
        self.record.ended(sys.exc_info()[1])
        # After a failure the state is already wrong; checking it again would
        # chain a second report onto the first.
        if hasattr(self, "state") and not getattr(self, "failed", False):
            self._do("teardown")
            # Let go of a clean example's state: Hypothesis's machine sits in
            # a reference cycle (its rule strategy holds it), so the state
            # would wait for the cyclic collector, which reads every entry
            # of every owner map and set the dead models hold (3 ms a
            # collection in a Mamba run at 16,384 slots, about 7 dead models
            # each time).  The state holds no cycle: reference counting
            # frees it once nothing else holds it (a coverage probe keeps
            # the last one until the next example starts).
            del self.state


def one_step_machine(base: type) -> type:
    """``base`` with its ``draws`` rules run through one Hypothesis rule,
    ``step``, that picks uniformly among the rules whose guard holds and
    then draws that rule's arguments.

    Hypothesis's own rule choice switches rules off per example (swarm
    testing), so a failure that needs five distinct rules sees all five
    on in about one example in six; here every applicable rule is one
    draw away in every example, as in the random baseline.  The rules
    stay ``MachineRule``s (coverage and the baseline read them)."""
    declared = machine_rules(base)
    # The rules' plain bodies hide the Hypothesis rules they were made into.
    body = {r.name: _plain(r) for r in declared}
    choices = _StepChoice(declared)

    def step(self, choice):
        chosen, args = choice
        if chosen is not None:  # None: no rule applies (a pool too small for any request), nothing to do
            chosen.body(self, **args)

    body["step"] = rule(choice=choices)(step)
    return type("OneStep" + base.__name__, (base,), body)


# The machine Hypothesis runs, drawn inside a rule's argument strategy.
_RUNNER = st.runner()


class _StepChoice(st.SearchStrategy):
    """The ``step`` rule's argument: a rule drawn uniformly among
    ``declared`` whose guard holds on the machine Hypothesis runs, then that
    rule's arguments, as ``(rule, {name: value})``.

    Each choice goes straight to the engine (``draw_integer``,
    ``draw_boolean``, both in Hypothesis 6.100): the very choices
    ``st.integers(low, high)`` and ``st.booleans()`` make, in the same order,
    so a choice sequence saved before (an example database) replays the same
    steps.  Left out is the span and the checks Hypothesis wraps around every
    strategy drawn, which cost about what the choice itself does: on
    builtin:token clean, calls per step over a whole run 399.7 -> 369.4;
    even so a Hypothesis step costs about 4 times a walk step (385-514 µs
    against 89-129 µs, in clean runs of 100 examples).  The engine mutates
    an example by its spans, so from the first mutation on, a seeded or
    derandomized run generates other examples than before this drawing.

    Hypothesis documents ``SearchStrategy`` as not to be subclassed.  What
    this relies on (``hypothesis_runner``, ``draw_integer(low, high)``,
    ``draw_boolean()``) is in 6.100 and 6.170;
    ``test_the_step_choice_makes_the_choices_the_declared_strategies_make``
    fails where a release changes the choices made (it needs
    ``ConjectureData.for_choices``, which 6.100 lacks, and skips there)."""

    def __init__(self, declared: list[MachineRule]):
        super().__init__()
        self.declared = declared
        # Each rule's arguments in the order they are drawn, each with its drawer (data -> value).
        self.ordered = {r.name: tuple((k, _drawer(v)) for k, v in sorted(r.draws.items())) for r in declared}

    def __repr__(self) -> str:
        return f"step_choice({', '.join(r.name for r in self.declared)})"

    def do_draw(self, data):
        applicable = [r for r in self.declared if r.applies(data.hypothesis_runner)]
        if not applicable:  # the walk ends its example here; Hypothesis has no way to, so the step does nothing
            return None, {}
        # As ``st.integers(0, n - 1)`` draws it while n <= 128: a machine has a few dozen rules at most.
        chosen = applicable[data.draw_integer(0, len(applicable) - 1)]
        return chosen, {k: draw(data) for k, draw in self.ordered[chosen.name]}


def _drawer(declared) -> Callable[[Any], Any]:
    """How ``_StepChoice`` draws an argument declared as ``declared`` (see
    ``draws``): data -> value, the choice its strategy would make."""
    if declared is bool:
        return lambda data: data.draw_boolean()
    low, high = declared
    if high - low > 127:
        # Wide enough that ``st.integers`` weights its ends: through the strategy.
        strategy = st.integers(low, high)
        return lambda data: data.draw(strategy)
    return lambda data: data.draw_integer(low, high)


def _plain(declared: MachineRule):
    fn = declared.body

    def plain(self, **kwargs):
        return fn(self, **kwargs)

    plain.__name__ = declared.name
    plain.machine_rule = declared
    return plain


def pool_sizes(config: Config, builds: Callable[[Config], bool]) -> tuple[int | None, ...]:
    """The pool sizes (slots) an example of ``config`` may run on: ``None``
    (its own) first, then each other size of ``POOL_PAGES`` that ``builds``;
    only ``None`` where ``config`` pins a size."""
    if config.size is not None:
        return (None,)
    others = (pages * config.page_size for pages in POOL_PAGES if pages is not None)
    return (None, *(size for size in others if builds(attrs.evolve(config, size=size))))


def pool_sorts(config: Config, keeps: Callable[[Config], bool]) -> tuple[bool | None, ...]:
    """The need_sort values an example of ``config`` may run on: its own
    (``None``) first, then True where ``config`` leaves it off and
    ``keeps`` it (the target builds with it and its allocator keeps the
    setting); only its own where ``config`` asks for need_sort."""
    if config.need_sort or not keeps(attrs.evolve(config, need_sort=True)):
        return (None,)
    return (None, True)


def pool_rows(config: Config, builds: Callable[[Config], bool]) -> tuple[int | None, ...]:
    """The req_to_token row counts an example of ``config`` may run on: its
    own (``None``) first, then each other of ``POOL_ROWS`` that ``builds``;
    only its own where ``config`` asks for other rows than the default."""
    if config.rows != attrs.fields(Config).rows.default:
        return (None,)
    others = (rows for rows in POOL_ROWS if rows is not None and rows != config.rows)
    return (None, *(rows for rows in others if builds(attrs.evolve(config, rows=rows))))


@st.composite
def _shape_indices(draw) -> tuple[int, int, int]:
    """An index into each of the running machine's ``shapes()``: size,
    need_sort, rows."""
    shapes = draw(_RUNNER).shapes()
    return tuple(draw(_below(len(axis))) for axis in (shapes.sizes, shapes.sorts, shapes.row_counts))


@functools.cache
def _below(n: int):
    """``st.integers(0, n - 1)``, made once per ``n`` (``st.integers`` looks
    its cache up on every call)."""
    return st.integers(0, n - 1)


class PoolShapeRule:
    """Mixed into a machine that draws its pool shape (``draws_shape``):
    its ``@initialize`` rule draws an index into each of ``shapes()``
    (index 0 of each, the run's own, is where a shrink heads) and builds the
    example's state there, from the machine's ``config`` as it is then,
    which a hang watch may have changed.  One class for every machine (the
    shapes are read when the rule runs), so making a machine builds no
    strategies for it.  Not a ``MachineRule``: the random baseline stays on
    the run's own pool."""

    @initialize(indices=_shape_indices())
    def draw_shape(self, indices):
        self.shape(*indices)

    def shape(self, size: int = 0, need_sort: int = 0, rows: int = 0) -> None:
        """Build the example's state in the shape of these indices (``shaped``)."""
        self.shape_as(self.shaped(self.config, size, need_sort, rows))

    def shape_as(self, config: Config) -> None:
        """Build the example's state on ``config`` (the machine's in a pool shape)."""
        try:
            self.state = self.build(config)
        except InvariantViolation:
            # The fresh pool fails in this shape (``family.may_draw`` keeps
            # such shapes): the example's failure, before any step.
            self.failed = True
            self.record.saw_failure()
            raise


class DecodeRules:
    """Mixed into a machine whose target runs ``decode`` (``Lockstep.runs``)."""

    @draws(guard=lambda s: s.decodable(), mask=(1, 15), order=(0, 3))
    def decode(self, mask, order):
        s = self.state
        batch = self.decode_batch(mask)
        if not batch or not s.decode_fits(batch):
            return
        if order == 0:
            # Requests taking a page first: the batch's tail then takes none,
            # the edge where a decode kernel's page index runs past the new pages.
            batch.sort(key=lambda r: not s.model.decode_needs_page(r.rid, s.page_size))
        else:
            k = order % len(batch)
            batch = batch[k:] + batch[:k]
        self._do("decode", batch)

    def decode_batch(self, mask: int = 15) -> list:
        """The decodable requests that bit ``i % 4`` of ``mask`` picks for
        the ``i``-th (15: every one), in their order, less each that needs a
        new page and has no room for it in its row."""
        s = self.state
        return [
            r for i, r in enumerate(s.decodable())
            if mask >> (i % 4) & 1 and (s.room(r) > 0 or not s.model.decode_needs_page(r.rid, s.page_size))
        ]


# An extend grows a request by 1 .. EXTEND_TOKENS_PAGES * page_size tokens.
EXTEND_TOKENS_PAGES = MAX_PAGES
# Batch members an extend draws a token count for: each live request and each
# fresh one needs a row, and there are rows of them (4 by default).
EXTEND_BATCH = 4


class ExtendRules:
    """Mixed into a machine whose target runs ``extend``."""

    @draws(
        guard=lambda s: s.any_live() or s.free_rows(),
        mask=(0, 15), fresh=(0, 2), prefix=(0, 4), order=(0, 3),
        t0=(1, 64), t1=(1, 64), t2=(1, 64), t3=(1, 64),
    )
    def extend(self, mask, fresh, prefix, order, t0, t1, t2, t3):
        # mask picks live requests to continue (bit i % 4 for the i-th);
        # fresh requests are admitted first, the first of them on a cached
        # prefix when prefix > 0.  t_i is the i-th member's token count, any
        # residue modulo the page size; order rotates the batch.
        s = self.state
        batch = [r for i, r in enumerate(s.extendable()) if mask >> (i % 4) & 1]
        entries = s.entries()
        for i in range(min(fresh, len(s.free_rows()))):
            entry = _pick(entries, prefix - 1) if i == 0 and prefix and entries else None
            batch.append(self._do("admit", prefix=entry))
        batch = batch[:EXTEND_BATCH]
        if not batch:
            return
        k = order % len(batch)
        batch = batch[k:] + batch[:k]
        reqs, tokens = [], []
        for req, t in zip(batch, (t0, t1, t2, t3)):
            room = s.config.row_pages * s.page_size - s.model.tokens(req.rid, s.page_size)
            n = min(1 + (t - 1) % (EXTEND_TOKENS_PAGES * s.page_size), room)
            if n > 0:
                reqs.append(req)
                tokens.append(n)
        if reqs:
            self._do("extend", reqs, tokens)


class HookRules:
    """Mixed into a machine whose target runs the scheduler-hook steps
    (``harness/hooks.py``): each rule where its step runs."""

    @draws(guard=lambda s: s.runs("ask"), tokens=(1, 64))
    def ask(self, tokens):
        # Any count up to a row's slots: below, at and above what is free.
        s = self.state
        self._do("ask", 1 + (tokens - 1) % (s.config.row_pages * s.page_size))

    @draws(guard=lambda s: s.runs("offload") and s.decodable(), which=PICKS)
    def offload(self, which):
        self._do("offload", _pick(self.state.decodable(), which))

    @draws(guard=lambda s: s.runs("finish_segments") and s.any_live(), which=PICKS, cut=(0, MAX_PAGES))
    def finish_segments(self, which, cut):
        s = self.state
        req = _pick(s.live(), which)
        self._do("finish_segments", req, cut % (len(s.model.requests[req.rid].own) + 1))

    @draws(guard=lambda s: s.runs("resize") and s.resizable(), pages=(1, 16))
    def resize(self, pages):
        # At most the pool's first size: the caller caps the resize there.
        s = self.state
        self._do("resize", 1 + (pages - 1) % (s.config.pool_size // s.page_size))
