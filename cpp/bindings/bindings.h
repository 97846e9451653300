#pragma once

#include <pybind11/pybind11.h>

namespace kvf::bind {
namespace py = pybind11;

void register_pager(py::module_ & m);

}  // namespace kvf::bind
