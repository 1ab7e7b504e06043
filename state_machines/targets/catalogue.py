"""The configurations the suite runs: every built-in target, every mutant."""

import allocators
from state_machines.config import Config
from state_machines.targets import builtin_page_sizes


def _token_only(name):
    return builtin_page_sizes(name) == (1,)


def _page_sizes(name):
    # Page size 2 too where alloc_extend runs: a page's partial fills differ most there.
    cls = allocators.BUILTINS[name][0]
    if getattr(cls, "page_sizes", None):
        return cls.page_sizes
    return (1, 2, 4) if hasattr(cls, "alloc_extend") else (1, 4)


def clean_configs():
    """Every built-in target at page sizes 1 and 4 (and 2 where it has
    ``alloc_extend``), need_sort off and on."""
    for name in sorted(allocators.BUILTINS):
        for page_size in _page_sizes(name):
            if _token_only(name) and page_size != 1 or page_size < getattr(allocators.BUILTINS[name][0], "min_page_size", 1):
                continue
            for need_sort in (False, True):
                yield Config(target=f"builtin:{name}", page_size=page_size, need_sort=need_sort)


def mutant_configs():
    """Every mutant of every built-in target, under the settings it needs."""
    for name, (cls, mutants) in sorted(allocators.BUILTINS.items()):
        for mutant in mutants.values():
            page_size = mutant.needs.get("page_size", 1 if _token_only(name) else 4)
            yield Config(
                target=f"builtin:{name}",
                mutant=mutant.name,
                page_size=page_size,
                need_sort=mutant.needs.get("need_sort", False),
                size=mutant.needs.get("size"),
                row_dtype=mutant.needs.get("row_dtype", "int32"),
            )
