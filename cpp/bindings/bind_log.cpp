// ggml and libllama log through one callback that hands each line to Python's `logging`
// (logger "kvflash_ggml.ggml"), so the library is quiet unless the user turns logging up.
#include "bindings/bindings.h"

#include "model/log_tap.h"

#include "ggml.h"
#include "llama.h"

#include <string>

namespace kvf::bind {
namespace {

int g_min_level = GGML_LOG_LEVEL_WARN;   // lines below this never cross into Python

void forward_log(ggml_log_level level, const char * text, void *) {
    log_tap_note(level, text);   // a loader waiting to name why it failed (model/log_tap.h)
    if (level == GGML_LOG_LEVEL_CONT || level < g_min_level || !Py_IsInitialized()) return;
    std::string line(text);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (line.empty()) return;
    int py_level = 10;   // DEBUG
    if (level == GGML_LOG_LEVEL_INFO) py_level = 20;
    if (level == GGML_LOG_LEVEL_WARN) py_level = 30;
    if (level == GGML_LOG_LEVEL_ERROR) py_level = 40;
    py::gil_scoped_acquire gil;
    try {
        py::module_::import("logging").attr("getLogger")("kvflash_ggml.ggml").attr("log")(py_level, line);
    } catch (...) {
        // a log line must never turn into an exception inside ggml
    }
}

}  // namespace

void register_log(py::module_ & m) {
    ggml_log_set(forward_log, nullptr);
    llama_log_set(forward_log, nullptr);
    llama_backend_init();
    m.def("set_log_level", [](int python_level) {
        g_min_level = python_level <= 10 ? GGML_LOG_LEVEL_DEBUG
                    : python_level <= 20 ? GGML_LOG_LEVEL_INFO
                    : python_level <= 30 ? GGML_LOG_LEVEL_WARN : GGML_LOG_LEVEL_ERROR;
    }, "Lowest Python logging level of ggml/llama lines forwarded to logging (default WARNING).");
}

}  // namespace kvf::bind
