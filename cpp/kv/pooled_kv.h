// PooledKV: the device K/V pool of every full-attention layer, plus the host store of chunk images.
// It executes KvPager plans on tensors, bit-exact. The per-step inputs (slot rows, mask, key order) are in
// kv_step_inputs.h, the graph's writes and views of the pool in kv_graph.h.
// It knows nothing of models: a layer is just an index with a K and a V row width.
//
// Layout (same for every architecture): per pooled layer, K is [n_embd_k, pool_tokens] and V is
// [n_embd_v, pool_tokens] (ggml order: ne0 = row width, ne1 = slot), so one chunk of one layer is one
// contiguous region of chunk_tokens rows and a page-out/page-in is one copy per layer per K/V.
// With v_trans (mul_mat attention, as llama.cpp lays V out without flash attention) V is
// [pool_tokens, n_embd_v] instead: mul_mat reads it as is, where slot rows would need a transposed copy
// of the whole pool per layer per step (on the CPU ~20% of a SmolLM2 decode step). A chunk of V is
// then n_embd_v strided runs of chunk_tokens values; images hold them in that native order, and
// snapshots convert them to slot rows (save_state/load_state), so a snapshot restores under either layout.
//
// Host store: on a GPU backend the chunk images live in page-locked host memory, handed out from slabs of
// HostMemory (common/host_memory.h: it pins faster than the device's own host buffer type; make_slabs can make
// them ahead of need on another thread), and page-outs/page-ins are asynchronous copies queued
// on the backend's stream, the stream the next forward runs on: stream order alone guarantees that a
// page-out has read a block before the forward overwrites it and that a page-in has landed before the
// forward reads it, so the host never waits for paging. It waits (synchronize()) only where it touches
// images or blocks itself: host_image, read_block, write_block, clear_host, destruction. On the CPU
// backend images are plain heap memory and copies are memcpy.
//
// On a model split across devices each pooled layer's K and V live on that layer's device (LayerBackends), and a
// chunk's page-out or page-in is one copy per layer on that layer's device. The pager stays one ledger (a chunk is
// resident on every device or on none), and the host store, on this host, holds each chunk's image of every layer,
// byte for byte what one device would hold: snapshots do not depend on the split.
#pragma once

#include "common/backend_buffers.h"
#include "common/host_memory.h"
#include "pager/kv_pager.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace kvf {

class ByteReader;
class ByteWriter;
class PoolArena;

struct KvLayout {
    int64_t n_layer      = 0;   // pooled (full-attention) layers
    int64_t n_embd_k     = 0;   // K row width = head_dim_k * n_head_kv
    int64_t n_embd_v     = 0;   // V row width = head_dim_v * n_head_kv
    int64_t pool_tokens  = 0;
    int64_t chunk_tokens = 64;
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    bool v_trans = false;       // V is [pool_tokens, n_embd_v] (unquantized V only)
};

ggml_type kv_type_from_name(const std::string & name);   // "f16" | "q8_0" | "q4_0" | "f32" | "bf16"

// The V layout of a pool for an attention path: transposed for mul_mat attention, which reads it as is.
// Flash attention reads slot rows, and the position-ordered copy (ordered attention) gathers slot rows,
// so either keeps V in slot rows.
inline bool v_trans_for(bool flash_attn, bool ordered_attention) { return !flash_attn && !ordered_attention; }

class PooledKV {
public:
    // backends: each layer's K and V (common/backend_buffers.h), or one for all.
    PooledKV(const LayerBackends & backends, const KvLayout & layout);
    // A pool that is one lane of `arena` (kv/pool_arena.h): the same behaviour, in the arena's memory.
    PooledKV(const LayerBackends & backends, const KvLayout & layout, std::shared_ptr<PoolArena> arena);
    ~PooledKV();
    PooledKV(const PooledKV &) = delete;
    PooledKV & operator=(const PooledKV &) = delete;

    const KvLayout & layout() const { return layout_; }
    const PoolArena * arena() const { return arena_.get(); }   // nullptr: the pool has memory of its own
    int64_t lane() const { return lane_; }                     // its lane in arena()
    ggml_tensor * k(int64_t il) const { return k_[il]; }   // [n_embd_k, pool_tokens]
    ggml_tensor * v(int64_t il) const { return v_[il]; }   // [n_embd_v, pool_tokens] ([pool_tokens, n_embd_v] if v_trans)

    int64_t chunk_bytes() const;        // one chunk, all layers, K and V
    int64_t device_bytes() const;       // the whole pool
    int64_t device_bytes_on(ggml_backend_t backend) const;   // its layers on that backend
    ggml_backend_t backend_of(int64_t il) const { return backends_[(size_t) il]; }
    int64_t host_bytes() const;         // images held in the host store
    int64_t host_store_bytes() const;   // the host store's slabs: held images and free slots

    // Carry out a pager plan on the tensors: page-outs (block -> host image) first, then page-ins
    // (host image -> block); dropped chunks lose their host image. Call before KvPager::apply(plan).
    // Chunks >= uncomputed_from have no K/V yet (layer-major prefill places a prompt before computing it):
    // their page-outs only reserve the image, which the prefill fills layer by layer.
    void execute(const Plan & plan, int64_t uncomputed_from = INT64_MAX);

