// Vocab: tokenization through libllama's own vocabulary code, loaded vocab-only from the same GGUF,
// so every GGUF that llama.cpp tokenizes is tokenized the same way here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

struct llama_model;
struct llama_vocab;

namespace kvf {

class Vocab {
public:
    explicit Vocab(const std::string & path);
    ~Vocab();
    Vocab(const Vocab &) = delete;
    Vocab & operator=(const Vocab &) = delete;

    std::vector<int32_t> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special) const;
    std::string token_to_piece(int32_t token, bool special) const;   // raw bytes of one token
    // The pieces of `tokens` laid end to end; offsets gets n + 1 entries: where each piece starts, then
    // the total. Maps tokens of one vocabulary to byte ranges another vocabulary can be aligned to.
    std::string pieces(const std::vector<int32_t> & tokens, bool special, std::vector<int64_t> & offsets) const;
    int32_t n_vocab() const;
    int32_t bos() const;
    int32_t eos() const;
    int32_t eot() const;
    bool add_bos() const;
    bool is_eog(int32_t token) const;
    std::string chat_template() const;                  // "" when the GGUF carries none
    std::string meta(const std::string & key) const;     // "" when absent

private:
    llama_model * model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
};

// libllama's own formatting of one of its built-in chat templates by name ("gemma", "chatml", ...): for
// GGUFs that carry no template of their own. messages: (role, content) pairs. Throws for an unknown name.
std::string builtin_chat_template(const std::string & name, const std::vector<std::pair<std::string, std::string>> & messages,
                                  bool add_generation_prompt);

}  // namespace kvf
