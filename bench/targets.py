"""What the bench runs: every bug and every clean target it can build here.

Built-in mutants and clean targets come from the suite's catalogue
(``tests/catalogue.py``), so a new allocator family or mutant is benched as
soon as the suite knows it.  sglang releases join where ``.sglang/VERSION``
is installed; one that cannot be built is skipped with the reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.bugs import HARD
from bench.known_shortest import bug_name
from state_machines.config import Config
from state_machines.harness import build
from state_machines.targets.catalogue import clean_configs, mutant_configs

# sglang releases with a free-group bug (0.5.17: flag drift and aliasing;
# 0.5.18: flag drift), and one without.
SGLANG_BUGGY = ("0.5.17", "0.5.18")
SGLANG_FIXED = ("0.5.23",)


def sglang_config(version: str) -> Config:
    return Config(target="sglang:token", sglang_path=f".sglang/{version}")


# A release's own bug behind its free-group bugs: a target of bench/bugs.py
# over the release's class, with free groups kept out (0.5.18's NPU decode).
SGLANG_DEEP = (Config(target="bench.bugs:npu_without_free_groups", page_size=4, sglang_path=".sglang/0.5.18"),)


def unavailable(config: Config) -> str | None:
    """Why ``config`` cannot run here, or ``None`` when it builds."""
    if config.sglang_path and not Path(config.sglang_path).is_dir():
        version = Path(config.sglang_path).name
        return f"{config.sglang_path} is not installed (make sglang V={version})"
    if config.sglang_path:
        # In a process of its own: this one must not import any sglang, since
        # a process can hold only one release and the bench compares several.
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, json.dumps(config.to_dict())], capture_output=True, text=True
        )
        if probe.returncode:
            return "cannot build: " + (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return None
    try:
        build(config)
    except Exception as exc:  # any failure to build is a reason to skip, and is reported
        return f"cannot build: {type(exc).__name__}: {exc}"
    return None


_PROBE = (
    "import json, sys\n"
    "from state_machines.config import Config\n"
    "from state_machines.harness import build\n"
    "build(Config.from_dict(json.loads(sys.argv[1])))\n"
)


def _split(configs) -> tuple[list[Config], list[tuple[Config, str]]]:
    ready, skipped = [], []
    for config in configs:
        reason = unavailable(config)
        if reason is None:
            ready.append(config)
        else:
            skipped.append((config, reason))
    return ready, skipped


def bugs() -> tuple[list[Config], list[tuple[Config, str]]]:
    """Every built-in mutant, the bench's harder bugs (``bench/bugs.py``),
    buggy sglang releases and their deeper bugs; and those skipped, with why."""
    return _split(every_bug())


def every_bug() -> list[Config]:
    """Every bug the bench knows, whether or not it can be built here."""
    return [*mutant_configs(), *HARD, *(sglang_config(v) for v in SGLANG_BUGGY), *SGLANG_DEEP]


def clean(match: str | None = None) -> tuple[list[Config], list[tuple[Config, str]]]:
    """Every clean built-in target and fixed sglang release (only those whose
    name ``match`` finds, if given); and those skipped."""
    configs = [*clean_configs(), *(sglang_config(v) for v in SGLANG_FIXED)]
    if match:
        configs = [c for c in configs if re.search(match, bug_name(c))]
    return _split(configs)
