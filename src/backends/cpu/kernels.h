// CPU kernels. Each takes the same params struct the CUDA kernels take.
#pragma once

#include <cstddef>

#include "attnforge/kernel/op_params.h"

namespace attnforge::cpu {

// Limits of one attention task: rows (query tokens x heads of a group) and head dims held in scratch.
constexpr int32_t kMaxRows = 128;
constexpr int32_t kMaxHeadDim = 512;
constexpr int32_t kKVBlock = 32;  // KV tokens converted to fp32 and scored together
// Scratch per worker: Q and accumulators for kMaxRows rows, one K and one V block, scores, row state, freqs.
constexpr size_t kScratchFloats = 2 * kMaxRows * kMaxHeadDim + 2 * kKVBlock * kMaxHeadDim + kMaxRows * kKVBlock +
                                  4 * kMaxRows + kMaxHeadDim;

void attention(const AttentionParams& p);
void merge_states(const MergeStatesParams& p);
void append_kv(const AppendKVParams& p);
void rope(const RopeApplyParams& p);

}  // namespace attnforge::cpu
