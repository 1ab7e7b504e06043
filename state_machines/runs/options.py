"""What a run's options open: a ``--duration``, an example database, the
output paths (checked before any run), and the multiprocessing context
workers start in.  Shared by plain runs (``watchdog``), long runs
(``longrun``) and the coverage runner (``cover``)."""

from __future__ import annotations

import multiprocessing
import os
import re
import tempfile
from pathlib import Path


class BadOption(ValueError):
    """A long-run option the user must mend (one line, exit 2)."""


_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """``20s``, ``10m``, ``2h``, ``1.5h`` or plain seconds, as seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise BadOption(f"--duration {text!r}: give a positive time like 20s, 10m or 2h")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def open_database(spec: str | None):
    """The Hypothesis example database ``spec`` names: a directory or ``redis://HOST:PORT[/DB]``."""
    if spec is None:
        return None
    if spec.startswith(("redis://", "rediss://")):
        try:
            import redis
        except ImportError:
            raise BadOption(f"--db {spec} needs the redis package: pip install 'kv-lockstep[redis]'") from None
        from hypothesis.extra.redis import RedisExampleDatabase

        client = redis.Redis.from_url(spec, socket_connect_timeout=5)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise BadOption(f"--db {spec}: cannot reach Redis ({exc}); start redis-server or fix the address") from None
        return RedisExampleDatabase(client)
    from hypothesis.database import DirectoryBasedExampleDatabase

    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise BadOption(f"--db {spec} is a file; give a directory (created if missing) or redis://HOST:PORT")
    return DirectoryBasedExampleDatabase(str(path))




# Workers per core a long run may start.  More only share the cores: 200 on
# 2 cores took 84 s to end a 3-s run, and 1,000 reported correct allocators
# as worker_died.
JOBS_PER_CORE = 32
# Files the command holds open per worker (its pipe's end, its process's
# sentinel, its beacon: 9 + 5 per worker seen), and a margin for the fork
# server and the pipes a start opens for a moment (under `ulimit -n 40`,
# -j 3 ran and -j 8 did not; under 56, -j 8 ran).
FILES_PER_WORKER, FILES_MARGIN = 5, 8


def check_jobs(jobs: int, cores: int) -> None:
    """Refuse ``-j`` beyond what this machine can hold; raise the soft limit
    on open files where the hard one allows what the workers need."""
    if jobs > JOBS_PER_CORE * cores:
        raise BadOption(f"-j {jobs}: at most {JOBS_PER_CORE * cores} here ({JOBS_PER_CORE} per core, {cores} core(s));"
                        " more workers only share the cores")
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to ask
        return
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 16
    need = open_now + FILES_PER_WORKER * jobs + FILES_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard == resource.RLIM_INFINITY or need <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
        except (OSError, ValueError):
            pass
    fewer = "give fewer workers, or raise the limit" if jobs > 1 else "raise the limit"
    raise BadOption(f"-j {jobs} needs about {need} open files, and this process may open {soft} (ulimit -n): {fewer}")


def worker_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # Import torch and the harness once in the server, not once per
        # worker; first, set SIGINT aside there (``forkserver_start``).
        ctx.set_forkserver_preload(["state_machines.runs.forkserver_start", "state_machines.runs.runner",
                                    "state_machines.runs.watchdog"])
        return ctx
    return multiprocessing.get_context("spawn")


def check_output_paths(trace_dir: str | None = None, stats_json: str | None = None, emit_pytest: str | None = None,
                       db: str | None = None, lines_json: str | None = None) -> None:
    """Output paths that cannot be written are bad input, found before any
    run: not after a failure has been shrunk.  So is a ``--db`` folder
    (Hypothesis's database drops what it cannot save without a word, and a
    run that found failures saved none for the next to replay)."""
    from state_machines.runs.trace import not_replaceable

    for value, flag in ((stats_json, "--stats-json"), (emit_pytest, "--emit-pytest"), (lines_json, "--lines-json")):
        if value is not None:
            check_file(value, flag)
            if why := not_replaceable(value, flag):
                raise BadOption(why)
            if os.path.islink(value):  # written through it, into the folder it leads to
                check_file(os.path.realpath(value), flag)
    if db is not None and not db.strip():
        raise BadOption("--db is empty: give a folder (created if missing) or redis://HOST:PORT")
    if trace_dir is not None:  # last but --db: its probe makes the folder
        check_folder(trace_dir, "--trace-dir")
        # Where each failure's first example goes at once, before shrinking.
        check_folder(str(Path(trace_dir) / "unshrunk"), "--trace-dir")
    if db is not None and not db.startswith(("redis://", "rediss://")):
        check_folder(db, "--db")  # made too: a run refused for its trace folder leaves none behind


def check_folder(value: str, flag: str) -> None:
    from state_machines.runs.trace import shown

    if not value.strip():  # Path("") is the current folder: traces went there without a word
        raise BadOption(f"{flag} is empty: give a folder (created if missing)")
    path, value = Path(value), shown(value)
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise BadOption(f"{flag} {value}: cannot write in that folder")
        _try_writing(path, flag, value)
        return
    if os.path.lexists(path):
        raise BadOption(f"{flag} {value} is a file, not a folder")
    existing = path.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadOption(f"{flag} {value} cannot be created: {shown(existing)} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadOption(f"{flag} {value} cannot be created: cannot write in {shown(existing)}")
    _try_writing(path, flag, value)


def _try_writing(folder: Path, flag: str, value: str) -> None:
    """Write and remove a file in ``folder``, creating it as a run would:
    ``os.access`` says yes to root wherever the mode would let root write
    (``/proc``, say), where writing then fails.  A folder made here is kept
    (the run writes there); removing it could pull it from under another
    run sharing it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kv-lockstep-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadOption(f"{flag} {value}: cannot write there: {exc.strerror or type(exc).__name__}") from None


def check_file(value: str, flag: str) -> None:
    from state_machines.runs.trace import shown

    if not value.strip():  # Path("") is the current folder: "--emit-pytest  is a folder"
        raise BadOption(f"{flag} is empty: give a file")
    path, value = Path(value), shown(value)
    if path.is_dir():
        raise BadOption(f"{flag} {value} is a folder, not a file")
    if not path.parent.is_dir():
        raise BadOption(f"{flag} {value}: folder {shown(path.parent)} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise BadOption(f"{flag} {value}: cannot write in {shown(path.parent)}")
    _try_writing(path.parent, flag, value)
