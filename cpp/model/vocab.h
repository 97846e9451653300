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
    // tokenize(text, add_special, parse_special = true), except where `text_spans` (half-open byte ranges,
    // sorted, disjoint) lie: a control or unknown token's text that overlaps one of them is not parsed but
    // stays text, as parse_special = false reads it (user-defined tokens are parsed everywhere, as libllama
    // does either way). A chat prompt: the spans are the messages' content, the rest is the template's markup.
    // n_text_kept (if given) gets how many such occurrences stayed text; with none, the tokens are exactly
    // tokenize(text, add_special, true). Linear in the special tokens found, where libllama's partition is
    // quadratic in them.
    std::vector<int32_t> tokenize_with_text_spans(const std::string & text,
                                                  const std::vector<std::pair<int64_t, int64_t>> & text_spans,
                                                  bool add_special, int64_t * n_text_kept = nullptr) const;
    // The first control or unknown token whose text occurs in `text`, longest first at a place, as
    // parse_special would read it: (byte offset, token id), or (-1, -1) when there is none.
    std::pair<int64_t, int32_t> find_control_text(const std::string & text) const;
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
    // libllama's special-token cache rebuilt from the public API in its order (control, user-defined and
    // unknown tokens, longest text first, by the same std::sort): what its special-token partition tries.
    std::vector<int32_t> special_;
};

// libllama's own formatting of one of its built-in chat templates by name ("gemma", "chatml", ...): for
// GGUFs that carry no template of their own. messages: (role, content) pairs. Throws for an unknown name.
std::string builtin_chat_template(const std::string & name, const std::vector<std::pair<std::string, std::string>> & messages,
                                  bool add_generation_prompt);

}  // namespace kvf
