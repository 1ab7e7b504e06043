"""Older SWA contracts run clean on the SWA harness; their real bug does not.

``OlderSWA`` follows the contract of earlier sglang SWA allocators: no
``free_full`` or segment forms (``free()`` skips slots that map to nothing),
``free_swa()`` releases at once even inside a free group, and a queued
``free()`` keeps its full-to-SWA mapping until ``free_group_end()``.
"""

import torch

from allocators.swa import SWAAllocator
from state_machines.config import Config
from state_machines.runs.runner import fuzz


class OlderSWA(SWAAllocator):
    """SWA allocator with the older contract (see the module docstring)."""

    free_full = None
    free_segment = None
    free_full_segment = None
    free_swa_segment = None
    # Nor the batched segment frees of 0.5.19 on.
    free_segments = None
    free_full_segments = None

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._queued(free_index))
            return
        self._free_now(free_index)

    def _queued(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index.clone()

    def _free_now(self, free_index: torch.Tensor) -> None:
        self.full_attn_allocator.free(free_index)
        self._release_swa(self._take_mapping(free_index))

    def free_swa(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self._release_swa(self._take_mapping(free_index))

    def free_group_begin(self) -> None:
        self.free_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self._free_now(torch.cat(pending))


class OlderSWAQueuesViews(OlderSWA):
    """Mutant: the group queue keeps the caller's row view."""

    def _queued(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index


def _config(name: str, page_size: int) -> Config:
    return Config(target=f"tests.test_swa_variants:{name}", page_size=page_size)


def test_older_swa_contract_runs_clean():
    """Immediate free_swa in a group, a mapping kept until end and no free_full raise no false alarm."""
    for page_size in (1, 4):
        outcome = fuzz(_config("OlderSWA", page_size))
        assert outcome.ok, [f"{t.invariant}: {t.detail}\n{t.program()}" for t in outcome.failures]


def test_older_swa_queuing_views_is_caught():
    """The same contract with a queue of row views fails on the freed sets."""
    outcome = fuzz(_config("OlderSWAQueuesViews", 1))
    invariants = {t.invariant for t in outcome.failures}
    # The queued view is read after the row changed: end() frees what the row
    # holds then (the padding slot, once per queued slot), not what was freed.
    assert invariants and invariants <= {"free_sets_agree", "no_page_freed_twice"}, invariants
