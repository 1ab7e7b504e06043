"""What the scheduler-facing hooks of an allocator must answer, from the
model's counts (plain values, no torch).

sglang's scheduler asks an allocator questions that change no ownership:
whether a decode fits (``check_decode_capacity``), what to evict first
(``evict_to_free_tokens``), how many tokens a prompt may still generate
(``max_new_tokens_for_memory``), whether a PD preallocation fits
(``prealloc_fits``), which token ids a transfer addresses.  Each predicate
returns ``None`` when the answer agrees with the model, else "allocator says
X / model says Y".
"""

from __future__ import annotations


def decode_capacity_agrees(got, tokens: int, available: int) -> str | None:
    """``check_decode_capacity(num_tokens=tokens)`` with nothing evictable:
    True exactly when the model has ``tokens`` free slots."""
    want = tokens <= available
    if got is want:
        return None
    return f"check_decode_capacity(num_tokens={tokens}) says {got!r} / model has {available} free slots: {want}"


def eviction_asks_shortfall(hook: str, asked: list[tuple[int, int]], want: list[tuple[int, int]]) -> str | None:
    """Asked to make room for a number of tokens, the allocator asks the
    cache to evict exactly each pool's shortfall (full, SWA), once, and
    nothing where no pool is short."""
    if asked == want:
        return None
    return f"{hook} asked the cache to evict (full, SWA) tokens {asked} / model's shortfall {want}"


def max_new_tokens_fit(got, input_tokens: int, max_new_tokens: int, capacity: int, page_size: int) -> str | None:
    """``max_new_tokens_for_memory``: ``None`` (the prompt cannot fit) or a
    count in ``0 .. max_new_tokens`` that, after the prompt's whole pages,
    still fits an empty pool of ``capacity`` slots.  0 is also an answer for
    a prompt that cannot fit: sglang's static pools clip to 0 rather than
    say None (``allocator/base.py``), and its scheduler refuses a prompt
    past ``max_req_len`` before it asks."""
    paged_input = -(-input_tokens // page_size) * page_size
    if got is None:
        if paged_input > capacity:
            return None
        return f"max_new_tokens_for_memory({input_tokens}) says None / model: a prompt of {paged_input} slots fits {capacity}"
    if isinstance(got, int) and 0 <= got <= max_new_tokens and (got == 0 or paged_input + got <= capacity):
        return None
    return (f"max_new_tokens_for_memory({input_tokens}, max {max_new_tokens}) says {got!r} / model: at most"
            f" {max(0, min(max_new_tokens, capacity - paged_input))} fit {capacity} slots")


def prealloc_fits_agrees(got, full_tokens: int, swa_tokens: int, full_budget: int, swa_budget: int | None) -> str | None:
    """``prealloc_fits`` over separate buffers: each side within its budget."""
    want = full_tokens <= full_budget and (swa_budget is None or swa_tokens <= swa_budget)
    if got is want:
        return None
    return (f"prealloc_fits(full {full_tokens}, swa {swa_tokens}) says {got!r} / model: budgets full {full_budget},"
            f" swa {swa_budget}: {want}")


def extend_demand_covers(got, need: int, conservative: int) -> str | None:
    """``get_extend_allocation_demand``: the tokens to evict for before an
    extend cover the new pages it will take (and no more than the caller's
    conservative count, which already does)."""
    if isinstance(got, int) and need <= got <= conservative:
        return None
    return f"get_extend_allocation_demand says {got!r} tokens / model: the extend takes {need}, the caller's bound is {conservative}"


def hook_answer_agrees(hook: str, got, want) -> str | None:
    """A hook whose answer the model knows exactly (a size, a pair of
    counts, the token ids a transfer addresses)."""
    if got == want:
        return None
    return f"{hook} says {_short(got)} / model says {_short(want)}"


def hook_answer_kind(hook: str, got, kinds: tuple[type, ...]) -> str | None:
    """A hook whose answer is policy (the model does not predict it), but of
    a documented kind."""
    if any(got is None if k is type(None) else isinstance(got, k) for k in kinds):
        return None
    return f"{hook} says {got!r} / model expects one of {', '.join(k.__name__ for k in kinds)}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
