// Layout of the communication buffer used by the EP ops (dispatch, combine, broadcast,
// slot_values), shared by the host (sizing, launch) and the kernels. Plain C++.
//
// Every rank of a group computes the same layout from the same static shapes, so a rank can write
// into a region of a peer's buffer at the offset it computes for its own. Regions marked "local"
// are touched by the owning device only; the others are written by peers (NVLink stores).
#pragma once

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/host_device.h"

namespace jax_ep {

// Most tokens per chunk (the unit of work of the data kernels and of the per-chunk ready flags).
inline constexpr int kMaxChunkTokens = 8;
// Chunks a call is cut into at least, down to one token per chunk: a chunk is one warp's serial chain
// of row copies, so few chunks leave most warps idle (2x H200, 128 tokens per rank: 8-token chunks
// made combine 200 µs), and big ones make a long tail. With every SM (131 blocks of 10 receiver
// warps) 512 chunks of 8 tokens at T = 4096 kept the SMs active 59% of dispatch's main kernel (one
// H200, ncu: SM active / elapsed cycles), each straggling warp copying 917 KB alone; 4096 chunks
// give every receiver warp ~3 one-token items.
inline constexpr int kMinChunks = 4096;
// A chunk's rows are also cut into column slices when T alone gives fewer than kMinChunks chunks:
// a work item is then (chunk, slice), and at T = 128 (128 one-token chunks) a row of 14 KiB is 10
// items instead of one warp's serial chain (combine, broadcast and dispatch were latency-bound
// there, at ~1/6 of HBM bandwidth). A slice is a whole number of kSliceBytes of the staged row
// (data_row_bytes): combine's piece (1.5 KiB) and so, for every row kind, a multiple of 16 bytes
// (bulk copies), of 256 elements (the converting copies' step) and of 128 FP8 channels (a slice
// holds whole scale groups). The last slice runs to the row's end.
inline constexpr int kSliceBytes = 1536;
// Largest top-k the EP kernels support (a warp holds a token's slots, one per lane).
inline constexpr int kMaxTopk = 32;
// Largest number of experts (the notify kernel keeps a count per expert in shared memory).
inline constexpr int kMaxExperts = 8192;
// Most rows of a data op's arrays: the receive capacity C and the R*T source slots (the handle's
// src_index / token_rows hold them as int32).
inline constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;
// Widest row in elements (row bytes and element offsets stay far below 2^31).
inline constexpr int64_t kMaxHidden = (int64_t{1} << 28) - 1;
// Warps of a data-kernel block (dispatch, combine, broadcast): the senders take 1..kBlockWarps-1.
inline constexpr int kBlockWarps = 16;
// Elements a row's width must be a multiple of (rows move as 16-byte vectors).
inline constexpr int kRowAlignment = 8;
// Channels per FP8 scale (e4m3 rows carry one float32 scale per block; jax_ep.config.FP8_BLOCK).
inline constexpr int kFp8Block = 128;
// The FP8 wire's floor of a block's amax (an all-zero block keeps a finite scale; DeepEP's clamp;
// jax_ep.fp8.FP8_MIN_AMAX).
inline constexpr float kFp8MinAmax = 1e-4f;

// Element kinds of rows (attribute values shared by handlers and kernels).
enum RowKind : int32_t { kRowBF16 = 0, kRowF32 = 1, kRowFP8 = 2 };

// Per-call bookkeeping in the local region of the buffer, written by the op's first kernel after
// group discovery and read by its later kernels (stream order makes it visible).
struct OpInfo {
  uint64_t expected;     // value of every ready flag of this call: (epoch << 16) | group key
  int32_t rank;          // this device's rank in the group
  int32_t size;          // R
  int32_t group;         // group id (0 on a 1-D mesh)
  int32_t total_rows;    // dispatch: sum of group_sizes on this rank
  uint32_t work[4];      // dynamic work counters of the data kernel (zeroed by the first kernel)
  int32_t ordinals[kMaxGroupRanks];  // device ordinal of each rank (-1: not linked)
  // Rank masking: bit r of `active` = rank r is active (the call's rank_mask); bit r of `linked` =
  // this call exchanges data with rank r (itself always; an active rank links the active ranks, a
  // masked one only itself). Nothing is written to, or waited for from, a rank that is not linked.
  uint32_t active;
  uint32_t linked;
  // Shrink mode: the ranks this call gave up on (a bounded wait on them timed out). In discovery
  // and the counts exchange (one block) they leave `active` / `linked` before anything depends on
  // them; in the data kernels a warp sets the bit (atomicOr, every block sees it) and every later
  // wait on that rank gives up at once. Zeroed when the OpInfo is published.
  uint32_t missed;
};

struct CommLayout {
  // byte offsets from the start of a communication buffer
  uint64_t op_info;       // local: OpInfo
  uint64_t count_flags;   // uint64 [kMaxGroupRanks]: "counts of rank s are written" (dispatch)
  uint64_t chunk_flags;   // uint64 [R][num_chunks][num_slices]: "slice k of chunk c from/for rank s
                          //   is written"
  uint64_t counts;        // int32 [R][E + R]: tokens of rank s per expert (dispatch); rank-major
                          //   dispatch adds, at [s][E + r], rank s's tokens that go to rank r
  uint64_t slot_rank;     // local int32 [T][K]: rank of (token, slot) among this rank's tokens of
                          //   its expert (rank-major dispatch: of its destination rank); unused
                          //   slots: unspecified
  uint64_t counts_local;  // local int32 [E + R]: this rank's tokens per expert, then (rank-major
                          //   dispatch) per destination rank
  // Receive side: the receiver places every row itself, from its own counts table, so that its
  // rows never depend on what a sender knows (a sender that missed a peer's counts, or lost one,
  // cannot misplace rows here).
  uint64_t base_row;      // local int32 [E] = [R][E_local]: row here of source s's rank-0 token of
                          //   local expert j (rank-major dispatch: [R], source s's first row here)
  uint64_t limit;         // local int32 [E] = [R][E_local]: source s's slot of local expert j is
                          //   kept iff its rank < limit[s][j]
  uint64_t seg_off;       // local int32 [E_local]: first row of each local expert
  uint64_t seg_kept;      // local int32 [E_local]: rows kept per local expert
  uint64_t meta_rows;     // int32 [R][T][K]: local expert here of (source s, token, slot), -1 not
                          //   here (dispatch, both modes)
  uint64_t meta_rank;     // int32 [R][T][K]: its rank among source s's tokens of that expert
  uint64_t meta_w;        // float [R][T][K]: gate weights (dispatch) / slot values (slot_values)
  uint64_t meta_pos;      // int32 [R][T]: rank-major dispatch: the token's rank among source s's
                          //   tokens sent here, -1 none
  uint64_t stage_scales;  // float [R][T][scale_row_bytes / 4]: FP8 scales (dispatch)
  uint64_t stage_data;    // [R][T][data_row_bytes]: token rows (dispatch, broadcast) or partial
                          //   sums (combine), block s written by rank s (combine: for rank s)
  uint64_t total;         // bytes of the buffer this layout needs
  uint64_t data_row_bytes;
  uint64_t scale_row_bytes;
  int32_t num_chunks;     // ceil(T / chunk_tokens)
  int32_t chunk_tokens;   // tokens per chunk, in [1, kMaxChunkTokens]
  int32_t num_slices;     // column slices per row: clamp(ceil(kMinChunks / num_chunks), 1, units),
                          //   units = ceil(data_row_bytes / kSliceBytes), then merged into
                          //   slice_bytes = ceil(units / slices) units each
  uint64_t slice_bytes;   // bytes of a slice of the staged row (a multiple of kSliceBytes)
};

JAX_EP_HOST_DEVICE inline uint64_t align_up_u64(uint64_t value, uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// num_ranks R, num_tokens T (per rank), num_topk K, num_experts E (global); data_row_bytes: bytes
// of one staged row (a multiple of 16); scale_row_bytes: FP8 scale bytes per row (0 without FP8).
JAX_EP_HOST_DEVICE inline CommLayout make_comm_layout(int64_t num_ranks, int64_t num_tokens,
                                                      int64_t num_topk, int64_t num_experts,
                                                      uint64_t data_row_bytes,
                                                      uint64_t scale_row_bytes) {
  const uint64_t R = static_cast<uint64_t>(num_ranks);
  const uint64_t T = static_cast<uint64_t>(num_tokens);
  const uint64_t K = static_cast<uint64_t>(num_topk);
  const uint64_t E = static_cast<uint64_t>(num_experts);
  const uint64_t local_experts = num_ranks > 0 ? E / R : 0;
  CommLayout layout{};
  const uint64_t chunk = T / kMinChunks;
  layout.chunk_tokens = static_cast<int32_t>(chunk < 1 ? 1 : chunk > kMaxChunkTokens ? kMaxChunkTokens : chunk);
  layout.num_chunks = static_cast<int32_t>((T + layout.chunk_tokens - 1) / layout.chunk_tokens);
  layout.data_row_bytes = align_up_u64(data_row_bytes, 16);
  layout.scale_row_bytes = scale_row_bytes;
  {
    const uint64_t chunks = static_cast<uint64_t>(layout.num_chunks);
    const uint64_t units = (layout.data_row_bytes + kSliceBytes - 1) / kSliceBytes;
    const uint64_t want = chunks > 0 ? (kMinChunks + chunks - 1) / chunks : 1;
    const uint64_t slices = units < 1 ? 1 : want < units ? want : units;
    const uint64_t per = units < 1 ? 1 : (units + slices - 1) / slices;  // units per slice
    layout.num_slices = static_cast<int32_t>(units < 1 ? 1 : (units + per - 1) / per);
    layout.slice_bytes = per * kSliceBytes;
  }
  uint64_t at = 0;
  const uint64_t kAlign = 256;
  layout.op_info = at;       at = align_up_u64(at + sizeof(OpInfo), kAlign);
  layout.count_flags = at;   at = align_up_u64(at + kMaxGroupRanks * sizeof(uint64_t), kAlign);
  layout.chunk_flags = at;
  at = align_up_u64(at + R * static_cast<uint64_t>(layout.num_chunks) *
                            static_cast<uint64_t>(layout.num_slices) * sizeof(uint64_t),
                    kAlign);
  layout.counts = at;        at = align_up_u64(at + R * (E + R) * 4, kAlign);
  layout.slot_rank = at;     at = align_up_u64(at + T * K * 4, kAlign);
  layout.counts_local = at;  at = align_up_u64(at + (E + R) * 4, kAlign);
  layout.base_row = at;      at = align_up_u64(at + E * 4, kAlign);
  layout.limit = at;         at = align_up_u64(at + E * 4, kAlign);
  layout.seg_off = at;       at = align_up_u64(at + local_experts * 4, kAlign);
  layout.seg_kept = at;      at = align_up_u64(at + local_experts * 4, kAlign);
  layout.meta_rows = at;     at = align_up_u64(at + R * T * K * 4, kAlign);
  layout.meta_rank = at;     at = align_up_u64(at + R * T * K * 4, kAlign);
  layout.meta_w = at;        at = align_up_u64(at + R * T * K * 4, kAlign);
  layout.meta_pos = at;      at = align_up_u64(at + R * T * 4, kAlign);
  layout.stage_scales = at;  at = align_up_u64(at + R * T * scale_row_bytes, kAlign);
  layout.stage_data = at;    at = align_up_u64(at + R * T * layout.data_row_bytes, kAlign);
  layout.total = at;
  return layout;
}

}  // namespace jax_ep
