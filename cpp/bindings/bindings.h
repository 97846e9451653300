#pragma once

#include <pybind11/pybind11.h>

#include <utility>

namespace kvf { class Session; }

namespace kvf::bind {
namespace py = pybind11;

// Runs fn with the GIL released. Every binding that locks a session (or a model) goes through this: the
// thread holding the lock may need the GIL (a compute logs through Python), so no thread may wait for
// the lock while holding the GIL.
template <typename Fn> auto without_gil(Fn && fn) {
    py::gil_scoped_release release;
    return std::forward<Fn>(fn)();
}

// Session.pager / Session.kv: the session's own pager and pool, read-only, reached through the session so
// that every call holds its lock (bind_pager.cpp, bind_kv.cpp). keep_alive ties the session to the handle.
struct SessionPager { Session * session; };
struct SessionKV { Session * session; };

void register_log(py::module_ & m);
// testing: kvflash_ggml._core.testing, the test-only bindings (standalone mutable KvPager and PooledKV,
// the mask builder, libllama's reference, a session's block order).
void register_pager(py::module_ & m, py::module_ & testing);
void register_kv(py::module_ & m, py::module_ & testing);
void register_model(py::module_ & m, py::module_ & testing);
void register_session(py::module_ & m, py::module_ & testing);
void register_snapshot(py::module_ & m);
void register_batch(py::module_ & m);   // bind_batch.cpp: BatchDecoder
void bind_session_snapshots(py::class_<Session> & cls);   // bind_snapshot.cpp, called by register_session

}  // namespace kvf::bind
