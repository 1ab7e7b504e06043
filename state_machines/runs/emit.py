"""``kv-lockstep replay TRACE --emit-pytest FILE``: a trace as a standalone
pytest file that an allocator's own test suite can commit.

The file drives the target through ``Lockstep``'s public step methods (the
allocator's public API and the ownership model in lockstep, every invariant
checked after each step).  It fails while the bug is there and passes once
it is fixed.  The slots each alloc returned when the file was written appear
as ``torch.tensor([...])`` literals in comments: the model predicts sets,
never order, so the test does not assert them.

A trace is data: the file is written from checked steps only (known rule
and argument names, numbers, request and entry names), and every piece of
the trace's text (its file name, invariant, detail) appears only inside a
string literal written by ``repr()``, never in a docstring or comment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import time
from pathlib import Path

import attrs

from state_machines.config import Config
from state_machines.harness import InvariantViolation, build
from state_machines.runs.trace import (
    Trace,
    TraceError,
    check_config,
    counted,
    not_replaceable,
    run_steps,
    shown,
    step_source,
    write_atomic,
)


def _recorded_allocs(trace: Trace, config: Config) -> dict[int, list[int] | None]:
    """What ``alloc()`` returned on ``config``, by the index of the step that
    called it (None when short).  Decode and extend call it too at page
    size 1; only alloc steps' returns are shown.

    A step that does not apply raises ``TraceError``: no file is written."""
    seen: dict[int, list[int] | None] = {}
    state = build(config)
    real_alloc = state.allocator.alloc

    def recording(n):
        out = real_alloc(n)
        # The seam records a step before it runs: the last one is the caller.
        index = len(state.steps) - 1
        try:
            seen[index] = None if out is None else [int(x) for x in out.detach().to("cpu").reshape(-1).tolist()]
        except Exception:  # noqa: BLE001 - not a tensor of slot ids: the harness reports that
            seen[index] = None
        return out

    state.allocator.alloc = recording
    try:
        run_steps(state, trace.steps)
        state.teardown()
    except InvariantViolation:
        pass
    return seen


def _comment(text: str) -> str:
    """Text fit for a ``#`` comment: no newline, backslash or quote survives."""
    return re.sub(r"[^A-Za-z0-9_ ,.()\[\]=-]", "", text)


def pytest_source(trace: Trace, config: Config, source: str | None = None, recorded: bool = True) -> str:
    """The text of a pytest module that replays ``trace`` on ``config``.
    With ``recorded``, the steps run here once first, so that each alloc's
    comment shows what it returned; without, no target code runs here and
    alloc steps carry no such comment."""
    trace = trace.checked()  # TraceError unless every part fits the schema
    config = check_config(config.to_dict(), "the replay's config")
    if config.sglang_path is not None:  # the file runs from any folder (pytest's, CI's)
        config = attrs.evolve(config, sglang_path=os.path.abspath(config.sglang_path))
    invariant = trace.invariant  # [a-z_]{1,64} or None, checked
    name = f"test_{invariant or 'every_invariant'}_regression"
    allocs = _recorded_allocs(trace, config) if recorded else None
    body = []
    for index, step in enumerate(trace.steps):
        line = step_source(step)
        if step.rule == "alloc" and allocs is not None:
            got = allocs.get(index)
            line += "  # " + _comment(f"returned torch.tensor({got})" if got is not None else "returned None")
        if index == len(trace.steps) - 1 and invariant:
            line += "  # " + _comment(f"broke {invariant} when recorded")
        body.append("    " + line)
    body.append("    state.teardown()")
    # A --caller trace builds the real caller: its family registers on import.
    register = "\nimport state_machines.callers  # noqa: F401  (registers the --caller family)" if config.caller != "harness" else ""
    defaults = Config().to_dict()
    build_args = ", ".join(f"{k}={v!r}" for k, v in config.to_dict().items() if v != defaults[k] or k == "target")
    text = f'''"""Regression test written by `kv-lockstep replay --emit-pytest`.

It replays a recorded trace (RECORDED_FROM below) step by step and fails
while the bug it caught is present; it passes once the bug is fixed.  Run it
with pytest where kv-lockstep is installed (`pip install kv-lockstep`).
"""

import torch  # noqa: F401  (the comments' tensor literals are valid Python)

from state_machines.harness import build{register}
from state_machines.runs.emit import replay_apart

# What the trace recorded, as data.
RECORDED_FROM = {(Path(source).name if source else None)!r}
RECORDED_INVARIANT = {invariant!r}
RECORDED_DETAIL = {trace.detail!r}


def _steps():
    state = build({build_args})
{chr(10).join(body)}


def {name}():
    """The recorded {counted(len(trace.steps), "step")} keep every invariant, RECORDED_INVARIANT included.

    They run in a child process (``replay_apart``): an allocator that
    exits, crashes or hangs fails this test, not the whole session."""
    replay_apart(_steps, RECORDED_INVARIANT, limit_s={_limit_s(config, len(trace.steps))!r}, apart={config.device == "cpu"!r})
'''
    try:
        compile(text, "<emitted>", "exec")  # never write a file that is not Python
    except SyntaxError as exc:
        raise TraceError(f"cannot write this trace as Python: {exc.msg} at line {exc.lineno}") from None
    return text


