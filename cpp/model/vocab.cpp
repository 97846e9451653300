#include "model/vocab.h"

#include "llama.h"

#include <stdexcept>

namespace kvf {

Vocab::Vocab(const std::string & path) {
    llama_model_params p = llama_model_default_params();
    p.vocab_only = true;
    model_ = llama_model_load_from_file(path.c_str(), p);
    if (!model_) throw std::runtime_error("libllama could not load the vocabulary of '" + path + "'");
    vocab_ = llama_model_get_vocab(model_);
}

Vocab::~Vocab() {
    if (model_) llama_model_free(model_);
}

std::vector<int32_t> Vocab::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    std::vector<int32_t> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, parse_special);
    if (n < 0) {   // buffer too small: -n is the size needed
        out.resize(-n);
        n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           parse_special);
    }
    if (n < 0) throw std::runtime_error("tokenization failed");
    out.resize(n);
    return out;
}

std::string Vocab::detokenize(const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special) const {
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab()) throw std::invalid_argument("token id " + std::to_string(t) + " outside the vocabulary");
    }
    std::string out(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(),
                                 remove_special, unparse_special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(),
                             remove_special, unparse_special);
    }
    if (n < 0) throw std::runtime_error("detokenization failed");
    out.resize(n);
    return out;
}

std::string Vocab::token_to_piece(int32_t token, bool special) const {
    if (token < 0 || token >= n_vocab()) throw std::invalid_argument("token id " + std::to_string(token) + " outside the vocabulary");
    char buf[256];
    int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, special);
    if (n < 0) {
        std::string big(-n, '\0');
        n = llama_token_to_piece(vocab_, token, big.data(), (int32_t) big.size(), 0, special);
        big.resize(std::max(n, 0));
        return big;
    }
    return std::string(buf, n);
}

std::string Vocab::pieces(const std::vector<int32_t> & tokens, bool special, std::vector<int64_t> & offsets) const {
    std::string out;
    offsets.assign(1, 0);
    offsets.reserve(tokens.size() + 1);
    for (int32_t t : tokens) {
        out += token_to_piece(t, special);
        offsets.push_back((int64_t) out.size());
    }
    return out;
}

int32_t Vocab::n_vocab() const { return llama_vocab_n_tokens(vocab_); }
int32_t Vocab::bos() const { return llama_vocab_bos(vocab_); }
int32_t Vocab::eos() const { return llama_vocab_eos(vocab_); }
int32_t Vocab::eot() const { return llama_vocab_eot(vocab_); }
bool Vocab::add_bos() const { return llama_vocab_get_add_bos(vocab_); }
bool Vocab::is_eog(int32_t token) const { return llama_vocab_is_eog(vocab_, token); }

std::string Vocab::chat_template() const {
    const char * t = llama_model_chat_template(model_, nullptr);
    return t ? std::string(t) : std::string();
}

std::string Vocab::meta(const std::string & key) const {
    int32_t n = llama_model_meta_val_str(model_, key.c_str(), nullptr, 0);
    if (n < 0) return "";
    std::string out(n + 1, '\0');
    llama_model_meta_val_str(model_, key.c_str(), out.data(), out.size());
    out.resize(n);
    return out;
}

}  // namespace kvf
