"""The first preload of the command's forkserver (``options.worker_context``:
a long run's workers, and where the command starts one, its watched
builds and replays).

A terminal's Ctrl-C reaches every process of the command's group, the
forkserver too, and the server sets SIGINT aside (``SIG_IGN``) only once
its preload (torch and the harness, a second or more) is done: a Ctrl-C in
that time printed its ``KeyboardInterrupt`` traceback under the command's
own "interrupted".  Imported first, this ignores SIGINT from there on, in
the server only: the command decides what a Ctrl-C means, and each worker
sets its own handlers (``watchdog.worker_signals``).  The server hands every
child the handlers it had before its own, so each child starts with SIGINT
ignored (not Python's ``default_int_handler``) until it sets its own: a
worker sets it aside anyway.
"""

import signal
import sys

# The server runs ``python -c "from multiprocessing.forkserver import main; ..."``.
if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
