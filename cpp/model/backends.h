// ggml backends through the registry only, so the same code runs against a static ggml (KVFLASH_NATIVE)
// and the portable build, where the CPU backend is whichever variant module (x64, haswell, zen4, ...)
// ggml scored best for this CPU when load_backends() ran.
#pragma once

#include "ggml-backend.h"

#include <string>

namespace kvf {

// Loads the backend modules that sit beside libkvflash-ggml.so (no-op when ggml is static). Idempotent and
// thread-safe; every function below calls it first.
void load_backends();

ggml_backend_t cpu_backend_init();                    // throws if no CPU backend could be loaded
void set_backend_threads(ggml_backend_t backend, int n_threads);   // no-op for backends without threads
std::string cpu_variant();                            // e.g. "CPU: SSE3=1 AVX=1 AVX2=1 ..." (compiled features)

}  // namespace kvf
