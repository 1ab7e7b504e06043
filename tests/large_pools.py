"""Shared by the fast-path tests (``test_mirrors``, ``test_twins``): the
configurations at a pool the fast paths read, a fuzz run on one that must
show each mutant's failure, and tables a bijection builds.

Not named ``test_*``: it holds no tests.
"""

import random

from allocators import BUILTINS
from bench.baseline import random_fuzz
from state_machines.config import Config
from state_machines.harness import build
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES
from state_machines.targets.base import TargetError


def configs(families: dict[str, tuple[int, ...]]):
    """Each built-in target of ``families`` (name -> the page sizes to try)
    and each of its mutants, at the first of those page sizes that shows
    its bug, with twice the pages the fast paths start at."""
    for family, page_sizes in families.items():
        for mutant in (None, *BUILTINS[family][1]):
            for ps in page_sizes:
                config = Config(target=f"builtin:{family}", mutant=mutant, page_size=ps,
                                size=2 * TENSOR_CENSUS_PAGES * ps)
                try:
                    build(config)
                except TargetError:
                    continue
                yield config
                break


# The mutants whose failure needs a pool filled (or emptied) to its edge,
# which requests of 4 rows of 12 pages never bring about at these pools:
# each runs on, and its states reach the fast paths, but it shows nothing.
QUIET_AT_LARGE_POOLS = {
    ("builtin:unified-swa", "full-queue-not-flushed"),
    ("builtin:unified-swa", "admission-ignores-swa"),
    ("builtin:unified-swa", "clear-keeps-swa"),
    ("builtin:unified-mamba", "bytes-not-shared"),
    ("builtin:multi-ended", "clear-keeps-free-ids"),
    ("builtin:hisparse", "short-leaks"),
}


def fuzz(config: Config):
    """``random_fuzz`` on ``config``, seeded by its name: a mutant for 20
    examples (most show by then at these pools), a built-in target for 3.
    A target must run clean (a false alarm fails here), and each mutant not
    in ``QUIET_AT_LARGE_POOLS`` must fail (a fast path that hid it fails
    here), so the states that break an invariant reach the fast paths;
    those in it must not, so the list names only what these pools hide."""
    outcome = random_fuzz(config, seed=random.Random(str(config)).randrange(100), max_examples=20 if config.mutant else 3)
    if config.mutant is None:
        assert outcome.ok, outcome.failure
    elif (config.target, config.mutant) not in QUIET_AT_LARGE_POOLS:
        assert not outcome.ok, f"{config.mutant} showed nothing in {outcome.record.examples} examples"
    else:
        # The list stays exact: one that shows now is a mutant these tests check, off the list.
        assert outcome.ok, f"{config.mutant} shows at a large pool now: take it off QUIET_AT_LARGE_POOLS"
    return outcome


def bijection(v2p: list[int], p2v: list[int], pairs, corrupt) -> None:
    """Map each (virtual, physical) of ``pairs`` both ways, where the tables
    reach (v2p's last row is a sentinel), then write each ``corrupt``
    (in v2p?, index, value) into one table."""
    for v, p in pairs:
        if v < len(v2p) - 1:
            v2p[v] = p
            if p < len(p2v):
                p2v[p] = v
    for in_v2p, at, value in corrupt:
        table = v2p if in_v2p else p2v
        table[at % len(table)] = value
