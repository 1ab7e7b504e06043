"""``kv-lockstep``: fuzz a target, replay a trace, list targets.

Exit codes: 0 no failure, 1 a failure (with a trace), 2 bad input,
130 on SIGINT, 143 on SIGTERM, 129 on SIGHUP.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import signal
import sys

import attrs

from state_machines.config import Config
from state_machines.early import imports_done, note_interrupts

DEFAULT_TARGET = "builtin:token"
DEFAULT_TRACE_DIR = ".kv-lockstep/traces"
DEFAULT_MAX_EXAMPLES = 300


class UsageError(Exception):
    """Bad command-line input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    _args: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):  # one line instead of usage + message
        prog = self.prog
        if message.startswith("unrecognized arguments") and self._args and self._args[0] in self._subcommands():
            prog = f"{prog} {self._args[0]}"  # the top parser reports them: point at the command's own help
        raise UsageError(f"{message}{self._dash_value_hint(message)} (see `{prog} --help`)")

    def _subcommands(self) -> tuple[str, ...]:
        return tuple(name for action in self._actions if isinstance(action, argparse._SubParsersAction) for name in action.choices)

    def _dash_value_hint(self, message: str) -> str:
        """argparse takes ``--trace-dir -out`` for two options: name the
        value it set aside, and how to give it.  Nothing where that word is
        one of the command's own options (``--duration -j 2``: the value
        was left out)."""
        missing = re.fullmatch(r"argument (\S+): expected one argument", message)
        if missing is None:
            return ""
        names = missing.group(1).split("/")
        for at, arg in enumerate(self._args[:-1]):
            value = self._args[at + 1]
            named = arg in names or (arg.startswith("--") and any(n.startswith(arg) for n in names if n.startswith("--")))
            if named and len(value) > 1 and value[0] == "-" and value[1] != "-" and not self._an_option(value):
                return f"; {value!r} was taken for an option: write {max(names, key=len)}={value}"
        return ""

    def _an_option(self, word: str) -> bool:
        """Whether argparse reads ``word`` as one of this command's options
        (``-j``, ``-j2``, ``-h``)."""
        return any(word == o or (len(o) == 2 and word.startswith(o)) for o in self._option_string_actions)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _target_spec(text: str) -> str:
    """``--target``: not empty (an empty one ran the default target)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give builtin:NAME, sglang:NAME or MODULE:ATTR")
    return text


def _caller_spec(text: str) -> str:
    """``--caller``: a name or ``MODULE:ATTR``, as a trace carries it (an
    unknown name was refused later, as ``config.caller``)."""
    from state_machines.runs.trace import CALLER_SPEC, CALLER_SPEC_SHOWN

    if not CALLER_SPEC.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not {CALLER_SPEC_SHOWN}")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _call_seconds(text: str) -> float:
    """``--call-timeout``: what a trace may carry, so that every trace the
    run writes replays: a day at most, and a tenth of a second at least
    (below it a correct call is taken for a hang)."""
    from state_machines.config import MAX_CALL_TIMEOUT_S, MIN_CALL_TIMEOUT_S

    value = _seconds(text)
    if value > MAX_CALL_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_CALL_TIMEOUT_S} seconds (a day), got {text}")
    if value < MIN_CALL_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_CALL_TIMEOUT_S} seconds (below it a correct call is"
                                         f" taken for a hang), got {text}")
    return value


def _build_timeout(parser) -> None:
    from state_machines.config import BUILD_TIMEOUT_S

    parser.add_argument("--build-timeout", type=_seconds, default=BUILD_TIMEOUT_S, metavar="SECONDS",
                        help="the target's factory (or a probe of its methods, its module's import, or an sglang release's) running longer"
                             " is bad input, exit 2;"
                             " apart from the allocator calls' limit (a trace's call_timeout_s, fuzz's --call-timeout),"
                             " as a device's first build is slow (default %(default)g)")


class _Version(argparse.Action):
    """``--version``, its metadata read only when asked (about 40 ms a command otherwise, helper-91)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit()


