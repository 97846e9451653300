#include "common/host_memory.h"

#include <algorithm>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define KVF_HAVE_MMAP 1
#endif
#ifdef KVFLASH_CUDA
#include <cuda_runtime.h>
#endif

namespace kvf {

namespace {
constexpr size_t k_align = size_t(2) << 20;   // whole huge pages where the kernel gives them

// Registering needs every page present. Faulting them in is most of pinning's cost (the kernel zeroes each
// page), and it scales with threads: 64 MiB or more per thread, at most 8.
void touch_pages(uint8_t * p, size_t bytes) {
    const auto touch = [](uint8_t * from, uint8_t * to) {
        for (uint8_t * q = from; q < to; q += 4096) *reinterpret_cast<volatile uint8_t *>(q) = 0;
    };
    const size_t n_threads = std::min<size_t>({8, std::max(1u, std::thread::hardware_concurrency()), bytes / (size_t(64) << 20)});
    if (n_threads <= 1) return touch(p, p + bytes);
    const size_t slice = (bytes / n_threads + k_align - 1) / k_align * k_align;
    std::vector<std::thread> threads;
    for (size_t i = 1; i < n_threads; ++i) {
        threads.emplace_back(touch, p + std::min(bytes, i * slice), p + std::min(bytes, (i + 1) * slice));
    }
    touch(p, p + std::min(bytes, slice));
    for (std::thread & t : threads) t.join();
}
}  // namespace

bool can_pin_for(ggml_backend_t backend) {
#ifdef KVFLASH_CUDA
    ggml_backend_dev_t dev = backend ? ggml_backend_get_device(backend) : nullptr;
    // ggml-rpc's devices call themselves GPUs too: their copies go through a socket, not a local DMA
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (reg && std::string(ggml_backend_reg_name(reg)) == "RPC") return false;
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU;
#else
    (void) backend;
    return false;
#endif
}

HostMemory::HostMemory(size_t bytes, bool pin) {
    size_ = bytes > 0 ? bytes : 1;
    mapped_ = (size_ + k_align - 1) / k_align * k_align;
#ifdef KVF_HAVE_MMAP
    void * p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = nullptr;
#ifdef MADV_HUGEPAGE
    if (p) madvise(p, mapped_, MADV_HUGEPAGE);   // before the first touch: 2 MiB faults, not 4 KiB ones
#endif
    if (p && pin) touch_pages(static_cast<uint8_t *>(p), mapped_);
#else
    void * p = ::operator new(mapped_, std::align_val_t(k_align), std::nothrow);
#endif
    if (!p) throw std::runtime_error("could not allocate " + std::to_string(size_) + " bytes of host memory");
    data_ = static_cast<uint8_t *>(p);
#ifdef KVFLASH_CUDA
    if (pin) {
        pinned_ = cudaHostRegister(p, mapped_, cudaHostRegisterPortable) == cudaSuccess;
        if (!pinned_) (void) cudaGetLastError();   // out of lockable memory: carry on pageable
    }
#endif
    buffer_ = ggml_backend_cpu_buffer_from_ptr(p, size_);
    if (!buffer_) {
        release();
        throw std::runtime_error("could not wrap host memory as a ggml buffer");
    }
}

HostMemory::~HostMemory() { release(); }

void HostMemory::release() {
    if (buffer_) ggml_backend_buffer_free(buffer_);   // does not own the bytes
    buffer_ = nullptr;
    if (!data_) return;
#ifdef KVFLASH_CUDA
    if (pinned_) cudaHostUnregister(data_);
#endif
#ifdef KVF_HAVE_MMAP
    munmap(data_, mapped_);
#else
    ::operator delete(data_, std::align_val_t(k_align));
#endif
    data_ = nullptr;
}

}  // namespace kvf
