"""``kv-lockstep replay TRACE --emit-pytest FILE``: a trace as a standalone
pytest file that an allocator's own test suite can commit.

The file drives the target through ``Lockstep``'s public step methods (the
allocator's public API and the ownership model in lockstep, every invariant
checked after each step).  It fails while the bug is there and passes once
it is fixed.  The slots each alloc returned when the file was written appear
as ``torch.tensor([...])`` literals in comments: the model predicts sets,
never order, so the test does not assert them.
"""

from __future__ import annotations

import re
from pathlib import Path

from state_machines.config import Config
from state_machines.harness import InvariantViolation, build
from state_machines.runs.trace import Trace, TraceError, run_steps


def _recorded_allocs(trace: Trace, config: Config) -> list[list[int] | None]:
    """What each alloc step returned on ``config``, in order (None when short)."""
    seen: list[list[int] | None] = []
    state = build(config)
    real_alloc = state.allocator.alloc

    def recording(n):
        out = real_alloc(n)
        seen.append(None if out is None else out.detach().to("cpu").reshape(-1).tolist())
        return out

    state.allocator.alloc = recording
    try:
        run_steps(state, trace.steps)
        state.teardown()
    except (InvariantViolation, TraceError):
        pass
    return seen


def pytest_source(trace: Trace, config: Config, source: str | None = None) -> str:
    """The text of a pytest module that replays ``trace`` on ``config``."""
    invariant = trace.invariant or "every invariant"
    name = re.sub(r"\W+", "_", f"test_{invariant}_regression").lower()
    allocs = iter(_recorded_allocs(trace, config))
    body = []
    for index, step in enumerate(trace.steps):
        line = step.call_text()
        if step.rule == "alloc":
            got = next(allocs, None)
            line += f"  # returned torch.tensor({got})" if got is not None else "  # returned None"
        if index == len(trace.steps) - 1 and trace.invariant:
            line += f"  # broke {trace.invariant} when recorded"
        body.append("        " + line)
    body.append("        state.teardown()")
    build = ", ".join(f"{k}={v!r}" for k, v in config.to_dict().items() if v != Config().to_dict()[k] or k == "target")
    detail = (trace.detail or "").replace('"""', "'''")
    return f'''"""Regression test written by `kv-lockstep replay --emit-pytest`{f" from {Path(source).name}" if source else ""}.

When recorded, the last step broke `{invariant}`:
    {detail}

It fails while that bug is present and passes once it is fixed.  Run it
with pytest where kv-lockstep is installed (`pip install kv-lockstep`).
"""

import pytest
import torch  # noqa: F401  (the comments' tensor literals are valid Python)

from state_machines.harness import InvariantViolation, build


def {name}():
    """The recorded {len(trace.steps)} steps keep every invariant, `{invariant}` included."""
    state = build({build})
    try:
{chr(10).join(body)}
    except InvariantViolation as exc:
        pytest.fail(
            f"{{exc.invariant}} at step {{len(exc.steps) - 1}}: {{exc.detail}}"
            " (this trace broke {invariant} when recorded)",
            pytrace=False,
        )
'''


def write_pytest(trace: Trace, config: Config, path: str | Path, source: str | None = None) -> Path:
    """Write the pytest file; returns its path."""
    path = Path(path)
    text = pytest_source(trace, config, source)
    compile(text, str(path), "exec")  # never write a file that is not Python
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
