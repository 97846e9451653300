// Model families, keyed by general.architecture. Adding a family = one file + one line here.
#include "model/model.h"

namespace kvf {

extern const ArchSpec arch_llama;
extern const ArchSpec arch_qwen2;
extern const ArchSpec arch_qwen3, arch_qwen3moe;
extern const ArchSpec arch_qwen35, arch_qwen35moe;
extern const ArchSpec arch_gemma3, arch_gemma4;
extern const ArchSpec arch_laguna;

static const ArchSpec * const k_archs[] = {&arch_llama,  &arch_qwen2,     &arch_qwen3,  &arch_qwen3moe, &arch_qwen35,
                                           &arch_qwen35moe, &arch_gemma3, &arch_gemma4, &arch_laguna};

const ArchSpec * find_arch(const std::string & name) {
    for (const ArchSpec * a : k_archs) if (name == a->name) return a;
    return nullptr;
}

std::string supported_archs() {
    std::string s;
    for (const ArchSpec * a : k_archs) s += (s.empty() ? "" : ", ") + std::string(a->name);
    return s;
}

}  // namespace kvf
