#include "bindings/bindings.h"

#include "model/ffn.h"
#include "runtime/session.h"

#include <pybind11/numpy.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <optional>

namespace kvf::bind {

py::array_t<float> make_logits(std::vector<float> && v, int64_t n_rows, int64_t n_vocab, bool all);

namespace {

using Tokens = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

py::array_t<float> float_array(const std::vector<float> & v) {
    py::array_t<float> out((py::ssize_t) v.size());
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

// prefill_exact's keywords as the session takes them (sparse top 0: exact); checked by the session.
ExactPrefillOptions prefill_options(int64_t n_batch, int64_t attention_block_bytes, int64_t top_chunks,
                                    int64_t local_chunks, bool checkpoint_before_last, int64_t blocks_per_call,
                                    int64_t ffn_part_rows) {
    ExactPrefillOptions o;
    o.n_batch = n_batch;
    o.attention_block_bytes = attention_block_bytes;
    o.blocks_per_call = blocks_per_call;
    o.ffn_part_rows = ffn_part_rows;
    o.sparse.top_chunks = top_chunks;
    o.sparse.local_chunks = local_chunks;
    o.checkpoint_before_last = checkpoint_before_last;
    return o;
}

py::array_t<float> mean_keys(const Session & s) {
    SummaryShape sh;
    int64_t n_chunks = 0;
    const std::vector<float> v = without_gil([&] {
        const SessionLock held = s.lock(/*device =*/ false);
        const ChunkSummaries * cs = s.summaries();
        if (!cs) throw std::logic_error("mean_keys needs a session made with track_summaries=True");
        sh = cs->shape();
        n_chunks = cs->n_chunks();
        return cs->mean_keys();
    });
    py::array_t<float> out({n_chunks, sh.n_layer, sh.n_head_kv, sh.head_dim});
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

void bind_config_and_timings(py::module_ & m) {
    py::class_<SessionConfig>(m, "SessionConfig")
        .def(py::init([](int64_t max_tokens, int64_t pool_tokens, const std::string & kv_type, const std::string & attention,
                         int64_t n_batch, int64_t chunk_tokens, int64_t sink_chunks, int64_t tail_chunks, bool allow,
                         std::optional<bool> ordered, bool summaries, bool capture, bool mtp) {
                 return SessionConfig{max_tokens, pool_tokens, kv_type, attention, n_batch, chunk_tokens, sink_chunks,
                                      tail_chunks, allow, ordered ? (int) *ordered : -1, summaries, capture, mtp};
             }),
             py::kw_only(), py::arg("max_tokens") = 4096, py::arg("pool_tokens") = 0, py::arg("kv_type") = "f16",
             py::arg("attention") = "auto", py::arg("n_batch") = 512, py::arg("chunk_tokens") = k_chunk_tokens,
             py::arg("sink_chunks") = 1, py::arg("tail_chunks") = 4, py::arg("allow_beyond_train_ctx") = false,
             py::arg("ordered_attention") = py::none(), py::arg("track_summaries") = false,
             py::arg("capture_attention") = false, py::arg("mtp") = false)
        .def_readonly("max_tokens", &SessionConfig::max_tokens)
        .def_readonly("pool_tokens", &SessionConfig::pool_tokens)
        .def_readonly("kv_type", &SessionConfig::kv_type)
        .def_readonly("attention", &SessionConfig::attention)
        .def_readonly("n_batch", &SessionConfig::n_batch)
        .def_property_readonly("ordered_attention", [](const SessionConfig & c) -> std::optional<bool> {
            if (c.ordered_attention < 0) return std::nullopt;   // auto: off (slot order)
            return c.ordered_attention != 0;
        })
        .def_readonly("track_summaries", &SessionConfig::track_summaries)
        .def_readonly("capture_attention", &SessionConfig::capture_attention)
        .def_readonly("mtp", &SessionConfig::mtp);

    py::class_<Session::ExactPrefillRun>(m, "ExactPrefillRun",
                                         "a layer-major exact prefill run step by step (Session.begin_prefill_exact)")
        .def("advance", [](Session::ExactPrefillRun & r, int64_t max_steps) {
                 return without_gil([&] { return r.advance(max_steps); });
             }, py::arg("max_steps") = 0,
             "run up to max_steps more steps (0: the rest); True once every step ran. If it raises, the session holds "
             "its first `start` tokens again and the run is closed")
        .def("finish", [](Session::ExactPrefillRun & r) {
                 ExactPrefill out = without_gil([&] { return r.finish(); });
                 return py::make_tuple(float_array(out.logits), float_array(out.attention));
             }, "after the last step: (logits [n_vocab], attention [n_tokens]) as prefill_exact returns them")
        .def("close", [](Session::ExactPrefillRun & r) { without_gil([&] { r.close(); }); },
             "unfinished: the session holds its first `start` tokens again; then the workspace is released")
        .def_property_readonly("n_steps", &Session::ExactPrefillRun::n_steps)
        .def_property_readonly("steps_run", &Session::ExactPrefillRun::steps_run)
        .def_property_readonly("open", &Session::ExactPrefillRun::open)
        .def("__enter__", [](Session::ExactPrefillRun & r) -> Session::ExactPrefillRun & { return r; },
             py::return_value_policy::reference)
        .def("__exit__", [](Session::ExactPrefillRun & r, py::object, py::object, py::object) {
                 without_gil([&] { r.close(); });
             });

    py::class_<SessionTimings>(m, "SessionTimings")
        .def_readonly("t_paging_ms", &SessionTimings::t_paging_ms)
        .def_readonly("t_compute_ms", &SessionTimings::t_compute_ms)
        .def_readonly("t_scoring_ms", &SessionTimings::t_scoring_ms)
        .def_readonly("n_computes", &SessionTimings::n_computes)
        .def_readonly("n_graph_builds", &SessionTimings::n_graph_builds)
        .def_readonly("t_prefill_graph_ms", &SessionTimings::t_prefill_graph_ms)
        .def_readonly("t_prefill_io_ms", &SessionTimings::t_prefill_io_ms)
        .def_readonly("n_prefill_graph_changes", &SessionTimings::n_prefill_graph_changes)
        .def_readonly("n_prefill_paired_blocks", &SessionTimings::n_prefill_paired_blocks)
        .def_readonly("n_prefill_shared_calls", &SessionTimings::n_prefill_shared_calls);
}


// The layer-major prefills and what they cost (memory).
void bind_session_prefill(py::class_<Session> & session) {
    const auto released = py::call_guard<py::gil_scoped_release>();
    session
        .def("prefill_exact", [](Session & s, const Tokens & tokens, int64_t start, int64_t n_batch,
                                 std::optional<py::function> between, int64_t attention_block_bytes, int64_t sparse_top_chunks,
                                 int64_t sparse_local_chunks, bool checkpoint_before_last, int64_t blocks_per_call,
                                 int64_t ffn_part_rows) {
                 const std::vector<int32_t> t(tokens.data(), tokens.data() + tokens.size());
                 std::function<void()> cb;
                 if (between) cb = [f = *between] { py::gil_scoped_acquire gil; f(); };
                 const ExactPrefillOptions o = prefill_options(n_batch, attention_block_bytes, sparse_top_chunks,
                                                               sparse_local_chunks, checkpoint_before_last, blocks_per_call,
                                                               ffn_part_rows);
                 ExactPrefill r = without_gil([&] { return s.prefill_exact(t.data(), (int64_t) t.size(), start, o, cb); });
                 return py::make_tuple(float_array(r.logits), float_array(r.attention));
             }, py::arg("tokens"), py::arg("start"), py::kw_only(), py::arg("n_batch") = 0, py::arg("between") = py::none(),
             py::arg("attention_block_bytes") = 0, py::arg("sparse_top_chunks") = 0,
             py::arg("sparse_local_chunks") = SparseParams{}.local_chunks, py::arg("checkpoint_before_last") = false,
             py::arg("blocks_per_call") = 0, py::arg("ffn_part_rows") = 0,
             "layer-major exact prefill: append the tokens at `start` (= n_tokens) with the K/V a "
             "full-cache run writes, in device memory set by the pool, in steps of n_batch tokens (0: the "
             "session's), each step's queries attended in blocks whose mask (and attention matrix) fit "
             "attention_block_bytes (0: 32 MiB where blocks share calls, else 64 MiB); between() runs after each "
             "layer (and each step that ran to its end) and may raise (the session then holds its first `start` "
             "tokens again). Returns (logits [n_vocab], attention "
             "[n_tokens]: the last prompt tokens' attention to every position, max over heads and layers). "
             "sparse_top_chunks > 0: a sparse prefill (each block of queries attends the sink, the window of "
             "sparse_local_chunks chunks and its top chunks; every position's K/V is still kept). "
             "checkpoint_before_last: keep the linear-attention state before the last token as a checkpoint "
             "(checkpoint() there), that token still run inside the pass. blocks_per_call (flash attention over "
             "F16 K/V, dense): up to that many blocks of queries share one attention call as its sequences; 0: "
             "calls of up to 512 queries; 1: a call per block. ffn_part_rows: most rows of a step the feed-forward "
             "takes at once (0: 1024, the default step's whole; above 512 SiLU and the product run in place)")
        .def("begin_prefill_exact", [](Session & s, const Tokens & tokens, int64_t start, int64_t n_batch,
                                       int64_t attention_block_bytes, int64_t sparse_top_chunks, int64_t sparse_local_chunks,
                                       bool checkpoint_before_last, int64_t blocks_per_call, int64_t ffn_part_rows) {
                 const std::vector<int32_t> t(tokens.data(), tokens.data() + tokens.size());
                 const ExactPrefillOptions o = prefill_options(n_batch, attention_block_bytes, sparse_top_chunks,
                                                               sparse_local_chunks, checkpoint_before_last, blocks_per_call,
                                                               ffn_part_rows);
                 return without_gil([&] { return s.begin_prefill_exact(t.data(), (int64_t) t.size(), start, o); });
             }, py::arg("tokens"), py::arg("start"), py::kw_only(), py::arg("n_batch") = 0, py::arg("attention_block_bytes") = 0,
             py::arg("sparse_top_chunks") = 0, py::arg("sparse_local_chunks") = SparseParams{}.local_chunks,
             py::arg("checkpoint_before_last") = false, py::arg("blocks_per_call") = 0, py::arg("ffn_part_rows") = 0,
             py::keep_alive<0, 1>(),
             "prefill_exact as a resumable run (ExactPrefillRun): nothing changes until its first advance(); while it "
             "is open the session refuses every other call but timings() and memory()")
        .def("prefill_coverage", [](const Session & s) { return without_gil([&] { return s.prefill_coverage(); }); },
             "after a sparse prefill, per pooled layer: the share of the prompt's last tokens' exact attention that "
             "the keys their block chose held (1: it saw every key); empty after an exact one")
        .def("memory", [](const Session & s) {
                 const SessionMemory m = without_gil([&] { return s.memory(); });
                 py::dict d;
                 d["pool_bytes"] = m.pool_bytes;
                 d["ring_bytes"] = m.ring_bytes;
                 d["recurrent_bytes"] = m.recurrent_bytes;
                 d["recurrent_checkpoint_bytes"] = m.recurrent_checkpoint_bytes;
                 d["compute_bytes"] = m.compute_bytes;
                 d["prefill_peak_bytes"] = m.prefill_peak_bytes;
                 d["prefill_staging_bytes"] = m.prefill_staging_bytes;
                 d["prefill_host_bytes"] = m.prefill_host_bytes;
                 d["host_store_bytes"] = m.host_store_bytes;
                 d["prefill_rows_bytes"] = m.prefill_rows_bytes;
                 py::list devices;
                 for (const DeviceMemory & dm : m.devices) {
                     py::dict e;
                     e["name"] = dm.name;
                     e["weight_bytes"] = dm.weight_bytes;
                     e["pool_bytes"] = dm.pool_bytes;
                     e["ring_bytes"] = dm.ring_bytes;
                     e["recurrent_bytes"] = dm.recurrent_bytes;
                     e["compute_bytes"] = dm.compute_bytes;
                     devices.append(e);
                 }
                 d["devices"] = devices;
                 return d;
             }, "device bytes besides the weights: the pool, the sliding-window rings, the step graphs' compute buffer, the largest layer-major "
                "prefill workspace so far (staging K/V + its compute buffer), and that prefill's host buffers; devices: "
                "per device of the model's split, its weights and the session's pool, rings, state and compute buffers");
}

// Residency (reselect, pins, the host store) and what the scorers read; the read-only properties.
void bind_session_residency(py::class_<Session> & session) {
    const auto released = py::call_guard<py::gil_scoped_release>();
    session
        .def("reselect", [](Session & s, py::array_t<float, py::array::c_style | py::array::forcecast> scores) {
                 if (scores.ndim() != 1) throw std::invalid_argument("scores must be a 1-D array, one per chunk");
                 const std::vector<float> v(scores.data(), scores.data() + scores.size());
                 without_gil([&] { s.reselect(v); });
             }, py::arg("scores"))
        .def("reset", &Session::reset, released)
        .def("reserve_host", &Session::reserve_host, py::arg("n_tokens"), released,
             "make the host store hold the images of a context of n_tokens positions now (one per chunk), "
             "as llama.cpp makes its KV cache with a context; returns the store's bytes")
        .def("pin", &Session::pin, py::arg("lo"), py::arg("hi"), released,
             "pin the chunks of positions [lo, hi): paged in if evicted, never evicted until unpin_all()")
        .def("unpin_all", &Session::unpin_all, released)
        .def("step_tokens", &Session::step_tokens, py::arg("n_remaining"), released,
             "how many of n_remaining tokens the next forward step takes (n_batch, what the pool can place, and "
             "with queries or attention captured, a last step of at least CAPTURE_TOKENS tokens)")
        .def("queries", [](const Session & s) {
                 const StepQueries q = without_gil([&] { return s.queries(); });
                 py::array_t<float> out({q.n_layer, q.n_tokens, q.n_head, q.head_dim});
                 std::copy(q.data.begin(), q.data.end(), out.mutable_data());
                 return out;
             }, "post-RoPE queries of the last (up to 8) tokens of the latest step: [n_layer, n_tokens, n_head, head_dim]")
        .def("chunk_scores", [](Session & s, const std::string & kind) {
                 return float_array(without_gil([&] { return s.chunk_scores(kind); }));
             }, py::arg("kind"), "per-chunk relevance for the latest step's queries: 'qk' or 'quest' (NaN: no summary)")
        .def("attention_capture", [](const Session & s) {
                 const AttentionCapture c = without_gil([&] { return s.attention_capture(); });
                 py::array_t<float> out({c.n_q, c.n_positions});
                 std::copy(c.data.begin(), c.data.end(), out.mutable_data());
                 return out;
             }, "softmaxed attention of the last (up to 8) tokens of the latest step to every position held, max "
                "over heads and layers: [n_q, n_tokens] (0 where not resident; needs capture_attention=True)")
        .def("attention_to_positions", [](const Session & s) {
                 return float_array(without_gil([&] { return s.attention_capture().max_over_queries(); }));
             }, "attention_capture() with the max over its query tokens too: [n_tokens]")
        .def("mean_keys", [](const Session & s) { return mean_keys(s); },
             "L2-normalised mean key per sealed chunk: [n_chunks, n_layer, n_head_kv, head_dim] (zeros: unsealed)")
        .def_property_readonly("n_tokens", py::cpp_function(&Session::n_tokens, released))
        .def_property_readonly("full_cache", &Session::full_cache)
        .def_property_readonly("flash_attn", &Session::flash_attn)
        .def_property_readonly("ordered_attention", &Session::ordered_attention)
        .def_property_readonly("config", &Session::config)
        .def_property_readonly("timings", py::cpp_function(&Session::timings, released))
        .def_property_readonly("pager", py::cpp_function([](Session & s) { return SessionPager{&s}; }, py::keep_alive<0, 1>()),
                               "The session's KvPager (every call holds the session's lock).")
        .def_property_readonly("kv", py::cpp_function([](Session & s) { return SessionKV{&s}; }, py::keep_alive<0, 1>()),
                               "The session's PooledKV (every call holds the session's lock).")
        .def_property_readonly("tokens", [](const Session & s) {
            const std::vector<int32_t> t = without_gil([&] {
                const SessionLock held = s.lock(/*device =*/ false);
                return s.tokens();
            });
            return py::array_t<int32_t>((py::ssize_t) t.size(), t.data());
        }, "The tokens whose K/V the session holds (a copy).")
        .def("token_range", [](const Session & s, int64_t start, int64_t stop) {
            const std::vector<int32_t> t = without_gil([&] {
                const SessionLock held = s.lock(/*device =*/ false);
                const int64_t n = (int64_t) s.tokens().size();
                if (start < 0 || start > stop || stop > n) {
                    throw std::out_of_range("token_range: [" + std::to_string(start) + ", " + std::to_string(stop) +
                                            ") is not within the " + std::to_string(n) + " tokens held");
                }
                return std::vector<int32_t>(s.tokens().begin() + start, s.tokens().begin() + stop);
            });
            return py::array_t<int32_t>((py::ssize_t) t.size(), t.data());
        }, py::arg("start"), py::arg("stop"), "The held tokens [start, stop) (a copy of those alone).");
}

}  // namespace

void register_session(py::module_ & m, py::module_ & testing) {
    bind_config_and_timings(m);
    m.attr("CHUNK_TOKENS") = k_chunk_tokens;
    m.attr("ATTENTION_BLOCK_BYTES") = k_attention_block_bytes;
    m.attr("GROUPED_BLOCK_BYTES") = k_grouped_block_bytes;
    m.attr("FFN_PART_ROWS") = k_ffn_part_rows;
    m.attr("EXACT_FFN_PART_ROWS") = k_exact_ffn_part_rows;
    m.attr("CAPTURE_TOKENS") = k_capture_tokens;

    // Every method that locks the session runs with the GIL released (bindings.h: without_gil); Python
    // objects are read before and built after.
    const auto released = py::call_guard<py::gil_scoped_release>();
    py::class_<Session> session(m, "Session");
    session
        .def(py::init<std::shared_ptr<Model>, const SessionConfig &, std::shared_ptr<PoolArena>>(), py::arg("model"),
             py::arg("config"), py::arg("arena") = nullptr, py::keep_alive<1, 2>(),
             "arena: keep the pool (and a hybrid's linear-attention state) in a lane of this PoolArena (batched "
             "decode steps of its sessions attend all their pools, and run all their states, at once)")
        .def_property_readonly("arena_lane", [](const Session & s) {
                 const SessionLock held = s.lock(false);
                 return s.kv().arena() ? s.kv().lane() : -1;
             }, "the pool's lane in its PoolArena (-1: a pool of its own)")
        .def("forward", [](Session & s, const Tokens & tokens, int64_t start, bool all_logits) {
                 // a copy: another thread may write into the caller's array while this one computes
                 const std::vector<int32_t> t(tokens.data(), tokens.data() + tokens.size());
                 std::vector<float> out = without_gil([&] { return s.forward(t.data(), (int64_t) t.size(), start, all_logits); });
                 return make_logits(std::move(out), (int64_t) t.size(), s.model().hparams().n_vocab, all_logits);
             },
             py::arg("tokens"), py::arg("start"), py::kw_only(), py::arg("all_logits") = false)
        .def("forward_greedy", [](Session & s, const Tokens & tokens, int64_t start) {
                 const std::vector<int32_t> t(tokens.data(), tokens.data() + tokens.size());
                 return without_gil([&] { return s.forward_greedy(t.data(), (int64_t) t.size(), start); });
             }, py::arg("tokens"), py::arg("start"),
             "forward(), returning only the argmax after the last token (computed on the backend)")
        .def("shared_prefix", [](const Session & s, const Tokens & tokens, int64_t start) {
                 return without_gil([&] { return s.shared_prefix(tokens.data(), (int64_t) tokens.size(), start); });
             }, py::arg("tokens"), py::arg("start") = 0,
             "How long a prefix the held tokens share with a sequence whose positions [start, ...) are `tokens` and "
             "whose first `start` are held (no copy of the held tokens)")
        .def("truncate", &Session::truncate, py::arg("n_tokens"), released,
             "forget positions >= n_tokens; raises ValueError (changing nothing) unless can_truncate(n_tokens)")
        .def("can_truncate", &Session::can_truncate, py::arg("n_tokens"), released,
             "whether truncate(n_tokens) is exact: always, unless a sliding-window layer's ring no longer holds "
             "the window before n_tokens, or the model has linear-attention layers (their state goes back only to 0) "
             "(then start over: reset() and run the tokens again)")
        .def("rewind_point", &Session::rewind_point, py::arg("n_tokens"), released,
             "the latest position <= n_tokens that truncate() reaches exactly (n_tokens itself unless a sliding-"
             "window ring or a linear-attention state cannot go back so far: then a checkpoint, or 0)")
        .def("checkpoint", &Session::checkpoint, released,
             "keep the linear-attention layers' state at n_tokens in host memory, so truncate() can come back "
             "here (the newest 3 are kept); no-op for models without such layers")
        .def("mark_unchanged", &Session::mark_unchanged, released,
             "start counting the positions held now that stay unchanged (n_unchanged)")
        .def_property_readonly("n_unchanged", py::cpp_function(&Session::n_unchanged, released),
             "how many of the positions held at mark_unchanged() are still held as they were: every truncate below "
             "them, reset() and a loaded state lower it")
        .def("stash", &Session::stash, released,
             "keep the linear-attention layers' state at n_tokens in a second device buffer (one, overwritten by the "
             "next stash), so truncate() can come back here; no-op for models without such layers")
        .def("mtp_draft", [](Session & s, int32_t token, int64_t step) {
                 std::vector<float> out = without_gil([&] { return s.mtp_draft(token, step); });
                 return make_logits(std::move(out), 1, s.model().hparams().n_vocab, false);
             }, py::arg("token"), py::arg("step"),
             "the multi-token-prediction head's logits [n_vocab] for the token after `token` at n_tokens + step: step 0's "
             "token is the one to be fed next, step i's the draft chosen from step i-1 (steps in order, nothing run "
             "between; needs mtp=True)")
        .def("mtp_room", &Session::mtp_room, released,
             "how many mtp_draft steps fit now (the pool's free slots and the context left; 0 without mtp)")
        .def_property_readonly("mtp", &Session::mtp, "the session runs the multi-token-prediction head")
        .def_property_readonly("has_recurrent_state", [](const Session & s) { return s.recurrent() != nullptr; },
             "whether the model has linear-attention layers: a state that exists only for everything held "
             "(no prefix snapshots, no truncate except to 0)")
        .def("recurrent_state", [](const Session & s) {
                 RecurrentState::Copy c = without_gil([&] {
                     const SessionLock held = s.lock();
                     if (!s.recurrent()) throw std::invalid_argument("this model has no linear-attention layers");
                     return s.recurrent()->copy();
                 });
                 return py::bytes(reinterpret_cast<const char *>(c.bytes.data()), c.bytes.size());
             }, "raw bytes of every linear-attention layer's conv and recurrent state (tests)")
        .def_property_readonly("ring_tokens", [](const Session & s) {
                 const SessionLock held = s.lock(false);
                 return s.ring() ? s.ring()->ring_tokens() : 0;
             }, "rows of each sliding-window layer's ring (window + n_batch, padded); 0: no sliding-window layers")
        .def("ring_block", [](const Session & s, int64_t block) {
                 std::vector<uint8_t> b = without_gil([&] {
                     const SessionLock held = s.lock();
                     if (!s.ring()) throw std::invalid_argument("this model has no sliding-window layers");
                     if (block < 0 || block >= s.ring()->ring_tokens() / s.config().chunk_tokens) {
                         throw std::out_of_range("ring block " + std::to_string(block) + " out of range");
                     }
                     return s.ring()->kv().read_block(block);
                 });
                 return py::bytes(reinterpret_cast<const char *>(b.data()), b.size());
             }, py::arg("block"), "raw bytes of ring rows [64 block, 64 block + 64), every sliding-window layer (tests)")
        .def("adopt", &Session::adopt, py::arg("source"), py::arg("n_tokens"), released);
    bind_session_prefill(session);
    bind_session_residency(session);
    bind_session_snapshots(session);

    testing.def("set_block_order", [](Session & s, const std::vector<int64_t> & order) {
        without_gil([&] {
            const SessionLock held = s.lock(/*device =*/ false);
            s.pager().set_block_order(order);
        });
    }, py::arg("session"), py::arg("order"),
       "hand out the session's free blocks in this order (only while no chunk is resident): shuffled blocks for tests");
    testing.def("place_and_unplace_step", [](Session & s, int64_t n) {
        without_gil([&] {
            const SessionLock held = s.lock(/*device =*/ false);
            s.unplace_step(s.place_step(n));
        });
    }, py::arg("session"), py::arg("n"),
       "place a step of n tokens in the pool and every other memory, then take it back, as a batched step whose graph "
       "failed does (n within check_step's bounds)");
}

}  // namespace kvf::bind
