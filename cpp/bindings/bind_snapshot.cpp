// Bindings for snapshots (cpp/snapshot/snapshot.h): Session.save / to_bytes / load / load_bytes, the static
// Session.restore / from_bytes, and SnapshotError. Paths accept str or os.PathLike; data any bytes-like.
#include "bindings/bindings.h"

#include "snapshot/snapshot.h"

#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstring>
#include <filesystem>

namespace kvf::bind {

namespace {

// prefix_chunks: None = everything the session holds.
int64_t prefix_arg(const std::optional<int64_t> & prefix_chunks) {
    if (prefix_chunks && *prefix_chunks < 0) throw py::value_error("prefix_chunks must be >= 0 (or None for all)");
    return prefix_chunks ? *prefix_chunks : -1;
}

// Session.restore / from_bytes max_tokens: None = the model's trained context (0 for snapshot_restore).
int64_t restore_limit(const std::optional<int64_t> & max_tokens) {
    if (max_tokens && *max_tokens <= 0) throw py::value_error("max_tokens must be positive (or None)");
    return max_tokens.value_or(0);
}

// A read-only view of a bytes-like object for the duration of one call.
struct Bytes {
    explicit Bytes(const py::buffer & b) : info(b.request()) {
        if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1) {
            throw py::type_error("snapshot data must be a contiguous bytes-like object");
        }
    }
    const uint8_t * data() const { return static_cast<const uint8_t *>(info.ptr); }
    size_t size() const { return (size_t) info.size; }
    py::buffer_info info;
};

py::dict info_dict(const SnapshotInfo & i) {
    py::dict d;
    d["format_version"] = i.format_version;
    d["fingerprint"] = i.fingerprint;
    d["n_tokens"] = i.n_tokens;
    d["max_tokens"] = i.config.max_tokens;
    d["pool_tokens"] = i.config.pool_tokens;
    d["kv_type"] = i.config.kv_type;
    d["chunk_tokens"] = i.config.chunk_tokens;
    return d;
}

}  // namespace

void bind_session_snapshots(py::class_<Session> & cls) {
    using Path = std::filesystem::path;
    cls.def("save", [](const Session & s, const Path & path, std::optional<int64_t> prefix_chunks) {
           const int64_t k = prefix_arg(prefix_chunks);
           py::gil_scoped_release nogil;
           snapshot_to_file(s, path.string(), k);
       }, py::arg("path"), py::kw_only(), py::arg("prefix_chunks") = py::none(),
       "Write a snapshot (atomically: a temporary file renamed into place). prefix_chunks=k saves only the "
       "first k chunks.")
        .def("to_bytes", [](const Session & s, std::optional<int64_t> prefix_chunks) {
            std::vector<uint8_t> out;
            {
                py::gil_scoped_release nogil;
                out = snapshot_to_bytes(s, prefix_arg(prefix_chunks));
            }
            return py::bytes(reinterpret_cast<const char *>(out.data()), out.size());
        }, py::kw_only(), py::arg("prefix_chunks") = py::none())
        .def("load", [](Session & s, const Path & path) {
            py::gil_scoped_release nogil;
            const SnapshotFile file(path.string());
            snapshot_load(s, file.data(), file.size());
        }, py::arg("path"), "Replace this session's state by a snapshot's; on error nothing changes.")
        .def("load_bytes", [](Session & s, const py::buffer & data) {
            Bytes b(data);
            py::gil_scoped_release nogil;
            snapshot_load(s, b.data(), b.size());
        }, py::arg("data"))
        .def_static("restore", [](std::shared_ptr<Model> model, const Path & path, std::optional<int64_t> max_tokens) {
            const int64_t limit = restore_limit(max_tokens);
            py::gil_scoped_release nogil;
            const SnapshotFile file(path.string());
            return snapshot_restore(std::move(model), file.data(), file.size(), limit);
        }, py::arg("model"), py::arg("path"), py::kw_only(), py::arg("max_tokens") = py::none(), py::keep_alive<0, 1>(),
           "A new session with the saved config and state (no model computation). The saved context may be at "
           "most max_tokens (None: the model's trained context); a snapshot asking for more raises SnapshotError "
           "before anything is allocated.")
        .def_static("from_bytes", [](std::shared_ptr<Model> model, const py::buffer & data, std::optional<int64_t> max_tokens) {
            const int64_t limit = restore_limit(max_tokens);
            Bytes b(data);
            py::gil_scoped_release nogil;
            return snapshot_restore(std::move(model), b.data(), b.size(), limit);
        }, py::arg("model"), py::arg("data"), py::kw_only(), py::arg("max_tokens") = py::none(), py::keep_alive<0, 1>());
}

void register_snapshot(py::module_ & m) {
    py::register_exception<SnapshotError>(m, "SnapshotError", PyExc_ValueError);
    // Registered after SnapshotError's, so tried first: file errors become OSError (FileNotFoundError...).
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const SnapshotIOError & e) {
            // OSError(errno, reason, path): the subclass follows errno (FileNotFoundError...); the text is the
            // reason where errno alone would mislead ("not a regular file (a FIFO)" rather than EINVAL's words)
            const std::string reason = e.reason.empty() ? std::string(std::strerror(e.err)) : e.reason;
            py::object err = py::module_::import("builtins").attr("OSError")(e.err, reason, e.path);
            PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(err.ptr())), err.ptr());
        }
    });
    m.def("snapshot_info", [](const py::buffer & data) {
        Bytes b(data);
        return info_dict(snapshot_info(b.data(), b.size()));
    }, py::arg("data"), "Header facts of snapshot bytes (checks the container and checksum).");
    m.def("snapshot_file_info", [](const std::filesystem::path & path) {
        const SnapshotFile file(path.string());
        return info_dict(snapshot_info(file.data(), file.size()));
    }, py::arg("path"));
    m.def("snapshot_checksum", [](const py::buffer & data) {
        Bytes b(data);
        return snapshot_checksum(b.data(), b.size());
    }, py::arg("data"), "The checksum the last 8 bytes of a snapshot must hold (tests reseal mutated files).");
}

}  // namespace kvf::bind
