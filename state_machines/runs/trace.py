"""Traces: the steps of a failing run, as JSON and as a program to replay."""

from __future__ import annotations

import json
import re
from pathlib import Path

from attrs import frozen

from state_machines.config import Config
from state_machines.harness import InvariantViolation, Lockstep, Step
from state_machines.harness.steps import BadStep, steps_of

FORMAT = "kv-lockstep-trace/1"


class TraceError(Exception):
    """A trace file that cannot be read; the CLI prints it on one line, exit 2."""


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

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "config": self.config.to_dict(),
                "steps": [s.to_dict() for s in self.steps],
                "failure": {"step": len(self.steps) - 1, "invariant": self.invariant, "detail": self.detail},
            },
            indent=1,
        )

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            steps = tuple(Step(s["rule"], dict(s["args"]), s.get("returns")) for s in data["steps"])
            failure = data.get("failure") or {}
            return cls(Config.from_dict(data["config"]), steps, failure.get("invariant"), failure.get("detail"))
        except OSError as exc:
            raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TraceError(f"cannot read trace {path}: {type(exc).__name__}: {exc}") from None

    def program(self) -> str:
        """The steps as Python that runs them again after ``from
        state_machines.harness import build``, Hypothesis style; the failing
        step, the last, carries the invariant it broke."""
        cfg = {k: v for k, v in self.config.to_dict().items() if v != Config().to_dict()[k] or k == "target"}
        lines = [f"state = build({', '.join(f'{k}={v!r}' for k, v in cfg.items())})"]
        lines += [step.call_text() for step in self.steps]
        if self.invariant:
            lines[-1] += f"  # fails: {self.invariant}"
        else:
            lines.append("state.teardown()")
        return "\n".join(lines)


def run_steps(state: Lockstep, steps) -> None:
    """Apply recorded steps to ``state``; raises ``InvariantViolation`` where
    one fails, and ``TraceError`` where a step does not fit its declaration
    or names what does not exist."""
    names: dict[str, object] = {}
    declared = steps_of(type(state))
    for index, step in enumerate(steps):
        spec = declared.get(step.rule) if isinstance(step.rule, str) else None
        if spec is None:
            known = ", ".join(sorted(declared))
            raise TraceError(f"step {index} has rule {step.rule!r:.40}, which this target's harness has not (it has {known})")
        if step.rule in state.disabled_rules:
            raise TraceError(f"step {index} ({step.rule}) cannot run on this target: {state.disabled_rules[step.rule]}")
        try:
            args = spec.resolve(step.args, names)
        except BadStep as exc:
            raise TraceError(f"step {index}: {exc}") from None
        try:
            made = getattr(state, step.rule)(**args)
        except (TypeError, KeyError, IndexError, AttributeError, RuntimeError, ValueError) as exc:
            # The harness's own bookkeeping refused the step: it does not fit this state.
            raise TraceError(f"step {index} ({step.rule}) does not apply here: {type(exc).__name__}: {exc}") from None
        if step.returns:
            names[step.returns] = made


def write(trace: Trace, trace_dir: str | Path) -> Path:
    directory = Path(trace_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", trace.config.label())
    path = directory / f"{stem}-{trace.invariant}.json"
    path.write_text(trace.to_json() + "\n")
    return path