    // ---- one layer of one chunk (layer-major prefill): K then V, in the pool's native layout ----
    int64_t layer_chunk_bytes() const { return chunk_bytes() / layout_.n_layer; }
    // Layer il of `block` to or from host memory of layer_chunk_bytes(); queued on the backend's stream
    // like paging (the caller synchronizes before it reads `out` or reuses `in`), or on `stream`: another backend
    // of the layer's device, whose queue the copy joins (the exact prefill's copy stream).
    void get_layer_async(int64_t block, int64_t il, uint8_t * out, ggml_backend_t stream = nullptr) const;
    void set_layer_async(int64_t block, int64_t il, const uint8_t * in, ggml_backend_t stream = nullptr);
    // Layer il's K rows of `block` (chunk_tokens rows of k(il)->nb[1] bytes) to host memory, queued the same way.
    void get_k_rows_async(int64_t block, int64_t il, uint8_t * out) const;
    // Layer il inside the chunk's host image; the image is made (its bytes undefined) if it has none.
    uint8_t * image_layer(int64_t chunk, int64_t il);

    // Raw bytes of one block (all layers, K then V per layer) and of a host image: for tests and snapshots.
    std::vector<uint8_t> read_block(int64_t block) const;
    void write_block(int64_t block, const std::vector<uint8_t> & bytes);
    bool has_host_image(int64_t chunk) const { return host_.count(chunk) != 0; }
    std::vector<uint8_t> host_image(int64_t chunk) const;
    void clear_host();
    // One chunk in slot rows (the snapshot form, whatever v_trans), from `block` if >= 0, else from its
    // host image; write_block_rows is the inverse. Two pools of the same row layout exchange exact K/V
    // through these (Session::adopt) even when one transposes V and the other does not.
    std::vector<uint8_t> chunk_rows(int64_t chunk, int64_t block) const;
    void write_block_rows(int64_t block, const std::vector<uint8_t> & rows);
    bool pinned_host() const { return !slabs_.empty() ? pinned_ : can_pin_; }   // images in page-locked memory
    // Growing the host store ahead of need: pinning runs at ~10 GiB/s, so a long prompt's images are better
    // made on another thread while the prompt computes. host_slots_short(n): how many more image slots n
    // images on the host in all would take; make_slabs touches no state of this pool (any thread);
    // add_slabs hands their slots to the host store.
    int64_t host_slots_short(int64_t n_images) const;
    std::vector<std::unique_ptr<HostMemory>> make_slabs(int64_t n_slots) const;
    void add_slabs(std::vector<std::unique_ptr<HostMemory>> slabs);
    void synchronize() const;   // wait for every queued page-out/page-in

    // ---- state (pooled_kv_state.cpp): the layout, then one image per chunk in logical order ----
    static constexpr uint32_t k_state_version = 1;
    int64_t state_bytes(int64_t n_chunks) const;
    // chunk_blocks[c] >= 0: chunk c is read from that block on the device; -1: from its host image.
    void save_state(ByteWriter & w, const std::vector<int64_t> & chunk_blocks) const;
    // Checks the saved layout equals this pool's (types, row widths, layers, chunk size) and returns
    // where each of the n_chunks images lies inside r's buffer. Changes nothing.
    std::vector<const uint8_t *> state_from(ByteReader & r, uint32_t version, int64_t n_chunks) const;
    // Commit: chunk c goes to block chunk_blocks[c] if >= 0, and to the host store if host_valid[c]; the
    // host store is replaced. Blocks no chunk owns keep their bytes (every slot in them is masked).
    void load_state(const std::vector<const uint8_t *> & images, const std::vector<int64_t> & chunk_blocks,
                    const std::vector<uint8_t> & host_valid);

private:
    static void check_layout(const KvLayout & layout);
    // Visit every region of one block, as ggml's 2D copies take them: fn(layer, tensor, byte offset, run size, runs,
    // run stride in the tensor, offset in image); in the image the runs lie back to back.
    // only_layer >= 0: that layer's regions alone, image offsets counted from the layer's start.
    template <typename Fn> void for_each_region(int64_t block, Fn && fn, int64_t only_layer = -1) const;
    uint8_t * image_for(int64_t chunk);   // the chunk's image slot, taken from the free slots if new
    void add_slab(std::unique_ptr<HostMemory> slab);
    void release_image(int64_t chunk);
    void get_block(int64_t block, uint8_t * out) const;      // chunk_bytes() bytes, as read_block
    void set_block(int64_t block, const uint8_t * in);        // chunk_bytes() bytes, as write_block
    // Snapshots store V in slot rows whatever the pool's layout: native image <-> that form.
    void image_to_rows(const uint8_t * native, uint8_t * rows) const;
    void image_from_rows(const uint8_t * rows, uint8_t * native) const;

    KvLayout layout_;
    LayerBackends backends_;            // per layer
    std::vector<ggml_backend_t> distinct_;   // each backend once (what synchronize() waits for)
    std::unique_ptr<BackendBuffers> own_;    // the pool's memory, unless it is an arena's lane
    ggml_context * ctx_ = nullptr;           // the lane views
    std::vector<ggml_tensor *> k_, v_;
    std::shared_ptr<PoolArena> arena_;   // set: k_ and v_ view lane_ of it
    int64_t lane_ = -1;

    // Host store: fixed-size image slots carved out of slabs; chunk -> slot.
    bool can_pin_ = false, pinned_ = false;
    std::vector<std::unique_ptr<HostMemory>> slabs_;
    std::vector<uint8_t *> free_slots_;
    std::unordered_map<int64_t, uint8_t *> host_;
};

}  // namespace kvf
