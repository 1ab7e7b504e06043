"""Rules beyond the core machine, chosen by what the target is.

- ``DecodeRules``: where the target has ``alloc_decode``, a batch of live
  requests grows by one token each;
- ``SWAMachine``: for the "swa" family, windows slide (``free_swa`` of a
  request's oldest tokens) and the cache drops entries' SWA side.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from state_machines.harness.machines import FreeGroupMachine, _pick, picks
from state_machines.harness.swa import SWALockstep


class DecodeRules:
    """Mixed into a machine whose target has ``alloc_decode``."""

    @precondition(lambda self: self.state.live())
    @rule(mask=st.integers(1, 15), order=st.integers(0, 3))
    def decode(self, mask, order):
        s = self.state
        live = s.live()
        # A request that needs a new page needs room for it in its row.
        batch = [
            r for i, r in enumerate(live)
            if mask >> (i % 4) & 1 and (s.room(r) > 0 or not s.model.decode_needs_page(r.rid, s.page_size))
        ]
        if not batch:
            return
        if order == 0:
            # Requests taking a page first: the batch's tail then takes none,
            # the edge where a decode kernel's page index runs past the new pages.
            batch.sort(key=lambda r: not s.model.decode_needs_page(r.rid, s.page_size))
        else:
            k = order % len(batch)
            batch = batch[k:] + batch[:k]
        self._do("decode", s.decode, ",".join(map(repr, batch)))


class SWAMachine(FreeGroupMachine):
    """The core rules over an SWA hybrid pool, plus window slides and SWA-side eviction."""

    @precondition(lambda self: self.state.slidable())
    @rule(which=picks, pages=st.integers(1, 4), segment=st.booleans())
    def slide(self, which, pages, segment):
        s = self.state
        req = _pick(s.slidable(), which)
        self._do("slide", s.slide, req, min(pages, s.live_own(req)), segment=segment)

    @precondition(lambda self: self.state.swa_evictable())
    @rule(which=picks)
    def evict_swa(self, which):
        self._do("evict_swa", self.state.evict_swa, _pick(self.state.swa_evictable(), which))


def base_machine_for(state) -> type[FreeGroupMachine]:
    """The machine class for a built state: by family, with decode where the target has it."""
    base = SWAMachine if isinstance(state, SWALockstep) else FreeGroupMachine
    if state.has_alloc_decode:
        return type(f"Decode{base.__name__}", (DecodeRules, base), {})
    return base
