"""The server's scheduler in-process: slot choice by longest shared prefix, a long prompt interleaved with the
other slots' decoding (its steps and theirs one after another in the rounds), cancellation inside a prompt, the bounded queue, slot commands. SmolLM2 on the CPU."""
from __future__ import annotations

import asyncio
import collections
import time

import pytest

from kvflash_ggml import _core
from kvflash_ggml.options import PoolConfig, ResidencyConfig, SamplingParams, SpeculativeConfig
from kvflash_ggml.server.scheduler import Outbox, QueueFull, Request, Scheduler, slot_engines
from kvflash_ggml.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture
def make_scheduler(smollm2, smollm2_path, tmp_path):
    made = []

    def make(n_slots=2, max_queue=4, prefill="exact", batch=True, speculative=None, policy="lru"):
        tok = Tokenizer(smollm2_path)
        pool = PoolConfig(n_ctx=4096, pool_tokens=512)
        engines = slot_engines(n_slots, smollm2, tok, pool, ResidencyConfig(policy=policy, prefill=prefill),
                               prefix_cache_dir=tmp_path / "cache", store_each_turn=False, speculative=speculative)
        s = Scheduler(engines, max_queue=max_queue, batch=batch)
        made.append(s)
        return s, tok

    yield make
    for s in made:
        s.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def drain(request) -> list:
    out = []
    while (item := await request.out.get()) is not None:
        out.append(item)
    return out


def test_a_flush_wakes_each_event_loop_once_with_its_requests_items_in_order():
    # However many streams got a record in a round, the round wakes each event loop once (a self-pipe write and a
    # thread that wants the GIL back each time).
    loops = [asyncio.new_event_loop() for _ in range(2)]
    calls: collections.Counter = collections.Counter()
    for i, loop in enumerate(loops):
        def counted(*a, _orig=loop.call_soon_threadsafe, _i=i):
            calls[_i] += 1
            return _orig(*a)
        loop.call_soon_threadsafe = counted
    try:
        requests = [Request([1], GREEDY, loops[i % 2]) for i in range(6)]
        box = Outbox()
        for k in range(3):
            for r in requests:
                box.put(r, k)
        box.put(requests[0], None)
        box.flush()
        assert calls == {0: 1, 1: 1}
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0))   # the loop runs what was handed to it
        for i, r in enumerate(requests):
            assert [r.out.get_nowait() for _ in range(r.out.qsize())] == [0, 1, 2] + ([None] if i == 0 else [])
        box.flush()   # nothing held: no wake
        assert calls == {0: 1, 1: 1}
    finally:
        for loop in loops:
            loop.close()


def test_a_rounds_records_go_out_right_before_the_next_step(make_scheduler):
    # The loop's work on them (a server's SSE chunks) then runs while the step holds no GIL: between rounds they
    # wait, and none is left when a batched step starts.
    sched, tok = make_scheduler()
    left_at_step, left_after_round = [], []

    class Watched:
        def __init__(self, decoder):
            self.decoder = decoder

        def __getattr__(self, name):
            return getattr(self.decoder, name)

        def step_greedy(self, *a):
            left_at_step.append(len(sched._outbox._items))
            return self.decoder.step_greedy(*a)

    sched.decoder = Watched(sched.decoder)
    round_once = sched._round

    def watched_round():
        round_once()
        if sum(s.busy and s.decoding for s in sched.slots) == 2:
            left_after_round.append(len(sched._outbox._items))
    sched._round = watched_round

    async def main():
        loop = asyncio.get_running_loop()
        reqs = [Request(tok.encode(t), SamplingParams(max_tokens=12, temperature=0), loop)
                for t in ("Count: 1, 2, 3,", "Letters: a, b, c,")]
        for r in reqs:
            sched.submit(r)
        return await asyncio.gather(*(drain(r) for r in reqs))

    outs = run(main())
    assert [len(o) for o in outs] == [13, 13], [len(o) for o in outs]   # 12 tokens, then the closing record
    assert len(left_at_step) >= 5 and set(left_at_step) == {0}, left_at_step
    assert left_after_round and max(left_after_round) == 2, left_after_round   # a record per slot, not yet sent


