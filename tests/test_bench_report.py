"""RESULTS.md says where the harness still loses to the baseline, and why."""

from bench.report import _raw_losses


def _bug(name, ratio_seconds, ratio_steps):
    return {"name": name, "ratio_seconds": ratio_seconds, "ratio_steps": ratio_steps}


def test_raw_losses_split_search_losses_from_dearer_steps():
    """A bug slower in seconds is a search loss when it also took more steps, else a dearer step; wins are not listed."""
    text = "\n".join(_raw_losses({"bugs": [_bug("more", 2.0, 1.5), _bug("dear", 1.2, 1.0), _bug("won", 0.5, 0.4)]}))
    search, dearer = (line for line in text.splitlines() if line.startswith("- "))
    assert "(2 of 3" in text
    assert "more (2.00" in search and "dear" not in search
    assert "dear (1.20" in dearer and "more (2.00" not in dearer
    assert "won" not in text


def test_raw_losses_say_so_when_there_are_none():
    """With no bug slower in raw seconds the section says the harness is nowhere slower."""
    assert "nowhere slower" in "\n".join(_raw_losses({"bugs": [_bug("won", 0.5, 0.4)]}))
