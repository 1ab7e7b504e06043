"""The DeepSeek V4 HiSparse family: an SWA pair plus a compressed (C4)
device pool, device buffers, and sglang's wrapper run over stand-ins."""

from pathlib import Path

import pytest

from reference_model.dsv4_hisparse import buffer_plan, compressed_growth, compressed_new_pages
from state_machines.harness import FAMILIES, build
from state_machines.harness.lockstep import InvariantViolation

REPO = Path(__file__).resolve().parents[1]
RELEASE = REPO / ".sglang" / "0.5.23"


def test_the_builtin_twin_runs_on_its_own_family():
    """builtin:dsv4-hisparse names its family, and the registry drives it there."""
    assert type(build(target="builtin:dsv4-hisparse", page_size=4)) is FAMILIES["dsv4_hisparse"].lockstep


# -- the model's arithmetic --


def test_a_prefill_writes_one_compressed_token_per_four():
    """Growing 3 -> 13 tokens at compressed page 2 completes blocks 0..2: page 0 full, page 1 one slot."""
    assert compressed_growth(3, 13, 4, 2) == {0: 2, 1: 1}


def test_a_device_page_is_taken_with_its_first_compressed_token():
    """Growing 8 -> 12 tokens at compressed page 4 fills page 0's third slot: no new device page."""
    assert compressed_new_pages(8, 12, 4, 4) == 0 and compressed_new_pages(0, 4, 4, 4) == 1


def test_a_long_row_keeps_its_first_slots_and_the_newest_at_the_reserved_page():
    """A row of 6 slots, a buffer of 4 (page 2): slots 0, 1, the newest, 3; the page only the rest touch goes."""
    plan = buffer_plan([4, 5, 6, 7, 8, 9], 4, 2)
    assert (plan.head, plan.kept, plan.surplus, plan.fresh) == ((4, 5, 9, 7), (2, 4, 3), (), 0)


def test_a_short_row_is_completed_to_a_whole_page_and_made_up_with_fresh_pages():
    """A row of 2 slots on a page of 4, a buffer of 8: the page's other two slots, then one fresh page."""
    plan = buffer_plan([4, 5], 8, 4)
    assert (plan.head, plan.kept, plan.surplus, plan.fresh) == ((4, 5, 6, 7), (1,), (), 1)


# -- the harness --


def test_an_extend_from_mid_block_continues_the_device_page():
    """At page size 8 (compressed page 2), 5 then 3 more tokens: the page's two compressed slots sit on one device page."""
    state = build(target="builtin:dsv4-hisparse", page_size=8)
    req = state.admit()
    state.extend(reqs=[req], tokens=[5])
    state.extend(reqs=[req], tokens=[3])
    page = state.model.requests[req.rid].pages[0]
    peer = state.device.mapping[page]
    assert state.device.filled_slots(page, 2) == 2
    assert state.allocator.full_to_hisparse_device_index_mapping[page * 2 : page * 2 + 2].tolist() == [peer * 2, peer * 2 + 1]


def test_a_free_in_a_group_keeps_the_device_page_until_the_group_ends():
    """free() inside a group is queued on the device side too: the page goes free at end()."""
    state = build(target="builtin:dsv4-hisparse", page_size=4)
    req = state.alloc(n=4)
    peer = state.device.mapping[state.model.requests[req.rid].pages[0]]
    state.begin()
    state.finish(req=req)
    assert peer not in state.device.free_pages
    state.end()
    assert peer in state.device.free_pages


def test_a_request_decodes_only_after_its_device_buffer():
    """The coordinator makes a request ready (its buffer) before it decodes, and never extends it again."""
    state = build(target="builtin:dsv4-hisparse", page_size=4)
    req = state.alloc(n=8)
    assert req not in state.decodable() and req in state.extendable()
    state.device_buffer_pages(req=req, pages=2)
    assert req in state.decodable() and req not in state.extendable()


@pytest.mark.sglang
@pytest.mark.skipif(not (RELEASE / "sglang").is_dir(), reason="sglang 0.5.23 is not installed (make sglang V=0.5.23)")
def test_0_5_23_device_buffer_hands_a_slot_out_twice_at_compressed_page_4():
    """0.5.23's alloc_device_buffer moves the newest slot first, then completes the page from the wrong end."""
    state = build(target="sglang:dsv4-hisparse", page_size=16, sglang_path=str(RELEASE))
    req = state.admit()
    state.extend(reqs=[req], tokens=[8])
    with pytest.raises(InvariantViolation) as caught:
        state.device_buffer_pages(req=req, pages=1)
    assert caught.value.invariant == "device_buffer_slots_distinct"


@pytest.mark.sglang
@pytest.mark.skipif(not (RELEASE / "sglang").is_dir(), reason="sglang 0.5.23 is not installed (make sglang V=0.5.23)")
def test_0_5_23_finding_shrinks_to_its_smallest_arguments():
    """The run's seed 0 found it as an extend of 24 tokens and a buffer of 2 pages, and the minimiser
    kept both, since either lowered alone passes (helper-80); lowered together they reach 8 and 1."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.minimize import minimize
    from state_machines.runs.trace import Trace

    config = Config(target="sglang:dsv4-hisparse", page_size=16, sglang_path=str(RELEASE))
    found = (
        Step("admit", {}, "req_0"),
        Step("extend", {"reqs": ["req_0"], "tokens": [24]}),
        Step("device_buffer_pages", {"req": "req_0", "pages": 2}),
    )
    shortest = minimize(Trace(config, found, "device_buffer_slots_distinct"))
    assert shortest.invariant == "device_buffer_slots_distinct"
    assert [s.args for s in shortest.steps[1:]] == [{"reqs": ["req_0"], "tokens": [8]}, {"req": "req_0", "pages": 1}]


def test_a_replayed_segment_that_cuts_into_written_tokens_is_refused():
    """The rules end a DSV4 segment past every written token; a minimiser's candidate cutting one short is not replayed."""
    from state_machines.harness import Step
    from state_machines.runs.trace import TraceError, run_steps

    state = build(target="builtin:dsv4-hisparse", page_size=8)
    steps = [Step("alloc", {"n": 8}, "req_0"), Step("free_segment", {"req": "req_0", "start": 0, "n": 1})]
    with pytest.raises(TraceError, match="past every written token"):
        run_steps(state, steps)