def prompt(tok, text, n):
    ids = tok.encode(text * 400)
    return ids[:n]


@pytest.mark.parametrize("prefill", ["exact", "pooled"])
def test_a_long_prompt_does_not_stall_a_decoding_slot(make_scheduler, prefill):
    sched, tok = make_scheduler(prefill=prefill)
    events: list = []   # (request, when its record reached the event loop)

    async def timed_drain(name, request):
        while (item := await request.out.get()) is not None:
            events.append((name, time.perf_counter(), item))

    async def main():
        loop = asyncio.get_running_loop()
        a = Request(tok.encode("1, 2, 3, 4, 5, 6,"), SamplingParams(max_tokens=300, temperature=0), loop)
        sched.submit(a)
        await a.out.get()     # a decodes
        b = Request(prompt(tok, "The river runs to the sea. ", 2000), SamplingParams(max_tokens=1, temperature=0), loop)
        sched.submit(b)
        await asyncio.gather(timed_drain("a", a), timed_drain("b", b))
        return b

    b = run(main())
    b_first = next(t for name, t, item in events if name == "b")
    during = [t for name, t, item in events if name == "a" and b.t_start < t < b_first]
    # a 2000-token prompt takes many forward steps (exact: one per layer per step; pooled: pool/8 tokens each)
    assert len(during) >= 10, (len(during), b_first - b.t_start)


@pytest.mark.parametrize("prefill", ["exact", "pooled"])
def test_a_round_runs_prompt_steps_and_decode_steps_one_after_another(make_scheduler, prefill):
    # Issue 38: a prompt is a resumable state the round steps (at most one prompt step a round, after the decode
    # steps), not a call that steps the other slots from inside its own prefill.
    sched, tok = make_scheduler(prefill=prefill)
    inside, nested, order = [0], [], []

    def watched(fn, kind):
        def call(*a, **k):
            if inside[0]:
                nested.append(kind)
            inside[0] += 1
            order.append(kind)
            try:
                return fn(*a, **k)
            finally:
                inside[0] -= 1
        return call

    for slot in sched.slots:
        slot.engine._prompt_step = watched(slot.engine._prompt_step, "prompt")
        slot.engine._prefill = watched(slot.engine._prefill, "prompt")
        slot.engine._decode_one_greedy = watched(slot.engine._decode_one_greedy, "decode")
    sched._batched_step = watched(sched._batched_step, "decode")

    async def main():
        loop = asyncio.get_running_loop()
        a = Request(tok.encode("1, 2, 3, 4, 5, 6,"), SamplingParams(max_tokens=200, temperature=0), loop)
        sched.submit(a)
        await a.out.get()
        b = Request(prompt(tok, "The river runs to the sea. ", 1500), SamplingParams(max_tokens=1, temperature=0), loop)
        sched.submit(b)
        await asyncio.gather(drain(a), drain(b))

    run(main())
    assert nested == []
    # b's prompt ran in many steps, with a's decode steps between them
    switches = sum(1 for x, y in zip(order, order[1:]) if x == "prompt" and y == "decode")
    assert order.count("prompt") >= 10 and switches >= 5, (order.count("prompt"), switches)


def test_requests_go_to_the_slot_holding_their_prefix(make_scheduler):
    sched, tok = make_scheduler(n_slots=3)
    convs = [prompt(tok, f"Conversation {i} is about topic {i}. ", 200) for i in range(3)]

    async def main():
        loop = asyncio.get_running_loop()
        first = [Request(c, GREEDY, loop) for c in convs]
        for r in first:
            sched.submit(r)
        await asyncio.gather(*(drain(r) for r in first))
        again = [Request(c + tok.encode(" And more."), GREEDY, loop) for c in reversed(convs)]
        for r in again:
            sched.submit(r)
        records = await asyncio.gather(*(drain(r) for r in again))
        return first, again, records

    first, again, records = run(main())
    assert [r.slot_id for r in again] == [r.slot_id for r in reversed(first)]
    for r, recs in zip(again, records):
        assert recs[-1].stats["prompt_tokens_reused"] >= 200 - 1


