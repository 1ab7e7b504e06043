"""The step seam: a step is declared once, by decorating a harness method.

``@step`` reads the method's signature (argument names, annotations and
defaults) into a ``StepSpec``; everything else reads the spec:

- the harness records each call as a ``Step`` and checks every invariant
  after it, in one place (``Lockstep._finish_step``);
- a trace's JSON is the recorded ``Step``\\ s; its schema (``runs/trace.py``)
  reads each rule's arguments, their kinds and what it returns from the
  specs, and so do replay, the printed program and the emitted pytest file;
- coverage and the bench see a step's arguments by name (``StepSpec.bind``).

A family that changes a step overrides it with ``@step`` again and calls
``super()``: only the outermost call records and checks.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from attrs import Factory, field, frozen


@frozen(repr=False)
class ReqRef:
    """A request, as a trace names it: ``req_0``."""

    rid: int

    def __repr__(self) -> str:
        return f"req_{self.rid}"


@frozen(repr=False)
class EntryRef:
    """A prefix-cache entry, as a trace names it: ``cache_0``."""

    eid: int

    def __repr__(self) -> str:
        return f"cache_{self.eid}"


# Argument kinds, read off annotations: what a value is and how JSON holds it.
INT, FLAG, REQ, ENTRY, REQS, INTS = "int", "flag", "req", "entry", "reqs", "ints"
_KINDS = {"int": INT, "bool": FLAG, "ReqRef": REQ, "EntryRef": ENTRY, "list[ReqRef]": REQS, "list[int]": INTS}


@frozen
class Param:
    name: str
    kind: str
    optional: bool


@frozen
class Step:
    """One recorded call: ``rule`` with its ``args`` as JSON values (refs as
    their names); ``returns`` names what it created (``req_0``), if anything."""

    rule: str
    args: dict
    returns: str | None = None

    def to_dict(self) -> dict:
        return {"rule": self.rule, "args": self.args, "returns": self.returns}


@frozen
class StepSpec:
    """A step's declaration: its name, parameters and what it returns."""

    name: str
    params: tuple[Param, ...]
    # "req" or "entry" when the step can create one, else None.
    returns: str | None
    doc: str
    # The parameters' names, read once: every step binds its call (``bind``).
    names: tuple[str, ...] = field(init=False, default=Factory(lambda self: tuple(p.name for p in self.params),
                                                                takes_self=True))

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """Positional and keyword arguments of a call, by parameter name."""
        call = dict(zip(self.names, args))
        if kwargs:
            call.update(kwargs)
        return call

    def record(self, call: dict) -> dict:
        """A call's arguments as JSON values; ``None`` is left out."""
        out = {}
        for p in self.params:
            value = call.get(p.name)
            if value is None:
                continue
            if p.kind == REQS:
                out[p.name] = [repr(r) for r in value]
            elif p.kind in (REQ, ENTRY):
                out[p.name] = repr(value)
            else:
                out[p.name] = list(value) if p.kind == INTS else value
        return out


def _kind(annotation: str) -> tuple[str, bool]:
    text = annotation.replace(" ", "")
    optional = text.endswith("|None")
    base = text.removesuffix("|None")
    if base not in _KINDS:
        raise TypeError(f"a step argument's annotation must be one of {', '.join(_KINDS)} (| None), not {annotation!r}")
    return _KINDS[base], optional


# Every declared step, by name, across every family's harness.
STEPS: dict[str, StepSpec] = {}


def step(fn: Callable) -> Callable:
    """Declare a harness method a step (see the module docstring).

    The method's annotations are strings (``from __future__ import
    annotations``), each one of the kinds above; its return annotation says
    whether it can create a request or a cache entry.
    """
    sig = inspect.signature(fn)
    params = []
    for name, p in list(sig.parameters.items())[1:]:
        kind, optional = _kind(p.annotation)
        params.append(Param(name, kind, optional or p.default is not p.empty))
    returns = {"ReqRef|None": REQ, "EntryRef|None": ENTRY}.get(str(sig.return_annotation).replace(" ", ""))
    spec = StepSpec(fn.__name__, tuple(params), returns, inspect.getdoc(fn) or "")
    if fn.__name__ in STEPS and STEPS[fn.__name__].params != spec.params:
        raise TypeError(f"step {fn.__name__} is declared twice with different arguments")
    STEPS.setdefault(fn.__name__, spec)

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        call = spec.bind(args, kwargs)
        if self.step_depth:
            # A family's override calling super(): the outer call records and checks.
            return fn(self, **call)
        self._start_step(spec, call)
        self.step_depth += 1
        try:
            result = fn(self, **call)
        finally:
            self.step_depth -= 1
        self._finish_step(result)
        return result

    run.step_spec = spec
    return run


def steps_of(cls) -> dict[str, StepSpec]:
    """The steps a harness class declares (its own and inherited)."""
    return {spec.name: spec for name in dir(cls) if (spec := getattr(getattr(cls, name, None), "step_spec", None))}


def disabled_steps(state) -> dict[str, str]:
    """Each step ``state``'s harness declares that does not run on its
    target here, with why (``why_not``): what ``targets --target`` lists,
    the run's header says and its statistics count as disabled."""
    return {name: why for name in sorted(steps_of(type(state))) if (why := state.why_not(name)) is not None}
