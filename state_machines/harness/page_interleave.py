"""The lockstep harness for page-interleaved pools (the "page_interleave" family).

sglang's ``PageInterleavePoolAllocator`` (logical-page KV sharding, from
0.5.20) keeps a free list per owner class (page ``l`` is class ``l % N``)
and allocates through ``alloc_extend`` only, with one rotation base per
request: ``alloc()`` and ``alloc_decode()`` raise (prefill nodes only).
Its caller (``alloc_paged_token_slots_extend`` in ``mem_cache/allocation.py``)
passes ``None`` for a request with no cached prefix (the allocator draws a
base and writes it back) and the chain's base otherwise; every extend
starts page-aligned (the radix match quantum and chunk flooring), so a
request whose last extend ended mid-page is not grown again.

``PageInterleaveLockstep`` runs the core steps against the core
``OwnershipModel``; ``alloc`` and ``extend`` both go through
``alloc_extend`` with the bases a consistent prefix tree would hold (read
off the prefix's last page, ``chain_base``).  After each call it checks the
bases were resolved, each new page's class follows its chain's rotation,
and ``None`` came back exactly when some class was short.  After every step
the core checks run on the union of the class lists (``available_size``
there is the aggregate free size), plus each class list holding only its
own pages and ``available_size()`` being the min-class floor.  The model
predicts classes and counts, never which page of a class comes out.
"""

from __future__ import annotations

import itertools

import torch
from attrs import define, frozen

from reference_model import page_interleave as pi
from state_machines.harness import twins
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, Lockstep, Pool, ids
from state_machines.harness.machines import MAX_PAGES, FreeGroupMachine, draws
from state_machines.harness.steps import EntryRef, ReqRef, step
from state_machines.targets import TargetError


@frozen
class _AggregateView:
    """The allocator as the core checks see one pool: its census, and the
    aggregate free size as ``available_size()`` (the accounting identity's
    term; the min-class floor is checked apart)."""

    allocator: object

    def get_all_free_pages(self):
        return self.allocator.get_all_free_pages()

    def available_size(self) -> int:
        return self.allocator.aggregate_free_size()


