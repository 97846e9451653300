#include "bindings/bindings.h"

#include "kv/kv_step_inputs.h"
#include "kv/pooled_kv.h"
#include "runtime/session.h"

#include "model/backends.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>

namespace kvf::bind {
namespace {

// A PooledKV on its own CPU backend, for tests of paging and of the mask builder.
struct CpuPooledKV {
    std::unique_ptr<ggml_backend, decltype(&ggml_backend_free)> backend{cpu_backend_init(), ggml_backend_free};
    std::unique_ptr<PooledKV> kv;
};

py::bytes to_bytes(const std::vector<uint8_t> & v) { return py::bytes(reinterpret_cast<const char *>(v.data()), v.size()); }

// Runs fn on a pool: a standalone one directly (the GIL serialises its calls), a session's under the
// session's lock and its model's compute mutex (pool copies use the model's backend), GIL released.
template <typename Fn> auto on_kv(PooledKV & kv, Fn && fn) { return fn(kv); }
template <typename Fn> auto on_kv(SessionKV & h, Fn && fn) {
    return without_gil([&] {
        const SessionLock held = h.session->lock();
        return fn(h.session->kv());
    });
}

// The pool's queries, for PooledKV (H = PooledKV) and for a session's pool (H = SessionKV).
template <typename H> void def_kv_queries(py::class_<H> & c) {
    c.def_property_readonly("chunk_bytes", [](H & h) { return on_kv(h, [](PooledKV & kv) { return kv.chunk_bytes(); }); })
        .def_property_readonly("layer_chunk_bytes", [](H & h) {   // one layer of one chunk, K and V
            return on_kv(h, [](PooledKV & kv) { return kv.layer_chunk_bytes(); });
        })
        .def_property_readonly("device_bytes", [](H & h) {
            return on_kv(h, [](PooledKV & kv) { return kv.device_bytes(); });
        })
        .def_property_readonly("host_bytes", [](H & h) { return on_kv(h, [](PooledKV & kv) { return kv.host_bytes(); }); })
        .def("read_block", [](H & h, int64_t b) {
            return to_bytes(on_kv(h, [&](PooledKV & kv) { return kv.read_block(b); }));
        }, py::arg("block"))
        .def("has_host_image", [](H & h, int64_t c) {
            return on_kv(h, [&](PooledKV & kv) { return kv.has_host_image(c); });
        }, py::arg("chunk"))
        .def_property_readonly("pinned_host", [](H & h) { return on_kv(h, [](PooledKV & kv) { return kv.pinned_host(); }); })
        .def("host_image", [](H & h, int64_t c) {
            return to_bytes(on_kv(h, [&](PooledKV & kv) { return kv.host_image(c); }));
        }, py::arg("chunk"));
}

// The standalone pool with its mutators (kvflash_ggml._core.testing): a session's pool changes only
// through the session's own calls.
void bind_testing_kv(py::module_ & testing) {
    py::class_<PooledKV> pooled(testing, "PooledKV");
    def_kv_queries(pooled);
    pooled.def("execute", [](PooledKV & kv, const Plan & plan) { kv.execute(plan); }, py::arg("plan"))
        .def("write_block", [](PooledKV & kv, int64_t b, const py::bytes & data) {
            const std::string s = data;
            kv.write_block(b, std::vector<uint8_t>(s.begin(), s.end()));
        }, py::arg("block"), py::arg("data"));

    py::class_<CpuPooledKV>(testing, "CpuPooledKV")
        .def(py::init([](int64_t n_layer, int64_t n_embd_k, int64_t n_embd_v, int64_t pool_tokens, int64_t chunk_tokens,
                         const std::string & kv_type, bool v_trans) {
                 auto w = std::make_unique<CpuPooledKV>();
                 KvLayout L;
                 L.n_layer = n_layer;
                 L.n_embd_k = n_embd_k;
                 L.n_embd_v = n_embd_v;
                 L.pool_tokens = pool_tokens;
                 L.chunk_tokens = chunk_tokens;
                 L.type_k = L.type_v = kv_type_from_name(kv_type);
                 L.v_trans = v_trans;
                 w->kv = std::make_unique<PooledKV>(LayerBackends{w->backend.get()}, L);
                 return w;
             }),
             py::kw_only(), py::arg("n_layer"), py::arg("n_embd_k"), py::arg("n_embd_v"), py::arg("pool_tokens"),
             py::arg("chunk_tokens") = k_chunk_tokens, py::arg("kv_type") = "f16", py::arg("v_trans") = false)
        .def_property_readonly("kv", [](CpuPooledKV & w) -> PooledKV & { return *w.kv; }, py::return_value_policy::reference_internal);

    testing.def("build_slot_mask", [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> slot_pos, int64_t n_kv,
                                      py::array_t<int32_t, py::array::c_style | py::array::forcecast> pos, int64_t window) {
        if (n_kv > slot_pos.size()) throw std::invalid_argument("n_kv is larger than slot_positions");
        py::array_t<uint16_t> out({(py::ssize_t) pos.size(), (py::ssize_t) n_kv});
        build_slot_mask(slot_pos.data(), n_kv, pos.data(), pos.size(), window, reinterpret_cast<ggml_fp16_t *>(out.mutable_data()));
        return out.attr("view")("float16");
    }, py::arg("slot_positions"), py::arg("n_kv"), py::arg("positions"), py::arg("window") = 0,
       "F16 slot-space mask [n_tokens, n_kv]: 0 where visible, -inf elsewhere");
}

}  // namespace

void register_kv(py::module_ & m, py::module_ & testing) {
    py::class_<SessionKV> session_kv(m, "SessionKV", "A session's PooledKV (Session.kv), read-only: every call holds "
                                                      "the session's lock and its model's compute mutex.");
    def_kv_queries(session_kv);
    bind_testing_kv(testing);
}

}  // namespace kvf::bind
