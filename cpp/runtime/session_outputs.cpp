// Session's output reading: the logits (through a pinned staging buffer on a GPU) and the greedy token
// (an argmax built into the graph, so only its candidates come back).
#include "runtime/session.h"
#include "model/rpc.h"

#include <algorithm>
#include <cstring>

namespace kvf {

void Session::read_logits(float * out) {
    const size_t n = ggml_nbytes(logits_);
    ggml_backend_buffer_type_t host = model_->on_gpu()
        ? ggml_backend_dev_host_buffer_type(ggml_backend_get_device(model_->backend())) : nullptr;
    if (host && (!logits_host_ || ggml_backend_buffer_get_size(logits_host_) < n)) {
        if (logits_host_) ggml_backend_buffer_free(logits_host_);
        logits_host_ = ggml_backend_buft_alloc_buffer(host, n);
    }
    if (!host || !logits_host_) {
        ggml_backend_tensor_get(logits_, out, 0, n);
        check_rpc_connections(sched_);   // a lost RPC device reads as zeros
        return;
    }
    // One DMA into pinned memory on the compute stream, then a host copy: a pageable read of the 0.5 MB
    // of an 8B model's logits goes through the driver's staging buffers and took longer.
    auto * staged = static_cast<const uint8_t *>(ggml_backend_buffer_get_base(logits_host_));
    ggml_backend_tensor_get_async(model_->backend(), logits_, const_cast<uint8_t *>(staged), 0, n);
    ggml_backend_synchronize(model_->backend());
    check_rpc_connections(sched_);
    std::memcpy(out, staged, n);
}

namespace {

// The most rows of at most 1024 that split n evenly (1 when n is prime).
int64_t greedy_rows(int64_t n) {
    for (int64_t r = std::min<int64_t>(n, 1024); r > 1; --r) if (n % r == 0) return r;
    return 1;
}

}  // namespace

void Session::build_greedy(GraphCtx & g) {
    // ggml's argmax runs one GPU block per row: over one 128K-wide row of logits it took 51 us of a 3.4 ms
    // H100 decode step (ncu). Split into R rows of C, each row's argmax and max (a C-wide max pool) run
    // in parallel and read_greedy picks among the R candidates.
    const int64_t n_vocab = logits_->ne[0], R = greedy_rows(n_vocab), C = n_vocab / R;
    ggml_tensor * rows = ggml_reshape_2d(g.ctx, logits_, C, R);
    ggml_tensor * col = ggml_cast(g.ctx, ggml_argmax(g.ctx, rows), GGML_TYPE_F32);                 // [R]
    ggml_tensor * max = ggml_pool_2d(g.ctx, rows, GGML_OP_POOL_MAX, (int) C, 1, (int) C, 1, 0, 0);   // [1, R]
    greedy_.rows = ggml_concat(g.ctx, ggml_reshape_1d(g.ctx, max, R), col, 0);
    greedy_.row_len = C;
    ggml_set_output(greedy_.rows);
    ggml_build_forward_expand(g.gf, greedy_.rows);
}

int32_t Session::read_greedy() {
    const int64_t R = greedy_.rows->ne[0] / 2;
    greedy_scratch_.resize((size_t) (2 * R));
    const float * max = greedy_scratch_.data();
    const float * col = max + R;
    ggml_backend_tensor_get_async(model_->backend(), greedy_.rows, greedy_scratch_.data(), 0, ggml_nbytes(greedy_.rows));
    ggml_backend_synchronize(model_->backend());
    check_rpc_connections(sched_);
    int64_t best = 0;   // the first row holding the maximum, as NumPy's argmax picks the first index
    for (int64_t r = 1; r < R; ++r) if (max[r] > max[best]) best = r;
    return (int32_t) (best * greedy_.row_len + (int64_t) col[best]);
}

}  // namespace kvf