def test_a_resent_prompt_is_answered_from_its_slot_without_running_again(make_scheduler):
    # A client retrying (or a regenerate) sends the prompt its slot ran last: the slot answers from what that prompt
    # computed (Engine._answer_again), and the answer is the first one's. 1500 tokens over a pool of 512: layer-major.
    sched, tok = make_scheduler(n_slots=2)
    p = prompt(tok, "The river runs to the sea. ", 1500)

    async def main():
        loop = asyncio.get_running_loop()
        outs = []
        for _ in range(2):
            r = Request(p, SamplingParams(max_tokens=12, temperature=0), loop)
            sched.submit(r)
            outs.append((r, await drain(r)))
        return outs

    (a, first), (b, again) = run(main())
    assert b.slot_id == a.slot_id
    assert first[-1].stats["prompt_tokens_computed"] == 1500
    assert again[-1].stats["prompt_tokens_computed"] == 0 and again[-1].stats["prompt_tokens_reused"] == 1500
    assert [rec.token for rec in again] == [rec.token for rec in first]


def test_a_taken_over_slot_stores_its_conversation(make_scheduler, tmp_path):
    sched, tok = make_scheduler(n_slots=1)
    a, b = prompt(tok, "Alpha beta gamma. ", 300), prompt(tok, "Delta epsilon zeta. ", 300)

    async def main():
        loop = asyncio.get_running_loop()
        for tokens in (a, b, a + tok.encode(" More.")):
            r = Request(tokens, GREEDY, loop)
            sched.submit(r)
            records = await drain(r)
        return records

    records = run(main())
    assert len(list((tmp_path / "cache").glob("*.kvf"))) >= 2   # a's and b's prefixes, each at takeover
    assert records[-1].stats["prompt_tokens_reused"] >= 300 // 64 * 64   # a came back from the cache


def test_a_request_cancelled_inside_its_prompt_stops_there(make_scheduler):
    sched, tok = make_scheduler(n_slots=1)

    async def main():
        loop = asyncio.get_running_loop()
        r = Request(prompt(tok, "Stop me soon. ", 3000), GREEDY, loop)
        sched.submit(r)
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        sched.cancel(r)
        records = await drain(r)
        return records, time.perf_counter() - t0

    records, waited = run(main())
    assert records == []
    slot = sched.slots[0]
    assert not slot.busy and slot.n_held < 3000   # rolled back, not finished
    # and the slot serves the next request
    async def again():
        r = Request(tok.encode("Hello"), GREEDY, asyncio.get_running_loop())
        sched.submit(r)
        return await drain(r)
    assert run(again())[-1].finish_reason in ("stop", "length")


def test_the_queue_is_bounded(make_scheduler):
    sched, tok = make_scheduler(n_slots=1, max_queue=1)

    async def main():
        loop = asyncio.get_running_loop()
        long = Request(tok.encode("1, 2, 3, 4, 5, 6,"), SamplingParams(max_tokens=200, temperature=0), loop)
        sched.submit(long)
        await long.out.get()
        waiting = Request(tok.encode("Hi"), GREEDY, loop)
        sched.submit(waiting)
        with pytest.raises(QueueFull):
            sched.submit(Request(tok.encode("Hi"), GREEDY, loop))
        sched.cancel(long)
        await drain(long)
        return await drain(waiting)

    assert run(main())[-1].finish_reason is not None


