"""Rule bodies the pure-SWA and HiSparse machines share with the core's,
narrowed: which requests a rule may pick, which cache entries it may use."""

from __future__ import annotations

from typing import Callable

from state_machines.harness.machines import _pick


def rematch_among(machine, reqs: list, which: int, dup: int, entry: int, donor_ok: Callable | None = None) -> None:
    """The core ``rematch`` rule over ``reqs`` only, and over the cache
    entries ``donor_ok(req, entry)`` allows (all, when None)."""
    s = machine.state
    req = _pick(reqs, which)
    dup = min(dup, len(s.model.requests[req.rid].own))
    donors = [
        e for e in s.entries()
        if len(s.model.cache[e.eid].pages) >= dup and (donor_ok is None or donor_ok(req, e))
    ] if dup else []
    if not donors:
        dup = 0
    machine._do("rematch", req, dup, _pick(donors, entry) if donors else None)
