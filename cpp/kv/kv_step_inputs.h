// The per-step inputs that describe the pool to a graph: which slot row each token writes, which slots
// each query may see (the slot-space mask), and, for ordered attention, the position order of the keys.
// As llama.cpp's KV cache owns its set_input_* functions, the pool owns these: a graph builder only
// reads the tensors, the session only asks for them (kv_step_inputs_new) and has them filled before
// every compute (kv_step_inputs_set).
#pragma once

#include "kv/pooled_kv.h"
#include "pager/kv_pager.h"

#include "ggml.h"

#include <cstdint>
#include <vector>

namespace kvf {

class CausalBand;

// Input tensors of one step's graph, created in its no_alloc context; shapes in ggml order.
struct KvStepInputs {
    ggml_tensor * slots    = nullptr;   // I64 [n_tokens]  pool row written by each token (nullptr, v_slots
                                        // too: the step writes nothing, kv_step_inputs_reads_only)
    ggml_tensor * v_slots  = nullptr;   // I64 [n_embd_v * n_tokens]  element of the transposed V pool
                                        // written by each V value (v_trans layouts only, else nullptr)
    ggml_tensor * mask     = nullptr;   // F16 [n_kv, n_tokens]  slot-space mask (nullptr: made from band)
    ggml_tensor * kv_order = nullptr;   // I64 [pool_tokens]  row of each slot in the position-ordered copy
                                        // (nullptr: attend the pool in slot order)
    const CausalBand * band = nullptr;  // set: an identity pool filled in order, whose mask rows are made in
    int64_t first_pos = 0;              // the graph per block of queries (kv_mask_rows); the step's first position
};

// The mask of queries [row0, row0 + n_rows) of a step, over the keys they can see: the first n_kv keys, or
// fewer when the mask comes from a band (keys past the block's last position are masked for all of its
// queries, so attention over the shorter prefix is the same sum). A graph node in ctx, F16 [>= n_kv, n_rows] and
// contiguous: a band's rows are wider than n_kv, which flash attention allows (it reads the first n_kv columns).
struct KvMaskRows {
    ggml_tensor * mask;
    int64_t n_kv;
};
KvMaskRows kv_mask_rows(ggml_context * ctx, const KvStepInputs & in, int64_t n_kv, int64_t row0, int64_t n_rows);
// The same mask as F16 [n_kv, n_rows], as soft_max wants it: mr.mask itself, or a copy of its first n_kv columns.
ggml_tensor * kv_mask_exact(ggml_context * ctx, const KvMaskRows & mr);

// The key order of one step: per attended key, the position it holds, as attention sees the keys.
struct KvKeyOrder {
    bool gathered = false;             // keys copied into position order (kv_order input)
    std::vector<int64_t> key_pos;      // position of attended key j (-1: empty), >= n_kv entries
    std::vector<int64_t> slot_row;     // gathered only: row of each slot in the ordered copy
    int64_t n_kv = 0;                  // keys attended, padded to a multiple of kv_pad (or the whole pool)
    int64_t window = 0;                // > 0: a query at p sees only keys at p - window < q (sliding-window rings)
};

// Which slots the next step attends, in which order. ordered: the session asked for position-ordered
// attention; it is used only once the mapping leaves identity and only for unquantized K/V (a gather
// copies whole rows). kv_pad: n_kv is rounded up to a multiple of it, so graphs are rebuilt rarely.
KvKeyOrder kv_key_order(const KvPager & pager, const KvLayout & layout, bool ordered, int64_t kv_pad);

// Creates (and marks as inputs) the tensors of a step of n_tokens tokens attending n_kv slots, in the
// no_alloc graph context ctx. gathered: the step attends a position-ordered copy (KvKeyOrder::gathered).
// band: the step's queries are those of an identity pool filled in order from first_pos, and their mask and slot
// rows are made in the graph from the band (nothing uploaded but a v_trans layout's V indices); nullptr: the mask
// and slot rows are inputs, uploaded.
KvStepInputs kv_step_inputs_new(ggml_context * ctx, const KvLayout & layout, int64_t n_tokens, int64_t n_kv,
                                bool gathered, const CausalBand * band = nullptr, int64_t first_pos = 0);

// The inputs of a step that only reads the pool (a layer attending another layer's K/V): no slot rows, which
// its graph would never allocate.
inline void kv_step_inputs_reads_only(KvStepInputs & in) { in.slots = in.v_slots = nullptr; }

// The slot masks of an identity pool (slot j holds position j) filled in order, for every step of a
// layer-major prefill: query i of a step at first_pos sees slots j <= first_pos + i. Every block of queries' mask
// is a view of one table made once, [width, max_rows + 8] with row r 0 up to column edge + r and -inf after
// (edge = n_slots rounded up to 8): the block's rows start at row first_pos % 8 and column edge + first_pos % 8 -
// first_pos, so the mask costs no work per step. Equal to build_slot_mask's for that pool. What it replaced, each
// measured: a mask uploaded per layer and step cost more than the compute at 32K positions; one made from F32 ops,
// 14% of the GPU time; one concatenated from a zero row and a triangle per block, 1.5 s of a 128K prefill on an H100
// (ggml's strided concat, ~10% of the memory bandwidth; R92). The table holds one attention block's mask (the
// block's rows are sized so: graph.h's attention_block_rows), as the concatenated one did in the compute buffer.
// The band also holds the pool's other per-step inputs, which in such a pool are counts (position p is in slot p):
// 0, 1, ... as I32 (positions, output rows) and as I64 (slot rows), so a step views them instead of uploading them.
// An uploaded input makes ggml's scheduler wait for the device to finish the step before it (it copies the input
// into the one buffer the running step reads), and a layer-major prefill has n_layer x more steps than a forward
// pass: on the GPU those waits left the device idle once per step.
class CausalBand {
public:
    // max_rows: the most queries a block asks a mask for; max_group: the most blocks of max_rows queries one attention
    // call takes (group_mask; 1 unless max_rows is a multiple of 8).
    CausalBand(ggml_backend_t backend, int64_t n_slots, int64_t max_rows, int64_t kv_pad, int64_t max_group = 1);
    ~CausalBand();
    CausalBand(const CausalBand &) = delete;
    CausalBand & operator=(const CausalBand &) = delete;
    // The mask of n_rows queries from first_pos over their first n_kv keys: a view in ctx, F16 [width, n_rows] and
    // contiguous, whose columns past n_kv flash attention does not read (kv_mask_exact cuts them off for others).
    ggml_tensor * mask(ggml_context * ctx, int64_t n_kv, int64_t n_rows, int64_t first_pos) const;
    // n_blocks consecutive blocks of n_rows queries from first_pos (n_rows a multiple of 8, at most max_rows), attended
    // by one flash attention call with the blocks along ne3, the latest first (block_order): a row r of the table serves
    // every block, n_rows columns further on for each earlier one, so the call's mask costs one block's rows however
    // many blocks it takes. Returns the latest block's mask over the n_kv keys it sees, as mask() makes it;
    // as_sequences() then makes it every block's (after ggml_flash_attn_ext, which asserts a contiguous mask).
    ggml_tensor * group_mask(ggml_context * ctx, int64_t n_kv, int64_t n_rows, int64_t first_pos, int64_t n_blocks) const;
    static void as_sequences(ggml_tensor * mask, int64_t n_rows, int64_t n_blocks);
    // I32 [n_blocks * max_rows], a view in ctx: the rows of n_blocks blocks of max_rows queries, the latest block first.
    // get_rows with it puts a group's queries in its call's order, and the call's output back (the order is its own
    // inverse).
    ggml_tensor * block_order(ggml_context * ctx, int64_t n_blocks) const;
    int64_t max_rows() const { return max_rows_; }
    int64_t max_group() const { return max_group_; }
    // Keys that queries up to position last_pos can see, padded as the step's n_kv is, at most n_kv.
    int64_t keys_seen(int64_t last_pos, int64_t n_kv) const;
    int64_t n_slots() const { return n_slots_; }
    // first, first + 1, ..., first + n - 1 as I32 (positions, output rows) or I64 (slot rows): a view in ctx.
    ggml_tensor * counts_i32(ggml_context * ctx, int64_t first, int64_t n) const;
    ggml_tensor * counts_i64(ggml_context * ctx, int64_t first, int64_t n) const;
    int64_t device_bytes() const;

private:
    int64_t n_slots_, max_rows_, kv_pad_, max_group_;
    int64_t edge_ = 0, width_ = 0;   // the table's (above)
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    ggml_tensor * table_ = nullptr;        // F16 [width, max_rows + 8]
    ggml_tensor * counts_i32_ = nullptr;   // I32 [n_slots]: 0, 1, ...
    ggml_tensor * counts_i64_ = nullptr;   // I64 [n_slots]: 0, 1, ...
    ggml_tensor * block_order_ = nullptr;  // I32 [max_group * max_rows] (max_group > 1)
};

// Uploads the step's pool inputs: the slot rows of `alloc` (its span_n tokens, at query positions pos;
// none for a step that only reads, whose alloc needs only span_n), the V element indices, the slot mask over order's first n_kv keys and the key order. The tensors must
// be allocated (after ggml_backend_sched_alloc_graph) and shaped for this step. scratch is reused.
void kv_step_inputs_set(const KvStepInputs & in, const KvLayout & layout, const KvKeyOrder & order,
                        const Plan & alloc, const int32_t * pos, std::vector<uint8_t> & scratch);

// One token of a batched decode step over a pool arena (kv/pool_arena.h): its session's lane, the slot its
// pager gave it, its position and its session's key order.
struct LaneToken {
    int64_t lane;
    int64_t slot;
    int32_t pos;
    const KvKeyOrder * order;
};

// Uploads such a step's inputs (made by kv_step_inputs_new with the arena's per-lane layout, n tokens and the
// step's n_kv): token t writes arena row lane * pool_tokens + slot (under v_trans, V element
// lane * pool_tokens * n_embd_v + channel * pool_tokens + slot), and mask row t is its own pool's slot mask
// over the first n_kv slots (n_kv is the largest of the lanes' own: slots past a lane's own are empty, masked).
void kv_step_inputs_set_lanes(const KvStepInputs & in, const KvLayout & layout, const std::vector<LaneToken> & tokens,
                              std::vector<uint8_t> & scratch);

// The F16 slot-space mask for one step, [n_kv, n_tokens] in ggml order (row i = query token i):
// 0 where slot s holds a position p with 0 <= p <= pos[i] and (window <= 0 or pos[i] - p < window),
// -inf elsewhere. slot_pos has at least n_kv entries (-1 = empty slot).
void build_slot_mask(const int64_t * slot_pos, int64_t n_kv, const int32_t * pos, int64_t n_tokens,
                     int64_t window, ggml_fp16_t * out);

}  // namespace kvf
