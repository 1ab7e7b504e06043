"""The ``kv-lockstep`` console script's entry: Ctrl-C noted from its first
line (``early``), then the command."""

from __future__ import annotations

from state_machines.early import note_interrupts


def main(argv: list[str] | None = None) -> int:
    note_interrupts()
    from state_machines.cli import main as command

    return command(argv)