def test_a_bad_request_fails_alone(make_scheduler):
    sched, tok = make_scheduler(n_slots=1)

    async def main():
        loop = asyncio.get_running_loop()
        bad = Request([tok.n_vocab + 5], GREEDY, loop)
        good = Request(tok.encode("Hello"), GREEDY, loop)
        sched.submit(bad)
        sched.submit(good)
        return await drain(bad), await drain(good)

    bad, good = run(main())
    assert len(bad) == 1 and isinstance(bad[0], ValueError)
    assert good[-1].finish_reason is not None


def test_slot_commands_run_between_rounds(make_scheduler, tmp_path):
    sched, tok = make_scheduler(n_slots=1)
    path = tmp_path / "s.kvf"

    async def main():
        loop = asyncio.get_running_loop()
        r = Request(prompt(tok, "Save me. ", 150), GREEDY, loop)
        sched.submit(r)
        await drain(r)
        await asyncio.wrap_future(sched.call(lambda: sched.slots[0].engine.save_state(path)))

    run(main())
    assert _core.snapshot_file_info(path)["n_tokens"] == sched.slots[0].n_held


def test_batched_rounds_equal_slots_stepped_alone(make_scheduler):
    """Greedy, seeded sampling and logprobs requests at once: batched (one forward per round, logits read back
    since some sample) they give the records the same requests give with every slot stepping alone."""
    kinds = [dict(max_tokens=24, temperature=0), dict(max_tokens=24, temperature=0.9, seed=5),
             dict(max_tokens=24, temperature=0.7, top_p=0.9, seed=11)]

    def run_all(batch):
        sched, tok = make_scheduler(n_slots=3, batch=batch)

        async def main():
            loop = asyncio.get_running_loop()
            reqs = [Request(tok.encode(f"Story number {i} begins"), SamplingParams(**kw), loop, logprobs=2 if i else None)
                    for i, kw in enumerate(kinds)]
            for r in reqs:
                sched.submit(r)
            return await asyncio.gather(*(drain(r) for r in reqs))

        records = run(main())
        return [[(r.token, r.text, r.logprobs) for r in recs[:-1]] for recs in records], sched.n_batched_steps

    batched, n_batched = run_all(True)
    alone, n_alone = run_all(False)
    assert n_batched > 0 and n_alone == 0
    assert batched == alone


def test_slots_that_score_chunks_batch_and_give_their_tokens_alone(make_scheduler, policy="quest"):
    """Regression for issue 38 item 3: qk / quest slots stepped one at a time. Now their decode steps batch, and
    the reselects their scores drive mid-generation (prompts past the 512-token pool; a reselect every 64 tokens)
    page what their slots stepped alone page: the same greedy tokens, the same page-ins (qk: test_batch_decoder.py's
    scores of batched sessions). A round runs one prompt step, so the later slots start decoding later: the earlier
    ones generate longer, and the prompts' steps are the pool's (not sized by the rounds' measured time: 60 rounds a
    prompt), so two or three decode together for ~140 rounds (all three for ~80) whatever the machine's speed."""
    n_gen = [260, 170, 80]

    def run_all(batch):
        sched, tok = make_scheduler(n_slots=3, batch=batch, policy=policy)
        for slot in sched.slots:   # 2 steps a layer for each prompt: 60 rounds
            slot.engine.prompt_step_cap = lambda: None

        async def main():
            loop = asyncio.get_running_loop()
            reqs = [Request(prompt(tok, f"Chapter {i}: the river ran past the mill. ", 700 + 150 * i),
                            SamplingParams(max_tokens=n, temperature=0), loop) for i, n in enumerate(n_gen)]
            for r in reqs:
                sched.submit(r)
            return await asyncio.gather(*(drain(r) for r in reqs))

        records = run(main())
        page_ins = [slot.engine.session.pager.stats().page_ins for slot in sched.slots]
        return [[r.token for r in recs[:-1]] for recs in records], page_ins, sched.n_batched_steps

    batched, page_ins_b, n_batched = run_all(True)
    alone, page_ins_a, n_alone = run_all(False)
    assert n_batched >= 100 and n_alone == 0
    assert [len(t) for t in batched] == n_gen
    assert batched == alone and page_ins_b == page_ins_a


