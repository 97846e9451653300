// HostMemory: a block of host memory that a GPU copies to and from by DMA (page-locked) where it can,
// usable as a ggml buffer so that graph tensors can be placed in it.
//
// Why not the device's own host buffer type (cudaHostAlloc): on the H100 VM that pins 1.6 GiB/s, while
// mapping the pages populated and registering them (cudaHostRegister) runs at ~8 GiB/s for the same
// page-locked result (experiments/profile_prefill.py --host-memory). The host store of a 128K prompt
// (15.5 GiB of chunk images) took 11 s to pin the first way.
#pragma once

#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>

namespace kvf {

class HostMemory {
public:
    // pin: page-lock for the GPU (a CUDA build with a GPU backend only; elsewhere, or when the driver
    // refuses, the memory stays pageable: pinned() says which). Throws std::runtime_error when the memory
    // cannot be had, before anything else changes.
    HostMemory(size_t bytes, bool pin);
    ~HostMemory();
    HostMemory(const HostMemory &) = delete;
    HostMemory & operator=(const HostMemory &) = delete;

    uint8_t * data() const { return data_; }
    size_t size() const { return size_; }
    bool pinned() const { return pinned_; }
    ggml_backend_buffer_t buffer() const { return buffer_; }   // a CPU buffer over these bytes

private:
    void release();

    uint8_t * data_ = nullptr;
    size_t size_ = 0, mapped_ = 0;
    bool pinned_ = false;
    ggml_backend_buffer_t buffer_ = nullptr;
};

// Whether HostMemory(.., pin = true) can page-lock memory for this backend's device.
bool can_pin_for(ggml_backend_t backend);

}  // namespace kvf
