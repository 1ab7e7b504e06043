"""Where the release's own scheduler opens free groups.

A free group changes what a free means (it is queued until
``free_group_end()``), so a caller bug can need one to show.  sglang's
scheduler processes every decode result inside a group; prefill results only
from 0.5.18 on (sglang PR 33475).  Rather than trust a version string, this
reads the release's scheduler source: does ``process_batch_result_prefill``
(and ``..._decode``) call ``free_group_begin()``?  ``--groups all`` forces a
group around both, to gate a release against the scheduler it will meet
next; ``--groups none`` around neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

from attrs import frozen

from state_machines.targets.base import TargetError

GROUPS = ("release", "all", "none")
# Where sglang's releases keep the result processors, newest first.
_SOURCES = (
    "sglang/srt/managers/scheduler_components/batch_result_processor.py",
    "sglang/srt/managers/scheduler_output_processor_mixin.py",
)


@frozen
class Site:
    """One result processor: whether it opens a group, and where it says so."""

    grouped: bool
    where: str  # file:line of the function, relative to the sglang folder

    def describe(self) -> str:
        return f"{'in a free group' if self.grouped else 'outside any free group'} ({self.where})"


@frozen
class Placement:
    """Whether prefill and decode results are processed inside a group."""

    prefill: bool
    decode: bool

    def label(self) -> str:
        return f"prefill {'grouped' if self.prefill else 'ungrouped'}, decode {'grouped' if self.decode else 'ungrouped'}"


@frozen
class ReleasePlacement:
    prefill: Site
    decode: Site

    @property
    def placement(self) -> Placement:
        return Placement(self.prefill.grouped, self.decode.grouped)


def _opens_group(fn: ast.FunctionDef) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "free_group_begin"
        for node in ast.walk(fn)
    )


def read_release(sglang_dir: str | Path) -> ReleasePlacement:
    """Read ``process_batch_result_prefill`` / ``_decode`` of the release in
    ``sglang_dir`` (the folder holding ``sglang/``); ``TargetError`` when
    neither file has them."""
    root = Path(sglang_dir)
    for rel in _SOURCES:
        path = root / rel
        if not path.is_file():
            continue
        found = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name in ("process_batch_result_prefill", "process_batch_result_decode"):
                found[node.name.rsplit("_", 1)[1]] = Site(_opens_group(node), f"{rel}:{node.lineno}")
        if len(found) == 2:
            return ReleasePlacement(found["prefill"], found["decode"])
    raise TargetError(
        f"cannot find process_batch_result_prefill/decode in the sglang at {root} ({', '.join(_SOURCES)}):"
        " pass --groups all or --groups none"
    )


def chosen(groups: str, release: ReleasePlacement) -> Placement:
    """The placement a run uses under ``--groups``."""
    if groups == "release":
        return release.placement
    if groups == "all":
        return Placement(True, True)
    if groups == "none":
        return Placement(False, False)
    raise TargetError(f"--groups {groups!r}: choose one of {', '.join(GROUPS)}")
