"""What one run drives: target, mutant, pool shape, device."""

from __future__ import annotations

from pathlib import Path

from attrs import asdict, field, fields, frozen

# How long the target's own code may run outside any allocator call, in
# its factory, its probes or its module's import, before it counts as hung
# (``fuzz --build-timeout``; the watchdog's build limit, and
# ``targets.base.import_death``'s).  Apart from the call limit, and long:
# a device pool's first build initialises CUDA or the NPU runtime, which
# can take well over a call's 10 s.
BUILD_TIMEOUT_S = 120.0

# The per-call limit's bounds: a day at most (what a trace may carry), and a
# tenth of a second at least: below it a correct call (a first torch op, a
# loaded machine) is taken for a hang (1e-9 failed builtin:token as
# allocator_hung on its first call).
MAX_CALL_TIMEOUT_S = 24 * 3600
MIN_CALL_TIMEOUT_S = 0.1


def call_limit_holds(value) -> bool:
    """Whether ``value`` is a per-call limit a run may have (and a trace carry)."""
    return type(value) in (int, float) and MIN_CALL_TIMEOUT_S <= value <= MAX_CALL_TIMEOUT_S


def _call_limit(config, attribute, value) -> None:
    if not call_limit_holds(value):
        raise ValueError(f"call_timeout_s is {value!r}, not a number of seconds in"
                         f" [{MIN_CALL_TIMEOUT_S}, {MAX_CALL_TIMEOUT_S}]")


@frozen
class Config:
    """One lockstep configuration; a trace stores it so a replay rebuilds it."""

    target: str = "builtin:token"
    mutant: str | None = None
    page_size: int = 1
    need_sort: bool = False
    device: str = "cpu"
    # Pool size in slots; the pool has size // page_size pages.
    size: int | None = None
    # req_to_token: `rows` rows of `row_pages * page_size` slots.
    rows: int = 4
    row_pages: int = 12
    sglang_path: str | None = field(default=None)
    # An allocator call that takes longer than this is reported as a hang
    # (`allocator_hung`); `kv-lockstep fuzz --call-timeout`.
    call_timeout_s: float = field(default=10.0, validator=_call_limit)
    # req_to_token's dtype: int32 as sglang's ReqToTokenPool keeps it; "int64"
    # for `kv-lockstep fuzz --row-dtype int64`.
    row_dtype: str = "int32"
    # Drive what no sglang caller does (`fuzz --latent`): at page size 1,
    # decode and extend go to alloc_decode / alloc_extend instead of alloc().
    # A failure then is a latent finding, not a gate failure.
    latent: bool = False
    # Who drives the allocator: "harness" (the simulated caller), or sglang's
    # own cache and scheduler helpers ("radix", "unified", "unified-swa",
    # "swa-radix", MODULE:ATTR), with
    # free groups where the release's scheduler opens them ("release"), or
    # forced around every result ("all") or none ("none").
    caller: str = "harness"
    groups: str = "release"

    @property
    def pool_size(self) -> int:
        return self.size if self.size is not None else 10 * self.page_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        names = {a.name for a in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known)

    def runs_users_code(self) -> bool:
        """Whether building this runs code of the user's: a ``MODULE:ATTR``
        target or cache class (``--caller``).  A built-in target, an sglang
        kind and a named cache are ours."""
        return self.target.partition(":")[0] not in ("builtin", "sglang") or ":" in self.caller

    def label(self) -> str:
        bits = [self.target]
        if self.mutant:
            bits.append(f"mutant={self.mutant}")
        bits.append(f"page_size={self.page_size}")
        if self.need_sort:
            bits.append("need_sort")
        if self.device != "cpu":
            bits.append(f"device={self.device}")
        if self.caller != "harness":
            bits.append(f"caller={self.caller} groups={self.groups}")
        if self.sglang_path:
            bits.append(f"sglang={Path(self.sglang_path).name}")
        if self.row_dtype != "int32":
            bits.append(f"rows={self.row_dtype}")
        if self.latent:
            bits.append("latent")
        return " ".join(bits)
