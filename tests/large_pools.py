"""Shared by the fast-path tests (``test_mirrors``, ``test_twins``): the
configurations at a pool the fast paths read, and tables a bijection builds.

Not named ``test_*``: it holds no tests.
"""

from allocators import BUILTINS
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
