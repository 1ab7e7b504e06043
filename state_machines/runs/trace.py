"""Traces: the steps of a failing run, as JSON and as a program to replay.

A trace is data, never code.  ``Trace.load`` checks every field against the
schema below (exact types, ranges, names) before anything runs or is
written, and ``run_steps`` runs a step only where the harness's own rule
could have drawn it; anything else is a ``TraceError`` (one line, exit 2),
never a failure blamed on the allocator.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import stat
import tempfile
from collections import Counter
from pathlib import Path

from attrs import fields, frozen

from state_machines.config import MAX_CALL_TIMEOUT_S, MIN_CALL_TIMEOUT_S, Config, call_limit_holds
from state_machines.harness import FAMILIES, STEPS, EntryRef, InvariantViolation, Lockstep, ReqRef, Step, build
from state_machines.harness import steps as seam
from state_machines.harness.lockstep import disarm_call_timer

FORMAT = "kv-lockstep-trace/1"

# Sizes a trace may not pass: far beyond any recorded run, small enough that
# reading or building one costs little.
MAX_TRACE_BYTES = 16 << 20
MAX_STEPS = 100_000
MAX_PAGE_SIZE = 1024
MAX_SLOTS = 1 << 22  # pool slots, and req_to_token's rows * row slots
MAX_ROWS = 256
MAX_ROW_PAGES = 4096
MAX_TEXT = 100_000  # characters of failure.detail

_REF = re.compile(r"(req|cache)_(0|[1-9][0-9]{0,8})", re.ASCII)
_INVARIANT = re.compile(r"[a-z_]{1,64}", re.ASCII)
_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,99}"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT}){{0,15}}"
_TARGET = re.compile(rf"builtin:[a-z0-9][a-z0-9_-]{{0,63}}|sglang:[a-z0-9][a-z0-9_-]{{0,63}}|{_DOTTED}:{_DOTTED}", re.ASCII)
_MUTANT = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}", re.ASCII)
CALLER_SPEC = re.compile(rf"harness|radix|unified|unified-swa|swa-radix|{_DOTTED}:{_DOTTED}", re.ASCII)
CALLER_SPEC_SHOWN = "harness, radix, unified, unified-swa, swa-radix or MODULE:ATTR"
_GROUPS = re.compile(r"release|all|none", re.ASCII)
_DEVICE = re.compile(r"(cpu|cuda|npu)(:[0-9]{1,3})?", re.ASCII)
_ROW_DTYPE = re.compile(r"int32|int64", re.ASCII)


class TraceError(Exception):
    """A trace file that cannot be read; the CLI prints it on one line, exit 2."""


class StepNotApplicable(TraceError):
    """A step that does not apply where it stands in a trace (``step``: its index)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


# --------------------------------------------------------------------------- #
# The step schema.  Rules, their arguments, each argument's kind and what a
# rule may return come from the harness's step declarations (``STEPS``);
# here each integer argument gets its unit, which bounds it by the config.

SLOTS = "slots"    # slots, a whole number of pages: page_size .. row_pages * page_size
SPAN = "span"      # slots, may end mid-page: 1 .. row_pages * page_size
SPAN0 = "span0"    # the same, possibly none: 0 .. row_pages * page_size
OFFSET = "offset"  # a page-aligned offset in a row: 0 .. row_pages * page_size - 1
ROW = "row"        # a row of req_to_token: 0 .. rows - 1
PAGES = "pages"    # pages: 1 .. row_pages
PAGES0 = "pages0"  # pages, possibly none: 0 .. row_pages
POOL = "pool"      # pages of the pool (a resize's): 1 .. pool_size // page_size
PROMPT = "prompt"  # a prompt, one decimal digit per page (state_machines/callers): 1 .. 999
FLAG, REQ, ENTRY, REQS = seam.FLAG, seam.REQ, seam.ENTRY, seam.REQS
LIST = "list of "  # prefixed to a unit: a list[int] argument, each element in the unit

