"""The sglang loader reads a release's layout from its files, and a release
that cannot be imported says why in one line.  Fake sglang folders stand in
for releases here; no real release is needed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from state_machines.targets import TargetError, sglang

REPO = Path(__file__).resolve().parent.parent
ABSENT = "kv_lockstep_absent_package"


def fake_sglang(root: Path, *, layout: str, version: str = "0.5.5", allocator_source: str = "") -> Path:
    """A folder holding a minimal ``sglang`` package of ``layout``."""
    mem_cache = root / "sglang" / "srt" / "mem_cache"
    mem_cache.mkdir(parents=True)
    for package in (root / "sglang", root / "sglang" / "srt", mem_cache):
        (package / "__init__.py").write_text("")
    (root / "sglang" / "version.py").write_text(f'__version__ = "{version}"\n')
    if layout == sglang.SINGLE_FILE:
        (mem_cache / "allocator.py").write_text(allocator_source)
    elif layout == sglang.PACKAGE:
        (mem_cache / "allocator").mkdir()
        (mem_cache / "allocator" / "__init__.py").write_text(allocator_source)
        (mem_cache / "allocator" / "token.py").write_text("")
    return root


def needs_import_set_torch():
    import torch

    need = sglang._required_torch()
    if torch.__version__.split("+")[0] != need:
        pytest.skip(f"the loader imports sglang only with torch {need} (sglang's import set), this venv has {torch.__version__}")


def run(module: str, *args, cwd: Path, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def test_a_folder_with_allocator_py_is_the_single_file_layout(tmp_path):
    """mem_cache/allocator.py, and no allocator/ package, reads as the single-file layout."""
    assert sglang.layout_of(fake_sglang(tmp_path, layout=sglang.SINGLE_FILE)) == sglang.SINGLE_FILE


def test_a_folder_with_an_allocator_package_is_the_package_layout(tmp_path):
    """mem_cache/allocator/__init__.py reads as the package layout."""
    assert sglang.layout_of(fake_sglang(tmp_path, layout=sglang.PACKAGE)) == sglang.PACKAGE


def test_a_folder_with_neither_layout_is_refused_in_one_line(tmp_path):
    """Neither allocator.py nor allocator/ is a TargetError naming both."""
    with pytest.raises(TargetError, match=r"has neither sglang/srt/mem_cache/allocator/ nor sglang/srt/mem_cache/allocator\.py"):
        sglang.layout_of(fake_sglang(tmp_path, layout="none"))


def test_single_file_release_files_are_allocator_py_and_the_npu_allocator(tmp_path):
    """The code --cover measures in a single-file release: allocator.py, then allocator_npu.py where present."""
    root = fake_sglang(tmp_path, layout=sglang.SINGLE_FILE)
    npu = root / "sglang" / "srt" / "hardware_backend" / "npu" / "allocator_npu.py"
    npu.parent.mkdir(parents=True)
    npu.write_text("")
    assert sglang.release_files(str(root)) == [root.resolve() / "sglang/srt/mem_cache/allocator.py", npu.resolve()]


def test_package_release_files_are_every_file_of_the_package(tmp_path):
    """In the package layout, every .py file of mem_cache/allocator/ counts, imported or not."""
    root = fake_sglang(tmp_path, layout=sglang.PACKAGE)
    folder = root.resolve() / "sglang/srt/mem_cache/allocator"
    assert sglang.release_files(str(root)) == [folder / "__init__.py", folder / "token.py"]


def test_a_release_missing_a_package_names_it_in_one_line(tmp_path):
    """An allocator module importing a package the import set lacks: exit 2, one line naming it and where."""
    needs_import_set_torch()
    root = fake_sglang(tmp_path / "rel", layout=sglang.SINGLE_FILE, allocator_source=f"import torch\nimport {ABSENT}\n")
    got = run("state_machines.cli", "targets", "--target", "sglang:token", "--sglang-path", str(root), cwd=tmp_path)
    assert got.returncode == 2, got.stdout + got.stderr
    assert got.stdout == ""
    assert got.stderr.splitlines() == [
        f"kv-lockstep: error: sglang 0.5.5 needs the package {ABSENT}, which the import set lacks:"
        f" ModuleNotFoundError: No module named '{ABSENT}' (at sglang/srt/mem_cache/allocator.py:2);"
        " add it to constraints/sglang.txt and rerun `make sglang V=0.5.5`"
    ]


def test_the_matrix_gives_a_release_that_cannot_import_one_row_saying_why(tmp_path):
    """A release whose allocators cannot import is one row, target `all`, with the reason; the matrix exits 0."""
    needs_import_set_torch()
    root = fake_sglang(tmp_path / "0.5.5", layout=sglang.PACKAGE, allocator_source=f"import {ABSENT}\n")
    got = run("state_machines.runs.matrix", str(root), "--json", str(tmp_path / "rows.json"), cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    [row] = json.loads((tmp_path / "rows.json").read_text())
    assert (row["release"], row["target"]) == ("0.5.5", "all")
    assert row["result"].startswith(f"cannot import: sglang 0.5.5 needs the package {ABSENT}, which the import set lacks")
    assert got.stdout.splitlines()[2].startswith(f"| 0.5.5 | all | cannot import: sglang 0.5.5 needs the package {ABSENT}")


@pytest.mark.parametrize("command", ["fuzz", "targets"])
def test_a_release_that_exits_while_it_imports_is_bad_input(tmp_path, command):
    """``sys.exit(0)`` at an allocator module's top level: the command
    ended with exit 0 and no word, a failing trace's replay too (a pass).
    Now exit 2, one line naming the release and the exit."""
    needs_import_set_torch()
    root = fake_sglang(tmp_path / "rel", layout=sglang.SINGLE_FILE, allocator_source="import sys\nsys.exit(0)\n")
    args = ["--max-examples", "5"] if command == "fuzz" else []
    got = run("state_machines.cli", command, "--target", "sglang:token", "--sglang-path", str(root), *args, cwd=tmp_path)
    assert got.returncode == 2, got.stdout + got.stderr
    assert got.stderr.splitlines() == ["kv-lockstep: error: sglang 0.5.5 not importable: SystemExit: 0 (at sglang/srt/mem_cache/allocator.py:2)"], got.stderr


def test_a_release_whose_import_never_returns_is_bad_input_within_the_build_timeout(tmp_path):
    """An allocator module that waits forever at its top level hung
    ``targets`` (and ``fuzz``, ``replay``): --build-timeout covered a custom
    module's import only.  Exit 2, one line naming the release, the limit
    and the line it waited on."""
    needs_import_set_torch()
    root = fake_sglang(tmp_path / "rel", layout=sglang.SINGLE_FILE, allocator_source="import time\ntime.sleep(600)\n")
    # The floor (5 minutes: sglang's own import takes about 10 s) lowered for the test.
    script = ("import sys\nfrom state_machines.targets import sglang\nsglang.IMPORT_FLOOR_S = 0\n"
              "from state_machines.cli import main\nsys.exit(main(sys.argv[1:]))")
    got = subprocess.run([sys.executable, "-c", script, "targets", "--target", "sglang:token", "--sglang-path", str(root),
                          "--build-timeout", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))  # without the clock: TimeoutExpired
    assert got.returncode == 2, got.stdout + got.stderr
    assert got.stderr.splitlines() == ["kv-lockstep: error: sglang 0.5.5: importing its allocators did not return within 3 s"
                                       " (--build-timeout) (at sglang/srt/mem_cache/allocator.py:2)"], got.stderr


def test_a_short_build_timeout_still_lets_a_release_import(tmp_path):
    """--build-timeout is sized for a factory (1 s in the suite); the
    release's import clock has a floor, so a slow import is not refused
    under it; and a limit past setitimer's range (1e12) was a traceback."""
    needs_import_set_torch()
    root = fake_sglang(tmp_path / "rel", layout=sglang.SINGLE_FILE, allocator_source="import time\ntime.sleep(2)\n")
    for limit in ("1", "1e12"):
        got = run("state_machines.cli", "targets", "--target", "sglang:token", "--sglang-path", str(root),
                  "--build-timeout", limit, cwd=tmp_path)
        assert "Traceback" not in got.stderr and "did not return" not in got.stderr, got.stderr
