"""Ctrl-C noted, not raised, until the command's imports are done: from
the console script's first line (``console``), and from ``cli.main`` on.

``state_machines.cli`` imports argparse and attrs at its top, and ``main``
sets SIGINT aside only once it runs: a Ctrl-C in those first tens of
milliseconds was Python's KeyboardInterrupt traceback (16-50 lines).  This
module imports only ``signal`` (half a millisecond).  Before it runs,
Python's own start (``site``, an editable install's path finder) is
Python's.
"""

from __future__ import annotations

import signal

_early_interrupts: list[int] = []


def interrupted_early(signum, frame) -> None:
    _early_interrupts.append(signum)


def note_interrupts() -> None:
    """SIGINT noted, not raised (``interrupted_early``), where it has
    Python's default handler in the main thread, until the command's
    imports are done (``imports_done``).  Raised inside
    torch's import it landed in pybind11's C++ (terminate, abort: rc -6),
    was swallowed by an import (the command ran to its end), or broke
    numpy's into an ImportError traceback."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, interrupted_early)
        except ValueError:  # not the main thread (main() called from a thread): its handlers are not this call's
            pass


def imports_done(raising: bool = True) -> None:
    """After the command's imports: SIGINT's default back, and a Ctrl-C
    that came during them raised again (``raising``), should an import
    have swallowed it."""
    if signal.getsignal(signal.SIGINT) is interrupted_early:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    came = bool(_early_interrupts)
    _early_interrupts.clear()
    if came and raising:
        raise KeyboardInterrupt