# (rule, integer argument) -> its unit (of each element, for a list[int]); an
# integer argument not named here is refused, so a new step's integers get a
# unit before a trace can carry them.
_UNITS = {
    ("extend", "tokens"): SPAN,
    ("alloc", "n"): SLOTS,
    ("free", "n"): SLOTS,
    ("free_segment", "start"): OFFSET,
    ("free_segment", "n"): SPAN,
    ("free_empty_span", "how"): PAGES0,  # a free method, taken modulo those the allocator has
    ("overwrite_row", "row"): ROW,
    ("rematch", "dup"): PAGES0,
    ("slide", "pages"): PAGES,
    ("arrive", "prompt"): PROMPT,
    ("arrive", "out"): SPAN,
    ("evict_tokens", "n"): SPAN,
    ("chunked_prefill", "pages"): PAGES,
    ("extend_swa_tail", "tokens"): SPAN,
    ("extend_swa_tail", "tail"): SPAN0,
    ("device_buffer", "n"): SLOTS,
    ("device_buffer_pages", "pages"): PAGES,
    ("alloc_group_begin", "n"): PAGES0,
    ("alloc_physical", "n"): SLOTS,
    ("free_physical", "loan"): PAGES0,
    # The unified Mamba pool's state slots (harness/unified_hybrid.py).
    ("mamba_alloc", "n"): PAGES,
    ("mamba_free", "state"): PAGES0,
    ("mamba_group_begin", "n"): PAGES0,
    ("prepare_mamba", "n"): PAGES,
    ("load_back", "n"): SLOTS,
    ("load_back", "start"): PAGES0,  # a class, taken modulo the shard size as alloc_cyclic takes it
    # The scheduler-hook steps (harness/hooks.py).
    ("ask", "tokens"): SPAN,
    ("finish_segments", "cut"): PAGES0,
    ("resize", "pages"): POOL,
    # The unified SWA pool's admission questions (harness/unified_hybrid.py).
    ("reserve", "full"): PAGES0,
    ("reserve", "swa"): PAGES0,
    ("reserve", "evict_full"): PAGES0,
    ("reserve", "evict_swa"): PAGES0,
    ("make_room", "full"): PAGES0,
    ("make_room", "swa"): PAGES0,
}


def _schema() -> dict[str, tuple[dict[str, tuple[str, bool]], str | None]]:
    """rule -> ({argument: (kind or unit, optional)}, what it may return)."""
    out = {}
    for name, spec in STEPS.items():
        params = {}
        for p in spec.params:
            kind = _UNITS.get((name, p.name), "unbounded") if p.kind in (seam.INT, seam.INTS) else p.kind
            if p.kind == seam.INTS:
                kind = LIST + kind
            params[p.name] = (kind, p.optional)
        out[name] = (params, spec.returns)
    return out


_ARGS = _schema()
RULES = tuple(sorted(_ARGS))


def _rules() -> dict:
    """The schema, read again when steps were declared after this module
    loaded (a family imported later, such as ``state_machines.callers``)."""
    global _ARGS, RULES
    if len(_ARGS) != len(STEPS):
        _ARGS = _schema()
        RULES = tuple(sorted(_ARGS))
    return _ARGS


def arg_kinds(rule: str) -> dict[str, str]:
    """``{argument: kind}`` of a known rule."""
    return {name: kind for name, (kind, _) in _rules()[rule][0].items()}


def optional_args(rule: str) -> frozenset[str]:
    """The arguments of a known rule that may be left out."""
    return frozenset(name for name, (_, optional) in _rules()[rule][0].items() if optional)


def returns_kind(rule: str) -> str | None:
    """What a known rule may create (``REQ`` or ``ENTRY``), or None."""
    return _rules()[rule][1]


def int_bounds(kind: str, config: Config) -> tuple[int, int, int]:
    """(lowest, highest, multiple of) for an integer argument of ``kind``."""
    ps, row_slots = config.page_size, config.row_pages * config.page_size
    if kind not in (SLOTS, SPAN, SPAN0, OFFSET, ROW, PAGES, PAGES0, POOL, PROMPT):
        raise TraceError(f"an integer argument of kind {kind!r} has no bounds in state_machines/runs/trace.py")
    return {
        SLOTS: (ps, row_slots, ps),
        SPAN: (1, row_slots, 1),
        SPAN0: (0, row_slots, 1),
        OFFSET: (0, row_slots - 1, ps),
        ROW: (0, config.rows - 1, 1),
        PAGES: (1, config.row_pages, 1),
        PAGES0: (0, config.row_pages, 1),
        POOL: (1, config.pool_size // ps, 1),
        PROMPT: (1, 999, 1),
    }[kind]


# --------------------------------------------------------------------------- #
# Checking values


def _show(value) -> str:
    """A value of unknown shape for a one-line message, short."""
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, dict):
        return "a JSON object"
    try:  # as the file writes it (true, null, "text"), escaped to one line
        text = json.dumps(value)
    except (TypeError, ValueError):  # not from JSON: a Python object
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(value, lo: int, hi: int, where: str, multiple: int = 1) -> int:
    # bool is an int to Python, and 1.0 or 1e30 are numbers to JSON: neither is taken.
    if type(value) is not int:
        raise TraceError(f"{where} is {_show(value)}, not a whole number")
    if not lo <= value <= hi:
        raise TraceError(f"{where} is {value}, outside {lo}..{hi}")
    if value % multiple:
        raise TraceError(f"{where} is {value}, not a multiple of the page size {multiple}")
    return value


def _bool(value, where: str) -> bool:
    if type(value) is not bool:
        raise TraceError(f"{where} is {_show(value)}, not true or false")
    return value


def _text(value, where: str, pattern: re.Pattern | None = None, what: str = "", limit: int = 4096) -> str:
    if type(value) is not str:
        raise TraceError(f"{where} is {_show(value)}, not a string")
    if pattern is not None and not pattern.fullmatch(value):
        raise TraceError(f"{where} is {_show(value)}, not {what}")
    if len(value) > limit:
        raise TraceError(f"{where} is {len(value)} characters long, more than {limit}")
    return value