def _version() -> str:
    """``kv-lockstep 0.1.0 (hypothesis 6.x, torch 2.x, Python 3.x)``: read
    from the installed packages' metadata, nothing imported."""
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return f"kv-lockstep {of('kv-lockstep')} (hypothesis {of('hypothesis')}, torch {of('torch')}, Python {python})"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kv-lockstep", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print this version and those of what it runs on (for a bug report), then exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    fuzz = sub.add_parser("fuzz", help="run a target in lockstep with the ownership model")
    fuzz.add_argument("--target", type=_target_spec, help=f"builtin:NAME, sglang:NAME or MODULE:ATTR (default {DEFAULT_TARGET};"
                      " with --caller, sglang:token at page size 1, else sglang:paged)")
    fuzz.add_argument("--mutant", help="a named bug variant of a builtin target")
    fuzz.add_argument("--page-size", type=_positive, default=1, help="slots a page (default 1)")
    fuzz.add_argument("--need-sort", action="store_true",
                      help="frees wait in release pages until an alloc runs short (without it, examples draw it off"
                           " or on where the target takes it; this pins it on)")
    fuzz.add_argument("--device", default="cpu", help="cpu, cuda or npu (`kv-lockstep devices` says which are available)")
    fuzz.add_argument("--size", type=_positive,
                      help="pool size in slots (default: each example draws 10, 4, 24 or 64 pages; this pins it)")
    fuzz.add_argument("--seed", type=int, help="seed of the random walk and of Hypothesis; runs with the same seed are the same")
    fuzz.add_argument("--max-examples", type=_positive, help=f"the budget: examples in all, the walk's and Hypothesis's (default {DEFAULT_MAX_EXAMPLES})")
    fuzz.add_argument("--trace-dir", default=DEFAULT_TRACE_DIR, help="where traces go (default %(default)s)")
    fuzz.add_argument("--sglang-path", help="a folder holding the sglang package (a checkout's python/)")
    fuzz.add_argument("--call-timeout", type=_call_seconds, default=Config().call_timeout_s, metavar="SECONDS",
                      help="an allocator call running longer is a hang, allocator_hung (default %(default)g)")
    _build_timeout(fuzz)
    fuzz.add_argument("--cover", action="store_true",
                      help="also measure statement coverage of the target's allocator code, per file (needs coverage.py)")
    fuzz.add_argument("--row-dtype", choices=("int32", "int64"), default=Config().row_dtype,
                      help="req_to_token's dtype (default %(default)s, as sglang's ReqToTokenPool)")
    fuzz.add_argument("--latent", action="store_true",
                      help="at page size 1, send decode and extend to alloc_decode / alloc_extend, as no sglang caller"
                           " does: a failure is a latent finding, not a gate failure")
    _caller_options(fuzz)
    long = fuzz.add_argument_group("long runs (see README, Long runs)")
    long.add_argument("--duration", help="run this long (20s, 10m, 2h) or until a failure, instead of --max-examples")
    long.add_argument("-j", "--jobs", type=_positive, help="worker processes for --duration (default: all cores)")
    long.add_argument("--db", help="shared Hypothesis example database: a directory or redis://HOST:PORT")
    long.add_argument("--stats-json", help="write the coverage figures of a --duration run to this file")

    replay = sub.add_parser("replay", help="re-run a trace step by step")
    replay.add_argument("trace")
    replay.add_argument("--target", type=_target_spec, help="run against this target instead of the trace's")
    replay.add_argument("--mutant", help="with this mutant (default: none when --target is given)")
    replay.add_argument("--sglang-path")
    _caller_options(replay, defaults=False)
    _build_timeout(replay)
    replay.add_argument("--emit-pytest", metavar="FILE", help="also write a standalone pytest file that replays the trace")

    targets = sub.add_parser("targets", help="list targets and mutants, or what one target can run here")
    targets.add_argument("--target", type=_target_spec, help="show this target's family, steps and disabled steps (with reasons)")
    targets.add_argument("--mutant")
    targets.add_argument("--page-size", type=_positive, help="the page size to describe at (default: with --target, the"
                         " least the target and its mutant take, most often 1; listing a release's kinds, each at the page"
                         " sizes the gate runs it at)")
    targets.add_argument("--need-sort", action="store_true")
    targets.add_argument("--row-dtype", choices=("int32", "int64"),
                         help=f"req_to_token's dtype to describe at (default {Config().row_dtype}; a mutant may need int64)")
    targets.add_argument("--sglang-path", help="without --target: list this sglang's kinds, each described")
    _build_timeout(targets)
    sub.add_parser("devices", help="which devices (cpu, cuda, npu) can run here, and why not")
    return parser


def _caller_options(parser, defaults: bool = True) -> None:
    group = parser.add_argument_group("the real caller (see README, The real caller)")
    group.add_argument("--caller", type=_caller_spec, default="harness" if defaults else None, metavar="CALLER",
                       help="harness (the simulated caller), radix, unified, unified-swa, swa-radix, or MODULE:ATTR (a cache class):"
                            " sglang's own prefix cache and scheduler helpers drive the allocator"
                            + (" (default %(default)s)" if defaults else " (default: the trace's)"))
    group.add_argument("--groups", default="release" if defaults else None, choices=("release", "all", "none"),
                       help="with --caller: free groups where the release's scheduler opens them, around every"
                            " result, or none" + (" (default %(default)s)" if defaults else " (default: the trace's)"))


