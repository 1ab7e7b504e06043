"""The family registry: which harness drives a target.

A family is a ``Lockstep`` subclass (the steps and the pools it checks), a
machine (the rules that draw those steps) and a test that recognizes its
allocators.  A target says its family by a ``family`` attribute on its
factory or class (built-ins do; see README, Targets); where it says none,
the first family here that recognizes the built allocator drives it.  A new
family is one module and one ``register`` line below.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable

import attrs
from attrs import frozen

from state_machines import targets
from state_machines.config import Config
from state_machines.harness import dsv4_hisparse, hisparse, mamba, page_interleave, pure_swa, swa, unified, unified_hybrid
from state_machines.harness.hooks import HOOK_STEPS
from state_machines.harness.lockstep import InvariantViolation, Lockstep, building
from state_machines.harness.machines import (
    OWN_SHAPE,
    DecodeRules,
    ExtendRules,
    FreeGroupMachine,
    HookRules,
    PoolShapeRule,
    PoolShapes,
    RunRecord,
    one_step_machine,
    pool_rows,
    pool_sizes,
    pool_sorts,
)
from state_machines.targets import devices, probe


@frozen
class Family:
    name: str
    lockstep: type[Lockstep]
    machine: type[FreeGroupMachine]
    # Whether an allocator whose target names no family belongs here.
    recognizes: Callable[[Any], bool]
    summary: str


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    FAMILIES[family.name] = family


register(Family("unified", unified.UnifiedLockstep, unified.UnifiedMachine, unified.is_unified, "virtual page ids over compacting physical pages"))
register(Family("mamba", mamba.MambaLockstep, mamba.MambaMachine, mamba.is_mamba, "state slots with allocation groups"))
register(Family("dsv4_hisparse", dsv4_hisparse.DSV4HiSparseLockstep, dsv4_hisparse.DSV4HiSparseMachine, dsv4_hisparse.is_dsv4_hisparse,
                "an SWA pair + a compressed device pool, device buffers"))
register(Family("hisparse", hisparse.HiSparseLockstep, hisparse.HiSparseMachine, hisparse.is_hisparse, "logical + device pools, device buffers"))
register(Family("page_interleave", page_interleave.PageInterleaveLockstep, page_interleave.PageInterleaveMachine,
                page_interleave.is_page_interleave, "per-owner-class free lists, alloc_extend with rotation bases"))
register(Family("pure_swa", pure_swa.PureSWALockstep, pure_swa.PureSWAMachine, pure_swa.is_pure_swa, "one pool, every layer windowed"))
register(Family("unified_mamba", unified_hybrid.UnifiedMambaLockstep, unified_hybrid.UnifiedMambaMachine, unified_hybrid.is_unified_mamba, "full pages + Mamba state slots in one byte arena"))
register(Family("unified_swa", unified_hybrid.UnifiedSWALockstep, unified_hybrid.UnifiedSWAMachine, unified_hybrid.is_unified_swa, "full + SWA sub-pools in one byte arena, virtual page ids"))
register(Family("swa", swa.SWALockstep, swa.SWAMachine, swa.is_hybrid, "full + SWA pools joined by a mapping"))
register(Family("free_group", Lockstep, FreeGroupMachine, lambda allocator: True, "one pool of pages"))


def family_of(target: targets.Target, allocator) -> Family:
    """The family the target names, else the first that recognizes its allocator."""
    if target.family is not None:
        if target.family not in FAMILIES:
            raise targets.TargetError(
                f"{target.spec} says family {target.family!r}; known families: {', '.join(sorted(FAMILIES))}"
            )
        family = FAMILIES[target.family]
        if target.spec.partition(":")[0] not in ("builtin", "sglang") and not (
                family.recognizes(allocator) or _a_builtin_of(allocator, family.name)):
            # A token pool that says "swa" was a harness traceback (no
            # full_attn_allocator), or allocator_raised at its first step (helper-90).
            raise targets.TargetError(
                f"{target.spec} says family {target.family!r}, but its {type(allocator).__name__} is not one: that harness"
                f" drives {family.summary}, named as sglang's classes name them (or subclass a built-in of the family)")
        return family
    return next(f for f in FAMILIES.values() if f.recognizes(allocator))


def _a_builtin_of(allocator, family: str) -> bool:
    """Whether ``allocator`` is an instance of a built-in allocator class of ``family``."""
    import allocators

    return any(isinstance(allocator, cls) and getattr(cls, "family", None) == family for cls, _ in allocators.BUILTINS.values())


def build(config: Config | None = None, **overrides) -> Lockstep:
    """A fresh allocator and model for ``config`` (or ``Config(**overrides)``),
    in the harness of the target's family.  Raises ``TargetError`` on bad
    input, ``InvariantViolation`` where the fresh allocator already disagrees."""
    config = config or Config(**overrides)
    if config.caller != "harness":
        # The real caller: state_machines/callers registers this family when imported.
        if "caller" not in FAMILIES:
            raise targets.TargetError(f"--caller {config.caller}: import state_machines.callers first")
        return FAMILIES["caller"].lockstep.from_config(config)
    target = targets.resolve(config.target, config.mutant, config.sglang_path)
    devices.require(config.device)

    def pool(size: int):
        with building("its factory"):
            return targets.build(
                target, size=size, page_size=config.page_size, device=config.device, need_sort=config.need_sort,
                row_dtype=config.row_dtype,
            )

    allocator = pool(config.pool_size)
    family = family_of(target, allocator)
    # The optional steps are probed on the target's default pool (10 pages),
    # not on a size the configuration pins: a pool too small for the probe's
    # extend returns None before the method's kernel runs, and the verdict is
    # kept for every size.
    # (The default size is worked out only where it is asked: every example builds.)
    with building("the probe of its optional methods (called once on a copy)"):
        disabled = probe.disabled_steps(
            allocator, page_size=config.page_size, device=config.device, latent=config.latent,
            own=None if config.size is None else lambda: pool(attrs.evolve(config, size=None).pool_size))
    return family.lockstep.create(config, allocator, defers_frees=target.defers_frees, disabled=disabled)


def machine_for(
    config: Config, record: RunRecord | None = None, *, draw_size: bool = True, built: Lockstep | None = None,
) -> type[FreeGroupMachine]:
    """A machine bound to ``config``: its family's rules, with ``decode``
    and ``extend`` where they run on the target (``Lockstep.runs``).  Its
    name spells the configuration, so the example database keeps
    configurations apart.  With ``draw_size``, where ``config`` pins no
    size, each example's first step draws its pool size (``pool_sizes``);
    without, every example runs on ``config`` itself.

    The machine's family and steps are read off a build of ``config``:
    ``built`` where the caller has one, fresh (``build(config)``, no step
    run on it), else one made here.  That state is then the first example's
    on ``config`` itself (the machine's ``build``), so a run builds its
    pool once before its first step, not three times (a build costs 0.05 ms
    on builtin:token, 0.8 ms on dsv4-hisparse).  The caller keeps no
    reference to ``built``: else the first example's state is kept to the
    run's end, not freed when its teardown returns."""
    state = built if built is not None else build(config)
    family = next(f.machine for f in FAMILIES.values() if type(state) is f.lockstep)
    # The core's optional rules; a family with steps of its own names them itself.
    core = isinstance(state, Lockstep)
    base = _rules(family, core and state.runs("decode"), core and state.runs("extend"),
                  any(state.runs(s) for s in HOOK_STEPS), state.runs("begin"))
    draws = draw_size and config.caller == "harness" and getattr(type(state), "draws_pool_size", True)

    def probe() -> PoolShapes:
        return _shapes(config) if draws else OWN_SHAPE

    def drawn(now: Config, rng: random.Random, refused: Config | None = None) -> Config | None:
        # Verdicts are kept for the run's configuration, not for ``now`` (a
        # hang watch's copy with a shorter call limit): the shape drawn goes onto ``now``.
        if not draws:
            return None if refused is not None else now
        shape = drawn_shape(config, rng, None if refused is None else _with_axes(config, _axes_of(refused)))
        return None if shape is None else _with_axes(now, _axes_of(shape))

    # The shapes offered before probing which build: whether an example draws one at all.
    offered = PoolShapes(pool_sizes(config, _any), pool_sorts(config, _any), pool_rows(config, _any))
    shaped = draws and offered != OWN_SHAPE
    bases = (PoolShapeRule, base) if shaped else (base,)
    name = base.__name__ + "_" + "".join(c if c.isalnum() else "_" for c in config.label())
    fresh = [state]

    def build_example(now: Config) -> Lockstep:
        # The state read above, once, for an example on ``config`` itself
        # (not on a shape drawn, nor on a hang watch's copy of it).
        return fresh.pop() if fresh and now is config else build(now)

    body = {"config": config, "record": record or RunRecord(), "build": staticmethod(build_example),
            "draws_shape": shaped, "shape_probe": staticmethod(probe), "shape_drawn": staticmethod(drawn)}
    return type(name, bases, body)


@functools.cache
def _rules(family: type, decode: bool, extend: bool, hooks: bool, groups: bool) -> type:
    """``family``'s machine with the optional rules a target runs, through
    one step rule (``one_step_machine``).  Made once per combination and
    shared by the machines of every configuration (each its own subclass):
    making the step rule's strategies took about half a millisecond of
    every run's ``machine_for``."""
    base = family
    if decode:
        base = type(f"Decode{base.__name__}", (DecodeRules, base), {})
    if extend:
        base = type(f"Extend{base.__name__}", (ExtendRules, base), {})
    if hooks:
        base = type(f"Hooks{base.__name__}", (HookRules, base), {})
    # A target without free groups (probe.GROUP_STEPS): no rule draws them,
    # as the Mamba machine has none.
    if getattr(base, "begin", None) is not None and not groups:
        base = type(f"NoGroups{base.__name__}", (base,), {"begin": None, "end": None})
    return one_step_machine(base)


@functools.cache
def _shapes(config: Config) -> PoolShapes:
    """The pool shapes that build for ``config`` (``machine_for``'s probe),
    kept for the process: they depend on the configuration and the
    target's code only, and probing builds the target in every shape
    (about a millisecond, 8 ms for dsv4-hisparse), once a run rather than
    once a seed.  Each shape's verdict is ``_drawable``'s, which
    ``drawn_shape`` may have taken already."""
    return PoolShapes(pool_sizes(config, _drawable), pool_sorts(config, _sort_drawable), pool_rows(config, _drawable))


# (config, sort) -> whether an example may draw that shape (``_drawable``),
# kept for the process as ``_shapes`` is.
_VERDICTS: dict[tuple[Config, bool], bool] = {}


def _drawable(config: Config, sort: bool = False) -> bool:
    """Whether an example may run on ``config``'s pool shape, kept in
    ``_VERDICTS``: ``_sorts`` for the need_sort axis (``sort``: the
    allocator must keep the setting too), else ``may_draw``."""
    key = (config, sort)
    if key not in _VERDICTS:
        _VERDICTS[key] = _sorts(config) if sort else may_draw(config)
    return _VERDICTS[key]


def _sort_drawable(config: Config) -> bool:
    return _drawable(config, True)


_AXES = (("size", pool_sizes), ("need_sort", pool_sorts), ("rows", pool_rows))


def drawn_shape(config: Config, rng: random.Random, refused: Config | None = None) -> Config | None:
    """``config`` in a pool shape drawn from ``rng``: on each axis (size,
    need_sort, rows) a value uniform among those offered, one draw an axis
    and no probe, whatever verdicts the process already holds (a seed draws
    the same shapes in any process).  The walk builds its example there:
    that build is the shape's probe.  Where the example is ``refused`` (its
    build raised, or its allocator dropped need_sort), or a value drawn is
    one a verdict (``_drawable``) already refused, this takes the verdict
    of each value of that shape off the run's own and draws again, each
    value drawn now probed and left out where it does not build: a first
    draw stands where its shape builds, and the second is uniform among
    the values that build, so each shape that builds is drawn as often as
    Hypothesis draws it from ``shapes()``.  A shape off the run's own on
    one axis is its value's probe, so its refusal is that value's verdict,
    taken with no second build.  None where every value of ``refused``
    builds on its own (the shape fails as a whole: the walk reports it).
    A search that fails in its second example no longer builds the target
    in every shape first (6 builds, 8 ms for dsv4-hisparse)."""
    if refused is None:
        drawn = _with_axes(config, {name: _one(rng, offered(config, _any)) for name, offered in _AXES})
        if not _known_refused(_axis_keys(config, drawn)):
            return drawn
        refused = drawn
    keys = _axis_keys(config, refused)
    if len(keys) == 1:
        _VERDICTS[keys[0]] = False
    elif not _known_refused(keys) and all(_drawable(*key) for key in keys):
        return None
    changes = {}
    for name, offered in _AXES:
        left = list(offered(config, _any))
        while (value := left.pop(rng.randrange(len(left)))) is not None:
            if _drawable(*_axis_key(config, name, value)):
                changes[name] = value
                break
    return attrs.evolve(config, **changes)


def _axes_of(shape: Config) -> dict:
    return {name: getattr(shape, name) for name, _ in _AXES}


def _one(rng: random.Random, values: tuple):
    return values[rng.randrange(len(values))]


def _with_axes(config: Config, values: dict) -> Config:
    """``config`` with each axis value that is not None (None: its own)."""
    return attrs.evolve(config, **{name: v for name, v in values.items() if v is not None})


def _axis_key(config: Config, name: str, value) -> tuple[Config, bool]:
    """The ``_VERDICTS`` key of ``config`` with axis ``name`` at ``value``."""
    return attrs.evolve(config, **{name: value}), name == "need_sort"


def _axis_keys(config: Config, shape: Config) -> list[tuple[Config, bool]]:
    """The ``_VERDICTS`` key of each value of ``shape`` off ``config``'s own."""
    return [_axis_key(config, name, getattr(shape, name)) for name, _ in _AXES
            if getattr(shape, name) != getattr(config, name)]


def _known_refused(keys: list[tuple[Config, bool]]) -> bool:
    """Whether a kept verdict already refuses one of ``keys`` (no probe: a
    shape with such a value is refused whatever its others' verdicts)."""
    return any(_VERDICTS.get(key) is False for key in keys)


def forget_machines() -> None:
    """Post: ``machine_for`` makes its step-rule classes and probes pool
    shapes afresh, as in a new process (the bench times each run so)."""
    _rules.cache_clear()
    _shapes.cache_clear()
    _VERDICTS.clear()


def _any(config: Config) -> bool:
    """Every shape, unprobed: what ``machine_for`` offers before it probes."""
    return True


def _sorts(config: Config) -> bool:
    """Whether an example may draw ``config`` (need_sort on): it builds and
    its allocator keeps need_sort (a class that ignores it draws no
    setting), or its fresh pool fails an invariant there, which the example
    that draws it reports (as ``may_draw``'s sizes)."""
    try:
        return getattr(build(config).allocator, "need_sort", False) is True
    except InvariantViolation:
        return True
    except Exception:  # noqa: BLE001 - a refusal draws no need_sort
        return False


def builds_fresh(config: Config) -> bool:
    """Whether ``config`` builds and its fresh pool checks out: a pool
    a target refuses, or whose fresh census already fails, is left out of
    the smaller pools ``minimize`` tries (its failure of building would
    pass for the bug's)."""
    return _fresh(config) == "builds"


def may_draw(config: Config) -> bool:
    """Whether an example may draw ``config``'s pool shape: the target
    builds it, or its fresh pool fails an invariant there, a failure the
    example that draws it reports (left out, a pool laid out wrong at 24
    or 64 pages only passed a run that never pinned ``--size``).  A shape
    the target refuses is left out."""
    return _fresh(config) != "refused"


def _fresh(config: Config) -> str:
    """``config`` built: "builds", "fails" (an invariant on the fresh pool)
    or "refused" (anything else the target or the harness raised)."""
    try:
        build(config)
    except InvariantViolation:
        return "fails"
    except Exception:  # noqa: BLE001 - any refusal leaves the shape out
        return "refused"
    return "builds"