def _path_text(value, where: str) -> str:
    text = _text(value, where)
    if not text or any(not ch.isprintable() for ch in text):
        raise TraceError(f"{where} is {_show(value)}, not a printable path")
    return text


def _object(value, where: str, required: tuple[str, ...], allowed: tuple[str, ...]) -> dict:
    if type(value) is not dict:
        raise TraceError(f"{where} is {_show(value)}, not a JSON object")
    for key in value:
        if key not in allowed:
            raise TraceError(f"{where} has an unknown field {_show(key)} (known: {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise TraceError(f"{where} lacks the field '{key}'")
    return value


def _optional(check):
    return lambda value, where: None if value is None else check(value, where)


# Each Config field and its check; a field Config gains must be added here,
# or every trace that carries it is refused.
_CONFIG_CHECKS = {
    "target": lambda v, w: _text(v, w, _TARGET, "builtin:NAME, sglang:NAME or MODULE:ATTR"),
    "mutant": _optional(lambda v, w: _text(v, w, _MUTANT, "a mutant name")),
    "page_size": lambda v, w: _int(v, 1, MAX_PAGE_SIZE, w),
    "need_sort": _bool,
    "device": lambda v, w: _text(v, w, _DEVICE, "cpu, cuda or npu (with :N)"),
    "size": _optional(lambda v, w: _int(v, 1, MAX_SLOTS, w)),
    "rows": lambda v, w: _int(v, 1, MAX_ROWS, w),
    "row_pages": lambda v, w: _int(v, 1, MAX_ROW_PAGES, w),
    "sglang_path": _optional(_path_text),
    "call_timeout_s": lambda v, w: _seconds(v, w),
    "row_dtype": lambda v, w: _text(v, w, _ROW_DTYPE, "int32 or int64"),
    "latent": _bool,
    "caller": lambda v, w: _text(v, w, CALLER_SPEC, CALLER_SPEC_SHOWN),
    "groups": lambda v, w: _text(v, w, _GROUPS, "release, all or none"),
}


def _seconds(value, where: str) -> float:
    if not call_limit_holds(value):
        raise TraceError(f"{where} is {_show(value)}, not a number of seconds in [{MIN_CALL_TIMEOUT_S}, {MAX_CALL_TIMEOUT_S}]")
    return float(value)


def check_config(data, where: str = "config") -> Config:
    """A ``Config`` from its JSON form, every field checked; ``TraceError`` if not."""
    names = tuple(a.name for a in fields(Config))
    _object(data, where, ("target",), names)
    unchecked = [name for name in names if name not in _CONFIG_CHECKS]
    if unchecked:  # a new Config field: refuse rather than pass it unchecked
        raise TraceError(f"config field {unchecked[0]} has no check in state_machines/runs/trace.py")
    for key, value in data.items():
        _CONFIG_CHECKS[key](value, f"{where}.{key}")
    config = Config(**data)
    if config.latent and config.page_size != 1:
        # As fuzz refuses --latent there: at page size > 1 the callers send
        # those steps to alloc_decode / alloc_extend themselves, and a
        # failure replayed so was called latent, not a gate failure.
        raise TraceError(f"{where}.latent is true at page size {config.page_size}: latent drives alloc_decode /"
                         " alloc_extend at page size 1 only, where sglang's callers use alloc()")
    if config.size is not None and config.size % config.page_size:
        # sglang builds its pools in whole pages (pool_configurator rounds
        # down); a model of ``size // page_size`` pages then disagrees with
        # the allocator's own size_full: a false alarm.
        raise TraceError(f"{where}.size is {config.size}, not a whole number of pages of {config.page_size} slots")
    slots = config.rows * config.row_pages * config.page_size
    if slots > MAX_SLOTS:
        raise TraceError(f"{where}: rows * row_pages * page_size is {slots}, more than {MAX_SLOTS}")
    return config


def needs_latent(config: Config, steps) -> bool:
    """Whether ``steps`` on ``config`` ran what only ``--latent`` drives: a
    decode or an extend at page size 1, which ``--latent`` sends to
    ``alloc_decode`` / ``alloc_extend`` where every caller sends it to
    ``alloc()`` (``probe.caller_sends``).  A latent run's failure without
    one is a gate failure: every one of its calls is a caller's."""
    from state_machines.targets.probe import OPTIONAL

    return config.latent and config.page_size == 1 and any(step.rule in OPTIONAL for step in steps)


def _ref_name(value, kind: str, where: str, defined: dict[str, str] | None) -> str:
    what = "a request name (req_N)" if kind == REQ else "a cache entry name (cache_N)"
    if type(value) is not str or not _REF.fullmatch(value) or not value.startswith(kind if kind == REQ else "cache_"):
        raise TraceError(f"{where} is {_show(value)}, not {what}")
    if defined is not None and value not in defined:
        raise TraceError(f"{where} names {value}, which no earlier step created")
    return value


def decode_names(value) -> list[str]:
    """The request names of a decode's ``reqs``, list or comma string."""
    return [part.strip() for part in value.split(",")] if isinstance(value, str) else list(value)


def _check_arg(kind: str, value, where: str, config: Config, defined: dict[str, str] | None):
    if kind == FLAG:
        return _bool(value, where)
    if kind in (REQ, ENTRY):
        return _ref_name(value, kind, where, defined)
    if kind == REQS:
        if type(value) is str:
            if len(value) > 16 * MAX_ROWS:
                raise TraceError(f"{where} is {len(value)} characters long")
        elif type(value) is not list:
            raise TraceError(f"{where} is {_show(value)}, not a list of request names")
        names = decode_names(value)
        if not names or len(names) > MAX_ROWS:
            raise TraceError(f"{where} must name 1..{MAX_ROWS} requests, not {len(names)}")
        for i, name in enumerate(names):
            _ref_name(name, REQ, f"{where}[{i}]", defined)
        if len(set(names)) != len(names):
            raise TraceError(f"{where} names a request twice")
        return value
    if kind.startswith(LIST):
        if type(value) is not list:
            raise TraceError(f"{where} is {_show(value)}, not a list of whole numbers")
        if not value or len(value) > MAX_ROWS:
            raise TraceError(f"{where} must hold 1..{MAX_ROWS} numbers, not {len(value)}")
        lo, hi, multiple = int_bounds(kind.removeprefix(LIST), config)
        return [_int(v, lo, hi, f"{where}[{i}]", multiple) for i, v in enumerate(value)]
    lo, hi, multiple = int_bounds(kind, config)
    return _int(value, lo, hi, where, multiple)


def check_step(raw, index: int, config: Config, defined: dict[str, str] | None = None) -> Step:
    """One step from its JSON form, checked against the rule table and
    ``config``; ``defined`` (name -> kind), where given, is what earlier
    steps created, and gains what this one returns."""
    where = f"steps[{index}]"
    _object(raw, where, ("rule",), ("rule", "args", "returns"))
    rule = raw["rule"]
    if type(rule) is not str or rule not in _rules():
        raise TraceError(f"{where}.rule is {_show(rule)}, not a known rule ({', '.join(RULES)})")
    params, returns_kind = _rules()[rule]
    args = raw.get("args", {})
    if type(args) is not dict:
        raise TraceError(f"{where}.args is {_show(args)}, not a JSON object")
    for key in args:
        if key not in params:
            raise TraceError(f"{where}: {rule} takes no argument {_show(key)} (takes {', '.join(params) or 'none'})")
    for key, (kind, optional) in params.items():
        if key not in args or (optional and args[key] is None):
            if not optional:
                raise TraceError(f"{where}: {rule} needs the argument '{key}'")
            continue
        _check_arg(kind, args[key], f"{where}.args.{key}", config, defined)
    if rule == "free_segment" and args["start"] + args["n"] > config.row_pages * config.page_size:
        raise TraceError(f"{where}: free_segment runs past the end of a row ({config.row_pages * config.page_size} slots)")
    if rule == "extend" and len(args["tokens"]) != len(decode_names(args["reqs"])):
        raise TraceError(f"{where}: extend names {len(decode_names(args['reqs']))} requests and {len(args['tokens'])} token counts")
    returns = raw.get("returns")
    if returns is not None:
        if returns_kind is None:
            raise TraceError(f"{where}: {rule} returns nothing, but the step names {_show(returns)}")
        if rule == "alloc" and args.get("req") is not None:
            # It was taken, and a later step naming it refused mid-replay as made by no step (helper-90).
            raise TraceError(f"{where}: alloc with req grows that request and returns nothing, but the step names {_show(returns)}")
        _ref_name(returns, returns_kind, f"{where}.returns", None)
        if defined is not None:
            if returns in defined:
                raise TraceError(f"{where}.returns names {returns} again")
            defined[returns] = returns_kind
    return Step(rule, {k: v for k, v in args.items() if v is not None}, returns)


def harness_only_field(config: Config) -> str | None:
    """The field of ``config`` only the harness's own caller takes (latent,
    or rows other than int32) that it sets with a real caller; else None."""
    if config.caller == "harness":
        return None
    return "latent" if config.latent else "row_dtype" if config.row_dtype != "int32" else None


def _real_caller_fields(config: Config) -> None:
    """A trace of a real caller carries neither latent nor int64 rows: fuzz
    refuses --latent and --row-dtype with --caller, and replay refused such
    a trace naming those flags, which the user never gave (helper-90)."""
    field_ = harness_only_field(config)
    if field_ is not None:
        value, flag = ("true", "--latent") if field_ == "latent" else (_show(config.row_dtype), "--row-dtype")
        raise TraceError(f"config.{field_} is {value} with caller {_show(config.caller)}: only the harness's own"
                         f" caller takes it (the release's caller keeps its own rows and calls; fuzz refuses {flag}"
                         " with --caller)")


def check_trace(data) -> tuple[Config, tuple[Step, ...], str | None, str | None]:
    """(config, steps, invariant, detail) from a trace's JSON form, all of
    it checked; ``TraceError`` names the first thing wrong."""
    _object(data, "the trace", ("format", "config", "steps"), ("format", "config", "steps", "failure"))
    if data["format"] != FORMAT:
        raise TraceError(f"format is {_show(data['format'])}, not {_show(FORMAT)}")
    config = check_config(data["config"])
    _real_caller_fields(config)
    raw_steps = data["steps"]
    if type(raw_steps) is not list:
        raise TraceError(f"steps is {_show(raw_steps)}, not a list")
    if len(raw_steps) > MAX_STEPS:
        raise TraceError(f"steps has {len(raw_steps)} entries, more than {MAX_STEPS}")
    defined: dict[str, str] = {}
    steps = tuple(check_step(raw, i, config, defined) for i, raw in enumerate(raw_steps))
    failure = data.get("failure")
    if failure is None:
        return config, steps, None, None
    _object(failure, "failure", (), ("step", "invariant", "detail"))
    if failure.get("step") is not None:
        _int(failure["step"], -1, len(steps) - 1, "failure.step")
    invariant = failure.get("invariant")
    if invariant is not None:
        _text(invariant, "failure.invariant", _INVARIANT, "an invariant name ([a-z_]+)")
    detail = failure.get("detail")
    if detail is not None:
        _text(detail, "failure.detail", limit=MAX_TEXT)
    return config, steps, invariant, detail


def _within_max_text(detail: str | None) -> str | None:
    """``detail`` cut to ``MAX_TEXT`` characters, saying how much was cut,
    so that a trace ``fuzz`` writes, ``replay`` reads."""
    if detail is None or len(detail) <= MAX_TEXT:
        return detail
    tail = f"... ({len(detail) - MAX_TEXT + 100:,} characters cut)"
    return detail[:MAX_TEXT - 100] + tail


@frozen
class Trace:
    config: Config
    steps: tuple[Step, ...]
    # The invariant that failed on the last step, and what it said.
    invariant: str | None = None
    detail: str | None = None

    @classmethod
    def from_violation(cls, exc: InvariantViolation) -> Trace:
        return cls(exc.config, tuple(exc.steps), exc.invariant, exc.detail)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "config": self.config.to_dict(),
            "steps": [s.to_dict() for s in self.steps],
            "failure": {"step": len(self.steps) - 1, "invariant": self.invariant, "detail": _within_max_text(self.detail)},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data) -> Trace:
        """A trace from its JSON form, checked throughout (``TraceError``)."""
        return cls(*check_trace(data))

    def checked(self) -> Trace:
        """This trace, as ``load`` would read it back: ``TraceError`` if any
        part of it does not fit the schema."""
        return Trace.from_dict(json.loads(json.dumps(self.to_dict())))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_TRACE_BYTES + 1)
        except OSError as exc:
            raise TraceError(f"cannot read trace {shown(path)}: {exc.strerror or type(exc).__name__}") from None
        if len(raw) > MAX_TRACE_BYTES:
            raise TraceError(f"cannot read trace {shown(path)}: larger than {MAX_TRACE_BYTES >> 20} MiB")
        try:
            data = json.loads(raw, object_pairs_hook=_once_each)
        except RecursionError:
            raise TraceError(f"cannot read trace {shown(path)}: JSON nested too deeply") from None
        except _KeyTwice as exc:
            raise TraceError(f"cannot read trace {shown(path)}: {exc}") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
            raise TraceError(f"cannot read trace {shown(path)}: not JSON: {_one_line(exc)}") from None
        try:
            return cls.from_dict(data)
        except TraceError as exc:
            raise TraceError(f"cannot read trace {shown(path)}: {exc}") from None

    def program(self) -> str:
        """The steps as Python that runs them again after ``from
        state_machines.harness import build``, Hypothesis style; the failing
        step, the last, carries the invariant it broke."""
        cfg = {k: v for k, v in self.config.to_dict().items() if v != Config().to_dict()[k] or k == "target"}
        lines = [f"state = build({', '.join(f'{k}={v!r}' for k, v in cfg.items())})"]
        lines += [step_source(step) for step in self.steps]
        if self.invariant and _INVARIANT.fullmatch(self.invariant):
            lines[-1] += f"  # fails: {self.invariant}"
        else:
            lines.append("state.teardown()")
        return "\n".join(lines)


