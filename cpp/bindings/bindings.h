#pragma once

#include <pybind11/pybind11.h>

namespace kvf { class Session; }

namespace kvf::bind {
namespace py = pybind11;

void register_log(py::module_ & m);
void register_pager(py::module_ & m);
void register_kv(py::module_ & m);
void register_model(py::module_ & m);
void register_session(py::module_ & m);
void register_snapshot(py::module_ & m);
void bind_session_snapshots(py::class_<Session> & cls);   // bind_snapshot.cpp, called by register_session

}  // namespace kvf::bind
