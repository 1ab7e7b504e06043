"""The README as a new user meets it: its first example prints what the README shows."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMAND = ".venv/bin/kv-lockstep fuzz --target builtin:token --mutant alias --seed 2"
# Wall times move from run to run; everything else (examples, traces and
# their hashes, shrunk programs) follows from the seed.
_SECONDS = re.compile(r"\d+(?:\.\d+)? s\b")


def _shown(readme: str) -> list[str]:
    """The output block that follows the README's ``COMMAND`` block, as lines."""
    after = readme[readme.index(COMMAND + "\n```\n") :]
    # The command's block, the blank line between, then the output's block.
    return after.split("```\n")[2].splitlines()


def test_the_readmes_fuzz_example_prints_what_the_readme_shows(tmp_path):
    """The draws of the walk move with every change to it: the block went
    stale once (the second failure met in another example and shrunk to
    another pool) and no test noticed."""
    shown = _shown((REPO / "README.md").read_text())
    args = COMMAND.split()[1:]
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    printed = run.stdout.splitlines()
    assert [_SECONDS.sub("N s", line) for line in printed] == [_SECONDS.sub("N s", line) for line in shown], run.stdout
