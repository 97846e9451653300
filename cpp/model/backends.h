// ggml backends through the registry only, so the same code runs against a static ggml (KVFLASH_NATIVE)
// and the portable build, where the CPU backend is whichever variant module (x64, haswell, zen4, ...)
// ggml scored best for this CPU when load_backends() ran.
#pragma once

#include "ggml-backend.h"

#include <string>
#include <vector>

namespace kvf {

// Loads the backend modules that sit beside libkvflash-ggml.so (no-op when ggml is static). Idempotent and
// thread-safe; every function below calls it first.
void load_backends();

ggml_backend_t cpu_backend_init();                    // throws if no CPU backend could be loaded
void set_backend_threads(ggml_backend_t backend, int n_threads);   // no-op for backends without threads
std::string cpu_variant();                            // e.g. "CPU: SSE3=1 AVX=1 AVX2=1 ..." (compiled features)

// The driver's view of a GPU's memory, beside our own counters: ggml's CUDA backend allocates beside our buffers
// (its memory pool, cuBLAS's workspace, graph instances) and none of that is ours to count. The first call per
// device records its used memory (total - free, the CUDA context already made); device_bytes_taken is what is
// used now above that. It is the whole device's view: another process's allocations on the same GPU move it.
void note_device_baseline(ggml_backend_dev_t dev);
struct DeviceTaken {
    std::string name;
    size_t      bytes;   // used now - used at the baseline (0 if that went down)
};
std::vector<DeviceTaken> device_bytes_taken();        // every device with a baseline, in the order first noted

}  // namespace kvf