def _caller_config(args, config: Config) -> Config:
    """The configuration with the command line's --caller and --groups; the
    target defaults to the release's allocator for the page size."""
    caller = args.caller or config.caller
    groups = args.groups or config.groups
    if caller == "harness":
        if args.groups not in (None, "release"):
            raise UsageError("--groups goes with --caller (the harness's own steps open and close groups)")
        return attrs.evolve(config, caller=caller, groups="release")
    return attrs.evolve(config, caller=caller, groups=groups)


def _no_release_for_a_builtin(config: Config) -> None:
    """A built-in target runs no sglang code: an ``--sglang-path`` given
    with one ran, and went into the header, the trace's name, replay's hint
    and an emitted file."""
    if config.target.startswith("builtin:") and config.sglang_path is not None and config.caller == "harness":
        raise UsageError(f"--sglang-path goes with an sglang: target, a MODULE:ATTR one or --caller:"
                         f" {config.target} runs no sglang code")


def _only_with(*flags: tuple[str, object], needs: str) -> None:
    """Refuse the ``(flag, value)`` pairs given a value, naming only those,
    as options that mean something only beside ``needs``."""
    given = [flag for flag, value in flags if value]
    if given:
        raise UsageError(f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with {needs}")


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.splitlines())


def _fits_a_trace(config: Config) -> None:
    """Refuse a configuration that a trace cannot carry (``trace.py``'s
    bounds: a page of 2,048 slots, a pool past 2^22 slots): every failure
    the run wrote would be a trace ``replay`` refuses."""
    from state_machines.runs.trace import TraceError, check_config

    try:
        check_config(config.to_dict())
    except TraceError as exc:
        # Name the option the user typed, not the trace's field.
        message = re.sub(r"^config\.(\w+)", lambda m: _OPTION_OF.get(m[1], f"--{m[1].replace('_', '-')}"), str(exc))
        raise UsageError(f"{message}: beyond what a trace carries, so no failure found could be replayed") from None


_OPTION_OF = {"call_timeout_s": "--call-timeout"}


def cmd_fuzz(args) -> int:
    """The allocator runs only in worker processes, watched from here
    (``runs/watchdog.py``), so that a crash, an exit or a hang inside it is
    a failure with a trace, and Ctrl-C keeps what was found."""
    from state_machines import targets
    from state_machines.runs.options import open_database
    from state_machines.targets import devices
    from state_machines.targets.base import is_passed

    target = args.target if args.target is not None else DEFAULT_TARGET
    if args.caller != "harness" and args.target is None:
        from state_machines.callers.release import default_target

        target = default_target(args.caller, args.page_size)
    config = Config(
        target=target,
        mutant=args.mutant,
        page_size=args.page_size,
        need_sort=args.need_sort,
        device=args.device,
        size=args.size,
        sglang_path=args.sglang_path,
        call_timeout_s=args.call_timeout,
        row_dtype=args.row_dtype,
        latent=args.latent,
    )
    if config.size is not None and config.size % config.page_size:
        raise UsageError(f"--size {config.size} is not a whole number of pages of {config.page_size} slots (--page-size):"
                         f" sglang builds its pools in whole pages; give a multiple of {config.page_size}")
    if args.latent and args.page_size != 1:
        raise UsageError(
            "--latent drives alloc_decode / alloc_extend at page size 1, where sglang's callers use alloc();"
            f" at --page-size {args.page_size} they are the callers' own path, run by default"
        )
    config = _caller_config(args, config)
    _no_release_for_a_builtin(config)
    if not args.duration:
        _only_with(("-j", args.jobs), ("--stats-json", args.stats_json), needs="--duration (e.g. --duration 10m)")
    if args.duration and args.max_examples is not None:
        raise UsageError("--duration and --max-examples are two budgets: give one")
    if args.max_examples is None:
        args.max_examples = DEFAULT_MAX_EXAMPLES
    if args.cover:
        from state_machines.runs import cover

        if reason := cover.missing():
            raise UsageError(reason)
        if args.duration:
            raise UsageError("--cover measures a plain run (--max-examples), not a --duration run")
    duration_s = None
    if args.duration:
        from state_machines.runs import longrun

        duration_s = longrun.parse_duration(args.duration)
    # Bad input fails here, before any output; what only building the
    # allocator can tell, the worker reports the same way.
    target = targets.resolve(config.target, config.mutant, config.sglang_path)
    if config.size is not None and not is_passed(target.factory, "size"):
        # It sizes its pool itself (the harness reads what it built): --size was ignored without a word (helper-88).
        raise UsageError(f"--size {config.size}: {config.target} takes no size parameter, so it builds a pool of its own"
                         " size; give its factory a `size` parameter, or leave --size out")
    devices.require(config.device)
    _fits_a_trace(config)
    open_database(args.db)
    # Last: the trace folder's probe makes it, which a run refused for
    # anything else should not leave behind.
    from state_machines.runs.options import check_output_paths

    check_output_paths(trace_dir=args.trace_dir, stats_json=args.stats_json, db=args.db)
    if config.caller != "harness":
        _print_caller_header(config, args.build_timeout)
    if duration_s is not None:
        return longrun.run(
            config, duration_s=duration_s, jobs=args.jobs or longrun.default_jobs(),
            db_spec=args.db, seed=args.seed, trace_dir=args.trace_dir, stats_json=args.stats_json,
            build_timeout_s=args.build_timeout,
        )
    from state_machines.runs.watchdog import fuzz_watched

    if not args.cover:
        return fuzz_watched(config, max_examples=args.max_examples, seed=args.seed, db_spec=args.db,
                            trace_dir=args.trace_dir, build_timeout_s=args.build_timeout)
    return _fuzz_covered(config, args)


