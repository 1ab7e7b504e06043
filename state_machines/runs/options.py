"""What a run's options open: a ``--duration``, an example database, and the
multiprocessing context workers start in.  Shared by plain runs
(``watchdog``) and long runs (``longrun``)."""

from __future__ import annotations

import multiprocessing
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




def worker_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # Import torch and the harness once in the server, not once per worker.
        ctx.set_forkserver_preload(["state_machines.runs.runner", "state_machines.runs.watchdog"])
        return ctx
    return multiprocessing.get_context("spawn")