def shown(path) -> str:
    """A path for a one-line message: as it is, or repr'd where it holds a
    newline or another character that is not printable."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def counted(n: int, noun: str) -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def replay_command(path, config: Config) -> str:
    """The ``kv-lockstep replay`` command that runs a trace written by a run
    of ``config``: replay imports no code and puts no folder on ``sys.path``
    that a trace names, so a custom target or cache class and an
    ``--sglang-path`` are passed again, as the run was given them, and with
    a custom target or cache class, the run's ``PYTHONPATH``, each folder in
    full."""
    if not written(path):
        return "none: no trace file was written"
    words = ["kv-lockstep", "replay", str(path)]
    if config.target.partition(":")[0] not in ("builtin", "sglang"):
        words += ["--target", config.target]
    if ":" in config.caller:
        words += ["--caller", config.caller]
    if config.sglang_path is not None:
        words += ["--sglang-path", config.sglang_path]
    module_path = os.environ.get("PYTHONPATH", "") if config.runs_users_code() else ""
    if module_path:  # each folder in full (an empty entry is the current one), as the trace's path may be
        module_path = os.pathsep.join(os.path.abspath(p or os.curdir) for p in module_path.split(os.pathsep))
    return (f"PYTHONPATH={shlex.quote(module_path)} " if module_path else "") + shlex.join(words)


class _KeyTwice(ValueError):
    """A JSON object that gives a key twice."""


def _once_each(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are all different: of a key given twice,
    ``json`` keeps the last without a word, so a trace could say two things
    of one field."""
    data = dict(pairs)
    if len(data) != len(pairs):
        twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        named = ", ".join(repr(k) if len(k) <= 40 else repr(k[:37] + "...") for k in twice[:3])
        raise _KeyTwice(f"key {named}{f' (and {len(twice) - 3} more)' if len(twice) > 3 else ''} given twice in one object")
    return data


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def step_source(step: Step) -> str:
    """A checked step as a line of Python: ``req_0 = state.alloc(n=3)``.

    Every part is a known rule or argument name, a request or entry name
    (``[a-z]+_[0-9]+``), or a literal written by ``repr()``: nothing of the
    trace's text reaches the line except as data.
    """
    kinds = arg_kinds(step.rule)  # KeyError for an unknown rule: never written
    parts = []
    for key, value in step.args.items():
        kind = kinds[key]
        if kind in (REQ, ENTRY):
            if not (isinstance(value, str) and _REF.fullmatch(value)):
                raise TraceError(f"{step.rule}: {key} is not a name")
            parts.append(f"{key}={value}")
        elif kind == REQS:
            names = decode_names(value)
            if not all(isinstance(n, str) and _REF.fullmatch(n) for n in names):
                raise TraceError(f"{step.rule}: {key} is not a list of names")
            parts.append(f"{key}=[{', '.join(names)}]")
        elif kind.startswith(LIST):
            if type(value) is not list or not all(type(v) is int for v in value):
                raise TraceError(f"{step.rule}: {key} is not a list of numbers")
            parts.append(f"{key}={value!r}")
        elif type(value) not in (int, bool):
            raise TraceError(f"{step.rule}: {key} is not a number")
        else:
            parts.append(f"{key}={value!r}")
    call = f"state.{step.rule}({', '.join(parts)})"
    if step.returns is None:
        return call
    if not _REF.fullmatch(step.returns):
        raise TraceError(f"{step.rule}: returns is not a name")
    return f"{step.returns} = {call}"


