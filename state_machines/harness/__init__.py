"""The lockstep harness: steps (``steps.py``), the core family
(``lockstep.py``, ``machines.py``), the SWA family (``swa.py``) and the
registry that picks one per target (``family.py``).

A printed trace runs again after ``from state_machines.harness import build``.
"""

from state_machines.harness.family import FAMILIES, Family, build, machine_for
from state_machines.harness.lockstep import InvariantViolation, Lockstep
from state_machines.harness.machines import RunRecord
from state_machines.harness.steps import STEPS, EntryRef, ReqRef, Step

__all__ = [
    "FAMILIES",
    "STEPS",
    "EntryRef",
    "Family",
    "InvariantViolation",
    "Lockstep",
    "ReqRef",
    "RunRecord",
    "Step",
    "build",
    "machine_for",
]