@pytest.mark.parametrize("batch", [True, False])
def test_speculative_slots_give_the_tokens_of_plain_decoding(make_scheduler, batch):
    """Slots that speculate (prompt lookup) beside each other, and one that samples with logprobs: batched, the
    verify steps of a round run as one forward (BatchDecoder.step_rows: each slot's pending token and drafts;
    issue 38 item 3, they ran one slot at a time before), alone each verifies its own; either way the greedy slots
    stream the tokens plain greedy decoding gives the same requests, and the sampling one its seeded tokens."""
    counting = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"
    kinds = [dict(max_tokens=40, temperature=0), dict(max_tokens=40, temperature=0),
             dict(max_tokens=24, temperature=0.8, seed=3)]

    def run_all(speculative, batch=True):
        sched, tok = make_scheduler(n_slots=3, speculative=speculative, batch=batch)

        async def main():
            loop = asyncio.get_running_loop()
            reqs = [Request(tok.encode(counting + " " * i), SamplingParams(**kw), loop, logprobs=2 if i == 2 else None)
                    for i, kw in enumerate(kinds)]
            for r in reqs:
                sched.submit(r)
            return await asyncio.gather(*(drain(r) for r in reqs))

        records = run(main())
        return [[r.token for r in recs[:-1]] for recs in records], [recs[-1].stats for recs in records], sched

    plain, _, _ = run_all(None)
    spec, stats, sched = run_all(SpeculativeConfig(draft="prompt_lookup"), batch)
    assert spec[:2] == plain[:2] and all(len(t) > 10 for t in spec)
    assert all(st["spec_accepted"] > 0 for st in stats[:2])
    assert (sched.n_batched_steps > 0) == batch
    if batch:   # the rows of a batched verify step are its own step's (one-token kernels): the same sampled tokens
        assert spec == run_all(SpeculativeConfig(draft="prompt_lookup"), False)[0]


def test_a_prompt_arriving_while_slots_decode_takes_steps_of_about_one_decode_round(make_scheduler):
    # Issue 38: each step of a long prompt is a gap in the decoding streams (p99 inter-token latency during a
    # prompt <= 3x the median), so while slots decode an exact prefill's step is sized from the measured decode
    # round and the last exact prefill's own rate: T = round x rate x n_layer, whole chunks.
    sched, tok = make_scheduler(n_slots=2)
    steps: list = []
    for slot in sched.slots:
        plain = slot.engine._exact_prefill_step
        slot.engine._exact_prefill_step = lambda plain=plain: steps.append(
            (plain(), sched.decode_round_s, max(s.engine.exact_prefill_tok_s or 0 for s in sched.slots))) or plain()

    async def main():
        loop = asyncio.get_running_loop()
        first = Request(prompt(tok, "A lamp stood by the door. ", 1200), SamplingParams(max_tokens=1, temperature=0), loop)
        sched.submit(first)
        await drain(first)   # alone: the pool's step, and the rate is measured
        a = Request(tok.encode("1, 2, 3, 4, 5, 6,"), SamplingParams(max_tokens=200, temperature=0), loop)
        sched.submit(a)
        await a.out.get()
        await a.out.get()    # a decodes: rounds of decode steps are measured
        b = Request(prompt(tok, "The river runs to the sea. ", 1200), SamplingParams(max_tokens=1, temperature=0), loop)
        sched.submit(b)
        await asyncio.gather(drain(a), drain(b))

    run(main())
    (alone, _, _), (capped, round_s, rate) = steps
    assert alone == 512   # the CPU's step (n_batch): nothing decoded beside the first prompt
    n_layer = sched.slots[0].engine.model.hparams.n_layer
    assert round_s > 0 and rate > 0
    assert capped == min(512, max(64, int(round_s * rate * n_layer) // 64 * 64)), (capped, round_s, rate)
