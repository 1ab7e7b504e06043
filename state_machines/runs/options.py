"""What a run's options open: a ``--duration``, an example database, and the
multiprocessing context workers start in.  Shared by plain runs
(``watchdog``) and long runs (``longrun``)."""

from __future__ import annotations

import multiprocessing
import os
import re
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
        # Import torch and the harness once in the server, not once per worker.
        ctx.set_forkserver_preload(["state_machines.runs.runner", "state_machines.runs.watchdog"])
        return ctx
    return multiprocessing.get_context("spawn")


