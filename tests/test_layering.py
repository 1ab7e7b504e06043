"""The layering `make lint` checks holds, and the check can fail."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_project_has_no_import_cycle_and_no_torch_in_the_model():
    """allocators/, reference_model/ and state_machines/ import in one direction, without cycles."""
    assert _checker().problems() == []


def test_the_layering_check_names_a_cycle_an_upward_import_and_torch_in_the_model(tmp_path):
    """A lazy import that closes a cycle, an allocator importing the harness, and torch in the model are each named."""
    files = {
        "allocators/__init__.py": "",
        "allocators/a.py": "def f():\n    import state_machines.x\n",
        "reference_model/__init__.py": "",
        "reference_model/m.py": "import torch\n",
        "state_machines/__init__.py": "",
        "state_machines/x.py": "from state_machines import y\n",
        "state_machines/y.py": "def g():\n    from state_machines.x import h\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sorted(_checker().problems(tmp_path)) == [
        "allocators/a.py: allocators imports state_machines",
        "import cycle: state_machines.x -> state_machines.y -> state_machines.x",
        "reference_model/m.py: reference_model imports torch",
    ]
