#!/usr/bin/env python
"""Smoke-test one sglang release's allocators through state_machines.sglang_targets.

    .venv/bin/python scripts/sglang_smoke.py --sglang-path .sglang/0.5.23

For the token (page_size 1) and paged (page_size 4) allocators it runs two
short free-group scenarios and prints which pages ended up free:

  aliasing: alloc A and B; put A in a request row; free_group_begin();
            free(row view of A); overwrite the row with B; free_group_end().
            Correct: A's pages come back.  Aliasing bug: B's pages do
            (the deferred free kept the view, not the values).
  repeat-end: alloc C; free_group_begin(); free(C); free_group_end();
            free_group_end() again.  Correct: C's pages are free once.
            Flag drift: the second end frees C again (duplicates in the census).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from state_machines import sglang_targets as st  # noqa: E402


def pages_of(idx, ps: int) -> list[int]:
    return sorted({int(x) // ps for x in idx})


def new_free(before: list[int], after: list[int]) -> list[int]:
    """Page ids the census gained (multiset difference, so a page freed twice shows twice)."""
    gained = Counter(after) - Counter(before)
    return sorted(gained.elements())


def aliasing(make, ps: int) -> tuple[str, bool]:
    import torch

    a = make()
    n = 2 * ps
    A = a.alloc(n)
    B = a.alloc(n)
    row = torch.zeros(4 * ps, dtype=torch.int64)
    row[:n] = A
    before = st.free_census(a)
    a.free_group_begin()
    a.free(row[:n])
    row[:n] = B  # the request row is reused before the group ends
    a.free_group_end()
    freed = new_free(before, st.free_census(a))
    pa, pb = pages_of(A, ps), pages_of(B, ps)
    if freed == pa:
        verdict, bad = "ok (freed A)", False
    elif freed == pb:
        verdict, bad = "ALIASING: freed the overwritten values B, A leaked, live B now free", True
    else:
        verdict, bad = "unexpected", True
    return f"A pages {pa}, B pages {pb}; freed {freed} -> {verdict}", bad


def repeat_end(make, ps: int) -> tuple[str, bool]:
    a = make()
    C = a.alloc(2 * ps)
    before = st.free_census(a)
    a.free_group_begin()
    a.free(C)
    a.free_group_end()
    after_one = new_free(before, st.free_census(a))
    try:
        a.free_group_end()
        second = "returned"
    except AssertionError as exc:
        second = f"AssertionError({exc})"
    after_two = new_free(before, st.free_census(a))
    dups = sorted(p for p, k in Counter(st.free_census(a)).items() if k > 1)
    bad = after_two != after_one or bool(dups)
    verdict = f"DOUBLE FREE: duplicated free pages {dups}" if bad else "ok (no change)"
    return (
        f"C pages {pages_of(C, ps)}; freed after 1st end {after_one}, "
        f"after 2nd end ({second}) {after_two} -> {verdict}"
    ), bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sglang-path", default=None, help="directory holding sglang/ (e.g. .sglang/0.5.23)")
    ap.add_argument("--size", type=int, default=32, help="pool size in tokens")
    ap.add_argument("--page-size", type=int, default=4, help="page size for the paged allocator")
    args = ap.parse_args(argv)

    try:
        info = st.load_sglang(args.sglang_path)
    except st.TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"sglang {info.version} from {info.path} (torch {info.torch_version})")
    print(f"  importable: {', '.join(info.kinds())}"
          + "".join(f"; {k} unavailable: {r}" for k, r in info.unavailable.items()))

    findings = 0
    for kind, ps in (("token", 1), ("paged", args.page_size)):
        fac = st.factory(kind)

        def make(fac=fac, ps=ps):
            return fac(args.size, ps, "cpu", False)

        print(f"[{kind} page_size={ps}] capabilities {json.dumps(st.describe_capabilities(make()))}")
        for name, scenario in (("aliasing", aliasing), ("repeat-end", repeat_end)):
            line, bad = scenario(make, ps)
            findings += bad
            print(f"[{kind} page_size={ps}] {name}: {line}")
    print(f"sglang {info.version}: {findings} finding(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
