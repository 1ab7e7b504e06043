"""The ownership model: who owns every page, in plain Python (no torch).

The model predicts sets and counts, never allocation order: it records the
pages an allocator handed out and checks them, so an allocator that keeps
its free list in any order passes.
"""

from reference_model import invariants
from reference_model.invariants import CHECKS, no_slot_handed_out_twice
from reference_model.ledger import Ledger
from reference_model.model import CacheEntry, Owner, OwnershipModel, Request
from reference_model.swa import SWASide

__all__ = [
    "CHECKS",
    "CacheEntry",
    "Ledger",
    "Owner",
    "OwnershipModel",
    "Request",
    "SWASide",
    "invariants",
    "no_slot_handed_out_twice",
]