# --------------------------------------------------------------------------- #
# Running steps


def _not_applicable(state: Lockstep, rule: str, args: dict) -> str | None:
    """Why the harness's rule could never have drawn this step here, or None.

    Mirrors the preconditions of ``harness/machines.py`` and
    ``harness/family.py``; a step outside them would run the allocator on
    what no caller passes (a slice past a row, a request that holds no
    pages) and blame it for the result.
    """
    own = getattr(state, "not_applicable", None)
    if own is not None:  # a harness with its own preconditions (state_machines/callers)
        return own(rule, args)
    ps, model = state.page_size, state.model
    req, entry = args.get("req"), args.get("entry")
    if req is not None and req.rid not in model.requests:
        return f"{req!r} has finished"
    for ref in args.get("reqs") or ():  # a batch's, before a family reads them (a finished one was a KeyError)
        if ref.rid not in model.requests:
            return f"{ref!r} has finished"
    request = model.requests[req.rid] if req is not None else None
    # A family's own preconditions (its steps, or what it narrows) come first.
    family_check = getattr(state, "step_not_applicable", None)
    if family_check is not None and (reason := family_check(rule, args)):
        return reason
    if rule == "alloc":
        prefix = args.get("prefix")
        if req is not None and prefix is not None:
            return "an alloc extends a request or starts one on a prefix, not both"
        if req is not None:
            return f"{req!r} has room for {state.room(req)} more pages" if args["n"] // ps > state.room(req) else None
        if not state.free_rows():
            return f"every one of the {state.config.rows} rows is in use"
        if prefix is not None:
            if prefix.eid not in model.cache:
                return f"{prefix!r} was evicted"
            if len(model.cache[prefix.eid].pages) + args["n"] // ps > state.config.row_pages:
                return f"{prefix!r} and {args['n']} slots do not fit in a row"
        return None
    if rule == "begin":
        return "a free group is already open" if state.in_group else None
    if rule in ("free", "free_segment", "rematch") and not request.own:
        return f"{req!r} holds no pages of its own"
    if rule == "free":
        return f"{req!r} holds {len(request.own) * ps} slots of its own" if args["n"] // ps > len(request.own) else None
    if rule == "free_segment":
        start, end, length = args["start"], args["start"] + args["n"], len(request.pages) * ps
        if not len(request.prefix) * ps <= start < length:
            return f"start {start} is not in {req!r}'s own pages"
        if not length - ps < end <= length:
            return f"the segment must end on {req!r}'s last page, slots {length - ps + 1}..{length}"
        return None
    if rule == "rematch":
        dup = args["dup"]
        if dup > len(request.own):
            return f"{req!r} holds {len(request.own)} pages of its own, not {dup}"
        if (entry is not None) != (dup > 0):
            return "a rematch names an entry exactly when dup > 0"
        if entry is not None:
            if entry.eid not in model.cache:
                return f"{entry!r} was evicted"
            if len(model.cache[entry.eid].pages) < dup:
                return f"{entry!r} holds fewer than {dup} pages"
        return None
    if rule == "evict":
        return None if entry in state.evictable() else f"{entry!r} is not evictable (evicted, or locked)"
    if rule in ("ask", "offload", "finish_segments") and (why := state.why_not(rule)) is not None:
        return f"{rule} does not run on {state.config.target} here: {why}"
    if rule == "offload" and not model.tokens(req.rid, ps):
        return f"{req!r} holds no tokens to copy"
    if rule == "resize":
        if not state.resizable():
            return "a resize comes before any request: something is live, cached or queued"
        if args["pages"] > state.config.pool_size // ps:
            return f"a resize past the pool's first {state.config.pool_size // ps} pages: the caller caps it there"
    if rule == "clear":
        clearable = getattr(state, "clearable", None)
        if clearable is None or not clearable():
            return "the scheduler flushes only when idle: a request is live, or a group or loan is open"
    if rule == "finish_segments" and args["cut"] > len(request.own):
        return f"{req!r} holds {len(request.own)} pages of its own, not {args['cut']}"
    if rule == "decode":
        if (why := state.why_not("decode")) is not None:
            return f"decode does not run on {state.config.target} here: {why}"
        for ref in args["reqs"]:
            if ref.rid not in model.requests:
                return f"{ref!r} has finished"
            if not model.requests[ref.rid].pages:
                return f"{ref!r} holds no tokens: a request decodes after its prefill"
            if state.room(ref) <= 0 and model.decode_needs_page(ref.rid, ps):
                return f"{ref!r} needs a new page and its row is full"
        return None
    if rule == "admit":
        if (why := state.why_not("admit")) is not None:
            return f"admit does not run on {state.config.target} here: {why}"
        if not state.free_rows():
            return f"every one of the {state.config.rows} rows is in use"
        prefix = args.get("prefix")
        if prefix is not None and prefix.eid not in model.cache:
            return f"{prefix!r} was evicted"
        return None
    if rule == "extend":
        if (why := state.why_not("extend")) is not None:
            return f"extend does not run on {state.config.target} here: {why}"
        row_slots = state.config.row_pages * ps
        for ref, tokens in zip(args["reqs"], args["tokens"]):
            if ref.rid not in model.requests:
                return f"{ref!r} has finished"
            if model.tokens(ref.rid, ps) + tokens > row_slots:
                return f"{ref!r} holds {model.tokens(ref.rid, ps)} tokens: {tokens} more do not fit in a row of {row_slots}"
        return None
    if rule == "slide":
        if req not in state.slidable():
            return f"{req!r} has no pages left in the window"
        return f"{req!r} has {state.live_own(req)} pages in the window" if args["pages"] > state.live_own(req) else None
    if rule == "evict_swa":
        return None if entry in state.swa_evictable() else f"{entry!r} has no SWA side to drop, or is locked"
    return None


