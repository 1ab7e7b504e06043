"""The make targets install nothing that moves torch off what `make sglang` put in .venv."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _recipes() -> str:
    return (ROOT / "Makefile").read_text() + (ROOT / "mk" / "sglang.mk").read_text()


def test_only_make_install_installs_the_project_and_it_forgets_sglangs_import_set():
    """`pip install -e .` (or an extra of it) re-resolves torch==2.13.0 over make sglang's 2.14.1
    (pip --dry-run: 'Would install kv-lockstep-0.1.0 torch-2.13.0+cpu'): only `make install` runs it,
    and it removes the stamp that would have `make sglang` report its import set up to date."""
    installs = [line.strip() for line in _recipes().splitlines() if "$(PIP_INSTALL)" in line and " -e " in line]
    assert installs == ["$(PIP_INSTALL) -e ."]
    install = re.search(r"^install:\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "rm -f $(VENV)/.sglang-deps" in install


def test_the_tools_the_makefile_installs_alone_are_pinned_as_pyprojects_extras():
    """`make lint`'s ruff and `make sglang-coverage`'s coverage.py, installed alone, as the extras pin them."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra, tool in (("lint", "ruff"), ("cover", "coverage")):
        (pin,) = re.findall(rf'^{extra} = \["({tool}[^"]*)"\]$', pyproject, re.M)
        assert f"$(PIP_INSTALL) '{pin}'" in _recipes(), pin
