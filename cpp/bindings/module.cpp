// kvflash_ggml._core: thin pybind11 bindings. No logic lives here; each component registers itself
// from its own bind_*.cpp file, and C++ exceptions become Python exceptions with their message.
#include "bindings/bindings.h"
#include "model/backends.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "kvflash-ggml compiled core (pager, pooled KV, models, sessions)";
    kvf::bind::register_log(m);
    kvf::load_backends();   // after the log hook, so a module that fails to load is reported through logging
    m.def("cpu_variant", &kvf::cpu_variant, "the loaded ggml CPU backend and the CPU features it was compiled for");
    kvf::bind::register_pager(m);
    kvf::bind::register_kv(m);
    kvf::bind::register_model(m);
    kvf::bind::register_session(m);
    kvf::bind::register_snapshot(m);
}