def run_steps(state: Lockstep, steps) -> None:
    """Apply recorded steps to ``state``; raises ``InvariantViolation`` where
    one fails, and ``TraceError`` where a step does not fit the schema, names
    what does not exist, or could not have been drawn here."""
    names: dict[str, ReqRef | EntryRef | None] = {}
    for index, step in enumerate(steps):
        if step.rule not in _rules() or not callable(getattr(state, step.rule, None)):
            # A harness trace replayed under --caller (or the other way) named a rule
            # "that does not exist for sglang:token": it does, under the other caller (helper-90).
            caller = state.config.caller
            harness = any(callable(getattr(f.lockstep, step.rule, None)) for name, f in FAMILIES.items() if name != "caller")
            callers = "caller" in FAMILIES and callable(getattr(FAMILIES["caller"].lockstep, step.rule, None))
            if (caller == "harness" and callers and not harness) or (caller != "harness" and harness and not callers):
                raise TraceError(f"step {index}: rule {step.rule!r} is not a step of caller {caller} on {state.config.target}:"
                                 f" it is {'a --caller' if caller == 'harness' else 'the harness'}'s own; a trace replays under"
                                 " the caller it was recorded with")
            raise TraceError(f"step {index}: rule {step.rule!r} does not exist for {state.config.target}")
        if (why := state.why_not(step.rule)) is not None:
            raise TraceError(f"step {index}: rule {step.rule} does not run on {state.config.target} here: {why}")
        check_step(step.to_dict(), index, state.config)
        kinds = arg_kinds(step.rule)
        args = {}
        for key, value in step.args.items():
            if kinds[key] in (REQ, ENTRY, REQS):
                refs = [_resolve(index, step.rule, name, names) for name in
                        (decode_names(value) if kinds[key] == REQS else [value])]
                args[key] = refs if kinds[key] == REQS else refs[0]
            else:
                args[key] = value
        if reason := _not_applicable(state, step.rule, args):
            raise StepNotApplicable(f"step {index} ({step_source(step)}) does not apply here: {reason}", index)
        try:
            made = getattr(state, step.rule)(**args)
        except (TypeError, KeyError, IndexError) as exc:
            raise StepNotApplicable(
                f"step {index} ({step.rule}) does not apply here: {type(exc).__name__}: {_one_line(exc)}", index) from None
        if step.returns:
            # A name is the trace's variable for what the step made; the
            # harness may number it differently (the minimiser deletes steps).
            names[step.returns] = made


