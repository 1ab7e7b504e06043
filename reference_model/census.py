"""The allocator's free list as the checks read it: one read per step.

``Census`` holds the free pages one census returned, with repeats, and
answers the questions the invariants ask of it (``invariants.CHECKS``); each
answer is computed at most once per census, so a step builds at most one
set of the free pages, whatever number of checks read it.  Plain Python, no
torch: a harness may hand the checks a subclass that answers the same
questions with the same values faster (the allocator harness's tensor
census), never a different answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator


class Census:
    """The free pages one census listed, in its order, with repeats."""

    def __init__(self, pages: Iterable[int]):
        self._pages = pages if isinstance(pages, list) else list(pages)
        self._distinct: set[int] | None = None

    @property
    def pages(self) -> list[int]:
        """Every page listed, in the census's order, with repeats."""
        return self._pages

    def __len__(self) -> int:
        return len(self.pages)

    def __iter__(self) -> Iterator[int]:
        return iter(self.pages)

    def distinct(self) -> set[int]:
        """The pages listed, each once (the step's one set; do not mutate)."""
        if self._distinct is None:
            self._distinct = set(self.pages)
        return self._distinct

    def num_distinct(self) -> int:
        """``len(set(pages))``."""
        return len(self.distinct())

    def repeats(self) -> list[int]:
        """The pages listed more than once, sorted; empty when none is."""
        if len(self.pages) == self.num_distinct():
            return []
        return sorted(p for p, n in Counter(self.pages).items() if n > 1)

    def lists_free_of(self, model) -> bool:
        """Whether the pages listed are exactly the model's free pages:
        ``set(pages) == model.free_pages`` (repeats allowed)."""
        return self.distinct() == model.free

    def within(self, model) -> bool:
        """Whether every page listed is one of the model's pool pages:
        ``set(pages) <= model.owner.keys()``."""
        return self.distinct() <= model.owner.keys()

    def change(self, model) -> tuple[list[int], list[int]]:
        """Against the model's free pages, each sorted: those not listed,
        and the pages listed that are not free in the model (what a step
        the model has not followed yet took and gave back)."""
        listed = self.distinct()
        return sorted(model.free - listed), sorted(listed - model.free)


def as_census(census: Census | Iterable[int]) -> Census:
    """``census`` itself, or a ``Census`` of the page list it is."""
    return census if isinstance(census, Census) else Census(census)
