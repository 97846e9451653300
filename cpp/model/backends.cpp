#include "model/backends.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace kvf {

namespace {

// The folder of the shared ggml library this process linked us against: the portable build installs the
// CPU variant modules right beside it (the wheel's kvflash_ggml/, build/<tag>/lib in a build tree).
std::string ggml_library_dir() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&ggml_backend_load_all_from_path), &info) == 0 || !info.dli_fname) return "";
    const std::string path = info.dli_fname;
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

}  // namespace

void load_backends() {
    static std::once_flag once;
    std::call_once(once, [] {
        // A static ggml registers its backends at start-up: loading modules is for the portable build only.
        if (ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)) return;
        const std::string dir = ggml_library_dir();
        ggml_backend_load_all_from_path(dir.empty() ? nullptr : dir.c_str());
    });
}

ggml_backend_t cpu_backend_init() {
    load_backends();
    ggml_backend_t b = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!b) {
        throw std::runtime_error("no ggml CPU backend could be loaded: the libggml-cpu-*.so modules beside " +
                                 ggml_library_dir() + "/libkvflash-ggml.so are missing or none runs on this CPU");
    }
    return b;
}

void set_backend_threads(ggml_backend_t backend, int n_threads) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (!reg) return;
    auto set = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set) set(backend, n_threads);
}

std::string cpu_variant() {
    load_backends();
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) return "";
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    std::string out = ggml_backend_reg_name(reg);
    auto features = (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features");
    if (!features) return out;
    out += ":";
    for (const ggml_backend_feature * f = features(reg); f && f->name; ++f) {
        out += std::string(" ") + f->name + "=" + f->value;
    }
    return out;
}

namespace {

struct Baseline {
    ggml_backend_dev_t dev;
    size_t             used;
};

std::mutex & baseline_mutex() {
    static std::mutex m;
    return m;
}

std::vector<Baseline> & baselines() {
    static std::vector<Baseline> b;
    return b;
}

size_t used_bytes(ggml_backend_dev_t dev) {
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    return total > free ? total - free : 0;
}

}  // namespace

void note_device_baseline(ggml_backend_dev_t dev) {
    if (!dev || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) return;
    std::lock_guard<std::mutex> lock(baseline_mutex());
    for (const Baseline & b : baselines()) {
        if (b.dev == dev) return;
    }
    baselines().push_back({dev, used_bytes(dev)});
}

std::vector<DeviceTaken> device_bytes_taken() {
    std::lock_guard<std::mutex> lock(baseline_mutex());
    std::vector<DeviceTaken> out;
    for (const Baseline & b : baselines()) {
        const size_t now = used_bytes(b.dev);
        out.push_back({ggml_backend_dev_name(b.dev), now > b.used ? now - b.used : 0});
    }
    return out;
}

}  // namespace kvf