def replay(trace: Trace, config: Config | None = None) -> InvariantViolation | None:
    """Run the trace's steps again, on its own configuration or ``config``.

    Returns the violation it hits, or ``None`` when every step and the
    teardown check out.
    """
    try:
        state = build(config or trace.config)
        run_steps(state, trace.steps)
        state.teardown()
    except InvariantViolation as exc:
        return exc
    finally:
        disarm_call_timer()
    return None


def _resolve(index: int, rule: str, name: str, names: dict):
    if name not in names:
        raise TraceError(f"step {index} ({rule}) names {name}, which no earlier step created")
    if names[name] is None:
        raise TraceError(f"step {index} ({rule}) names {name}, which its step did not create on this replay")
    return names[name]


# --------------------------------------------------------------------------- #
# Writing


def file_name(trace: Trace) -> str:
    """``LABEL-INVARIANT-HASH.json``: the hash (8 hex digits of SHA-256 over
    the configuration, steps and invariant) keeps different failures apart,
    and the same failure written twice lands on the same name."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", trace.config.label()).strip(".")[:120] or "trace"
    invariant = trace.invariant if trace.invariant and _INVARIANT.fullmatch(trace.invariant) else "passes"
    key = json.dumps(
        {"config": trace.config.to_dict(), "steps": [s.to_dict() for s in trace.steps], "invariant": trace.invariant},
        sort_keys=True,
    )
    return f"{stem}-{invariant}-{hashlib.sha256(key.encode()).hexdigest()[:8]}.json"


_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISDIR, "folder"))


def not_replaceable(path: str | Path, flag: str) -> str | None:
    """Why ``write_atomic`` may not write ``path`` (given as ``flag``), or
    None.  It writes through a temporary and a rename, which would put a
    plain file where a FIFO or a device was (``/dev/null``, as root), and
    opening a FIFO blocks until someone reads it: what is there must be a
    plain file.  A link is followed, and must lead to one or to nothing in
    a folder."""
    real = Path(os.path.realpath(path))
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        if not real.parent.is_dir():
            return f"{flag} {shown(path)}: folder {shown(real.parent)} does not exist"
        return None
    except OSError as exc:
        return f"{flag} {shown(path)}: {exc.strerror or type(exc).__name__}"
    for test, kind in _KINDS:
        if test(mode):
            return f"{flag} {shown(path)} is a {kind}, not a plain file"
    return None


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same
    folder and ``os.replace``: a reader sees the old file or the new one,
    never part of one.  The folder must exist."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write(trace: Trace, trace_dir: str | Path) -> Path:
    """Write ``trace`` into ``trace_dir`` (created if missing) under
    ``file_name(trace)``, atomically; returns its path."""
    directory = Path(trace_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return write_atomic(directory / file_name(trace), trace.to_json() + "\n")
    except OSError as exc:
        raise TraceError(f"cannot write a trace into {shown(directory)}: {exc.strerror or type(exc).__name__}") from None


# What ``write_or_why`` gives for a trace it could not write.
NOT_WRITTEN = "(not written: "


def write_or_why(trace: Trace, trace_dir: str | Path) -> str:
    """``write``'s path, as text; where the trace cannot be written (a disk
    that filled during the run, a folder removed since it began), why, in
    parentheses.  A run reports a failure all the same, its steps printed,
    with no file to replay (a full disk was a harness error's traceback
    over a report naming a trace that did not exist)."""
    try:
        return str(write(trace, trace_dir))
    except TraceError as exc:
        return f"{NOT_WRITTEN}{exc})"


def written(path) -> bool:
    """Whether ``path`` (from ``write_or_why``) names a written trace."""
    return not str(path).startswith(NOT_WRITTEN)


def trace_fields(path) -> dict:
    """``write_or_why``'s answer (or None: none asked) as JSON a tool reads:
    ``trace`` a path or null, ``trace_error`` why it was not written or null
    (the text in ``trace`` was taken for a path)."""
    if path is None or written(path):
        return {"trace": None if path is None else str(path), "trace_error": None}
    return {"trace": None, "trace_error": str(path)[len(NOT_WRITTEN):-1]}
