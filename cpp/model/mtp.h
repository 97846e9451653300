// The multi-token-prediction (nextn) head in a graph: what a session's steps add to the trunk so the head can draft
// (build_mtp_follow), and one draft step of the head (build_mtp_draft). The family's own block is ArchSpec::mtp (model.h).
//
// The head runs one position behind the trunk: its K/V at position p come from token p's embedding and the
// trunk's output-normed final hidden state at p - 1 (libllama's h_nextn; zeros at p = 0). A step of the trunk
// over positions [p0, p1) therefore writes the head's K/V of [p0, p1) from the hidden states of [p0 - 1, p1 - 1):
// the one before p0 is the carry (RecurrentState::mtp_carry, exact only for everything consumed, as the
// linear-attention state), which then becomes the step's last. A draft at position n (the token after the held
// ones) pairs that token with the carry; the draft after it pairs its own token with the head's normed output.
#pragma once

#include "model/graph.h"

#include <vector>

namespace kvf {

// After the trunk of a step: h is its final hidden state of every token ([n_embd, n_tokens], before the output
// norm; GraphCtx::all_rows). Writes the head's K/V of the step's positions into GraphCtx::mtp_kv_layer and moves
// the carry on. Returns h's output rows (select_outputs), for the logits.
ggml_tensor * build_mtp_follow(GraphCtx & g, const Model & m, ggml_tensor * h);

// One draft step of one session or several (a token each, GraphCtx::in.tokens and positions; several: GraphCtx::lanes,
// each attending its own pool): the head's block over token i and the hidden state hs[i] (F32 [n_embd], persistent:
// read, then overwritten with the head's normed output for the next step), attending (and writing) the head's K/V.
// Returns the logits [n_vocab, n], marked as an output.
ggml_tensor * build_mtp_draft(GraphCtx & g, const Model & m, const std::vector<ggml_tensor *> & hs);

}  // namespace kvf