def _fuzz_covered(config: Config, args) -> int:
    """``fuzz --cover``: the run, then statement coverage of the target's
    allocator code, one row per file (a file never imported at 0%)."""
    from state_machines.runs import cover
    from state_machines.runs.watchdog import fuzz_watched

    files = cover.measured_files(config)
    seen: dict[str, set[int]] = {}
    reports = []

    def received(lines: dict) -> None:
        reports.append(lines)
        cover.union(seen, lines)

    code = fuzz_watched(config, max_examples=args.max_examples, seed=args.seed, db_spec=args.db,
                        trace_dir=args.trace_dir, cover=cover.Recorder(files), on_cover=received,
                        build_timeout_s=args.build_timeout)
    if code == 2:
        return code
    root = cover.root_of(config, files)
    print("\n" + cover.heading(config, files))
    if not reports:
        print("  none: the worker ended before it reported the lines it ran")
        return code
    print(cover.table(cover.tally(files, {f: sorted(s) for f, s in seen.items()}, root)))
    return code


def _build_here_or_watched(config: Config, job, build_timeout_s: float):
    """``job(config)``, which builds ``config``'s target: here where that runs
    only our code, else in a watched worker (``watchdog.build_watched``),
    where a factory or cache class that exits, crashes or never returns is
    bad input (it ended the command silently with its code, or hung it)."""
    if not config.runs_users_code():
        try:
            return job(config)
        finally:  # no alarm of its calls' timer during the run that follows
            from state_machines.harness.lockstep import disarm_call_timer

            disarm_call_timer()
    from state_machines.runs.watchdog import build_watched

    return build_watched(config, job, build_timeout_s=build_timeout_s)


def _caller_header(config: Config) -> list[str]:
    import state_machines.callers as callers

    return callers.build(config).header()


