"""Layer-major exact prefill (Session.prefill_exact) against the full cache it must equal.

A prompt larger than the pool runs layer by layer with a one-layer staging pool; afterwards every chunk,
resident or in the host store, must hold the bytes a full-cache session computes for it, and the logits
after the last token must be the full cache's. Both run the same ggml CPU kernels on the same shapes (the
same steps of n_batch tokens, the same padded n_kv), so the bar is byte equality: measured max |diff| 0.0
for every case here. A bug in the staging copy, the placement or the layer order moves whole chunks.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg

C = _core.CHUNK_TOKENS
MAX_TOKENS = 1024
POOL = 448   # the minimum pool: 7 blocks, so most of a 700-token prompt ends in the host store


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models


def session(model, pool: int, **kw) -> _core.Session:
    return _core.Session(model, _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=pool, n_batch=128, **kw))


def chunk_bytes(sess: _core.Session, c: int) -> bytes:
    block = sess.pager.chunk_blocks()[c]
    return sess.kv.read_block(block) if block >= 0 else sess.kv.host_image(c)


def assert_same_chunks(sess: _core.Session, full: _core.Session, n_tokens: int) -> None:
    """Every whole chunk (a partial last one holds rows no position owns yet) equals the full cache's."""
    assert sess.n_tokens == full.n_tokens == n_tokens
    sess.pager.check_invariants()
    for c in range(n_tokens // C):
        assert chunk_bytes(sess, c) == full.kv.read_block(c), f"chunk {c}"


def assert_same_rings(sess: _core.Session, full: _core.Session) -> None:
    """The sliding-window rings hold the full cache's bytes, row for row."""
    assert sess.ring_tokens == full.ring_tokens > 0
    for b in range(sess.ring_tokens // C):
        assert sess.ring_block(b) == full.ring_block(b), f"ring block {b}"


def prompt(model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.hparams.n_vocab, n).astype(np.int32)


def exact_and_full(model, attention: str, kv_type: str, n: int = 700):
    """A prompt of n through an exact prefill into the minimum pool and through a full cache: the same logits and
    chunk bytes, and the exact prefill paged. Returns both sessions and the prompt's captured attention."""
    tokens = prompt(model, n)
    full = session(model, 0, attention=attention, kv_type=kv_type)
    logits_full = full.forward(tokens, 0)
    sess = session(model, POOL, attention=attention, kv_type=kv_type)
    logits, attention_to = sess.prefill_exact(tokens, 0)
    np.testing.assert_array_equal(logits, logits_full)
    assert sess.pager.stats().page_outs > 0
    assert_same_chunks(sess, full, len(tokens))
    return sess, full, attention_to


@pytest.mark.parametrize("arch", rg.ARCHS)
@pytest.mark.parametrize("attention,kv_type", [("matmul", "f16"), ("flash", "f16"), ("flash", "q8_0"),
                                               ("flash", "q4_0")])
def test_exact_prefill_writes_the_full_cache_bytes(tiny, arch, attention, kv_type):
    sess, full, attention_to = exact_and_full(tiny(arch), attention, kv_type)
    assert sess.pager.n_resident() == POOL // C
    # the last tokens' attention: one weight per position, each a softmax probability
    assert attention_to.shape == (sess.n_tokens,) and np.all((attention_to >= 0) & (attention_to <= 1))
    assert attention_to.max() > 0


# gemma4's last 3 layers keep no K/V: local layers 3 and 4 attend local layer 1's (its ring), global layer 5 attends
# global layer 2's (the staging pool). They write none and run only the prompt's last step, so the chunks and rings
# test their sources and the logits test them.
SHARED_KV = dict(n_shared_kv=3)


@pytest.mark.parametrize("attention,kv_type", [("matmul", "f16"), ("flash", "f16"), ("flash", "q8_0"),
                                               ("flash", "q4_0")])
def test_exact_prefill_of_shared_kv_layers_writes_the_full_cache_bytes(tiny, attention, kv_type):
    model = tiny("gemma4", **SHARED_KV)
    assert model.hparams.n_layer_kv == 3
    sess, full, attention_to = exact_and_full(model, attention, kv_type)
    assert_same_rings(sess, full)   # 700 positions through rings of 256 rows: each wrapped twice
    assert attention_to.max() > 0


@pytest.mark.parametrize("attention", ["flash", "matmul"])
@pytest.mark.parametrize("held", [576, 601, 950])
def test_exact_prefill_of_shared_kv_layers_extends_a_held_prefix(tiny, attention, held):
    # The shared global layer attends the held positions the staging pool took from the pool and the host store;
    # after 950 held the whole prompt is one step, whose local windows reach back into the rings' held rows.
    model = tiny("gemma4", **SHARED_KV)
    tokens = prompt(model, 1000, seed=7)
    full = session(model, 0, attention=attention)
    full.forward(tokens[:held], 0)
    logits_full = full.forward(tokens[held:], held)
    sess = session(model, POOL, attention=attention)
    sess.prefill_exact(tokens[:held], 0)
    assert sess.pager.n_host_images() > 0
    logits, _ = sess.prefill_exact(tokens[held:], held)
    np.testing.assert_array_equal(logits, logits_full)
    assert_same_chunks(sess, full, len(tokens))
    assert_same_rings(sess, full)


@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("gemma4", SHARED_KV)])
@pytest.mark.parametrize("attention", ["flash", "matmul"])
def test_exact_prefill_in_larger_steps_than_the_full_cache(tiny, attention, arch, overrides):
    # The engine runs the exact prefill in larger steps than a full cache when attention is flash
    # (PoolConfig.exact_prefill_batch). On the CPU the mul_mat path computes each token's row alone: bytes stay
    # the full cache's. The flash kernel tiles a large batch of queries differently (F32 tiles, not per-row F16
    # dots): equal within summation order, measured max |logit diff| 6.7e-4 here (gemma4: 5.0e-4). On gemma4 the
    # ring layers' steps stay at what a ring takes (160), the global ones take 384, and the shared layers the last
    # ring step: a global shared layer then runs steps of another size than its source did.
    model = tiny(arch, **overrides)
    tokens = prompt(model, 700, seed=3)
    full = session(model, 0, attention=attention)
    logits_full = full.forward(tokens, 0)
    sess = session(model, POOL, attention=attention)
    logits, _ = sess.prefill_exact(tokens, 0, n_batch=384)
    if attention == "matmul":
        np.testing.assert_array_equal(logits, logits_full)
        assert_same_chunks(sess, full, len(tokens))
        return
    np.testing.assert_allclose(logits, logits_full, atol=2e-3)
    for c in range(len(tokens) // C):
        mine = np.frombuffer(chunk_bytes(sess, c), np.float16).astype(np.float32)
        theirs = np.frombuffer(full.kv.read_block(c), np.float16).astype(np.float32)
        np.testing.assert_allclose(mine, theirs, atol=2e-3, err_msg=f"chunk {c}")


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen35", {}), ("gemma4", SHARED_KV)])
@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_exact_prefill_attends_a_step_in_blocks_of_queries(tiny, arch, overrides, attention):
    # A step's mask (and the mul_mat path's attention matrix) grows with the keys it attends, so the layer-major
    # prefill attends a step's queries in blocks whose buffers fit attention_block_bytes: 1 byte forces the
    # smallest block (32 queries), four per step of 128, each seeing only the keys up to its last position; on the
    # flash path the captured queries' attention is then computed over blocks of 64 keys (a log-sum-exp pass,
    # then the probabilities). The mul_mat path computes each query's row alone: the full cache's bytes. The CPU flash kernel tiles a block
    # of 32 queries otherwise than one of 128: summation order only (measured max |diff| of logits / attention /
    # K/V values: llama 2.5e-4 / 1.2e-7 / 4.9e-4, qwen35 7.6e-5 / 1.8e-5 / 2.4e-3 on K/V of ~1, gemma4 0).
    # The prompt's second part starts at 603, off a multiple of 8: the band's mask views then start at another row
    # of its table (kv_step_inputs.h).
    model = tiny(arch, **overrides)
    tokens, split = prompt(model, 1000, seed=5), 603
    full = session(model, 0, attention=attention)
    full.forward(tokens[:split], 0)
    logits_full = full.forward(tokens[split:], split)
    whole = session(model, POOL, attention=attention)
    whole.prefill_exact(tokens[:split], 0)
    _, attention_whole = whole.prefill_exact(tokens[split:], split)
    sess = session(model, POOL, attention=attention)
    sess.prefill_exact(tokens[:split], 0, attention_block_bytes=1)
    assert sess.pager.n_host_images() > 0
    logits, attention_to = sess.prefill_exact(tokens[split:], split, attention_block_bytes=1)
    if attention == "matmul":
        np.testing.assert_array_equal(logits, logits_full)
        np.testing.assert_array_equal(attention_to, attention_whole)
        assert_same_chunks(sess, full, len(tokens))
        return
    np.testing.assert_allclose(logits, logits_full, atol=1e-3)
    np.testing.assert_allclose(attention_to, attention_whole, atol=1e-4)
    for c in range(len(tokens) // C):
        mine = np.frombuffer(chunk_bytes(sess, c), np.float16).astype(np.float32)
        theirs = np.frombuffer(full.kv.read_block(c), np.float16).astype(np.float32)
        np.testing.assert_allclose(mine, theirs, atol=5e-3, err_msg=f"chunk {c}")


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen35", {}), ("gemma4", SHARED_KV)])
def test_blocks_of_queries_sharing_a_flash_call_attend_as_they_do_apart(tiny, arch, overrides):
    # blocks_per_call: a step's blocks of queries go into one flash attention call as its sequences (ne3), the latest
    # first, each under its own mask, which is the latest block's view of the band's table moved on by a block's rows
    # per sequence; K and V are one view for all (stride 0 along ne3). 1 byte of attention_block_bytes makes blocks of
    # 32 queries, four to a step of 128; split at 603 (off a multiple of 8) the views start at another table row. Each
    # query then attends the keys it did alone, those past its block masked: logits, the captured attention (its
    # block is the last of a group) and every chunk's K/V as with a call per block. (On tiny-gemma4 only the latest
    # block's output reaches the logits: its one global layer with K/V feeds shared-K/V layers that run the last
    # token alone; llama and qwen35 check the other blocks' masks.)
    # The default (blocks_per_call 0) groups as many blocks as make a call of up to 512 queries: all four here.
    model = tiny(arch, **overrides)
    tokens, split = prompt(model, 1000, seed=5), 603
    runs = []
    for per_call in ({"blocks_per_call": 1}, {"blocks_per_call": 4}, {}):
        sess = session(model, POOL, attention="flash")
        sess.prefill_exact(tokens[:split], 0, attention_block_bytes=1, **per_call)
        logits, attention_to = sess.prefill_exact(tokens[split:], split, attention_block_bytes=1, **per_call)
        runs.append((sess, logits, attention_to))
    (apart, logits_apart, attention_apart), *grouped_runs = runs
    assert apart.timings.n_prefill_shared_calls == 0
    for grouped, logits, attention_to in grouped_runs:
        assert grouped.timings.n_prefill_shared_calls > 0
        np.testing.assert_array_equal(logits, logits_apart)
        np.testing.assert_array_equal(attention_to, attention_apart)
        grouped.pager.check_invariants()
        for c in range(len(tokens) // C):
            assert chunk_bytes(grouped, c) == chunk_bytes(apart, c), f"chunk {c}"


def test_blocks_share_calls_only_over_f16_keys(tiny):
    # ggml-cuda would convert a quantized pool's K/V to F16 for every sequence of a shared call: q8_0 blocks stay
    # a call each, and a sparse prefill's blocks choose their own keys.
    model = tiny("llama")
    tokens = prompt(model, 1000, seed=5)
    for kv_type, sparse in (("q8_0", 0), ("f16", 4)):
        sess = session(model, POOL, attention="flash", kv_type=kv_type)
        sess.prefill_exact(tokens, 0, attention_block_bytes=1, sparse_top_chunks=sparse)
        assert sess.timings.n_prefill_shared_calls == 0, (kv_type, sparse)


def test_blocks_per_call_must_not_be_negative(tiny):
    sess = session(tiny("llama"), POOL, attention="flash")
    with pytest.raises(ValueError, match="blocks_per_call"):
        sess.prefill_exact(prompt(tiny("llama"), 500), 0, blocks_per_call=-1)
    assert sess.n_tokens == 0


def test_the_captured_attention_over_key_blocks_of_whole_partial_maxima(tiny):
    # On the flash path the captured queries' attention over more keys than one block holds takes each block's
    # maximum per query and head first through 256-key partial maxima (when the block is a multiple of 256 keys):
    # 1000 keys in blocks of 512 give what one pass over all keys gives, within summation order. (A log-sum-exp is
    # the same whichever finite shift it takes: this checks the path's result, not that its shift is the maximum.)
    model = tiny("llama")
    tokens = prompt(model, 1000, seed=7)
    per_key = _core.CAPTURE_TOKENS * model.hparams.n_head * 2 * 4   # scores and their exp, F32
    whole = session(model, POOL, attention="flash")
    logits_whole, attention_whole = whole.prefill_exact(tokens, 0)
    sess = session(model, POOL, attention="flash")
    logits, attention_to = sess.prefill_exact(tokens, 0, attention_block_bytes=512 * per_key)
    assert np.abs(attention_whole).max() > 0
    np.testing.assert_allclose(attention_to, attention_whole, atol=1e-5)
    np.testing.assert_allclose(logits, logits_whole, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen35", "gemma3"])
@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("blocks", ["one", "growing", "grouped"])
def test_a_layers_steps_build_graphs_of_one_shape(tiny, arch, attention, blocks):
    # ggml's allocator keeps a reservation only for a graph with as many nodes and leafs; a step whose graph has
    # others is re-reserved, and on a GPU that waits for the device: a layer's steps then no longer queue behind each
    # other. Counted from a fresh session (a first step at position 0 made its mask from other tensors) with one
    # query block per step, and with a block budget under which the last steps' keys alone would need more query
    # blocks than the first steps' (the blocks are sized by the whole staging pool instead), and with those blocks
    # sharing flash attention calls (blocks_per_call; the mul_mat path takes a call per block).
    model = tiny(arch)
    sess = session(model, POOL, attention=attention)
    budget = 0 if blocks == "one" else 128 * 512 * (2 if attention == "flash" else 2 + 8 * model.hparams.n_head)
    sess.prefill_exact(prompt(model, 1000, seed=3), 0, attention_block_bytes=budget,
                       blocks_per_call=4 if blocks == "grouped" else 1)
    assert sess.timings.n_computes > 2 * model.hparams.n_layer
    assert sess.timings.n_prefill_graph_changes == 0


def test_exact_prefill_refuses_a_negative_attention_block(tiny):
    sess = session(tiny("llama"), POOL)
    with pytest.raises(ValueError, match="attention_block_bytes"):
        sess.prefill_exact(prompt(tiny("llama"), 600), 0, attention_block_bytes=-1)
    assert sess.n_tokens == 0


@pytest.mark.parametrize("ordered", [False, True])
def test_exact_prefill_extends_a_held_prefix_from_the_pool_and_the_host_store(tiny, ordered):
    # The second part attends to the first wherever it lies: resident blocks and host images alike.
    model = tiny("llama")
    tokens = prompt(model, 900, seed=1)
    full = session(model, 0, attention="matmul", ordered_attention=ordered)
    full.forward(tokens[:576], 0)
    logits_full = full.forward(tokens[576:], 576)
    sess = session(model, POOL, attention="matmul", ordered_attention=ordered)
    sess.prefill_exact(tokens[:576], 0)
    assert sess.pager.n_host_images() > 0
    logits, attention_to = sess.prefill_exact(tokens[576:], 576, n_batch=100)   # steps need not divide anything
    assert attention_to.shape == (900,)
    np.testing.assert_allclose(logits, logits_full, atol=1e-5)
    for c in range(900 // C):   # step sizes differ from the reference's here: summation order only
        mine = np.frombuffer(chunk_bytes(sess, c), np.float16).astype(np.float32)
        theirs = np.frombuffer(full.kv.read_block(c), np.float16).astype(np.float32)
        np.testing.assert_allclose(mine, theirs, atol=2e-3, err_msg=f"chunk {c}")


@pytest.mark.parametrize("held", [600, 601, 639])
def test_exact_prefill_extends_a_prefix_that_ends_inside_a_chunk(tiny, held):
    # The chunk the held tokens end in keeps its held rows (it may even be paged out while the prompt is
    # placed) and takes the new ones: equal bytes again, the same steps as the full cache's from `held`.
    model = tiny("qwen2")
    tokens = prompt(model, 1000, seed=7)
    full = session(model, 0, attention="flash", kv_type="q8_0")
    full.forward(tokens[:held], 0)
    logits_full = full.forward(tokens[held:], held)
    sess = session(model, POOL, attention="flash", kv_type="q8_0")
    sess.prefill_exact(tokens[:held], 0)
    logits, _ = sess.prefill_exact(tokens[held:], held)
    np.testing.assert_array_equal(logits, logits_full)
    assert_same_chunks(sess, full, len(tokens))


def test_exact_prefill_then_decode_equals_a_pooled_session_that_adopted_the_full_cache(tiny):
    # After the prompt both pools hold the same bytes in the same blocks, so decode steps agree exactly.
    model = tiny("qwen3")
    tokens = prompt(model, 640, seed=2)
    full = session(model, 0, attention="matmul")
    full.forward(tokens, 0)
    adopted = session(model, POOL, attention="matmul")
    adopted.adopt(full, len(tokens))
    sess = session(model, POOL, attention="matmul")
    logits, _ = sess.prefill_exact(tokens, 0)
    np.testing.assert_array_equal(sess.pager.chunk_blocks(), adopted.pager.chunk_blocks())
    tok = int(logits.argmax())
    for i in range(5):
        a = sess.forward(np.array([tok], np.int32), len(tokens) + i)
        b = adopted.forward(np.array([tok], np.int32), len(tokens) + i)
        np.testing.assert_array_equal(a, b)
        tok = int(a.argmax())


def test_exact_prefill_seals_the_summaries_a_forward_would(tiny):
    model = tiny("qwen2")
    tokens = prompt(model, 600, seed=3)
    full = session(model, 0, attention="matmul", track_summaries=True)
    full.forward(tokens, 0)
    sess = session(model, POOL, attention="matmul", track_summaries=True)
    sess.prefill_exact(tokens, 0)
    np.testing.assert_allclose(sess.mean_keys(), full.mean_keys()[:len(tokens) // C], atol=1e-6)
    # the post-prompt scorers read the last prompt tokens' queries, as after a forward
    np.testing.assert_allclose(sess.queries(), full.queries(), atol=1e-5)
    np.testing.assert_allclose(sess.chunk_scores("quest"), full.chunk_scores("quest"), atol=1e-5)   # NaN: partial chunk


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_an_interrupted_exact_prefill_leaves_what_was_held(tiny, arch):
    # gemma3: the prompt overwrites every ring row, the held positions' windows included; they come back.
    model = tiny(arch)
    tokens = prompt(model, 800, seed=4)
    sess = session(model, POOL, attention="matmul")
    sess.prefill_exact(tokens[:192], 0)
    before = [chunk_bytes(sess, c) for c in range(3)]
    rings = [sess.ring_block(b) for b in range(sess.ring_tokens // C)]
    calls = []

    def stop_after_one_layer():
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sess.prefill_exact(tokens[192:], 192, between=stop_after_one_layer)
    assert calls == [1] and sess.n_tokens == 192 and list(sess.tokens) == tokens[:192].tolist()
    sess.pager.check_invariants()
    assert [chunk_bytes(sess, c) for c in range(3)] == before
    assert [sess.ring_block(b) for b in range(sess.ring_tokens // C)] == rings
    # and it can go on: the retry equals an uninterrupted run
    sess.prefill_exact(tokens[192:], 192)
    other = session(model, POOL, attention="matmul")
    other.prefill_exact(tokens[:192], 0)
    other.prefill_exact(tokens[192:], 192)
    for c in range(800 // C):
        assert chunk_bytes(sess, c) == chunk_bytes(other, c)
    if sess.ring_tokens:
        assert_same_rings(sess, other)


@pytest.mark.parametrize("arch", ["llama", "qwen35", "gemma3"])
def test_an_exact_prefill_run_step_by_step_equals_one_call(tiny, arch):
    # Session.begin_prefill_exact: the same prefill as a resumable state (a server's rounds interleave other slots'
    # steps with its steps); advanced a few steps at a time it writes the same bytes as one prefill_exact call.
    model = tiny(arch)
    tokens = prompt(model, 700, seed=6)
    one = session(model, POOL)
    one.prefill_exact(tokens[:130], 0)
    logits_one, attention_one = one.prefill_exact(tokens[130:], 130)
    sess = session(model, POOL)
    sess.prefill_exact(tokens[:130], 0)
    run = sess.begin_prefill_exact(tokens[130:], 130)
    assert run.open and run.steps_run == 0 and sess.timings.n_computes > 0   # timings stay readable
    advances = 0
    while not run.advance(3):
        advances += 1
        assert run.steps_run == 3 * advances
    assert advances >= run.n_steps // 3 - 1 and run.steps_run == run.n_steps
    logits, attention_to = run.finish()
    assert not run.open
    np.testing.assert_array_equal(logits, logits_one)
    np.testing.assert_array_equal(attention_to, attention_one)
    assert sess.n_tokens == one.n_tokens == 700
    for c in range(700 // C):
        assert chunk_bytes(sess, c) == chunk_bytes(one, c), f"chunk {c}"
    if sess.ring_tokens:
        assert_same_rings(sess, one)


@pytest.mark.parametrize("arch", ["llama", "qwen35", "gemma3"])
@pytest.mark.parametrize("how", ["close", "del", "error"])
def test_an_unfinished_exact_prefill_run_leaves_what_was_held(tiny, arch, how):
    model = tiny(arch)
    tokens = prompt(model, 800, seed=7)
    sess = session(model, POOL)
    sess.prefill_exact(tokens[:192], 0)
    before = [chunk_bytes(sess, c) for c in range(3)]
    rings = [sess.ring_block(b) for b in range(sess.ring_tokens // C)]
    recurrent = sess.recurrent_state() if sess.has_recurrent_state else None
    run = sess.begin_prefill_exact(tokens[192:], 192)
    run.advance(run.n_steps // 2)   # past layer 0: the prompt's positions are placed
    with pytest.raises(RuntimeError, match="middle of an exact prefill"):
        sess.forward(tokens[192:200], 192)
    with pytest.raises(RuntimeError, match="middle of an exact prefill"):
        sess.n_tokens
    if how == "close":
        run.close()
    elif how == "del":
        del run
        gc.collect()
    else:
        with pytest.raises(ValueError, match="max_steps"):
            run.advance(-1)   # refused before anything runs: the run stays open
        run.close()
    assert sess.n_tokens == 192 and list(sess.tokens) == tokens[:192].tolist()
    sess.pager.check_invariants()
    assert [chunk_bytes(sess, c) for c in range(3)] == before
    assert [sess.ring_block(b) for b in range(sess.ring_tokens // C)] == rings
    if recurrent is not None:
        assert sess.recurrent_state() == recurrent
    # and it goes on as if the run never began
    logits, _ = sess.prefill_exact(tokens[192:], 192)
    other = session(model, POOL)
    other.prefill_exact(tokens[:192], 0)
    logits_other, _ = other.prefill_exact(tokens[192:], 192)
    np.testing.assert_array_equal(logits, logits_other)


def test_an_exact_prefill_run_refuses_misuse(tiny):
    model = tiny("llama")
    tokens = prompt(model, 600, seed=8)
    sess = session(model, POOL)
    with pytest.raises(ValueError, match="start=5"):
        sess.begin_prefill_exact(tokens, 5)
    run = sess.begin_prefill_exact(tokens, 0)
    with pytest.raises(RuntimeError, match="steps left"):
        run.finish()
    with pytest.raises(RuntimeError, match="middle of an exact prefill"):
        sess.begin_prefill_exact(tokens, 0)   # one run at a time
    with run:
        assert run.advance() is True
        run.finish()
    with pytest.raises(RuntimeError, match="closed"):
        run.advance()
    assert sess.n_tokens == 600   # finished runs stay


@pytest.mark.parametrize("call,message", [
    (lambda s, t: s.prefill_exact(t[:100], 10), "start=10"),   # the session holds nothing
    (lambda s, t: s.prefill_exact(t[:100], 0, n_batch=-1), "n_batch"),
    (lambda s, t: s.prefill_exact(np.zeros(MAX_TOKENS + 1, np.int32), 0), "exceeds max_tokens"),
    (lambda s, t: s.prefill_exact(np.array([1, 10**6], np.int32), 0), "outside the vocabulary"),
    (lambda s, t: s.prefill_exact(t[:0], 0), "at least one token"),
])
def test_bad_exact_prefill_calls_are_refused_before_anything_changes(tiny, call, message):
    model = tiny("llama")
    tokens = prompt(model, 200, seed=5)
    sess = session(model, POOL)
    with pytest.raises(ValueError, match=message):
        call(sess, tokens)
    assert sess.n_tokens == 0 and sess.pager.n_chunks() == 0


def test_memory_reports_the_prefill_workspace(tiny):
    model = tiny("llama")
    sess = session(model, POOL, attention="matmul")
    assert sess.memory()["prefill_peak_bytes"] == 0
    sess.prefill_exact(prompt(model, 700, seed=6), 0)
    mem = sess.memory()
    hp = model.hparams
    one_layer_kv = 768 * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 2   # staging: positions, padded
    assert mem["pool_bytes"] == sess.kv.device_bytes
    assert one_layer_kv <= mem["prefill_peak_bytes"] < one_layer_kv + 8 * 2**20


def test_a_layer_major_prompt_gives_the_step_buffer_back_while_it_runs(tiny):
    # The step graphs' compute buffer is not held beside the prompt's workspace: it goes back to the device when a
    # layer-major prompt begins and the next step allocates it again. A pool that holds the whole prompt: that
    # step's logits are then the full cache's.
    model = tiny("llama")
    tokens = prompt(model, 701, seed=8)
    sess = session(model, 1024, attention="matmul")
    sess.forward(tokens[:300], 0)
    assert sess.memory()["compute_bytes"] > 0
    sess.prefill_exact(tokens[300:700], 300)
    assert sess.memory()["compute_bytes"] == 0
    logits = sess.forward(tokens[700:], 700)
    assert sess.memory()["compute_bytes"] > 0
    full = _core.Session(model, _core.SessionConfig(max_tokens=MAX_TOKENS, n_batch=128, attention="matmul"))
    full.forward(tokens[:700], 0)
    np.testing.assert_allclose(logits, full.forward(tokens[700:], 700), atol=1e-4)


def test_shared_kv_layers_run_only_the_prompts_last_step_and_need_no_workspace(tiny):
    # Their outputs at earlier positions feed nothing (no K/V): 6 steps of 128 for each of layers 0-2, one for each of
    # 3-5, and the workspace is the staging pool's, as for any model.
    model = tiny("gemma4", **SHARED_KV)
    sess = session(model, POOL, attention="matmul")
    sess.prefill_exact(prompt(model, 700, seed=6), 0)
    assert sess.timings.n_computes == 3 * 6 + 3
    hp = model.hparams
    staging = 768 * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 2
    assert staging <= sess.memory()["prefill_peak_bytes"] < staging + 8 * 2**20


def test_a_snapshot_after_exact_prefill_restores_and_continues_exactly(tiny):
    # The pool and the host store after a layer-major prefill are ordinary state: a snapshot of it restores
    # into a fresh session byte for byte, and both continue with the same logits.
    model = tiny("qwen3")
    tokens = prompt(model, 750, seed=8)
    sess = session(model, POOL, attention="flash", kv_type="q8_0")
    logits, _ = sess.prefill_exact(tokens, 0)
    data = sess.to_bytes()
    restored = session(model, POOL, attention="flash", kv_type="q8_0")
    restored.load_bytes(data)
    assert restored.to_bytes() == data
    tok = np.array([int(logits.argmax())], np.int32)
    np.testing.assert_array_equal(restored.forward(tok, len(tokens)), sess.forward(tok, len(tokens)))


def test_exact_prefill_step_is_large_with_flash_attention_only():
    # Steps pay a fixed cost each (flash attention: 1024 tokens at least); their masks and attention matrices
    # no longer grow with the step (blocks of queries), so nothing caps it below that.
    from kvflash_ggml.options import PoolConfig

    pool = PoolConfig(n_ctx=8192, pool_tokens=1024)
    assert pool.exact_prefill_batch(True) == 1024
    assert PoolConfig(n_ctx=8192, pool_tokens=1024, n_batch=2048).exact_prefill_batch(True) == 2048
    assert pool.exact_prefill_batch(False) == pool.n_batch


def test_a_reserved_host_store_is_the_one_a_prompt_then_fills(tiny):
    # reserve_host makes the images a context's evicted chunks need before any prompt (llama.cpp makes its KV cache
    # with its context): the prompt that follows adds no slab and computes the same bytes as one that pins its own.
    model = tiny("llama")
    tokens = prompt(model, 1000, seed=9)
    cold, warm = session(model, POOL), session(model, POOL)
    held = warm.reserve_host(len(tokens))
    needed = (-(-len(tokens) // C) - POOL // C) * warm.kv.chunk_bytes   # the prompt's evicted chunks
    assert held >= -(-len(tokens) // C) * warm.kv.chunk_bytes and warm.memory()["host_store_bytes"] == held
    rows = len(tokens) * model.hparams.n_embd * 4   # and the hidden-state rows of an exact prefill that long
    assert warm.memory()["prefill_rows_bytes"] == rows
    assert warm.reserve_host(len(tokens)) == held and warm.reserve_host(10) == held   # nothing more, nothing less
    assert warm.memory()["prefill_rows_bytes"] == rows
    logits_cold, _ = cold.prefill_exact(tokens, 0)
    logits_warm, _ = warm.prefill_exact(tokens, 0)
    assert warm.memory()["host_store_bytes"] == held and warm.kv.host_bytes == needed
    # the prompt took the kept rows: its own host buffers are the cold one's less them
    assert cold.memory()["prefill_host_bytes"] - warm.memory()["prefill_host_bytes"] == rows
    np.testing.assert_array_equal(logits_warm, logits_cold)
    for c in range(len(tokens) // C):
        assert chunk_bytes(warm, c) == chunk_bytes(cold, c), f"chunk {c}"
    warm.reset()   # the store stays, empty
    assert warm.memory()["host_store_bytes"] == held and warm.kv.host_bytes == 0
    full = session(model, 0)
    assert full.reserve_host(len(tokens)) == 0 and full.memory()["prefill_rows_bytes"] == 0   # a full cache: no store
    with pytest.raises(ValueError, match="n_tokens"):
        warm.reserve_host(-1)