@define
class PageInterleaveLockstep(Lockstep):
    # Decode is not this class's (prefill only); the batched extend is modelled.
    caller_steps = ("extend",)
    # Whether the last alloc_extend call had to return None (``_short``).
    class_short: bool = False

    def start_models(self, defers_frees: bool) -> None:
        if "extend" in self.disabled_rules:
            raise TargetError(f"{self.config.target} allocates through alloc_extend only, which cannot run here: "
                              f"{self.disabled_rules['extend']}")
        super().start_models(defers_frees)

    @property
    def shard_size(self) -> int:
        return int(self.allocator.shard_size)

    def why_not(self, step: str) -> str | None:
        if step == "decode" and "decode" in self.disabled_rules:
            return self.disabled_rules["decode"]
        if step == "load_back" and not callable(getattr(self.allocator, "alloc_cyclic", None)):
            return f"{self.config.target} has no alloc_cyclic (sglang adds it in 0.5.23)"
        return super().why_not(step)

    # -- steps --

    @step
    def load_back(self, n: int, start: int) -> ReqRef | None:
        """HiCache's load-back of a host copy: ``alloc_cyclic(start, n)``,
        ``n`` slots of whole pages whose owners cycle from class ``start % N``
        (a copy keeps its pages' owners), held by a new request.  Returns it,
        or None when a class is short."""
        ps, shard = self.page_size, self.shard_size
        what = f"alloc_cyclic(start_class={start}, need_size={n})"
        out = self._call(what, self.allocator.alloc_cyclic, start, n)
        need = pi.class_counts(start % shard, n // ps, shard)
        class_free = pi.class_free_counts(self.model, shard)
        self.class_short = any(k > f for k, f in zip(need, class_free))
        self._judge(pi.none_iff_class_short, what, out is None, need, class_free)
        slots = self._index_tensor(what, out, n, n // ps)
        if slots is None:
            return None
        pages = [slots[i] // ps for i in range(0, n, ps)]
        self._judge(pi.pages_follow_rotation, what, ["the copy"], [start % shard], [0], [pages], shard)
        return self._hold(slots, pages)

    def _hold(self, slots: list[int], pages: list[int]) -> ReqRef:
        """A new request on a free row holds ``pages`` (checked free first)."""
        self._judge_handout(pages)
        row = self.free_rows()[0]
        made = self.model.new_request(row, pages)
        self.row_holder[row] = made.rid
        self.rows[row, : len(slots)] = torch.tensor(slots, dtype=self.rows.dtype, device=self.rows.device)
        return ReqRef(made.rid)

    def extendable(self) -> list[ReqRef]:
        """Requests whose length is page-aligned: an extend starts on a page
        boundary, so one whose last extend ended mid-page is done growing."""
        return [r for r in self.live() if self.model.requests[r.rid].spare == 0]

    # -- checks --

    def pools(self) -> list[Pool]:
        return [Pool(_AggregateView(self.allocator), self.model)]

    def check_joint(self, censuses: list[list[int]]) -> None:
        """Each class list holds its own pages; ``available_size()`` is the
        min-class floor of the model's per-class free counts."""
        a = self.allocator
        n = self.shard_size
        lists = self._call("class census", lambda: [torch.cat((f, r)) for f, r in zip(a.class_free_pages, a.class_release_pages)])
        if sum(pages.numel() for pages in lists) < TENSOR_CENSUS_PAGES or not self._twin_holds(
                pi.free_pages_in_own_class, "classes", twins.classes_hold, lists, n):
            self._judge(pi.free_pages_in_own_class, [ids(pages) for pages in lists], n)
        available = self._count("available_size()", a.available_size)
        self._judge(pi.interleave_available_size_agrees, available, pi.class_free_counts(self.model, self.shard_size),
                    self.page_size, self.shard_size)

    # -- the allocation hooks --

    def _short(self, pages: int) -> bool:
        return self.class_short

    def _alloc_call(self, n: int, req: ReqRef | None, prefix: EntryRef | None):
        """``alloc`` of ``n`` slots is an ``alloc_extend`` of one request."""
        before, last = self._alloc_start(req, prefix)
        return self._extend_call([before], [before + n], [last], n)

    def _extend_call(self, prefix_lens: list[int], seq_lens: list[int], last: list[int], total: int):
        """``alloc_extend(..., rotation_bases=...)``: ``None`` for a request
        with no prefix, else its chain's base; then the bases, the classes
        of the new pages and whether ``None`` was due are judged."""
        ps, n = self.page_size, self.shard_size
        prefix_pages = [p // ps for p in prefix_lens]
        given = [pi.chain_base(lst // ps, k, n) if k else None for lst, k in zip(last, prefix_pages)]
        bases = list(given)
        device = self.rows.device

        def host(values):
            return torch.tensor(values, dtype=torch.int64)

        what = (f"alloc_extend(prefix_lens={prefix_lens}, seq_lens={seq_lens}, last_loc={last},"
                f" extend_num_tokens={total}, rotation_bases={given})")
        out = self._call(what, lambda: self.allocator.alloc_extend(
            host(prefix_lens).to(device), host(prefix_lens), host(seq_lens).to(device), host(seq_lens),
            host(last).to(device), total, rotation_bases=bases,
        ))
        new_pages = [-(-s // ps) - k for s, k in zip(seq_lens, prefix_pages)]
        if out is not None:
            self._judge(pi.rotation_bases_resolved, what, given, bases, n)
        need = self._class_need(bases, prefix_pages, new_pages, out is None)
        class_free = pi.class_free_counts(self.model, n)
        self.class_short = any(k > f for k, f in zip(need, class_free))
        self._judge(pi.none_iff_class_short, what, out is None, need, class_free)
        if isinstance(out, torch.Tensor) and out.dim() == 1 and out.numel() == total:
            slots, pages, at = ids(out), [], 0
            for s, p in zip(seq_lens, prefix_lens):
                pages.append([slots[j] // ps for j in range(at, at + s - p, ps)])
                at += s - p
            names = [f"batch member {i}" for i in range(len(pages))]
            self._judge(pi.pages_follow_rotation, what, names, bases, prefix_pages, pages, n)
        return what, out

    def _class_need(self, bases: list, prefix_pages: list[int], new_pages: list[int], got_none: bool) -> list[int]:
        """Pages per class the batch draws under the resolved ``bases``.  A
        base left unresolved by a call that returned ``None`` may be any
        class: the need is that of a choice that is short, if one is."""
        n = self.shard_size
        open_ = [i for i, b in enumerate(bases) if not isinstance(b, int)]
        class_free = pi.class_free_counts(self.model, n)
        need = None
        for choice in itertools.product(range(n), repeat=len(open_) if got_none else 0):
            filled = list(bases)
            for i, c in zip(open_, choice):
                filled[i] = c
            need = pi.batch_class_needs(filled, prefix_pages, new_pages, n)
            if any(k > f for k, f in zip(need, class_free)):
                return need
        return need if need is not None else pi.batch_class_needs([0] * len(bases), prefix_pages, new_pages, n)

    # -- replay --

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw."""
        if rule == "load_back":
            if (why := self.why_not("load_back")) is not None:
                return f"load_back does not run here: {why}"
            return None if self.free_rows() else f"every one of the {self.config.rows} rows is in use"
        grown = [args["req"]] if rule == "alloc" and args.get("req") is not None else args.get("reqs", []) if rule == "extend" else []
        for ref in grown:
            if ref.rid in self.model.requests and self.model.requests[ref.rid].spare:
                return f"{ref!r} ends mid-page: a page-interleaved extend starts on a page boundary"
        return None


class PageInterleaveMachine(FreeGroupMachine):
    """The core rules (``alloc`` and ``extend`` grow page-aligned requests
    only), and HiCache's load-back where the allocator has ``alloc_cyclic``."""

    @draws(guard=lambda s: s.free_rows() and s.runs("load_back"), pages=(1, MAX_PAGES), start=(0, 5))
    def load_back(self, pages, start):
        self._do("load_back", pages * self.state.page_size, start)


def is_page_interleave(allocator) -> bool:
    """Whether an allocator keeps sglang's per-class free lists."""
    return all(hasattr(allocator, n) for n in ("class_free_pages", "class_release_pages", "shard_size"))
