// Bindings for the KV pager (cpp/pager/kv_pager.h). Thin: conversions only, no logic.
// Exceptions map by pybind11's defaults: invalid_argument -> ValueError, out_of_range -> IndexError,
// runtime_error / logic_error (the invariant checks) -> RuntimeError.
#include "bindings/bindings.h"
#include "pager/kv_pager.h"
#include "runtime/session.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <type_traits>

namespace kvf::bind {

namespace {

template <typename T>
py::array_t<T> to_numpy(const std::vector<T> & v) {
    return py::array_t<T>((py::ssize_t) v.size(), v.data());
}

py::array_t<bool> to_numpy_bool(const std::vector<uint8_t> & v) {
    py::array_t<bool> out((py::ssize_t) v.size());
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

std::vector<float> to_vector(const FloatArray & a) {
    if (a.ndim() != 1) {
        throw py::value_error("scores must be 1-D (one per chunk), got " + std::to_string(a.ndim()) + " dimensions");
    }
    return std::vector<float>(a.data(), a.data() + a.size());
}

std::string repr(const PagerConfig & c) {
    return "PagerConfig(chunk_tokens=" + std::to_string(c.chunk_tokens) + ", pool_tokens=" +
           std::to_string(c.pool_tokens) + ", max_tokens=" + std::to_string(c.max_tokens) + ", sink_chunks=" +
           std::to_string(c.sink_chunks) + ", tail_chunks=" + std::to_string(c.tail_chunks) + ", chunk_bytes=" +
           std::to_string(c.chunk_bytes) + ")";
}

void bind_config(py::module_ & m) {
    py::class_<PagerConfig>(m, "PagerConfig", "Pager geometry: chunk size, pool size, protections.")
        .def(py::init([](int64_t chunk_tokens, int64_t pool_tokens, int64_t max_tokens, int64_t sink_chunks,
                         int64_t tail_chunks, int64_t chunk_bytes) {
                 PagerConfig c;
                 c.chunk_tokens = chunk_tokens;
                 c.pool_tokens  = pool_tokens;
                 c.max_tokens   = max_tokens;
                 c.sink_chunks  = sink_chunks;
                 c.tail_chunks  = tail_chunks;
                 c.chunk_bytes  = chunk_bytes;
                 return c;
             }),
             py::kw_only(), py::arg("chunk_tokens") = k_chunk_tokens, py::arg("pool_tokens") = 0, py::arg("max_tokens") = 0,
             py::arg("sink_chunks") = 1, py::arg("tail_chunks") = 4, py::arg("chunk_bytes") = 0)
        .def_readwrite("chunk_tokens", &PagerConfig::chunk_tokens)
        .def_readwrite("pool_tokens", &PagerConfig::pool_tokens)
        .def_readwrite("max_tokens", &PagerConfig::max_tokens)
        .def_readwrite("sink_chunks", &PagerConfig::sink_chunks)
        .def_readwrite("tail_chunks", &PagerConfig::tail_chunks)
        .def_readwrite("chunk_bytes", &PagerConfig::chunk_bytes)
        .def("min_pool_tokens", &PagerConfig::min_pool_tokens)
        .def("validate", &PagerConfig::validate)
        .def("__repr__", &repr);
}

void bind_plan(py::module_ & m) {
    py::class_<ChunkMove>(m, "ChunkMove", "One chunk moving between a block and the host store.")
        .def_readonly("chunk", &ChunkMove::chunk)
        .def_readonly("block", &ChunkMove::block)
        .def_readonly("copy", &ChunkMove::copy)
        .def("__repr__", [](const ChunkMove & mv) {
            return "ChunkMove(chunk=" + std::to_string(mv.chunk) + ", block=" + std::to_string(mv.block) +
                   ", copy=" + (mv.copy ? "True" : "False") + ")";
        });

    py::class_<Plan>(m, "Plan", "A pager plan: made by KvPager.plan_*(), executed by PooledKV, then applied.")
        .def_readonly("epoch", &Plan::epoch)
        .def_readonly("page_outs", &Plan::page_outs)
        .def_readonly("page_ins", &Plan::page_ins)
        .def_readonly("fresh", &Plan::fresh)
        .def_readonly("dropped", &Plan::dropped)
        .def_readonly("n_tokens_after", &Plan::n_tokens_after)
        .def_readonly("span_start", &Plan::span_start)
        .def_readonly("span_n", &Plan::span_n)
        .def_property_readonly("slots", [](const Plan & p) { return to_numpy(p.slots); })
        .def_property_readonly("scores", [](const Plan & p) { return to_numpy(p.scores); })
        .def_readonly("sets_scores", &Plan::sets_scores)
        .def_readonly("pins", &Plan::pins)
        .def("moves_bytes", &Plan::moves_bytes)
        .def("__repr__", [](const Plan & p) {
            return "Plan(epoch=" + std::to_string(p.epoch) + ", page_outs=" + std::to_string(p.page_outs.size()) +
                   ", page_ins=" + std::to_string(p.page_ins.size()) + ", fresh=" + std::to_string(p.fresh.size()) +
                   ", dropped=" + std::to_string(p.dropped.size()) + ", n_tokens_after=" +
                   std::to_string(p.n_tokens_after) + ")";
        });

    py::class_<PagerStats>(m, "PagerStats", "Cumulative paging ledger.")
        .def_readonly("page_outs", &PagerStats::page_outs)
        .def_readonly("page_ins", &PagerStats::page_ins)
        .def_readonly("bytes_out", &PagerStats::bytes_out)
        .def_readonly("bytes_in", &PagerStats::bytes_in)
        .def_readonly("reselects", &PagerStats::reselects)
        .def_readonly("evictions", &PagerStats::evictions)
        .def("to_dict", [](const PagerStats & s) {
            py::dict d;
            d["page_outs"] = s.page_outs;
            d["page_ins"]  = s.page_ins;
            d["bytes_out"] = s.bytes_out;
            d["bytes_in"]  = s.bytes_in;
            d["reselects"] = s.reselects;
            d["evictions"] = s.evictions;
            return d;
        })
        .def("__repr__", [](const PagerStats & s) {
            return "PagerStats(page_outs=" + std::to_string(s.page_outs) + ", page_ins=" + std::to_string(s.page_ins) +
                   ", bytes_out=" + std::to_string(s.bytes_out) + ", bytes_in=" + std::to_string(s.bytes_in) +
                   ", reselects=" + std::to_string(s.reselects) + ", evictions=" + std::to_string(s.evictions) + ")";
        });
}

// Runs fn on a pager: a standalone KvPager directly (only Python holds it; the GIL serialises its
// calls), a session's under the session's lock with the GIL released. Results are copies, made under
// the lock and converted to Python after it.
template <typename Fn> auto on_pager(KvPager & p, Fn && fn) { return fn(p); }
template <typename Fn> auto on_pager(SessionPager & h, Fn && fn) {
    return without_gil([&] {
        const SessionLock held = h.session->lock(/*device =*/ false);
        return fn(h.session->pager());
    });
}

std::string repr(const KvPager & p) {
    return "KvPager(n_tokens=" + std::to_string(p.n_tokens()) + ", n_blocks=" + std::to_string(p.n_blocks()) +
           ", n_resident=" + std::to_string(p.n_resident()) + ", epoch=" + std::to_string(p.epoch()) + ")";
}

// A KvPager member as a method of H, through on_pager: the result is copied out under the lock.
template <typename H, typename R, typename... A> auto pcall(R (KvPager::*f)(A...) const) {
    return [f](H & h, A... a) -> std::decay_t<R> {
        return on_pager(h, [&](KvPager & p) -> std::decay_t<R> { return (p.*f)(a...); });
    };
}
template <typename H, typename R, typename... A> auto pcall(R (KvPager::*f)(A...)) {
    return [f](H & h, A... a) -> std::decay_t<R> {
        return on_pager(h, [&](KvPager & p) -> std::decay_t<R> { return (p.*f)(a...); });
    };
}

// The pager's queries, for KvPager (H = KvPager) and for a session's pager (H = SessionPager).
template <typename H> void def_pager_queries(py::class_<H> & c) {
    c.def("config", pcall<H>(&KvPager::config))
        .def("n_blocks", pcall<H>(&KvPager::n_blocks))
        .def("n_tokens", pcall<H>(&KvPager::n_tokens))
        .def("n_chunks", pcall<H>(&KvPager::n_chunks))
        .def("epoch", pcall<H>(&KvPager::epoch))
        .def("max_span_tokens", pcall<H>(&KvPager::max_span_tokens), py::arg("limit") = INT64_MAX)
        .def("slot_of", pcall<H>(&KvPager::slot_of), py::arg("pos"))
        .def("slot_positions", [](H & h) { return to_numpy(pcall<H>(&KvPager::slot_positions)(h)); })
        .def("chunk_blocks", [](H & h) { return to_numpy(pcall<H>(&KvPager::chunk_blocks)(h)); })
        .def("chunk_host_valid", [](H & h) { return to_numpy_bool(pcall<H>(&KvPager::chunk_host_valid)(h)); })
        .def("protected_chunks", [](H & h) { return to_numpy_bool(pcall<H>(&KvPager::protected_chunks)(h)); })
        .def("scores", [](H & h) { return to_numpy(pcall<H>(&KvPager::scores)(h)); })
        .def("is_resident", pcall<H>(&KvPager::is_resident), py::arg("chunk"))
        .def("is_pinned", pcall<H>(&KvPager::is_pinned), py::arg("chunk"))
        .def("is_identity", pcall<H>(&KvPager::is_identity))
        .def("n_resident", pcall<H>(&KvPager::n_resident))
        .def("n_host_images", pcall<H>(&KvPager::n_host_images))
        .def("host_bytes", pcall<H>(&KvPager::host_bytes))
        .def("stats", pcall<H>(&KvPager::stats))   // a copy: the Python object does not track later changes
        .def("check_invariants", pcall<H>(&KvPager::check_invariants))
        .def("__repr__", [](H & h) { return on_pager(h, [](KvPager & p) { return repr(p); }); });
}

// A session's pager is read-only from Python: its ledger moves with the session's tokens and K/V, so
// only the session's own calls (forward, truncate, reselect, pin, unpin_all, reset) change it.
void bind_session_pager(py::module_ & m) {
    py::class_<SessionPager> session_pager(m, "SessionPager",
                                           "A session's KvPager (Session.pager), read-only: every call holds the "
                                           "session's lock.");
    def_pager_queries(session_pager);
}

// The standalone pager with its mutators, for the pager's own tests (kvflash_ggml._core.testing).
void bind_kv_pager(py::module_ & testing) {
    py::class_<KvPager> pager(testing, "KvPager", "Residency bookkeeping for the pooled KV cache (plan, then apply).");
    pager.def(py::init<const PagerConfig &>(), py::arg("config"));
    def_pager_queries(pager);
    pager.def("plan_alloc", &KvPager::plan_alloc, py::arg("start"), py::arg("n"))
        .def("plan_reselect", [](KvPager & p, const FloatArray & s) { return p.plan_reselect(to_vector(s)); },
             py::arg("scores"))
        .def("plan_truncate", &KvPager::plan_truncate, py::arg("n"))
        .def("plan_pin", &KvPager::plan_pin, py::arg("lo"), py::arg("hi"))
        .def("apply", &KvPager::apply, py::arg("plan"))
        .def("unpin_all", &KvPager::unpin_all)
        .def("reset", &KvPager::reset)
        .def("set_block_order", &KvPager::set_block_order, py::arg("order"));
}

}  // namespace

void register_pager(py::module_ & m, py::module_ & testing) {
    bind_config(m);
    bind_plan(m);
    bind_session_pager(m);
    bind_kv_pager(testing);
}

}  // namespace kvf::bind