def _print_caller_header(config: Config, build_timeout_s: float) -> None:
    """Build the caller once and name what it drives and stands in: here (the
    worker forks from this process, so the release's imports are made once),
    or, where that runs the user's code, in a watched worker forked after the
    release and the cache class's module are loaded here."""
    if config.runs_users_code():
        from state_machines.callers.release import cache_class, open_release

        cache_class(open_release(config.sglang_path), config.caller)
    from state_machines.harness import InvariantViolation

    try:
        lines = _build_here_or_watched(config, _caller_header, build_timeout_s)
    except InvariantViolation:
        return  # failing before any step: the run meets it again, and writes its trace
    for line in lines:
        print(line)


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (``b`` existing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either missing: not one file (a missing trace is refused as ever)
        return False


def _replay_config(trace, args) -> Config:
    """The configuration a replay runs: the trace's, with the command line's
    choices over it.  A trace builds built-in and ``sglang:`` targets by
    itself; a custom ``MODULE:ATTR`` target, or a folder to put on
    ``sys.path``, runs only when the command line names it."""
    from state_machines.runs.trace import harness_only_field, shown

    config = trace.config
    if args.target:
        config = attrs.evolve(config, target=args.target, mutant=args.mutant)
    elif args.mutant:
        if not config.target.startswith("builtin:"):  # the target is the trace's: say so (helper-88)
            raise UsageError(f"--mutant applies to builtin targets only, and trace {shown(args.trace)} runs {config.target}:"
                             " give --target builtin:NAME with it")
        config = attrs.evolve(config, mutant=args.mutant)
    kind = config.target.partition(":")[0]
    from state_machines.targets import miscased

    if why := miscased(config.target):
        raise UsageError(why if args.target else f"trace {shown(args.trace)}: {why}")
    if not args.target and kind not in ("builtin", "sglang"):
        raise UsageError(
            f"trace {shown(args.trace)} names the custom target {config.target}, and replay imports no code a trace names:"
            f" pass --target {config.target} to run it"
        )
    if (args.caller or config.caller).partition(":")[1] and not args.caller:
        raise UsageError(
            f"trace {shown(args.trace)} names the custom cache class {config.caller}, and replay imports no code a trace"
            f" names: pass --caller {config.caller} to run it"
        )
    config = _caller_config(args, config)
    if field_ := harness_only_field(config):
        # The trace's own caller is the harness's (a real caller's trace carries neither: ``check_trace``).
        what = "latent" if field_ == "latent" else f"{config.row_dtype} rows"
        raise UsageError(f"--caller {config.caller}: trace {shown(args.trace)} was recorded with {what}, which only"
                         " the harness's own caller takes")
    if args.sglang_path:
        config = attrs.evolve(config, sglang_path=args.sglang_path)
        _no_release_for_a_builtin(config)
    elif config.sglang_path is not None:
        if kind == "sglang" or config.caller != "harness":
            # Another target helps only where the release is the target's, not the caller's.
            other = " (or --target to run another target)" if not args.target and config.caller == "harness" else ""
            raise UsageError(
                f"trace {shown(args.trace)} was recorded with --sglang-path {config.sglang_path!r}, and replay puts no folder"
                f" a trace names on sys.path: pass --sglang-path DIR to replay it{other}"
            )
        config = attrs.evolve(config, sglang_path=None)  # only sglang: targets read it
    return config


def cmd_replay(args) -> int:
    """The steps run in a worker process watched from here
    (``runs/watchdog.py``), as ``fuzz``'s do: an allocator that exits,
    crashes or hangs where SIGALRM cannot reach it is a failure the replay
    reports (exit 1), and one that dies while it is built is bad input."""
    from state_machines.runs.options import check_output_paths
    from state_machines.runs.trace import Trace, counted, needs_latent, shown, step_source
    from state_machines.runs.watchdog import replay_watched, signal_name

    check_output_paths(emit_pytest=args.emit_pytest)
    if args.emit_pytest and _same_file(args.emit_pytest, args.trace):
        raise UsageError(f"--emit-pytest {shown(args.emit_pytest)} is the trace itself: writing it would overwrite the trace")
    trace = Trace.load(args.trace)  # checked throughout: nothing of it runs before this
    config = _replay_config(trace, args)
    # Bad input fails here, before any output, as in fuzz.
    from state_machines import targets
    from state_machines.targets import devices

    targets.resolve(config.target, config.mutant, config.sglang_path)
    devices.require(config.device)
    print(f"kv-lockstep replay: {counted(len(trace.steps), 'step')} of {shown(args.trace)} on {config.label()}", flush=True)
    replayed = replay_watched(trace, config, args.build_timeout)
    if replayed.signal is not None:
        print(f"kv-lockstep: interrupted ({signal_name(replayed.signal)})", file=sys.stderr)
        return 128 + replayed.signal
    if replayed.bad_input is not None:
        raise UsageError(replayed.bad_input)
    if replayed.error is not None:
        print(f"kv-lockstep: harness error in the worker:\n{replayed.error}", file=sys.stderr)
        return 1
    failure = replayed.failure
    if args.emit_pytest:
        print(_emitted(trace, config, args))
    if failure is None:
        print(f"trace passes: all {counted(len(trace.steps), 'step')} and the teardown check out")
        return 0
    index = len(failure.steps) - 1
    step = failure.steps[-1] if failure.steps else None
    where = f"step {index}, {step_source(step)}" if step else "building the target"
    print(f"FAILED at {where}: {failure.invariant}")
    print(_indent(failure.detail))
    if needs_latent(config, failure.steps):
        print("  (latent: the trace drives what no sglang caller does; a finding, not a gate failure)")
    recorded = len(trace.steps) - 1
    if trace.invariant is not None and (trace.invariant, recorded) != (failure.invariant, index):
        # Edited by hand, or replayed on another target or mutant.
        def at(i: int) -> str:
            return f"step {i}" if i >= 0 else "building the target"

        print(f"  (not the failure the trace recorded: {trace.invariant} at {at(recorded)};"
              f" this replay broke {failure.invariant} at {at(index)})")
    return 1


def _emit_pytest(config: Config, trace, path: str, source: str, recorded: bool = True) -> str:
    from state_machines.runs.emit import write_pytest

    return str(write_pytest(trace, config, path, source=source, recorded=recorded))


def _emitted(trace, config: Config, args) -> str:
    """``replay --emit-pytest``: write the file, and say where.  Writing it
    runs the steps again, to record what each alloc returned: in a worker
    watched as the replay's is (``watchdog.build_watched``), for every
    target, since a trace whose allocator died or hung in the replay does so
    again here (it ended the command silently with the allocator's code,
    before the replay's verdict was printed, or hung it).  Where the worker
    dies or hangs in an allocator call, the file is written without those
    returns, and the line says why."""
    from state_machines.harness import InvariantViolation
    from state_machines.runs.trace import shown
    from state_machines.runs.watchdog import build_watched

    try:
        path = build_watched(config, _emit_pytest, trace, args.emit_pytest, args.trace, build_timeout_s=args.build_timeout)
    except InvariantViolation as exc:  # the steps did not run through: no returns to show
        path = _emit_pytest(config, trace, args.emit_pytest, args.trace, recorded=False)
        why = " ".join(exc.detail.split())
        return (f"pytest file: {shown(path)} (without the slots each alloc returned: recording them, {exc.invariant}: {why})"
                + _uncollected(path))
    return f"pytest file: {shown(path)}" + _uncollected(path)


def _uncollected(path) -> str:
    """A word where pytest, looking for tests in a folder, would pass the
    file by (its default ``python_files``: test_*.py, *_test.py)."""
    name = os.path.basename(str(path))
    if not name.endswith(".py"):
        return "; pytest does not collect it by default: name it test_*.py"
    if name.startswith("test_") or name.endswith("_test.py"):
        return ""
    return ("; by default pytest collects it only when named on its command line"
            " (in a folder it looks for test_*.py or *_test.py)")


def _describe(config: Config) -> list[str]:
    """What ``config``'s target runs here: its class and harness, then one
    line each for the steps it runs, each disabled step and each check it
    cannot offer (with reasons)."""
    from state_machines.harness import build
    from state_machines.harness.steps import disabled_steps, steps_of

    state = build(config)
    lines = [f"{config.label()}: {type(state.allocator).__name__}, harness {type(state).__name__}"]
    disabled = disabled_steps(state)
    lines.append(f"  steps: {', '.join(name for name in sorted(steps_of(type(state))) if name not in disabled)}")
    lines += [f"  disabled: {name}: {why}" for name, why in disabled.items()]
    lines += [f"  not checked: {name}: {why}" for name, why in sorted(getattr(state, "skipped_checks", {}).items())]
    # An optional free that is a NotImplementedError stub: the harness frees as if it had none.
    lines += [f"  not provided: {why}; the harness frees without it" for why in getattr(state, "not_provided", {}).values()]
    # What a target is built over where sglang's class needs pools it cannot have here.
    lines += [f"  stand-in: {what}" for what in getattr(state, "stand_ins", ())]
    return lines


def _describe_target(args) -> int:
    from state_machines import targets
    from state_machines.harness import InvariantViolation

    config = Config(target=args.target, mutant=args.mutant, page_size=args.page_size or 1, need_sort=args.need_sort,
                    sglang_path=args.sglang_path, row_dtype=args.row_dtype or Config().row_dtype)
    _no_release_for_a_builtin(config)
    target = targets.resolve(config.target, config.mutant, config.sglang_path)  # loaded here once: a fork shares it
    if args.page_size is None:
        # The least page size the target (and its mutant) takes: "takes page size 4, not 1" named a 1 nobody typed (helper-90).
        config = attrs.evolve(config, page_size=_least_page_size(target))
    try:
        print("\n".join(_build_here_or_watched(config, _describe, args.build_timeout)))
    except InvariantViolation as exc:
        print(f"FAILED before any step: {exc.invariant}")
        print(_indent(exc.detail))
        print(f"  a trace: {_fuzz_for_a_trace(config, args.page_size)}")
        return 1
    return 0


def _least_page_size(target) -> int:
    """The least page size ``target`` takes: 1, or its own least, or what its mutant needs."""
    least = min(target.page_sizes) if target.page_sizes else max(1, target.min_page_size)
    if "page_size" in target.needs:
        return target.needs["page_size"]
    return max(least, target.needs.get("min_page_size", 1))


def _fuzz_for_a_trace(config: Config, page_size: int | None) -> str:
    """The ``fuzz`` command that meets a failure a listing found before any
    step and writes its trace (a listing writes no file)."""
    words = ["kv-lockstep", "fuzz", "--target", config.target]
    words += ["--mutant", config.mutant] if config.mutant else []
    words += ["--page-size", str(page_size)] if page_size else []
    words += ["--need-sort"] if config.need_sort else []
    words += ["--sglang-path", config.sglang_path] if config.sglang_path else []
    return f"{shlex.join(words)} (its failure shrinks to building the pool)"


def _describe_release(args) -> int:
    """``targets --sglang-path P``: every sglang kind of that release, with
    its class, the page sizes it takes, and what it runs here (at
    ``--page-size`` where it takes that, else at each page size the gate
    runs it at, ``gate_kinds()``)."""
    from state_machines.harness import InvariantViolation
    from state_machines.targets import TargetError, resolve, sglang

    info = sglang.load_sglang(args.sglang_path)
    where = ("one file, sglang/srt/mem_cache/allocator.py" if info.layout == sglang.SINGLE_FILE
             else "a package, sglang/srt/mem_cache/allocator/")
    print(f"sglang {info.version} at {info.path}: allocators in {where}")
    gated: dict[str, list[int]] = {}
    for kind, gate_page_size in sglang.gate_kinds():
        gated.setdefault(kind, []).append(gate_page_size)
    for kind, gate_page_sizes in gated.items():
        spec = f"sglang:{kind}"
        try:
            target = resolve(spec, None, args.sglang_path)
        except TargetError as exc:
            print(f"  {spec}: unavailable: {exc}")
            continue
        cls = sglang.class_of(kind)
        takes = target.page_sizes
        if args.page_size and (takes is None or args.page_size in takes) and args.page_size >= target.min_page_size:
            gate_page_sizes = [args.page_size]
        pages = (f"page size {', '.join(map(str, takes))} only" if takes
                 else f"page size {target.min_page_size} or more" if target.min_page_size > 1 else "any page size")
        print(f"  {spec}: {cls.__name__} ({cls.__module__}), {pages}")
        for page_size in gate_page_sizes:
            config = Config(target=spec, page_size=page_size, need_sort=args.need_sort, sglang_path=args.sglang_path,
                            row_dtype=args.row_dtype or Config().row_dtype)
            try:
                lines = _describe(config)
            except InvariantViolation as exc:
                print(f"    at page size {page_size}: fails before any step: {exc.invariant}: {exc.detail.splitlines()[0]}")
                print(f"      a trace: {_fuzz_for_a_trace(config, page_size)}")
                continue
            except TargetError as exc:
                print(f"    at page size {page_size}: unavailable: {exc}")
                continue
            harness = lines[0].rpartition(", ")[2]
            print(f"    at page size {page_size}: {harness}")
            print("\n".join("  " + line for line in lines[1:]))
    return 0


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence on one line, without reST's double
    backticks: its first line alone may stop mid-sentence."""
    text = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")
    head, dot, _ = text.partition(". ")
    return head + "." if dot else text


def cmd_targets(args) -> int:
    import allocators
    from state_machines.targets import describe_needs

    if args.target:
        return _describe_target(args)
    _only_with(("--mutant", args.mutant), needs="--target")
    if args.sglang_path:
        return _describe_release(args)
    # The listing of every target takes none of these.
    _only_with(("--page-size", args.page_size), ("--need-sort", args.need_sort), ("--row-dtype", args.row_dtype),
               needs="--target or --sglang-path")
    print("built-in targets (--target builtin:NAME [--mutant M]):")
    width = max(map(len, allocators.BUILTINS))
    named = max(len(m) for _, mutants in allocators.BUILTINS.values() for m in mutants)  # a column past the longest
    for name, (cls, mutants) in sorted(allocators.BUILTINS.items()):
        print(f"  builtin:{name:<{width}} {_first_sentence(cls.__doc__ or '')}")
        for mutant in mutants.values():
            needs = f"  [needs {describe_needs(mutant.needs)}]" if mutant.needs else ""
            print(f"      --mutant {mutant.name:<{named}} {mutant.summary}{needs}")
    from state_machines.targets.sglang import FACTORIES

    print("sglang targets (--target sglang:NAME [--sglang-path DIR]): " + ", ".join(f"sglang:{k}" for k in FACTORIES))
    print("custom targets: --target MODULE:ATTR, a factory or class called with the parameters it names among"
          " size, page_size, device, need_sort, dtype, kvcache")
    print("families (a target's `family` attribute, else the first that recognizes its allocator):")
    from state_machines.harness import FAMILIES

    width = max(len(name) for name in FAMILIES) + 1  # dsv4_hisparse ran into its summary
    for family in FAMILIES.values():
        print(f"  {family.name:<{width}} {family.summary}")
    print("devices (--device D), every target:")
    _print_devices()
    return 0


def _print_devices() -> None:
    from state_machines.targets import devices

    for status in devices.probe_all():
        print(f"  {status.name:<5} {'available' if status.available else 'unavailable':<12} {status.reason}")


def cmd_devices(args) -> int:
    _print_devices()
    return 0


# What writing the command's output raises where it cannot be written
# (``>/dev/full``, a full disk, a closed or dead terminal); a broken pipe is
# ``_ReaderMayLeave``'s case.
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EBADF, errno.EFBIG, errno.EDQUOT})


def main(argv: list[str] | None = None) -> int:
    """The command: its exit code (the module's docstring).  Around
    ``_main``, whose imports (torch's) take a second or two: a Ctrl-C
    there, or an output that cannot be written (``>/dev/full``, ``>&-``),
    ended in a traceback, the latter with exit 1, which says a failure was
    found."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:  # its descriptor closed (>&-): what it says goes nowhere
            setattr(sys, name, open(os.devnull, "w"))
    streams = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    wrapped = {name: _ReaderMayLeave(stream) for name, stream in streams.items()}
    for name, wrapper in wrapped.items():
        setattr(sys, name, wrapper)
    try:
        return _main_guarded(argv)
    finally:
        for name, wrapper in wrapped.items():
            if getattr(sys, name) is wrapper:  # not another's since (a main() in another thread)
                setattr(sys, name, streams[name])


class _ReaderMayLeave:
    """``sys.stdout`` or ``sys.stderr`` for the command: once its reader
    has gone (``| head -1``, ``2>&1 | grep -m1``), a write's
    ``BrokenPipeError`` points it at /dev/null, and the command goes on as
    with a closed stream, its words going nowhere, to its own end and exit
    code.  It ended at once with 141, a failure found unshrunk and its trace
    not written; on stderr, bad input ended with exit 1, a failure's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _silence(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _silence(self._stream)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _main_guarded(argv: list[str] | None) -> int:
    """``main``'s body, its stdout and stderr set (``_ReaderMayLeave``)."""
    note_interrupts()  # noted, not raised, until _main's imports are done (``early``)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        _say("kv-lockstep: interrupted")
        return 130
    except Exception as exc:
        if not isinstance(exc, OSError) or exc.errno not in _OUTPUT_ERRNOS:
            raise
        _silence(sys.stdout)
        watchdog = sys.modules.get("state_machines.runs.watchdog")
        if watchdog is not None and watchdog.RECEIVED:  # stopped by a signal (a hangup: the terminal went, EIO)
            return 128 + watchdog.RECEIVED[-1]
        _say(f"kv-lockstep: error: cannot write the output: {exc.strerror or type(exc).__name__}")
        return 2
    finally:
        imports_done(raising=False)  # where _main ended before it (an import that raised)


def _say(line: str) -> None:
    """``line`` on stderr, where it can be written."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _silence(stream) -> None:
    """Point ``stream``'s descriptor at /dev/null: what it still buffers
    would fail again as the interpreter exits (exit status 120, and a word
    on stderr)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):
        pass


def _main(argv: list[str] | None = None) -> int:
    # Imported here, not at the top: a worker that ``fuzz --cover`` starts
    # re-imports this module, and must not import the allocators before its
    # coverage starts.
    from state_machines.harness import InvariantViolation
    from state_machines.harness.lockstep import disarm_call_timer
    from state_machines.runs.options import BadOption
    from state_machines.runs.trace import TraceError
    from state_machines.runs.watchdog import Interrupted, WorkerError, signal_name
    from state_machines.targets import TargetError

    imports_done()
    if getattr(signal, "SIGCHLD", None) and signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        # Ignored by whatever started this (it carries over exec): the
        # kernel would then reap its children itself, and no worker's or
        # import check's end could be read (waitpid: no child processes).
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        args = _parser().parse_args(argv)
        if hasattr(args, "build_timeout"):
            from state_machines.targets.base import limit_imports

            limit_imports(args.build_timeout)  # a target module's import is the target's code too
        if getattr(args, "caller", None) not in (None, "harness") or args.command == "replay":
            import state_machines.callers  # noqa: F401 - registers the caller family (a trace may name one)
        return {"fuzz": cmd_fuzz, "replay": cmd_replay, "targets": cmd_targets, "devices": cmd_devices}[args.command](args)
    except (UsageError, TargetError, TraceError, BadOption) as exc:
        print(f"kv-lockstep: error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"kv-lockstep: harness error in the worker:\n{exc}", file=sys.stderr)
        return 1
    except InvariantViolation as exc:
        # Raised outside a run: the freshly built allocator already disagrees.
        print(f"FAILED before any step: {exc.invariant}")
        print(_indent(exc.detail))
        return 1
    except Interrupted as exc:  # a watched build's worker, killed
        print(f"kv-lockstep: interrupted ({signal_name(exc.signal)})", file=sys.stderr)
        return 128 + exc.signal
    except KeyboardInterrupt:
        print("kv-lockstep: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # A write past ``_ReaderMayLeave`` (to the raw buffer) whose reader went
        # away: nothing more can be said; no traceback at exit either.
        _silence(sys.stdout)
        return 141
    finally:
        # What this process built itself (a --caller header, a description)
        # left the call timer set: firing once the interpreter has put
        # SIGALRM's default back on its way out, it ended the command with
        # signal 14 (-14) after its last word.
        disarm_call_timer()


if __name__ == "__main__":
    sys.exit(main())
