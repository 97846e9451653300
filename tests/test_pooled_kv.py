"""PooledKV: page-out/page-in through real pager plans is byte-exact; the slot mask matches NumPy."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvflash_ggml import _core

KV_TYPES = ["f16", "q8_0", "q4_0", "f32", "f16-v_trans", "f32-v_trans"]


def make(kv_type, pool_tokens=448, chunk=64, n_layer=3):
    kv_type, _, layout = kv_type.partition("-")
    store = _core.testing.CpuPooledKV(n_layer=n_layer, n_embd_k=64, n_embd_v=96, pool_tokens=pool_tokens,
                              chunk_tokens=chunk, kv_type=kv_type, v_trans=layout == "v_trans")
    pager = _core.testing.KvPager(_core.PagerConfig(chunk_tokens=chunk, pool_tokens=pool_tokens, max_tokens=4096,
                                            chunk_bytes=store.kv.chunk_bytes))
    return store, pager


def execute(kv, pager, plan):
    kv.execute(plan)
    pager.apply(plan)


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_page_out_and_in_is_byte_exact(kv_type):
    store, pager = make(kv_type)
    kv, rng = store.kv, np.random.default_rng(0)
    images = {}   # chunk -> the bytes we wrote into its block
    for c in range(20):   # 20 chunks through a 7-block pool: most get evicted
        plan = pager.plan_alloc(pager.n_tokens(), 64)
        execute(kv, pager, plan)
        block = int(pager.chunk_blocks()[c])
        images[c] = rng.integers(0, 256, kv.chunk_bytes, dtype=np.uint8).tobytes()
        kv.write_block(block, images[c])   # stands in for the graph's set_rows writes
    assert pager.stats().page_outs > 0
    evicted = [c for c, b in enumerate(pager.chunk_blocks()) if b < 0]
    for c in evicted:
        assert kv.host_image(c) == images[c]
    # bring evicted chunks back with a reselect that scores them highest
    scores = np.zeros(pager.n_chunks(), np.float32)
    scores[evicted[:2]] = 10.0
    plan = pager.plan_reselect(scores)
    assert plan.page_ins
    execute(kv, pager, plan)
    pager.check_invariants()
    for c, b in enumerate(pager.chunk_blocks()):
        if b >= 0:
            assert kv.read_block(int(b)) == images[c], f"chunk {c} in block {b} differs after paging"


def test_write_block_rejects_wrong_size():
    store, _ = make("f16")
    with pytest.raises(ValueError, match="expected"):
        store.kv.write_block(0, b"\0" * 10)
    with pytest.raises(IndexError, match="outside the pool"):
        store.kv.read_block(99)


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="multiple of chunk_tokens"):
        _core.testing.CpuPooledKV(n_layer=1, n_embd_k=64, n_embd_v=64, pool_tokens=100)
    with pytest.raises(ValueError, match="block size"):
        _core.testing.CpuPooledKV(n_layer=1, n_embd_k=48, n_embd_v=64, pool_tokens=448, kv_type="q8_0")
    with pytest.raises(ValueError, match="unknown kv_type"):
        _core.testing.CpuPooledKV(n_layer=1, n_embd_k=64, n_embd_v=64, pool_tokens=448, kv_type="q3_k")
    with pytest.raises(ValueError, match="transposed V needs an unquantized type"):
        _core.testing.CpuPooledKV(n_layer=1, n_embd_k=64, n_embd_v=64, pool_tokens=448, kv_type="q8_0", v_trans=True)


def numpy_mask(slot_pos, n_kv, pos, window):
    sp = np.asarray(slot_pos[:n_kv])[None, :]
    p = np.asarray(pos)[:, None]
    visible = (sp >= 0) & (sp <= p)
    if window > 0:
        visible &= (p - sp) < window
    return np.where(visible, 0.0, -np.inf).astype(np.float16)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_slot_mask_matches_numpy(data):
    n_slots = data.draw(st.integers(1, 300))
    slot_pos = data.draw(st.lists(st.integers(-1, 500), min_size=n_slots, max_size=n_slots))
    n_kv = data.draw(st.integers(1, n_slots))
    pos = data.draw(st.lists(st.integers(0, 600), min_size=1, max_size=40))
    if data.draw(st.booleans()):   # a prefill step's positions ascend (the mask builder's fast path)
        pos = sorted(pos)
    window = data.draw(st.sampled_from([0, 0, 1, 16, 128]))
    got = _core.testing.build_slot_mask(np.array(slot_pos, np.int64), n_kv, np.array(pos, np.int32), window)
    assert got.dtype == np.float16 and got.shape == (len(pos), n_kv)
    np.testing.assert_array_equal(got, numpy_mask(slot_pos, n_kv, pos, window))
