#include "bindings/bindings.h"

#include "kv/pooled_kv.h"

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

}  // namespace

void register_kv(py::module_ & m) {
    py::class_<PooledKV>(m, "PooledKV")
        .def_property_readonly("chunk_bytes", &PooledKV::chunk_bytes)
        .def_property_readonly("device_bytes", &PooledKV::device_bytes)
        .def_property_readonly("host_bytes", &PooledKV::host_bytes)
        .def("execute", &PooledKV::execute, py::arg("plan"))
        .def("read_block", [](const PooledKV & kv, int64_t b) { return to_bytes(kv.read_block(b)); }, py::arg("block"))
        .def("write_block", [](PooledKV & kv, int64_t b, const py::bytes & data) {
            std::string s = data;
            kv.write_block(b, std::vector<uint8_t>(s.begin(), s.end()));
        }, py::arg("block"), py::arg("data"))
        .def("has_host_image", &PooledKV::has_host_image, py::arg("chunk"))
        .def_property_readonly("pinned_host", &PooledKV::pinned_host)
        .def("host_image", [](const PooledKV & kv, int64_t c) { return to_bytes(kv.host_image(c)); }, py::arg("chunk"));

    py::class_<CpuPooledKV>(m, "CpuPooledKV")
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
                 w->kv = std::make_unique<PooledKV>(w->backend.get(), L);
                 return w;
             }),
             py::kw_only(), py::arg("n_layer"), py::arg("n_embd_k"), py::arg("n_embd_v"), py::arg("pool_tokens"),
             py::arg("chunk_tokens") = 64, py::arg("kv_type") = "f16", py::arg("v_trans") = false)
        .def_property_readonly("kv", [](CpuPooledKV & w) -> PooledKV & { return *w.kv; }, py::return_value_policy::reference_internal);

    m.def("build_slot_mask", [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> slot_pos, int64_t n_kv,
                                py::array_t<int32_t, py::array::c_style | py::array::forcecast> pos, int64_t window) {
        if (n_kv > slot_pos.size()) throw std::invalid_argument("n_kv is larger than slot_positions");
        py::array_t<uint16_t> out({(py::ssize_t) pos.size(), (py::ssize_t) n_kv});
        build_slot_mask(slot_pos.data(), n_kv, pos.data(), pos.size(), window, reinterpret_cast<ggml_fp16_t *>(out.mutable_data()));
        return out.attr("view")("float16");
    }, py::arg("slot_positions"), py::arg("n_kv"), py::arg("positions"), py::arg("window") = 0,
       "F16 slot-space mask [n_tokens, n_kv]: 0 where visible, -inf elsewhere");
}

}  // namespace kvf::bind
