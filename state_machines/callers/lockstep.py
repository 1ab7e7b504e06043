"""The real caller: sglang's own prefix cache, request pool and scheduler
helpers, driven in lockstep with its allocator.

Where the core harness simulates the cache with its own rows, here every
object is the release's: ``Req``, ``ReqToTokenPool``, the cache class
(``RadixCache``, ``UnifiedRadixCache`` with or without its SWA component,
or a subclass), ``alloc_for_extend``,
``alloc_for_decode``, ``release_kv_cache`` and ``cache_unfinished_req`` /
``checkpoint_kv_cache``.  The steps are what a scheduler does (a request
arrives, a prefill batch, a decode step, an eviction, a retraction, an
abort, a window slide on an SWA cache); free groups open where the release's own scheduler opens them, or
where ``--groups`` forces them.  After every step, and after every
request's result while a group is open, the census (``reference_model.caller``)
checks that the tree, the live rows, the free list and the open group hold
the pool between them, each page once.

A failure is labelled by reachability (``_reachability``): *reachable* when
the same steps fail under the release's own free-group placement, *latent*
when only a forced placement shows it.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import attrs
import torch
from attrs import define, field

from reference_model import caller as census
from reference_model import invariants
from state_machines.callers import placement as placement_mod
from state_machines.callers.adapters import (
    Generation,
    ids,
    open_group_pages,
    path_reader,
    path_slots,
    tree_sizes,
    tree_slots,
)
from state_machines.callers.release import (
    STAND_INS,
    SWA_KINDS,
    SWA_STAND_INS,
    VOCAB_SIZE,
    Release,
    cache_class,
    make_cache,
    open_release,
    sliding_window,
)
from state_machines.config import Config
from state_machines.harness.lockstep import (
    InvariantViolation,
    Lockstep,
    building,
    census_of,
    factory_takes_size,
    violation_type,
)
from state_machines.harness.steps import ReqRef, Step, step, steps_of
from state_machines.harness.swa import is_hybrid
from state_machines.orphans import call_user_code
from state_machines.targets.base import TargetError, quiet
from state_machines.targets.cpu_paths import cpu_kernels

# Prompts: each decimal digit (1..ALPHABET) is a page of that token.
ALPHABET = 3
MAX_PROMPT_PAGES = 3
# Requests waiting at once, at most.
MAX_WAITING = 4
WAITING, RUNNING, DONE = "waiting", "running", "done"


def max_new_tokens(page_size: int, swa: bool = False) -> int:
    """The most new tokens a request asks for: past two page boundaries, or
    four on an SWA cache (its windows slide only a page or more past what the
    tree holds)."""
    return (4 if swa else 2) * page_size + 1


def prompt_tokens(prompt: int, page_size: int) -> list[int] | None:
    """The tokens ``prompt`` spells, or None when a digit is outside 1..3 or
    it has more than ``MAX_PROMPT_PAGES`` digits."""
    digits = [int(d) for d in str(prompt)]
    if not 1 <= len(digits) <= MAX_PROMPT_PAGES or not all(1 <= d <= ALPHABET for d in digits):
        return None
    return [d for d in digits for _ in range(page_size)]


def next_token(tokens) -> int:
    """The stand-in model: greedy, so equal sequences continue alike."""
    return sum(tokens) % ALPHABET + 1


# The sglang kinds the release's prefix caches drive (the hybrid swa only
# under a cache that pairs SWA peers: ``pairs_swa_peers``).
CACHE_KINDS = ("token", "paged", "npu", "swa")


def _not_a_cache_kind(caller: str, what: str) -> str:
    # Another kind (a Mamba, HiSparse or unified pool) ran into the
    # release's code with what it never pairs: a false alarm on the release.
    return (f"--caller {caller} drives {', '.join(f'sglang:{k}' for k in CACHE_KINDS)} or a MODULE:ATTR allocator"
            f" of those, not {what}")


def release_kind(allocator) -> str | None:
    """The sglang kind whose class is the most specific one ``allocator``
    is an instance of, or None (an allocator of the user's own)."""
    from state_machines.targets import sglang as sglang_targets

    best: tuple[str, type] | None = None
    for kind in sglang_targets.FACTORIES:
        try:
            cls = sglang_targets.class_of(kind)
        except TargetError:  # the release has none
            continue
        if isinstance(allocator, cls) and (best is None or issubclass(cls, best[1])):
            best = (kind, cls)
    return None if best is None else best[0]


def pairs_swa_peers(release, cache_type: type) -> bool:
    """Whether ``cache_type`` keeps a hybrid allocator's SWA side: a
    ``UnifiedRadixCache`` (built with the SWA component over one) or an
    ``SWARadixCache``, or a subclass of either."""
    m = release.modules
    return any(base is not None and issubclass(cache_type, base) for base in (m.UnifiedRadixCache, m.SWARadixCache))


@define
class Live:
    """A request of the run: the real ``Req`` and its place in the scheduler."""

    req: Any
    status: str = WAITING


def swa_queues_full_slots(allocator, ps: int) -> bool:
    """Whether the hybrid allocator's ``free_swa`` in a free group queues the
    full slots, resolved to their SWA peers at the group's end (sglang
    0.5.18: ``allocator/swa.py:352``, ``:370-375``; the peers stay mapped
    until then), rather than the SWA slots, resolved and unmapped at once
    (0.5.23).  Probed on a copy: one page of full slots mapped to one of SWA
    slots, ``free_swa`` inside a group, and is the mapping still there?
    Anything that stops the probe reads as the second form."""
    try:
        with quiet():
            probe = copy.deepcopy(allocator)
            full, swa = probe.full_attn_allocator.alloc(ps), probe.swa_attn_allocator.alloc(ps)
            if full is None or swa is None:
                return False
            mapping = probe.full_to_swa_index_mapping
            mapping[full.long()] = swa.to(mapping.dtype)
            probe.free_group_begin()
            probe.free_swa(full)
            return bool((mapping[full.long()] > 0).all())
    except Exception:  # noqa: BLE001 - the release's own form unknown: as 0.5.23's
        return False


@define
class CallerLockstep:
    """One release's allocator, request pool and prefix cache, driven as its
    scheduler drives them."""

    config: Config
    release: Release
    gen: Generation
    allocator: Any
    pool: Any  # the release's ReqToTokenPool
    cache: Any
    placement: placement_mod.Placement
    pool_pages: frozenset = frozenset()
    swa_pool_pages: frozenset = frozenset()
    # How the census reads a locked path (adapters.path_reader); None: it cannot.
    path_how: str | None = None
    stand_ins: tuple[str, ...] = ()
    requests: dict[int, Live] = field(factory=dict)
    waiting: list[int] = field(factory=list)
    running: list[int] = field(factory=list)
    steps: list[Step] = field(factory=list)
    step_depth: int = 0
    disabled_rules: dict[str, str] = field(factory=dict)
    # Census predicates this cache cannot feed, with the reason.
    unchecked: dict[str, str] = field(factory=dict)
    in_group: bool = False
    # The request in chunked prefill (rid), or None: it is neither waiting nor running.
    chunked: int | None = None
    # The cache pairs full slots with SWA peers (an SWA cache over the hybrid allocator).
    swa: bool = False
    # A re-run of the steps under the release's own placement (_reachability).
    replaying: bool = False
    # Whether free_swa in a free group queues full slots (swa_queues_full_slots).
    swa_queues_full_slots: bool = False

    # The seam's side and the call wrapper are the core harness's own.
    _start_step = Lockstep._start_step
    _finish_step = Lockstep._finish_step
    _call = Lockstep._call
    _count = Lockstep._count
    _judge = Lockstep._judge

    def why_not(self, step: str) -> str | None:
        """Why ``step`` does not run here, or None: this family runs its own
        steps, ``slide_windows`` on an SWA cache only."""
        if step == "chunked_prefill" and self.gen.chunking:
            return self.gen.chunking
        if step == "slide_windows" and not self.swa:
            return f"{type(self.cache).__name__} keeps no sliding windows (an SWA cache does: --caller unified-swa)"
        if step in steps_of(type(self)):
            return None
        return f"the real caller has no step {step}"

    def runs(self, step: str) -> bool:
        return self.why_not(step) is None

    @classmethod
    def from_config(cls, config: Config) -> CallerLockstep:
        """The release's objects for ``config``, checked once before any step."""
        from state_machines import targets

        if config.device != "cpu":
            raise TargetError(f"--caller runs on cpu only, not {config.device}")
        release = open_release(config.sglang_path)
        target = targets.resolve(config.target, config.mutant, config.sglang_path)
        if target.spec.startswith("builtin:"):
            raise TargetError(
                f"--caller {config.caller} drives sglang's own allocator: --target sglang:token (page size 1),"
                f" sglang:paged, or MODULE:ATTR, not {target.spec}"
            )
        kind = target.spec.partition(":")[2] if target.spec.startswith("sglang:") else None
        if kind is not None and kind not in CACHE_KINDS:
            raise TargetError(_not_a_cache_kind(config.caller, target.spec))
        if config.latent:
            raise TargetError("--latent: --caller drives the release's own caller code, which has no latent mode"
                              " (a failure under --caller is reachable, or latent only under --groups all)")
        if config.row_dtype != "int32":
            raise TargetError(f"--row-dtype {config.row_dtype}: --caller drives the release's own ReqToTokenPool, whose"
                              " rows keep the release's dtype; --row-dtype is for the harness's own rows")
        ps = config.page_size
        if target.family == "swa":
            # The SWA family takes page size 1 for its alloc() (it asserts above 1); sglang's
            # callers allocate with alloc_extend / alloc_decode there, as this one does.
            target = attrs.evolve(target, page_sizes=None)
        # The target's own code, and the cache class's below, run in building
        # phases as ``family.build``'s factory does: in a watched worker, one
        # that exits or hangs there is bad input (``watchdog.build_death``,
        # ``build_hang``), not ``worker_died`` between calls or a hang with no limit.
        with building("its factory"):
            allocator = targets.build(target, size=config.pool_size, page_size=ps, device="cpu", need_sort=config.need_sort)
        swa = is_hybrid(allocator)
        if kind is None and (built := release_kind(allocator)) not in (None, *CACHE_KINDS):
            # A factory of the user's, judged on what it built.
            raise TargetError(_not_a_cache_kind(config.caller, f"{target.spec} (a {type(allocator).__name__}, sglang:{built})"))
        if config.caller in SWA_KINDS and not swa:
            raise TargetError(f"--caller {config.caller} pairs full slots with SWA peers: it drives the hybrid"
                              f" allocator (--target sglang:swa), not {target.spec}")
        kernels = cpu_kernels(allocator, ps)
        m = release.modules
        release.configure(ps)
        pool = m.ReqToTokenPool(size=config.rows, max_context_len=config.row_pages * ps, device="cpu",
                                enable_memory_saver=False)
        cache_type = cache_class(release, config.caller)
        if swa and not pairs_swa_peers(release, cache_type):
            # A plain RadixCache frees a hybrid allocator's full slots without their SWA side.
            raise TargetError(f"--caller {config.caller} ({cache_type.__name__}) keeps no SWA peers: it drives a plain"
                              f" allocator, not the hybrid {target.spec} (over that: --caller unified-swa, unified or"
                              " swa-radix, or a subclass of UnifiedRadixCache or SWARadixCache)")
        with building(f"its cache ({cache_type.__name__}, --caller {config.caller})"):
            cache = make_cache(release, cache_type, pool, allocator, ps, swa=swa)
        how = path_reader(cache)
        unchecked = {} if how else {"protected_prefix_is_locked_path": f"{type(cache).__name__} exposes no tree path"}
        state = cls(
            config=config, release=release, gen=release.generation, allocator=allocator, pool=pool, cache=cache,
            placement=placement_mod.chosen(config.groups, release.placement), path_how=how,
            stand_ins=(release.runtime, *STAND_INS) + (SWA_STAND_INS if swa else ()) + tuple(kernels), unchecked=unchecked, swa=swa,
        )
        fresh = state._call("census", census_of, state._full())
        state.pool_pages = frozenset(fresh)
        # The pool is what the fresh census lists: one that lists the padding
        # page 0, or a page short, was taken for the pool itself (no failure).
        state._judge(invariants.fresh_pool_lists_every_page, fresh,
                     config.pool_size // ps if factory_takes_size(config) else None)
        if swa:
            state.swa_queues_full_slots = call_user_code(swa_queues_full_slots, allocator, ps)
            state.swa_pool_pages = frozenset(state._call("SWA census", census_of, allocator.swa_attn_allocator))
        state.check()
        return state

    def header(self) -> list[str]:
        """What a run's header says: the objects, the placement, the stand-ins."""
        rp = self.release.placement
        window = f", SWA window {sliding_window(self.page_size)} tokens" if self.swa else ""
        return [
            f"caller: {type(self.cache).__name__} over {type(self.allocator).__name__}, sglang {self.release.modules.version},"
            f" API generation {self.gen.name}{window}",
            f"free groups: {self.placement.label()} (--groups {self.config.groups}); the release's scheduler processes"
            f" prefill results {rp.prefill.describe()}, decode results {rp.decode.describe()}",
            *[f"stand-in: {s}" for s in self.stand_ins],
            *[f"not checked: {k}: {v}" for k, v in sorted(self.unchecked.items())],
        ]

    # -- what a rule may act on --

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def refs(self, rids) -> list[ReqRef]:
        return [ReqRef(r) for r in rids]

    def budget(self) -> int:
        """Tokens an allocation may take: free plus evictable.  In a step:
        the allocator's count is called as every call is, so what it raises
        is the run's failure with its trace."""
        return self._count("available_size()", self.allocator.available_size) + tree_sizes(self.cache)[0]

    def guard_budget(self) -> int:
        """``budget`` for a guard, or a draw between steps, which must not
        fail: 0 where the count raises or is no number (the next step's
        calls report that, with a trace; it was a harness error)."""
        try:
            return int(self.allocator.available_size()) + tree_sizes(self.cache)[0]
        except Exception:  # noqa: BLE001 - the allocator's own state: a step reports it
            return 0

    def can_decode(self) -> bool:
        # Each request may need a new page (the helpers evict that much first).
        return bool(self.running) and len(self.running) * self.page_size <= self.guard_budget()

    def abortable(self) -> list[ReqRef]:
        # Running and not yet aborted: leaving the waiting queue frees nothing.
        return [ReqRef(r) for r in self.running if not self.requests[r].req.to_finish]

    def not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a trace's step could not have been drawn here, or None (the
        rules' preconditions, for replay)."""
        ps = self.page_size
        req = args.get("req")
        if rule == "arrive":
            if prompt_tokens(args["prompt"], ps) is None:
                return f"prompt {args['prompt']} is not 1 to {MAX_PROMPT_PAGES} digits from 1..{ALPHABET}"
            if args["out"] > max_new_tokens(ps, self.swa):
                return f"out {args['out']} is more than {max_new_tokens(ps, self.swa)} new tokens"
            # Each token but the last new one is a slot of its req_to_token row.
            filled, row = len(prompt_tokens(args["prompt"], ps)) + args["out"] - 1, self.config.row_pages * ps
            if filled > row:
                return (f"prompt {args['prompt']} and out {args['out']} fill {filled} slots of a row, which holds {row}"
                        f" (row_pages {self.config.row_pages} at page size {ps})")
            return f"{MAX_WAITING} requests are waiting already" if len(self.waiting) >= MAX_WAITING else None
        if rule == "prefill":
            if self.chunked is not None:
                return f"req_{self.chunked} is in chunked prefill (its chunks go first)"
            return None if self.waiting else "no request is waiting"
        if rule == "chunked_prefill":
            return self.why_not(rule) or self._why_not_chunk(args["pages"])
        if rule == "decode":
            if [r.rid for r in args["reqs"]] != self.running:
                return f"the running batch is {self.refs(self.running)}"
            return None if self.can_decode() else "the running batch does not fit in free + evictable memory"
        if rule == "evict_tokens":
            n = args["n"]
            if n % ps or not 1 <= n // ps <= 4:
                return f"n {n} is not 1 to 4 pages of {ps} tokens"
            return None if tree_sizes(self.cache)[0] > 0 else "the tree holds no evictable token"
        if rule == "slide_windows":
            if not self.swa:
                return self.why_not(rule)
            return None if self.running else "no request is running"
        if rule == "retract":
            return None if req.rid in self.running else f"{req!r} is not running"
        if rule == "abort":
            return None if req in self.abortable() else f"{req!r} is not running, or is aborted already"
        return f"{rule} is not a step of the caller harness"

    # -- steps --

    @step
    def arrive(self, prompt: int, out: int) -> ReqRef | None:
        """A request joins the waiting queue; nothing is allocated.  Its
        prompt is spelled by the digits of ``prompt``, each digit a page of
        that token (``12`` at page size 2 is ``[1, 1, 2, 2]``); it stops
        after ``out`` new tokens."""
        rid = len(self.requests)
        tokens = prompt_tokens(prompt, self.page_size)
        req = self._call(f"Req(req_{rid}, {tokens})", self.gen.make_req, f"req_{rid}", tokens, out, VOCAB_SIZE)
        self.requests[rid] = Live(req)
        self.waiting.append(rid)
        return ReqRef(rid)

    @step
    def prefill(self) -> None:
        """The scheduler's next prefill batch.  Admission: each waiting
        request in turn is matched (``init_next_round_input``) and locked,
        while a row is free and free + evictable memory covers the batch's
        new tokens plus a page per request; the first that does not fit is
        unlocked and stops admission.  Then ``alloc_for_extend`` allocates
        and writes the rows, and the result is processed (in a free group
        where the placement says): each request takes its next token; one
        that is done is released (``release_kv_cache``), the others publish
        their prefill (``cache_unfinished_req`` / ``checkpoint``)."""
        gen, ps = self.gen, self.page_size
        batch: list[int] = []
        need = 0
        for rid in list(self.waiting):
            if len(batch) >= self.pool.available_size():
                break
            req = self.requests[rid].req
            self._call(f"req_{rid}.init_next_round_input(cache)", req.init_next_round_input, self.cache)
            self._call(f"lock req_{rid}'s prefix", gen.lock, req, self.cache)
            fill = len(req.full_untruncated_fill_ids)
            extra = fill - gen.prefix_len(req) + ps
            if need + extra > self.budget():
                self._call(f"unlock req_{rid}'s prefix", gen.unlock, req, self.cache)
                break
            gen.set_extend(req, fill)
            need += extra
            batch.append(rid)
        if not batch:
            return
        reqs = [self.requests[r].req for r in batch]
        prefix_lens = [gen.prefix_len(r) for r in reqs]
        extend_lens = [gen.extend_len(r) for r in reqs]
        seq_lens = torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)], dtype=torch.int64)
        b = self._batch(reqs, prefix_lens=prefix_lens, extend_lens=extend_lens, seq_lens=seq_lens,
                        seq_lens_cpu=seq_lens.clone(), extend_num_tokens=sum(extend_lens))
        self._call(f"alloc_for_extend(batch of {self.refs(batch)})", self.release.modules.allocation.alloc_for_extend, b)
        for req, n in zip(reqs, seq_lens.tolist()):
            gen.after_extend(req, n)
        for rid in batch:
            self.waiting.remove(rid)
        self._results("prefill", batch, self.placement.prefill, finished_only=False)

    def _why_not_chunk(self, pages: int) -> str | None:
        if self.chunked is None and not self.waiting:
            return "no request is waiting and none is in chunked prefill"
        if self.chunked is None and self.pool.available_size() == 0:
            return "no request row is free"
        if (pages + 1) * self.page_size > self.guard_budget():
            return f"free + evictable memory does not cover {pages} pages and one more"
        return None

    @step
    def chunked_prefill(self, pages: int) -> None:
        """A prefill batch of one request, at most ``pages`` pages of it (the
        chunk budget).  The request in chunked prefill goes on: its last
        chunk is published (``stash_chunked_request``: ``checkpoint_kv_cache``)
        and it resumes at its own prefix (``init_next_round_input()``).
        Else the first waiting request is matched and locked.  Then
        ``alloc_for_extend`` of as many whole pages as free + evictable
        memory covers with a page to spare (none: a new request waits again,
        first; the chunked one is parked this round); a chunk short of the
        request's end has no result (it stays in chunked prefill), the last
        one is processed as ``prefill`` processes a result."""
        gen = self.gen
        if self.chunked is not None:
            rid = self.chunked
            req = self.requests[rid].req
            self._call(f"stash_chunked_request(req_{rid})", gen.stash_chunk, req, self.cache)
            self._call(f"req_{rid}.init_next_round_input()", gen.next_chunk, req)
        else:
            rid = self.waiting.pop(0)
            req = self.requests[rid].req
            self._call(f"req_{rid}.init_next_round_input(cache)", req.init_next_round_input, self.cache)
            self._call(f"lock req_{rid}'s prefix", gen.lock, req, self.cache)
        start, fill, ps = gen.prefix_len(req), len(req.full_untruncated_fill_ids), self.page_size
        # The chunk memory covers once the prefix is locked, a page to spare, in whole pages.
        room = min(pages * ps, (self.budget() - ps) // ps * ps)
        if room < ps:
            if self.chunked is None:  # admission turns it away: it waits again, first
                self._call(f"unlock req_{rid}'s prefix", gen.unlock, req, self.cache)
                self.waiting.insert(0, rid)
            else:  # parked: no chunk this round
                gen.set_extend(req, start)
            return
        end = min(fill, start + room)
        gen.set_extend(req, end)
        seq = torch.tensor([end], dtype=torch.int64)
        b = self._batch([req], prefix_lens=[start], extend_lens=[end - start], seq_lens=seq, seq_lens_cpu=seq.clone(),
                        extend_num_tokens=end - start)
        self._call(f"alloc_for_extend(batch of [req_{rid}], chunk {start}..{end})",
                   self.release.modules.allocation.alloc_for_extend, b)
        gen.after_extend(req, end)
        if end < fill:
            self.chunked = rid
            return
        self.chunked = None
        self._results("prefill", [rid], self.placement.prefill, finished_only=False)

    @step
    def decode(self, reqs: list[ReqRef]) -> None:
        """One decode step of the running batch (``reqs``: every running
        request, in order): ``alloc_for_decode`` gives each a slot for its
        last token, then the result is processed (in a free group where the
        placement says): each takes its next token, and one that is done
        (or aborted) is released (``release_kv_cache``)."""
        gen = self.gen
        live = [self.requests[r.rid].req for r in reqs]
        seq = torch.tensor([gen.committed_len(r) for r in live], dtype=torch.int64)
        rows = torch.tensor([gen.row(r) for r in live], dtype=torch.int64)
        b = self._batch(live, seq_lens=seq, seq_lens_cpu=seq.clone(), req_pool_indices=rows,
                        req_pool_indices_cpu=rows.clone())
        self._call(f"alloc_for_decode(batch of {reqs})", self.release.modules.allocation.alloc_for_decode, b, 1)
        for req in live:
            gen.after_decode(req)
        self._results("decode", [r.rid for r in reqs], self.placement.decode, finished_only=True)

    @step
    def evict_tokens(self, n: int) -> None:
        """The cache evicts at least ``n`` tokens' worth of unlocked leaves,
        where it has them (``evict(EvictParams(num_tokens=n))``)."""
        params = self.release.modules.EvictParams(num_tokens=n)
        self._call(f"evict(num_tokens={n})", self.cache.evict, params)

    @step
    def slide_windows(self) -> None:
        """The running requests' sliding windows move up to their last token
        (SWA caches only): the release's own ``ScheduleBatch.maybe_evict_swa``
        in decode mode, as ``alloc_for_decode`` runs it before each decode
        step, over the running batch (eviction interval 1).  It frees, in one
        free group, the SWA peers of each request's slots that fell out of the
        window and that the tree does not hold (``evict_sliding_windows``)."""
        live = [self.requests[r].req for r in self.running]
        b = self._batch(live, forward_mode=self.release.modules.ForwardMode.DECODE, enable_overlap=False,
                        forward_iter=0, prefix_lens=[self.gen.prefix_len(r) for r in live])
        sb = self.release.modules.ScheduleBatch
        # The release's own methods on the stand-in batch (0.5.17 has no _swa_eviction_trigger).
        for name in ("maybe_evict_swa", "_swa_eviction_trigger", "_evict_swa"):
            if hasattr(sb, name):
                setattr(b, name, getattr(sb, name).__get__(b))
        self.in_group = True  # maybe_evict_swa opens and closes its own group
        try:
            self._call(f"maybe_evict_swa(batch of {self.refs(self.running)})", b.maybe_evict_swa)
        finally:
            self.in_group = False

    @step
    def retract(self, req: ReqRef) -> None:
        """The scheduler retracts a running request under memory pressure:
        ``release_kv_cache`` without inserting, ``reset_for_retract``, and the
        request waits again (its prompt and output so far to re-prefill)."""
        live = self.requests[req.rid]
        self._call(f"release_kv_cache({req!r}, no insert)", lambda: self.gen.release(live.req, self.cache, insert=False))
        self._call(f"{req!r}.reset_for_retract()", live.req.reset_for_retract)
        self.running.remove(req.rid)
        self.waiting.append(req.rid)
        live.status = WAITING

    @step
    def abort(self, req: ReqRef) -> None:
        """A client aborts a running request: it is marked (``to_finish``),
        as the scheduler marks it, and finishes at its next result."""
        self.requests[req.rid].req.to_finish = self.release.modules.FINISH_ABORT()

    def teardown(self) -> None:
        """The final state must still check out."""
        self.check()

    # -- the scheduler's result processing --

    def _batch(self, reqs, **fields):
        return self.gen.batch(reqs=reqs, req_to_token_pool=self.pool, tree_cache=self.cache,
                              token_to_kv_pool_allocator=self.allocator, device="cpu", **fields)

    def _results(self, phase: str, batch: list[int], grouped: bool, *, finished_only: bool) -> None:
        """``process_batch_result_prefill`` / ``_decode`` for the batch."""
        if grouped:
            self._call("free_group_begin()", self.allocator.free_group_begin)
            self.in_group = True
        for rid in batch:
            live = self.requests[rid]
            req = live.req
            req.output_ids.append(next_token(list(req.origin_input_ids) + list(req.output_ids)))
            req.update_finish_state()
            if req.finished():
                self._call(f"release_kv_cache(req_{rid})", lambda: self.gen.release(req, self.cache, insert=True))
                live.status = DONE
                if rid in self.running:
                    self.running.remove(rid)
            elif not finished_only:
                self._call(f"cache_unfinished_req(req_{rid})", self.gen.cache_unfinished, req, self.cache)
                live.status = RUNNING
                self.running.append(rid)
            if grouped:
                self.check(f"{phase}, req_{rid}'s result, free group open")
        if grouped:
            self._call("free_group_end()", self.allocator.free_group_end)
            self.in_group = False

    # -- the census --

    def _action(self) -> str:
        if not self.steps:
            return "building"
        last = self.steps[-1]
        args = ", ".join(f"{k}={v}" for k, v in last.args.items())
        return f"step {len(self.steps) - 1}, {last.rule}({args})"

    def check(self, where: str | None = None) -> None:
        """The census (``reference_model.caller.CENSUS``), every predicate."""
        action = self._action() + (f" ({where})" if where else "")
        ps = self.page_size
        tree = self._call("all_values_flatten()", tree_slots, self.cache)
        free = self._call("free pages", census_of, self._full())
        self._judge(census.free_list_has_no_repeats, free, ps, action)
        self._judge(census.tree_holds_each_slot_once, tree, action)
        holders = [census.Holder(census.TREE, tuple(s // ps for s in tree)), census.Holder(census.FREE, tuple(free))]
        if self.in_group:
            queued = open_group_pages(self.allocator, ps) + (open_group_pages(self._full(), ps) if self.swa else [])
            holders.append(census.Holder(census.QUEUED, tuple(queued)))
        rows = self._rows()
        for rid, row, lo, hi in rows:
            slots = ids(self.pool.req_to_token[row, lo:hi])
            holders.append(census.Holder(f"req_{rid}'s row {row} (positions {lo}..{hi})", tuple(s // ps for s in slots)))
        self._judge(census.census_covers_pool, holders, self.pool_pages, ps, action)
        if self.path_how is not None:
            for rid, row, lo, _ in rows:
                node = self.gen.locked_node(self.requests[rid].req)
                if node is None:
                    continue
                path = self._call(f"req_{rid}'s locked path", path_slots, self.cache, self.path_how, node)
                self._judge(census.protected_prefix_is_locked_path, f"req_{rid}", ids(self.pool.req_to_token[row, :lo]),
                            path, action)
        evictable, protected = self._call("tree sizes", tree_sizes, self.cache)
        self._judge(census.tree_sizes_balance, evictable, protected, len(tree), action)
        if self.swa:
            self._check_swa(free, tree, action)

    def _full(self):
        """The allocator whose free list holds full pages (the hybrid's full pool)."""
        return self.allocator.full_attn_allocator if self.swa else self.allocator

    def _check_swa(self, free_full_pages: list[int], tree: list[int], action: str) -> None:
        """The SWA pool's census: peers pair at most one full slot each, a
        free full slot has none, and the SWA free list, the group's SWA queue
        and the peers hold the SWA pool between them, each page once."""
        ps, a = self.page_size, self.allocator
        # 0 means no peer; the mapping's last entry is -1, for a last_loc of -1.
        peers = {full: swa for full, swa in enumerate(ids(a.full_to_swa_index_mapping)) if swa > 0}
        self._judge(census.swa_peers_are_a_partial_bijection, peers, action)
        free_slots = [p * ps + i for p in free_full_pages for i in range(ps)]
        self._judge(census.free_full_slots_have_no_peer, free_slots, peers, action)
        swa_free = self._call("SWA free pages", census_of, a.swa_attn_allocator)
        self._judge(census.free_list_has_no_repeats, swa_free, ps, f"{action} (SWA pool)")
        holders = [census.Holder(census.SWA_FREE, tuple(swa_free)),
                   census.Holder("full slots' SWA peers", tuple(sorted({s // ps for s in peers.values()})))]
        # Full slots whose SWA peers an open group's free_swa has queued, where the
        # release resolves them at the group's end: still mapped, no longer the tree's.
        pending: set[int] = set()
        if self.in_group:
            queued = [p for t in getattr(a, "swa_page_ids_group", None) or [] for p in ids(t)]
            if self.swa_queues_full_slots:  # their peers are counted above, as mapped
                pending = {s // ps * ps + i for t in getattr(a, "swa_free_group", None) or [] for s in ids(t)
                           for i in range(ps)}
            else:
                queued += [s // ps for t in getattr(a, "swa_free_group", None) or [] for s in ids(t) if s > 0]
            queued += open_group_pages(a.swa_attn_allocator, ps)
            holders.append(census.Holder(census.SWA_QUEUED, tuple(queued)))
        self._judge(census.census_covers_pool, holders, self.swa_pool_pages, ps, f"{action} (SWA pool)")
        if callable(getattr(self.cache, "swa_evictable_size", None)):
            self._judge(census.swa_tree_sizes_balance, int(self.cache.swa_evictable_size()),
                        int(self.cache.swa_protected_size()), sum(1 for s in tree if s in peers and s not in pending),
                        action)

    def _rows(self) -> list[tuple[int, int, int, int]]:
        """(rid, row, protected length, allocated length) of each request holding a row."""
        out = []
        for rid, live in self.requests.items():
            row = self.gen.row(live.req)
            if row is not None:
                out.append((rid, row, self.gen.protected_len(live.req), self.gen.allocated_len(live.req)))
        return out

    # -- failures --

    def _fail(self, invariant: str, detail: str):
        if invariant == "allocator_raised":
            lacking = self._lacking(sys.exc_info()[1])
            if lacking is not None:
                raise TargetError(lacking)
            invariant = "sglang_raised"  # the cache or a helper raised, not only the allocator
        label = "" if self.replaying else self._reachability() + "\n"
        raise violation_type(invariant)(label + detail, self.steps, self.config)

    def _lacking(self, exc: BaseException | None) -> str | None:
        """Where the release looked up a method or attribute that a class of
        the user's (a ``MODULE:ATTR`` target, its sub-allocators, a
        ``--caller MODULE:ATTR`` cache) does not have, the one line that says
        so: bad input, not a failure of the release's (0.5.23's
        ``alloc_for_extend`` calls the allocator's ``evict_to_free_tokens``,
        which sglang's base class has: every custom target that did not
        subclass it was *reachable* ``sglang_raised``).  None for anything
        else, such as a lookup in the user's own code, which is theirs to fix
        in the run's failure, or the object's own inherited method reading its
        own state."""
        name = getattr(exc, "name", None) if isinstance(exc, AttributeError) else None
        tb = exc.__traceback__ if name else None
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or not str(tb.tb_frame.f_globals.get("__name__", "")).startswith("sglang."):
            return None
        obj, theirs = getattr(exc, "obj", None), []
        if not self.config.target.startswith("sglang:"):
            a = self.allocator
            theirs += [(a, self.config.target), *((getattr(a, n, None), f"{self.config.target}'s {n}")
                                                   for n in ("full_attn_allocator", "swa_attn_allocator"))]
        if ":" in self.config.caller:
            theirs.append((self.cache, f"--caller {self.config.caller}"))
        who = next((label for o, label in theirs if o is not None and o is obj), None)
        if who is None or tb.tb_frame.f_locals.get("self") is obj:
            # The object's own method (one it inherits from the release) read
            # what it lacks now: its own state, gone; the allocator's failure.
            return None
        file = tb.tb_frame.f_code.co_filename
        at = file[file.rfind("/sglang/srt/") + 1:] if "/sglang/srt/" in file else file
        return (f"{who} ({type(obj).__name__}) has no {name}, which sglang {self.release.modules.version} looks up"
                f" on it ({at}:{tb.tb_lineno}): give it one, or subclass the release's class that has it")

    def _reachability(self) -> str:
        """*reachable* when the release's own placement is this run's, or the
        same steps fail under it too; else *latent*."""
        rp = self.release.placement
        if self.placement == rp.placement:
            return f"reachable: with the release's own free-group placement ({rp.placement.label()})"
        again = attrs.evolve(self.config, groups="release")
        try:
            other = CallerLockstep.from_config(again)
            other.replaying = True
            for s in self.steps:
                getattr(other, s.rule)(**_resolve(s.args))
        except InvariantViolation as exc:
            return f"reachable: the same steps fail with the release's own placement too ({exc.invariant})"
        except Exception:  # noqa: BLE001 - the steps do not replay there: not shown reachable
            pass
        return (
            f"latent: only with --groups {self.config.groups} ({self.placement.label()}); the release's scheduler"
            f" processes prefill results {rp.prefill.describe()} and decode results {rp.decode.describe()},"
            " where these steps pass"
        )


def _resolve(args: dict) -> dict:
    """A recorded step's arguments as the step takes them (names to refs)."""
    out = {}
    for key, value in args.items():
        if isinstance(value, str) and value.startswith("req_"):
            out[key] = ReqRef(int(value[4:]))
        elif isinstance(value, list):
            out[key] = [ReqRef(int(v[4:])) for v in value]
        else:
            out[key] = value
    return out