def write_pytest(trace: Trace, config: Config, path: str | Path, source: str | None = None, recorded: bool = True) -> Path:
    """Write the pytest file atomically, through a link to where it leads;
    its folder must exist.  Returns the path given.  ``recorded``: as
    ``pytest_source``'s."""
    text = pytest_source(trace, config, source, recorded)
    if why := not_replaceable(path, "--emit-pytest"):
        raise TraceError(why)
    given, path = Path(path), Path(os.path.realpath(path))
    try:
        write_atomic(path, text)
        return given
    except OSError as exc:
        raise TraceError(f"--emit-pytest {shown(given)}: cannot write: {exc.strerror or type(exc).__name__}") from None


def _limit_s(config: Config, steps: int) -> float:
    """How long an emitted test waits for its steps: each call may take the
    per-call limit (SIGALRM cuts it short in the child), so a wait past
    twice that per step, the build and teardown included, and a margin is
    a hang SIGALRM could not stop."""
    return round(2 * config.call_timeout_s * (steps + 2) + 5, 1)


def replay_apart(steps, recorded_invariant: str | None, limit_s: float, apart: bool = True) -> None:
    """Run ``steps()`` (an emitted file's build and steps) in a forked
    child and fail the calling test as the steps failed there: an
    invariant broken (as the in-process test reported it), the child
    ended by the allocator before it said how the steps went (``os._exit``,
    with any code, 0 included; a crash: in pytest's own process it ended
    the whole session, silently, exit 3), or the child still running after
    ``limit_s`` (a hang SIGALRM cannot stop hung the session): its process
    group is killed.  The child is waited for, not its pipe, which a
    process the steps start can hold open.  In this process where there is
    no fork, or ``apart`` is false (a device trace: a device runtime does
    not survive a fork)."""
    import pytest

    if not apart or not hasattr(os, "fork"):
        try:
            steps()
        except InvariantViolation as exc:
            pytest.fail(_broke(exc.invariant, len(exc.steps) - 1, exc.detail, recorded_invariant), pytrace=False)
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, which leaves by os._exit alone
        try:
            os.setpgid(0, 0)  # its own group: a hang is killed with whatever it started
            os.close(read)
            try:
                steps()
                said = {"passed": True}
            except InvariantViolation as exc:
                said = {"invariant": exc.invariant, "step": len(exc.steps) - 1, "detail": exc.detail}
            except BaseException:  # noqa: BLE001 - a harness error, told to the test
                import traceback

                said = {"error": traceback.format_exc()}
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(said))
        finally:
            os._exit(0)
    os.close(write)
    os.set_blocking(read, False)
    got, status, deadline = b"", None, time.monotonic() + limit_s
    try:
        while status is None:
            got += _drain(read)
            done, waited = os.waitpid(pid, os.WNOHANG)
            if done:
                status = waited
            elif time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the steps did not end within {limit_s:g} s: a hang SIGALRM could not stop"
                            f"{_recorded(recorded_invariant)}", pytrace=False)
            else:
                select.select([read], [], [], 0.05)
        got += _drain(read)
    finally:
        os.close(read)
    said = json.loads(got) if got.startswith(b"{") and got.endswith(b"}") else {}
    if said.get("passed"):
        return
    if "invariant" in said:
        pytest.fail(_broke(said["invariant"], said["step"], said["detail"], recorded_invariant), pytrace=False)
    if "error" in said:
        pytest.fail(f"the harness raised in the child:\n{said['error']}", pytrace=False)
    code = os.waitstatus_to_exitcode(status)
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    with contextlib.suppress(ValueError):
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else how
    pytest.fail(f"the process running the steps {how} before they ended: the allocator ended it"
                f"{_recorded(recorded_invariant)}", pytrace=False)


def _drain(fd: int) -> bytes:
    """What non-blocking ``fd`` holds now."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def _broke(invariant: str, step: int, detail: str, recorded_invariant: str | None) -> str:
    return f"{invariant} at step {step}: {detail}{_recorded(recorded_invariant)}"


def _recorded(invariant: str | None) -> str:
    return f" (this trace broke {invariant} when recorded)" if invariant else " (the trace recorded no failure)"
