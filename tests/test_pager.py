"""KvPager (cpp/pager): a property run against a byte-level model, then targeted tests.

The property run drives random sequences of alloc / reselect / pin / unpin / truncate / reset /
stale-apply over random configs. Plans are executed on fake bytes the way PooledKV will execute them
(every page-out, then every page-in), where each position's "bytes" are the id of the write that
produced it; after every step each written position must read back its id from its slot or from its
chunk's host image.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import kvflash_ggml._core as core

# pager calls that plan or mutate (successful or refused), and machine steps, over the whole run
COUNTS = {"ops": 0, "steps": 0}


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    yield
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if COUNTS["steps"] and capture is not None:
        with capture.global_and_fixture_disabled():
            print(f"\ntest_pager: {COUNTS['ops']} pager operations in {COUNTS['steps']} state-machine steps")


def ceil_div(a, b):
    return -(-a // b)


class Emu:
    """Fake pool + host store executing plans like PooledKV: page-outs, drops, page-ins, fresh, writes."""

    JUNK = -2   # what a fresh block holds before it is written

    def __init__(self, cfg):
        self.ct = cfg.chunk_tokens
        n_chunks = ceil_div(cfg.max_tokens, cfg.chunk_tokens)
        self.pool = np.full(cfg.pool_tokens, -1, np.int64)
        self.host = np.full((n_chunks, self.ct), -1, np.int64)
        self.has_host = np.zeros(n_chunks, bool)

    def rows(self, block):
        return slice(block * self.ct, (block + 1) * self.ct)

    def execute(self, plan, n_tokens, write_ids=None):
        for m in plan.page_outs:
            if m.copy:
                self.host[m.chunk] = self.pool[self.rows(m.block)]
                self.has_host[m.chunk] = True
            else:
                # a drop without copy is only right if the host image equals the block's written rows
                k = min(self.ct, n_tokens - m.chunk * self.ct)
                assert self.has_host[m.chunk], f"copy=False page-out of chunk {m.chunk} without a host image"
                assert (self.host[m.chunk, :k] == self.pool[self.rows(m.block)][:k]).all(), \
                    f"copy=False page-out of chunk {m.chunk} whose host image is stale"
        for c in plan.dropped:
            self.has_host[c] = False
        for m in plan.page_ins:
            assert self.has_host[m.chunk], f"page-in of chunk {m.chunk} without a host image"
            self.pool[self.rows(m.block)] = self.host[m.chunk]
        for m in plan.fresh:
            self.pool[self.rows(m.block)] = self.JUNK
        if write_ids is not None:
            self.pool[plan.slots] = write_ids


def eviction_key(c, scores, last_write, resident):
    """The documented victim order: unscored/NaN lowest, then score, then non-resident, oldest written."""
    scored = c < len(scores) and not math.isnan(scores[c])
    return (scored, float(scores[c]) if scored else 0.0, bool(resident[c]), int(last_write[c]), c)


class PagerMachine(RuleBasedStateMachine):
    # ---- setup and the Python model ------------------------------------------------------------

    @initialize(ct=st.sampled_from([4, 8, 64]), sink=st.integers(0, 2), tail=st.integers(0, 4),
                extra=st.integers(0, 6), max_chunks=st.integers(1, 40), cut=st.integers(0, 63),
                chunk_bytes=st.sampled_from([0, 4096]), order_seed=st.integers(0, 3))
    def setup(self, ct, sink, tail, extra, max_chunks, cut, chunk_bytes, order_seed):
        n_blocks = sink + tail + 2 + extra
        max_tokens = max(1, max_chunks * ct - cut % ct)
        self.cfg = core.PagerConfig(chunk_tokens=ct, pool_tokens=n_blocks * ct, max_tokens=max_tokens,
                                    sink_chunks=sink, tail_chunks=tail, chunk_bytes=chunk_bytes)
        self.p = core.testing.KvPager(self.cfg)
        self.ct, self.sink, self.tail, self.nb = ct, sink, tail, n_blocks
        self.max_chunks = ceil_div(max_tokens, ct)
        self.order = list(range(n_blocks))
        if order_seed:   # seed 0 keeps the identity hand-out order
            self.set_order(order_seed)
        self.rng = np.random.default_rng(order_seed)
        self.model_reset()

    def set_order(self, seed):
        self.order = [int(b) for b in np.random.default_rng(seed).permutation(self.nb)]
        self.op()
        self.p.set_block_order(self.order)

    def model_reset(self):
        self.val = np.full(self.cfg.max_tokens, -1, np.int64)   # write id per position, -1 = unwritten
        self.n = 0
        self.pins = np.zeros(self.max_chunks, bool)
        self.last_write = np.zeros(self.max_chunks, np.int64)
        self.clock = 0
        self.scores = np.zeros(0, np.float32)
        self.stats = dict(page_outs=0, page_ins=0, bytes_out=0, bytes_in=0, reselects=0, evictions=0)
        self.next_id = 0
        self.emu = Emu(self.cfg)

    def op(self, k=1):
        COUNTS["ops"] += k

    def expected_protected(self, n, pins=None):
        pins = self.pins if pins is None else pins
        nc = ceil_div(n, self.ct)
        prot = np.zeros(nc, bool)
        prot[: min(self.sink, nc)] = True
        prot |= pins[:nc]
        if n:
            head = (n - 1) // self.ct
            prot[max(0, head - self.tail): head + 1] = True
        return prot

    def snapshot(self):
        p = self.p
        return (p.n_tokens(), p.epoch(), p.slot_positions().tobytes(), p.chunk_blocks().tobytes(),
                p.chunk_host_valid().tobytes(), p.scores().tobytes(), repr(p.stats()),
                tuple(p.is_pinned(c) for c in range(self.max_chunks)))

    def refused(self, exc, match, fn, *args):
        """A refused call raises the documented error and leaves the pager exactly as it was."""
        before = self.snapshot()
        self.op()
        with pytest.raises(exc, match=match):
            fn(*args)
        assert self.snapshot() == before

    def run_plan(self, plan, write_ids=None):
        """Execute on the emulator, update the ledger model, apply."""
        self.emu.execute(plan, self.p.n_tokens(), write_ids)
        s = self.stats
        s["page_outs"] += len(plan.page_outs)
        s["page_ins"] += len(plan.page_ins)
        s["bytes_out"] += sum(m.copy for m in plan.page_outs) * self.cfg.chunk_bytes
        s["bytes_in"] += len(plan.page_ins) * self.cfg.chunk_bytes
        s["reselects"] += plan.sets_scores
        s["evictions"] += 0 if plan.sets_scores else len(plan.page_outs)
        self.op()
        self.p.apply(plan)

    def free_in_order(self):
        owned = set(int(b) for b in self.p.chunk_blocks() if b >= 0)
        return [b for b in self.order if b not in owned]

    # ---- rules ---------------------------------------------------------------------------------

    # Valid allocations get three rules (hypothesis picks rules evenly) so that contexts grow past the
    # pool and evictions dominate; refusals have one rule of their own.
    @rule()
    def alloc_one(self):   # a decode step
        self.alloc_ok(1)

    @rule(x=st.integers(0, 1 << 16))
    def alloc_some(self, x):   # a prefill batch, often spanning chunk boundaries
        self.alloc_ok(1 + x % (3 * self.ct))

    @rule()
    def alloc_max(self):
        self.alloc_ok(self.p.max_span_tokens())

    @rule(kind=st.sampled_from(["over", "huge", "badstart", "zero"]), x=st.integers(0, 1 << 16))
    def alloc_refused(self, kind, x):
        p = self.p
        start, m = p.n_tokens(), p.max_span_tokens()
        if kind == "badstart":
            self.refused(ValueError, r"must equal n_tokens\(\)=", p.plan_alloc, start + 1 + x % 3, 1)
        elif kind == "zero":
            self.refused(ValueError, r"n=0 must be >= 1", p.plan_alloc, start, 0)
        else:
            n = m + 1 + x % self.ct if kind == "over" else self.cfg.max_tokens + 1
            if n > self.cfg.max_tokens - start:
                self.refused(IndexError, r"exceed max_tokens=", p.plan_alloc, start, n)
            else:
                self.refused(RuntimeError, r"max_span_tokens\(\)=%d" % m, p.plan_alloc, start, n)

    def alloc_ok(self, n):
        p, ct = self.p, self.ct
        start = p.n_tokens()
        n = min(n, p.max_span_tokens())
        if n == 0:   # the context is full
            return
        self.op(2)   # max_span_tokens, plan_alloc
        plan = p.plan_alloc(start, n)
        self.check_alloc_plan(plan, start, n)
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        self.run_plan(plan, ids)
        self.val[start:start + n] = ids
        self.n = start + n
        self.clock += 1
        self.last_write[start // ct:(start + n - 1) // ct + 1] = self.clock
        sp = p.slot_positions()
        assert (sp[plan.slots] == np.arange(start, start + n)).all()

    def check_alloc_plan(self, plan, start, n):
        ct = self.ct
        assert plan.span_start == start and plan.span_n == n and plan.n_tokens_after == start + n
        assert len(plan.slots) == n and plan.slots.dtype == np.int32
        assert len(np.unique(plan.slots)) == n
        assert plan.page_ins == [] and plan.dropped == [] and not plan.sets_scores
        blocks = self.p.chunk_blocks()
        resident = np.zeros(self.max_chunks, bool)
        resident[: len(blocks)] = blocks >= 0
        keep = np.zeros(self.max_chunks, bool)
        prot = self.expected_protected(start + n)
        keep[: len(prot)] = prot
        keep[start // ct:(start + n - 1) // ct + 1] = True
        new = [c for c in range(ceil_div(start, ct), ceil_div(start + n, ct))]
        assert [mv.chunk for mv in plan.fresh] == new
        # evict only when the free blocks run out, and exactly the first victims of the documented order
        free = self.free_in_order()
        n_evict = max(0, len(new) - len(free))
        cands = [c for c in range(self.max_chunks) if resident[c] and not keep[c]]
        cands.sort(key=lambda c: eviction_key(c, self.scores, self.last_write, resident))
        assert [mv.chunk for mv in plan.page_outs] == cands[:n_evict]
        # fresh blocks: free blocks in hand-out order, then the victims' blocks
        assert [mv.block for mv in plan.fresh] == (free + [mv.block for mv in plan.page_outs])[: len(new)]

    @rule(style=st.sampled_from(["random"] * 3 + ["ties"] * 3 + ["nan"] * 3 + ["wrong_len", "2d"]),
          seed=st.integers(0, 1 << 30))
    def reselect(self, style, seed):
        p = self.p
        nc = p.n_chunks()
        rng = np.random.default_rng(seed)
        if style == "wrong_len":
            bad = np.zeros(nc + 1 + seed % 3, np.float32)
            self.refused(ValueError, r"scores has %d entries but n_chunks\(\)=%d" % (len(bad), nc),
                         p.plan_reselect, bad)
            return
        if style == "2d":
            self.refused(ValueError, r"1-D", p.plan_reselect, np.zeros((1, nc), np.float32))
            return
        if style == "random":
            scores = rng.standard_normal(nc).astype(np.float32)
        else:
            scores = rng.choice(np.array([-1.0, 0.0, 0.5, 2.0], np.float32), nc)
        if style == "nan":
            scores[rng.random(nc) < 0.4] = np.nan
        self.op()
        plan = p.plan_reselect(scores)
        expected = self.expected_reselect(scores)
        blocks = p.chunk_blocks()
        before = set(int(c) for c in np.flatnonzero(blocks >= 0))
        assert sorted(mv.chunk for mv in plan.page_ins) == sorted(expected - before)
        assert sorted(mv.chunk for mv in plan.page_outs) == sorted(before - expected)
        # page-outs come first: every page-in lands in a block that is free or emptied by a page-out
        usable = set(self.free_in_order()) | {mv.block for mv in plan.page_outs}
        assert all(mv.block in usable for mv in plan.page_ins)
        assert plan.fresh == [] and plan.sets_scores
        self.run_plan(plan)
        self.scores = scores.copy()
        assert set(int(c) for c in np.flatnonzero(p.chunk_blocks() >= 0)) == expected
        np.testing.assert_array_equal(p.scores(), scores)

    def expected_reselect(self, scores):
        """Protected chunks + the top-ranked others that fit (ties: resident first, then newest)."""
        nc = self.p.n_chunks()
        prot = self.expected_protected(self.n)
        resident = np.zeros(self.max_chunks, bool)
        resident[:nc] = self.p.chunk_blocks() >= 0
        others = [c for c in range(nc) if not prot[c]]
        others.sort(key=lambda c: eviction_key(c, scores, self.last_write, resident))
        budget = self.nb - int(prot.sum())
        chosen = others[max(0, len(others) - budget):]
        return set(int(c) for c in np.flatnonzero(prot)) | set(chosen)

    @rule(lo=st.integers(0, 1 << 16), length=st.integers(0, 1 << 16), past_end=st.booleans())
    def pin(self, lo, length, past_end):
        p, ct = self.p, self.ct
        mt = self.cfg.max_tokens
        if past_end and length % 8 == 0:
            self.refused(IndexError, r"0 <= lo <= hi <= max_tokens=%d" % mt, p.plan_pin, lo % (mt + 1), mt + 1)
            return
        lo = lo % (self.n + 1) if lo % 4 else lo % (mt + 1)   # mostly over written positions
        hi = min(mt, lo + length % (3 * ct + 1))
        new = np.zeros(self.max_chunks, bool)
        if hi > lo:
            new[lo // ct:(hi - 1) // ct + 1] = True
        pins_after = self.pins | new
        n_sp = int(np.count_nonzero(pins_after | (np.arange(self.max_chunks) < self.sink)))
        if self.nb - n_sp - (self.tail + 1) < 1:
            self.refused(RuntimeError, r"one block must stay evictable", p.plan_pin, lo, hi)
            return
        self.op()
        plan = p.plan_pin(lo, hi)
        assert sorted(plan.pins) == [int(c) for c in np.flatnonzero(new & ~self.pins)]
        nc = p.n_chunks()
        blocks = p.chunk_blocks()
        want_in = [c for c in range(nc) if new[c] and blocks[c] < 0]
        assert sorted(mv.chunk for mv in plan.page_ins) == want_in
        self.run_plan(plan)
        self.pins = pins_after

    @rule(kind=st.sampled_from(["near"] * 4 + ["deep"] * 2 + ["over", "negative"]), x=st.integers(0, 1 << 16))
    def truncate(self, kind, x):
        p, ct = self.p, self.ct
        if kind == "over":
            self.refused(IndexError, r"must be in \[0, n_tokens\(\)=", p.plan_truncate, p.n_tokens() + 1 + x % 5)
            return
        if kind == "negative":
            self.refused(IndexError, r"must be in \[0, n_tokens\(\)=", p.plan_truncate, -1 - x % 5)
            return
        # near: a rejected speculative draft; deep: rewinding into evicted chunks, which pages them in
        n = max(0, self.n - x % (2 * ct)) if kind == "near" else x % (self.n + 1)
        self.op()
        plan = p.plan_truncate(n)
        old_nc = p.n_chunks()
        assert plan.dropped == list(range(ceil_div(n, ct), old_nc))
        blocks = p.chunk_blocks()
        prot = self.expected_protected(n)
        assert sorted(mv.chunk for mv in plan.page_ins) == [c for c in range(len(prot)) if prot[c] and blocks[c] < 0]
        self.run_plan(plan)
        self.val[n:] = -1
        self.n = n
        self.last_write[ceil_div(n, ct):] = 0
        self.scores = self.scores[: ceil_div(n, ct)]
        for q in range(n, min(self.cfg.max_tokens, n + ct)):
            assert p.slot_of(q) == -1

    # The rarer operations share one rule so they do not crowd out the ones that build state.
    @rule(kind=st.sampled_from(["unpin"] * 3 + ["stale"] * 3 + ["reset", "block_order"]),
          seed=st.integers(1, 1 << 16))
    def misc(self, kind, seed):
        p = self.p
        if kind == "unpin":
            self.op()
            p.unpin_all()
            self.pins[:] = False
        elif kind == "stale":
            self.op(2)
            old = p.plan_truncate(p.n_tokens())     # changes nothing but the epoch
            p.apply(p.plan_truncate(p.n_tokens()))
            self.refused(RuntimeError, r"stale plan made at epoch %d" % old.epoch, p.apply, old)
        elif kind == "reset":
            self.op()
            p.reset()
            self.model_reset()
            assert p.stats().to_dict() == self.stats
        elif p.n_resident() > 0:
            self.refused(RuntimeError, r"only allowed while no chunk is resident", p.set_block_order,
                         list(range(self.nb)))
        else:
            self.set_order(seed)

    # ---- the checks after every step -----------------------------------------------------------

    @invariant()
    def consistent(self):
        COUNTS["steps"] += 1
        p, ct, n = self.p, self.ct, self.n
        p.check_invariants()
        assert p.n_tokens() == n and p.n_chunks() == ceil_div(n, ct)
        blocks, hv = p.chunk_blocks(), p.chunk_host_valid()
        resident = blocks >= 0
        assert p.n_resident() == resident.sum() <= self.nb
        assert len(set(blocks[resident].tolist())) == resident.sum()
        prot = self.expected_protected(n)
        np.testing.assert_array_equal(p.protected_chunks(), prot)
        assert resident[prot].all(), "a protected chunk is not resident"
        for c in range(self.max_chunks):
            assert p.is_pinned(c) == self.pins[c]
        if self.order == list(range(self.nb)) and self.nb >= self.max_chunks:
            assert p.is_identity(), "a pool that holds every chunk keeps the identity mapping"

        # every written position reads back its write id, from its slot or from its host image
        pos = np.arange(n)
        ch, off = pos // ct, pos % ct
        blk = blocks[ch]
        res = blk >= 0
        slots = blk * ct + off
        sp = p.slot_positions()
        assert (sp[slots[res]] == pos[res]).all()
        assert np.count_nonzero(sp >= 0) == res.sum(), "a slot holds a position that is not resident there"
        assert (self.emu.pool[slots[res]] == self.val[:n][res]).all()
        assert hv[ch[~res]].all()
        assert (self.emu.host[ch[~res], off[~res]] == self.val[:n][~res]).all()
        clean = res & hv[ch]   # a valid host image of a resident chunk matches its block
        assert (self.emu.host[ch[clean], off[clean]] == self.val[:n][clean]).all()
        for q in {0, n - 1, n, n // 2, int(self.rng.integers(0, self.cfg.max_tokens))}:
            if 0 <= q < self.cfg.max_tokens:
                want = int(slots[q]) if q < n and res[q] else -1
                assert p.slot_of(q) == want

        assert p.stats().to_dict() == self.stats
        assert p.n_host_images() == hv.sum()
        assert p.host_bytes() == hv.sum() * self.cfg.chunk_bytes
        np.testing.assert_array_equal(p.scores(), self.scores)


def run_machine(max_examples, steps):
    run_state_machine_as_test(PagerMachine, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))


def test_property_fast():
    run_machine(max_examples=30, steps=40)


@pytest.mark.slow
def test_property_long():
    before = COUNTS["ops"]
    while COUNTS["ops"] - before < 100_000:
        run_machine(max_examples=100, steps=100)


# ---- targeted tests ---------------------------------------------------------------------------------

def make(ct=4, n_blocks=None, max_tokens=64, sink=1, tail=1, chunk_bytes=0):
    n_blocks = n_blocks or sink + tail + 2
    return core.testing.KvPager(core.PagerConfig(chunk_tokens=ct, pool_tokens=n_blocks * ct, max_tokens=max_tokens,
                                         sink_chunks=sink, tail_chunks=tail, chunk_bytes=chunk_bytes))


def do(p, plan):
    p.apply(plan)
    p.check_invariants()
    return plan


def alloc(p, n):
    return do(p, p.plan_alloc(p.n_tokens(), n))


def fill(p, n):
    """Write n more positions a chunk at a time (a small pool cannot take them in one span)."""
    while n > 0:
        k = min(n, p.max_span_tokens(), p.config().chunk_tokens)
        alloc(p, k)
        n -= k


def resident_set(p):
    return set(np.flatnonzero(p.chunk_blocks() >= 0).tolist())


def test_config_defaults_and_minimum():
    cfg = core.PagerConfig(pool_tokens=512, max_tokens=4096)
    assert (cfg.chunk_tokens, cfg.sink_chunks, cfg.tail_chunks) == (64, 1, 4)
    assert cfg.min_pool_tokens() == 448
    p = core.testing.KvPager(cfg)
    assert p.n_blocks() == 8 and p.n_tokens() == 0 and p.n_chunks() == 0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(pool_tokens=300), ValueError, r"pool_tokens=300 is not a multiple of chunk_tokens=64"),
    (dict(pool_tokens=256),
     ValueError, r"pool_tokens=256 is below the minimum 448 = \(sink_chunks 1 \+ tail_chunks 4 \+ 2\) \* 64"),
    (dict(pool_tokens=512, chunk_tokens=0), ValueError, r"chunk_tokens=0 must be > 0"),
    (dict(pool_tokens=512, max_tokens=0), ValueError, r"max_tokens=0 must be > 0"),
    (dict(pool_tokens=512, sink_chunks=-1), ValueError, r"sink_chunks=-1 must be >= 0"),
    (dict(pool_tokens=512, tail_chunks=-2), ValueError, r"tail_chunks=-2 must be >= 0"),
    (dict(pool_tokens=512, chunk_bytes=-5), ValueError, r"chunk_bytes=-5 must be >= 0"),
])
def test_bad_config(kwargs, exc, match):
    kwargs = dict(dict(max_tokens=4096), **kwargs)
    with pytest.raises(exc, match=match):
        core.testing.KvPager(core.PagerConfig(**kwargs))


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        core.PagerConfig(64, 512)


def test_identity_hand_out_until_first_eviction():
    p = make(ct=4, n_blocks=6, max_tokens=64)
    for _ in range(6 * 4):   # one token at a time fills blocks 0..5 with chunks 0..5
        alloc(p, 1)
        assert p.is_identity()
    assert [p.slot_of(q) for q in range(24)] == list(range(24))
    plan = alloc(p, 1)   # chunk 6 needs a block: the first eviction (LRU: chunk 1, block 1)
    assert [(m.chunk, m.block) for m in plan.page_outs] == [(1, 1)]
    assert [(m.chunk, m.block) for m in plan.fresh] == [(6, 1)]
    assert plan.slots.tolist() == [4] and not p.is_identity()


def test_full_cache_pool_keeps_identity_through_truncate():
    p = make(ct=4, n_blocks=8, max_tokens=32)
    fill(p, 30)
    do(p, p.plan_truncate(9))
    assert p.slot_of(8) == 8 and p.slot_of(9) == -1
    alloc(p, 20)
    assert p.is_identity() and p.slot_positions().tolist()[:29] == list(range(29))


def test_block_order_hook():
    p = make(ct=4, n_blocks=5, max_tokens=64)
    p.set_block_order([4, 3, 2, 1, 0])
    plan = alloc(p, 9)
    assert [(m.chunk, m.block) for m in plan.fresh] == [(0, 4), (1, 3), (2, 2)]
    assert plan.slots.tolist() == [16, 17, 18, 19, 12, 13, 14, 15, 8]
    assert not p.is_identity()
    with pytest.raises(RuntimeError, match=r"only allowed while no chunk is resident \(n_resident\(\)=3\)"):
        p.set_block_order([0, 1, 2, 3, 4])
    p.reset()   # keeps the order: the hook is for replaying a layout
    assert alloc(p, 1).slots.tolist() == [16]
    p.reset()
    with pytest.raises(ValueError, match=r"order has 4 entries; it must be a permutation of \[0, n_blocks=5\)"):
        p.set_block_order([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"order\[2\]=1 is out of range or repeated"):
        p.set_block_order([0, 1, 1, 3, 4])


def test_lru_victims_without_scores():
    p = make(ct=4, n_blocks=6, max_tokens=80, sink=1, tail=1)
    alloc(p, 24)                    # chunks 0..5 fill the pool
    plan = alloc(p, 12)             # chunks 6, 7, 8: protected are 0 (sink) and 7, 8 (tail) + the span
    assert [m.chunk for m in plan.page_outs] == [1, 2, 3]   # oldest written first
    assert all(m.copy for m in plan.page_outs)
    assert resident_set(p) == {0, 4, 5, 6, 7, 8}
    assert p.stats().evictions == 3 and p.stats().page_outs == 3


def test_lowest_score_victim_then_unscored_first():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1)
    alloc(p, 20)                                                   # chunks 0..4, all resident
    do(p, p.plan_reselect(np.array([0, 0.9, 0.1, 0.5, 0.7], np.float32)))
    assert [m.chunk for m in alloc(p, 4).page_outs] == [2]        # chunk 5: lowest of 1, 2, 3
    assert [m.chunk for m in alloc(p, 4).page_outs] == [3]        # chunk 6: lowest of 1, 3, 4
    assert [m.chunk for m in alloc(p, 4).page_outs] == [5]        # chunk 7: 5 has no score: below all


def test_nan_scores_rank_lowest():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1)
    alloc(p, 20)
    do(p, p.plan_reselect(np.array([0, np.nan, -1e30, -np.inf, 5], np.float32)))
    assert [m.chunk for m in alloc(p, 4).page_outs] == [1]


def test_reselect_top_scores_page_outs_first():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1)
    fill(p, 40)                                                   # chunks 0..9; resident 0, 6, 7, 8, 9
    assert resident_set(p) == {0, 6, 7, 8, 9}
    scores = np.array([0, 0.1, 3.0, 0.2, 0.3, 2.0, 0.0, 0.5, 0, 0], np.float32)
    evictions = p.stats().evictions
    plan = p.plan_reselect(scores)
    assert sorted(m.chunk for m in plan.page_outs) == [6, 7]
    assert sorted(m.chunk for m in plan.page_ins) == [2, 5]
    # a full pool: page-ins reuse exactly the blocks the page-outs empty, so page-outs must run first
    assert sorted(m.block for m in plan.page_ins) == sorted(m.block for m in plan.page_outs)
    assert plan.moves_bytes() and plan.sets_scores
    do(p, plan)
    assert resident_set(p) == {0, 2, 5, 8, 9}
    assert p.stats().reselects == 1 and p.stats().evictions == evictions   # reselect page-outs are not evictions
    np.testing.assert_array_equal(p.scores(), scores)
    again = do(p, p.plan_reselect(scores))                         # same scores: nothing moves
    assert not again.moves_bytes() and p.stats().reselects == 2


def test_reselect_ties_keep_resident_chunks():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1)
    fill(p, 40)                                                    # resident 0, 6, 7, 8, 9
    do(p, p.plan_reselect(np.array([0, 1, 1, 0, 0, 0, 0, 0, 0, 0], np.float32)))
    assert resident_set(p) == {0, 1, 2, 8, 9}
    # all tied now: the old chunks 1, 2 stay rather than the newer 6, 7 coming back
    plan = do(p, p.plan_reselect(np.zeros(10, np.float32)))
    assert not plan.moves_bytes() and resident_set(p) == {0, 1, 2, 8, 9}


def test_reselect_keeps_everything_that_fits():
    p = make(ct=4, n_blocks=6, max_tokens=80, sink=1, tail=1)
    alloc(p, 16)
    plan = do(p, p.plan_reselect(np.full(4, np.nan, np.float32)))
    assert not plan.moves_bytes() and resident_set(p) == {0, 1, 2, 3}


def test_clean_host_image_is_dropped_without_copy():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1, chunk_bytes=100)
    fill(p, 40)                                                   # 1..5 paged out (copies)
    assert p.stats().bytes_out == 500 and p.host_bytes() == 500
    up = np.array([0, 0, 9, 0, 0, 0, 0, 0, 0, 0], np.float32)
    down = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)
    do(p, p.plan_reselect(up))                 # 2 comes back (its image stays valid), 6 goes out (a copy)
    assert p.chunk_host_valid()[2] and p.is_resident(2)
    out = do(p, p.plan_reselect(np.where(np.arange(10) == 6, 9, down).astype(np.float32)))
    moves = {m.chunk: m.copy for m in out.page_outs}
    assert moves == {2: False}
    assert p.stats().bytes_out == 600 and p.stats().bytes_in == 200   # 2 and 6 came in


def test_writing_into_a_chunk_invalidates_its_host_image():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1)
    fill(p, 40)                                   # chunks 0..9, 1..5 evicted
    plan = do(p, p.plan_truncate(14))              # head is chunk 3: window 2, 3 paged in
    assert sorted(m.chunk for m in plan.page_ins) == [2, 3]
    assert plan.dropped == [4, 5, 6, 7, 8, 9]
    assert p.chunk_host_valid()[3]
    alloc(p, 1)                                    # position 14 rewrites chunk 3
    assert not p.chunk_host_valid()[3] and p.chunk_host_valid()[2]
    outs = {}
    while 3 in resident_set(p):                    # write on until 3 leaves the window and is evicted
        outs.update({m.chunk: m.copy for m in alloc(p, 1).page_outs})
    assert outs[3] is True


def test_truncate_forgets_positions_and_scores():
    p = make(ct=4, n_blocks=5, max_tokens=80, sink=1, tail=1)
    fill(p, 30)
    do(p, p.plan_reselect(np.arange(8, dtype=np.float32)))
    do(p, p.plan_truncate(10))
    assert p.n_tokens() == 10 and p.n_chunks() == 3 and len(p.scores()) == 3
    assert [p.slot_of(q) for q in range(10, 14)] == [-1] * 4
    do(p, p.plan_truncate(0))
    assert p.n_resident() == 0 and p.n_host_images() == 0 and len(p.scores()) == 0


def test_pins_page_in_and_protect():
    p = make(ct=4, n_blocks=7, max_tokens=80, sink=1, tail=1)
    fill(p, 40)                                   # 1..5 evicted
    plan = do(p, p.plan_pin(5, 9))                 # chunks 1 and 2
    assert sorted(m.chunk for m in plan.page_ins) == [1, 2] and sorted(plan.pins) == [1, 2]
    assert p.is_pinned(1) and p.is_pinned(2) and not p.is_pinned(3)
    for _ in range(6):
        alloc(p, 4)
        assert {1, 2} <= resident_set(p)
    do(p, p.plan_pin(60, 64))                      # a future chunk (15): protected once written
    while p.n_tokens() < 64:
        alloc(p, 4)
    assert p.is_resident(15)
    p.unpin_all()
    assert not p.is_pinned(1)
    alloc(p, 4)
    alloc(p, 4)
    assert not {1, 2} <= resident_set(p)


def test_pins_must_leave_an_evictable_block():
    p = make(ct=4, n_blocks=6, max_tokens=80, sink=1, tail=1)   # 6 - 1 sink - 2 tail: at most 2 more
    with pytest.raises(RuntimeError, match=r"makes 4 sink or pinned chunks; with n_blocks=6 and a tail window "
                                           r"of tail_chunks\+1=2 at most 3 are allowed"):
        p.plan_pin(4, 16)
    do(p, p.plan_pin(4, 12))
    epoch = p.epoch()
    with pytest.raises(RuntimeError, match=r"one block must stay evictable"):
        p.plan_pin(40, 41)
    assert p.epoch() == epoch
    with pytest.raises(IndexError, match=r"range \[5, 81\) must satisfy 0 <= lo <= hi <= max_tokens=80"):
        p.plan_pin(5, 81)


def test_stale_plan_is_refused():
    p = make(ct=4, n_blocks=4, max_tokens=80)
    a, b = p.plan_alloc(0, 4), p.plan_alloc(0, 4)
    do(p, a)
    with pytest.raises(RuntimeError, match=r"stale plan made at epoch 0; the pager is at epoch 1"):
        p.apply(b)
    c = p.plan_alloc(4, 1)
    p.unpin_all()
    with pytest.raises(RuntimeError, match=r"stale plan"):
        p.apply(c)
    d = p.plan_truncate(0)
    p.reset()
    with pytest.raises(RuntimeError, match=r"stale plan"):
        p.apply(d)


def test_bad_calls_raise_with_the_valid_values():
    p = make(ct=4, n_blocks=5, max_tokens=40, sink=1, tail=1)
    alloc(p, 6)
    with pytest.raises(ValueError, match=r"start=5 must equal n_tokens\(\)=6"):
        p.plan_alloc(5, 1)
    with pytest.raises(ValueError, match=r"n=0 must be >= 1"):
        p.plan_alloc(6, 0)
    with pytest.raises(IndexError, match=r"positions \[6, 41\) exceed max_tokens=40; at most 34 more positions fit"):
        p.plan_alloc(6, 35)
    with pytest.raises(RuntimeError, match=r"span \[6, 26\) needs 7 resident chunks .* n_blocks=5; "
                                           r"max_span_tokens\(\)=14"):
        p.plan_alloc(6, 20)
    with pytest.raises(ValueError, match=r"scores has 1 entries but n_chunks\(\)=2"):
        p.plan_reselect([0.5])
    with pytest.raises(IndexError, match=r"n=7 must be in \[0, n_tokens\(\)=6\]"):
        p.plan_truncate(7)
    with pytest.raises(IndexError, match=r"pos=40 is outside \[0, max_tokens=40\)"):
        p.slot_of(40)
    with pytest.raises(IndexError, match=r"chunk=10 is outside \[0, 10\)"):
        p.is_resident(10)
    assert p.slot_of(6) == -1


def test_max_span_tokens_is_the_largest_span_that_fits():
    for start in range(0, 30, 3):
        p = make(ct=4, n_blocks=5, max_tokens=60, sink=1, tail=1)
        if start:
            fill(p, start)
        m = p.max_span_tokens()
        p.plan_alloc(start, m)
        if start + m < 60:
            with pytest.raises(RuntimeError):
                p.plan_alloc(start, m + 1)


def test_stats_and_host_bytes():
    p = make(ct=4, n_blocks=4, max_tokens=40, sink=1, tail=1, chunk_bytes=1000)
    fill(p, 24)
    s = p.stats()
    assert (s.page_outs, s.bytes_out, s.evictions, s.page_ins) == (2, 2000, 2, 0)
    assert p.host_bytes() == 2000 and p.n_host_images() == 2
    p.reset()
    assert p.stats().to_dict() == dict(page_outs=0, page_ins=0, bytes_out=0, bytes_in=0, reselects=0, evictions=0)


def test_invariant_checker_runs_on_a_fresh_pager():
    p = make()
    p.check_invariants()
    assert p.slot_positions().tolist() == [-1] * 16
