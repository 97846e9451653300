// kvflash_ggml._core: thin pybind11 bindings. No logic lives here; each component registers itself
// from its own bind_*.cpp file, and C++ exceptions become Python exceptions with their message.
// kvflash_ggml._core.testing holds what only tests use, so nothing public goes around a session's ledger.
#include "bindings/bindings.h"
#include "model/backends.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "kvflash-ggml compiled core (pager, pooled KV, models, sessions)";
    kvf::bind::register_log(m);
    kvf::load_backends();   // after the log hook, so a module that fails to load is reported through logging
    m.def("cpu_variant", &kvf::cpu_variant, "the loaded ggml CPU backend and the CPU features it was compiled for");
    pybind11::module_ testing = m.def_submodule("testing", "test-only bindings: standalone pager and pool with their "
                                                           "mutators, the mask builder, libllama's reference");
    // importable by name too (import kvflash_ggml._core.testing), not only as an attribute
    pybind11::module_::import("sys").attr("modules")[testing.attr("__name__")] = testing;
    kvf::bind::register_pager(m, testing);
    kvf::bind::register_kv(m, testing);
    kvf::bind::register_model(m, testing);
    kvf::bind::register_session(m, testing);
    kvf::bind::register_snapshot(m);
    kvf::bind::register_batch(m);
}
