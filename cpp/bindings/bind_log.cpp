// ggml and libllama log through one callback that hands each line to Python's `logging`
// (logger "kvflash_ggml.ggml"), so the library is quiet unless the user turns logging up.
//
// A line from a thread Python does not know (ggml-rpc's dispatcher, a CPU worker) never waits for the GIL: the
// thread holding it may be waiting on that very thread. A Session or Model freed by Python (the GIL held) waits
// for ggml-rpc's dispatcher to send the buffer frees, and the dispatcher logs the send failing when the server
// is gone: taking the GIL there deadlocked. Such lines are queued and logged by the main thread
// (Py_AddPendingCall, which needs no GIL) the next time it runs Python code.
#include "bindings/bindings.h"

#include "model/log_tap.h"

#include "ggml.h"
#include "llama.h"

#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kvf::bind {
namespace {

int g_min_level = GGML_LOG_LEVEL_WARN;   // lines below this never cross into Python

void emit(int py_level, const std::string & line) {   // the GIL held
    try {
        py::module_::import("logging").attr("getLogger")("kvflash_ggml.ggml").attr("log")(py_level, line);
    } catch (...) {
        // a log line must never turn into an exception inside ggml
    }
}

// Lines from threads Python does not know, waiting for the main thread (see the top of the file).
std::mutex g_deferred_mutex;
std::vector<std::pair<int, std::string>> g_deferred;
bool g_drain_scheduled = false;
constexpr size_t k_max_deferred = 1000;   // a main thread that runs no Python for long loses the rest

int drain_deferred(void *) {
    std::vector<std::pair<int, std::string>> lines;
    {
        std::lock_guard<std::mutex> lock(g_deferred_mutex);
        lines.swap(g_deferred);
        g_drain_scheduled = false;
    }
    for (const auto & [py_level, line] : lines) emit(py_level, line);
    return 0;
}

void defer(int py_level, std::string line) {
    std::lock_guard<std::mutex> lock(g_deferred_mutex);
    if (g_deferred.size() >= k_max_deferred) return;
    g_deferred.emplace_back(py_level, std::move(line));
    if (!g_drain_scheduled) g_drain_scheduled = Py_AddPendingCall(drain_deferred, nullptr) == 0;
}

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
    if (PyGILState_GetThisThreadState() == nullptr) return defer(py_level, std::move(line));
    py::gil_scoped_acquire gil;
    emit(py_level, line);
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
