#include "model/vocab.h"

#include "model/gguf_meta.h"
#include "model/log_tap.h"

#include "llama.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <unordered_set>

namespace kvf {

namespace {

std::string printable(const std::string & s) {
    std::string out;
    for (char c : s.substr(0, 40)) out += (c >= 32 && c < 127) ? c : '?';
    return s.size() > 40 ? out + "..." : out;
}

// libllama's vocabulary loader throws on most bad tokenizer metadata, but GGML_ASSERTs (aborts the
// process) on some: two tokens with the same text, a vocabulary type without a tokenizer ("none"), a
// BOS/EOS/SEP token that add_*_token asks for but that is missing (at the first tokenize). The file is
// checked for those here, before libllama sees it.
void check_tokenizer_meta(const std::string & path) {
    const std::unique_ptr<GgufFile> file = open_gguf(path, /*with_tensors =*/ false);
    const gguf_context * g = file->gguf;
    std::string model;
    if (!meta_str(g, "tokenizer.ggml.model", model)) throw std::runtime_error("GGUF has no tokenizer.ggml.model key");
    if (model != "gpt2" && model != "llama") {
        throw std::runtime_error("tokenizer.ggml.model '" + printable(model) +
                                 "' is not supported (supported: gpt2 (byte-level BPE), llama (SentencePiece))");
    }
    int64_t n = 0;
    if (!meta_array_n(g, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, n)) {
        throw std::runtime_error("GGUF has no tokenizer.ggml.tokens key");
    }
    if (n < 1 || n > INT32_MAX) throw std::runtime_error("tokenizer.ggml.tokens has " + std::to_string(n) + " entries");
    const int64_t id = gguf_find_key(g, "tokenizer.ggml.tokens");
    std::unordered_set<std::string> seen;
    seen.reserve((size_t) n);
    for (int64_t i = 0; i < n; ++i) {
        std::string word = gguf_get_arr_str(g, id, (size_t) i);
        if (word.empty()) word = "[EMPTY_" + std::to_string(i) + "]";   // libllama's name for an empty token
        if (!seen.insert(std::move(word)).second) {
            throw std::runtime_error("tokenizer.ggml.tokens: token " + std::to_string(i) + " ('" +
                                     printable(gguf_get_arr_str(g, id, (size_t) i)) + "') appears twice");
        }
    }
}

void check_special(const llama_vocab * v) {
    const struct { bool add; llama_token tok; const char * what; } asks[] = {
        {llama_vocab_get_add_bos(v), llama_vocab_bos(v), "add_bos_token is set but the vocabulary has no BOS token"},
        {llama_vocab_get_add_eos(v), llama_vocab_eos(v), "add_eos_token is set but the vocabulary has no EOS token"},
        {llama_vocab_get_add_sep(v), llama_vocab_sep(v), "add_sep_token is set but the vocabulary has no SEP token"},
    };
    for (const auto & a : asks) {
        if (a.add && a.tok == LLAMA_TOKEN_NULL) throw std::runtime_error(std::string("tokenizer.ggml.") + a.what);
    }
}

constexpr int32_t SPECIAL_ATTRS = LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_USER_DEFINED | LLAMA_TOKEN_ATTR_UNKNOWN;
constexpr int32_t MARKUP_ONLY_ATTRS = LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_UNKNOWN;   // not parsed in text spans

// The same list, in the same order, as libllama's cache_special_tokens (llama-vocab.cpp, load): its partition
// tries the tokens in this order, and the order decides which of two overlapping occurrences wins.
std::vector<int32_t> special_tokens(const llama_vocab * v) {
    std::vector<int32_t> out;
    for (int32_t id = 0; id < llama_vocab_n_tokens(v); ++id) {
        if (llama_vocab_get_attr(v, id) & SPECIAL_ATTRS) out.push_back(id);
    }
    std::sort(out.begin(), out.end(), [&](int32_t a, int32_t b) {
        return std::strlen(llama_vocab_get_text(v, a)) > std::strlen(llama_vocab_get_text(v, b));
    });
    return out;
}

using Spans = std::vector<std::pair<int64_t, int64_t>>;

bool overlaps(const Spans & spans, int64_t lo, int64_t hi) {
    // the first span that ends after lo; spans are sorted and disjoint
    auto it = std::upper_bound(spans.begin(), spans.end(), lo, [](int64_t x, const std::pair<int64_t, int64_t> & s) {
        return x < s.second;
    });
    return it != spans.end() && it->first < hi;
}

// Which bytes and byte pairs a text holds: a special token whose first two bytes are not among them does not
// occur in it, and its pass over the text can be skipped (most of a large vocabulary's thousands of control
// tokens, "<unused...>" and the like, on ordinary text).
class BytePairs {
public:
    explicit BytePairs(std::string_view text) : seen_(65536 + 256, false) {
        for (size_t i = 0; i < text.size(); ++i) {
            seen_[65536 + (uint8_t) text[i]] = true;
            if (i + 1 < text.size()) seen_[((size_t) (uint8_t) text[i] << 8) | (uint8_t) text[i + 1]] = true;
        }
    }
    bool may_hold(std::string_view word) const {
        if (word.size() == 1) return seen_[65536 + (uint8_t) word[0]];
        return seen_[((size_t) (uint8_t) word[0] << 8) | (uint8_t) word[1]];
    }

private:
    std::vector<bool> seen_;
};

struct Fragment {
    int32_t token;           // a special token, or -1: raw text [offset, offset + length)
    int64_t offset, length;
};

// One special token's pass of libllama's tokenizer_st_partition over one raw fragment, appending the pieces to
// `out`: its occurrences left to right, the whitespace beside them stripped where the token's LSTRIP / RSTRIP
// says so (C isspace, as libllama), empty pieces dropped. An occurrence that overlaps a text span is left as
// text when `markup_only`. Returns whether the fragment was split.
bool split_fragment(const std::string & text, const Fragment & f, int32_t id, const std::string & word, int32_t attr,
                    bool markup_only, const Spans & spans, std::vector<Fragment> & out, int64_t & n_text_kept) {
    int64_t base = f.offset, len = f.length, from = f.offset;
    bool split = false;
    while (true) {
        const size_t m = std::string_view(text.data(), (size_t) (base + len)).find(word, (size_t) from);
        if (m == std::string_view::npos) break;
        const int64_t end = (int64_t) (m + word.size());
        if (markup_only && overlaps(spans, (int64_t) m, end)) {
            ++n_text_kept;
            from = (int64_t) m + 1;
            continue;
        }
        int64_t left = (int64_t) m - base;
        if (attr & LLAMA_TOKEN_ATTR_LSTRIP) {
            while (left > 0 && isspace(text[base + left - 1])) left--;
        }
        if (left > 0) out.push_back({-1, base, left});
        out.push_back({id, 0, 0});
        split = true;
        int64_t right = base + len - end, right_at = end;
        if (attr & LLAMA_TOKEN_ATTR_RSTRIP) {
            while (right > 0 && isspace(text[right_at])) { right_at++; right--; }
        }
        base = from = right_at;
        len = right;
        if (len == 0) break;
    }
    if (!split) out.push_back(f);
    else if (len > 0) out.push_back({-1, base, len});
    return split;
}

}  // namespace

Vocab::Vocab(const std::string & path) {
    check_tokenizer_meta(path);
    llama_model_params p = llama_model_default_params();
    p.vocab_only = true;
    LogTap tap;
    model_ = llama_model_load_from_file(path.c_str(), p);
    if (!model_) throw std::runtime_error(with_reason("libllama could not load the vocabulary of '" + path + "'", tap));
    vocab_ = llama_model_get_vocab(model_);
    try {
        check_special(vocab_);
    } catch (...) {
        llama_model_free(model_);
        throw;
    }
    special_ = special_tokens(vocab_);
}

Vocab::~Vocab() {
    if (model_) llama_model_free(model_);
}

std::vector<int32_t> Vocab::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    if (text.size() > (size_t) INT32_MAX / 2) throw std::invalid_argument("text too long to tokenize (libllama counts in int32)");
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

// libllama's partition of the text at special tokens, redone here because llama_tokenize can only parse
// special tokens everywhere or nowhere. Each raw fragment is then tokenized by libllama alone, as it tokenizes
// the fragments of its own partition (each on its own, an SPM space prefix before each: every raw fragment
// follows a special token or starts the text), so where no occurrence is kept as text the tokens are
// libllama's (tests/test_chat_content.py checks it on texts dense with special tokens). Not libllama's whole
// call: its partition walks its list from the start at every occurrence (quadratic: 40 s for a chat of
// 20,000 short messages where this takes 3 s).
std::vector<int32_t> Vocab::tokenize_with_text_spans(const std::string & text, const Spans & text_spans,
                                                     bool add_special, int64_t * n_text_kept) const {
    for (size_t i = 0; i < text_spans.size(); ++i) {
        const auto & [lo, hi] = text_spans[i];
        if (lo < 0 || hi < lo || hi > (int64_t) text.size() || (i > 0 && lo < text_spans[i - 1].second)) {
            throw std::invalid_argument("text_spans must be sorted, disjoint byte ranges [lo, hi) of the text");
        }
    }
    std::vector<Fragment> frags, next;
    if (!text.empty()) frags.push_back({-1, 0, (int64_t) text.size()});
    int64_t kept = 0;
    const BytePairs held(text);
    for (int32_t id : special_) {
        const std::string word = llama_vocab_get_text(vocab_, id);
        if (word.empty() || !held.may_hold(word)) continue;
        const int32_t attr = llama_vocab_get_attr(vocab_, id);
        next.clear();
        for (const Fragment & f : frags) {
            if (f.token >= 0) next.push_back(f);
            else split_fragment(text, f, id, word, attr, attr & MARKUP_ONLY_ATTRS, text_spans, next, kept);
        }
        frags.swap(next);
    }
    if (n_text_kept) *n_text_kept = kept;
    std::vector<int32_t> out;
    if (add_special && add_bos()) out.push_back(bos());
    for (const Fragment & f : frags) {
        if (f.token >= 0) {
            out.push_back(f.token);
            continue;
        }
        const std::vector<int32_t> part = tokenize(text.substr((size_t) f.offset, (size_t) f.length), false, false);
        out.insert(out.end(), part.begin(), part.end());
    }
    if (add_special && llama_vocab_get_add_eos(vocab_)) out.push_back(eos());
    return out;
}

std::pair<int64_t, int32_t> Vocab::find_control_text(const std::string & text) const {
    std::pair<int64_t, int32_t> first{-1, -1};
    const BytePairs held(text);
    for (int32_t id : special_) {
        if (!(llama_vocab_get_attr(vocab_, id) & MARKUP_ONLY_ATTRS)) continue;
        const std::string_view word = llama_vocab_get_text(vocab_, id);
        if (word.empty() || !held.may_hold(word)) continue;
        const size_t m = std::string_view(text).find(word);
        // longest first: a shorter token found at the same place is part of a longer one
        if (m != std::string_view::npos && (first.first < 0 || (int64_t) m < first.first)) first = {(int64_t) m, id};
    }
    return first;
}

std::string Vocab::detokenize(const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special) const {
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab()) throw std::invalid_argument("token id " + std::to_string(t) + " outside the vocabulary");
    }
    if (tokens.size() > (size_t) INT32_MAX / 16) throw std::invalid_argument("too many tokens to detokenize at once");
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

std::string builtin_chat_template(const std::string & name, const std::vector<std::pair<std::string, std::string>> & messages,
                                  bool add_generation_prompt) {
    std::vector<const char *> names(64);
    names.resize((size_t) std::max(0, llama_chat_builtin_templates(names.data(), names.size())));
    if (std::find_if(names.begin(), names.end(), [&](const char * n) { return name == n; }) == names.end()) {
        throw std::invalid_argument("'" + name + "' is not one of libllama's built-in chat templates");
    }
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (const auto & [role, content] : messages) {
        chat.push_back({role.c_str(), content.c_str()});
        total += role.size() + content.size();
    }
    std::string out(2 * total + 256, '\0');
    int32_t n = llama_chat_apply_template(name.c_str(), chat.data(), chat.size(), add_generation_prompt, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize((size_t) n);
        n = llama_chat_apply_template(name.c_str(), chat.data(), chat.size(), add_generation_prompt, out.data(), (int32_t) out.size());
    }
    if (n < 0) throw std::invalid_argument("libllama's chat template '" + name + "' refused these messages");
    out.resize((size_t) n);
    return out;
}

}  // namespace kvf
