// Throughput dispatch over NVLink (intra-node EP). Two kernels on XLA's stream (two more in shrink
// mode: 3. pending and 5. fixup, below), no host sync; 1 and 2 are one kernel, the notify kernel
// (its block 0 notifies while blocks 1.. prep; dispatch_notify_kernel says why that is safe):
//
//  1. prep (rank-local, blocks 1..): sanitises topk_idx, writes is_token_in_rank, counts this
//     rank's tokens per expert and gives every (token, slot) its rank among this rank's tokens of
//     that expert, in token order (warp bit masks + popc: deterministic, no atomics order).
//  2. notify (block 0): group discovery (the start barrier of the call; the peers' config
//     fingerprints are checked there, cuda/fingerprint.cuh), overlapping prep; then, once every
//     prep block has arrived (a counter: wait_prep_blocks), every rank writes
//     its counts [E] into counts[me] of every rank and raises a flag; once all are in, each rank
//     computes, exactly like jax_ep.reference.dispatch, its local experts' segments (offset, kept
//     rows) and, per source rank and local expert, the first row here and the rows kept
//     (base_row / limit tables), and its own group_sizes, expert_counts, num_dropped. Every row is
//     placed by its receiver from its own table: a sender's view of the counts never matters.
//     Rank masking: only linked ranks (OpInfo::linked) exchange counts; rows come from active
//     sources only and a masked destination keeps none. A pair with a masked source or destination
//     goes nowhere and counts in its source's num_dropped (the only rank that knows it).
//  3. pending (shrink mode only): src_index of the received rows starts as kPendingRow.
//  4. main (num_blocks blocks, warps split into senders and receivers):
//     senders: per chunk (1-8 tokens, ep_layout.h), every token routed to a remote rank crosses
//       NVLink ONCE (TMA bulk copies through shared memory or 16-byte stores; BF16/FP8 conversion
//       fused) into that rank's staging [me][t], with its per-slot metadata (local expert there or
//       -1, the slot's rank among this rank's tokens of that expert, gate weight); metadata goes
//       to every remote rank for every token. Then a release flag per (chunk, destination).
//     receivers: zero the alignment-padding rows and write src_index/row_weights of the unused
//       tail, expand this rank's own tokens straight from x, and expand each remote chunk as soon
//       as its flag arrives (overlapping the transfer): one staged row read, written to each of its
//       receive rows (base_row + rank, or dropped past limit); token_rows, row_weights and
//       src_index alongside.
// The next call's start barrier protects the staging area from being overwritten early.
// Pulled (DispatchLaunch::pull): the senders stage each such token once, into their own staging
// [me][t], and the receivers read it from there (the metadata and flags still go to each receiver).
// Not with shrink mode: a receiver the sender gave up on could still be reading after the
// sender's next call has overwritten it.
#include <algorithm>

#include "cuda/dispatch.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

constexpr int kPrepThreads = 1024;
constexpr int kPrepWarps = kPrepThreads / 32;
constexpr int kPrepMaxExperts = 128;  // experts per prep block (shared bit masks)
static_assert(kPrepWarps == 32, "the prefix scan of a key: lane w holds warp w");
constexpr int kNotifyThreads = kPrepThreads;  // one kernel: the notify block and the prep blocks
constexpr int kRowsThreads = 256;     // pending and fixup
constexpr int kTailRows = 8192;       // unused-tail rows per receiver work item
constexpr int kEmptyRows = 16;        // rank-major: empty rows (zeroed) per receiver work item

enum Conversion : int {
  kConvCopy = 0,       // rows keep x's dtype (bf16 -> bf16, f32 -> f32)
  kConvF32ToBF16 = 1,
  kConvBF16ToFP8 = 2,
  kConvF32ToFP8 = 3,
};

__device__ __forceinline__ int64_t round_up_i64(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// ---- 1. prep (blocks 1.. of the notify kernel) ------------------------------------------------
// Prep block b owns experts [b * experts_per_block, ...); rank-major dispatch adds the R keys
// E + r (destination rank r) to every block, after its experts: each block walks all tokens in tiles
// of 1024 (one token per thread) and, per tile, marks in masks[key][warp] the lanes whose token has
// the key. A token's rank within a
// key = tokens of earlier tiles + tokens of earlier warps of this tile + popc of the lower lanes
// of its warp: token order, independent of scheduling. slot_rank gets, per (token, slot), its rank
// among this rank's tokens of the slot's expert (expert-major) or of the slot's destination rank
// (rank-major: the token's place in this rank's block of rows there). Rank-major's slot ranks of a
// tile are written by one block (tile % blocks), as is_token_in_rank: one block holding the rank
// keys and writing all T * K of them was prep's long pole (at T=8192 on one H200 its ballots, slot
// values and stores made ~19 us of notify's 43: docs/benchmarks.md, session 12).

// A token's K expert ids, sanitised (sanitized_expert: -1 for an unused, out-of-range or
// repeated slot) into registers: slots past K are -1. Every prep block walks every token, so the
// ids are loaded and checked once per token and block, not once per use (with them reloaded and
// re-checked per slot, prep ran ~1,150 instructions per token: 40 us at T=4096, K=8 on one H200,
// bound by instruction issue).
// Loaded a tile ahead (prep_block), so the walk over the tiles does not wait for each tile's loads:
// load_early, as ptxas sank __ldg's loads past the tile's barriers to their first use (ncu at
// T=8192: ~25% of prep's stall samples waited on them). A row of 8 ids: two 16-byte loads.
template <int kSlots>
__device__ __forceinline__ void load_raw_ids(const int32_t* __restrict__ row, int K,
                                             int32_t (&raw)[kSlots]) {
  if (kSlots == 8 && K == 8 && (reinterpret_cast<uintptr_t>(row) & 15u) == 0u) {
#pragma unroll
    for (int k = 0; k < kSlots; k += 4) {
      const int4 v = load_early4(row + k);
      raw[k] = v.x;
      raw[k + 1] = v.y;
      raw[k + 2] = v.z;
      raw[k + 3] = v.w;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kSlots; ++k) raw[k] = k < K ? load_early(row + k) : -1;
}

template <int kSlots>
__device__ __forceinline__ void sanitize_ids(const int32_t (&raw)[kSlots], int E,
                                             int32_t (&ids)[kSlots]) {
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    bool keep = raw[k] >= 0 && raw[k] < E;
#pragma unroll
    for (int j = 0; j < k; ++j) keep &= raw[j] != raw[k];
    ids[k] = keep ? raw[k] : -1;
  }
}

// n / d by a multiply-high with m = divisor_magic(d) = ceil(2^32 / d): exact for 0 <= n, n * d < 2^32
// (here n < E <= kMaxExperts, d <= E). Prep is bound by instruction issue, and a division by a
// runtime divisor costs ~25 instructions (the slot's destination rank, per slot).
__device__ __forceinline__ uint64_t divisor_magic(uint32_t d) {
  return ((uint64_t{1} << 32) + d - 1) / d;
}
__device__ __forceinline__ int divide_by_magic(int n, uint64_t magic) {
  return static_cast<int>((static_cast<uint64_t>(n) * magic) >> 32);
}
static_assert(static_cast<int64_t>(kMaxExperts) * kMaxExperts < (int64_t{1} << 32),
              "divide_by_magic needs n * d < 2^32 for an expert id n and experts per rank d");

// The ranks a token's sanitised slots go to, as a bit mask (rank_magic: divisor_magic(E / R)).
template <int kSlots>
__device__ __forceinline__ uint32_t token_ranks(const int32_t (&ids)[kSlots], uint64_t rank_magic) {
  uint32_t ranks = 0u;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    if (ids[k] >= 0) ranks |= 1u << divide_by_magic(ids[k], rank_magic);
  }
  return ranks;
}

// Token t (of tile `tile`, sanitised ids `ids`): marks its lane in masks[e - e_lo][warp] for every
// expert e in [e_lo, e_hi) it picked; the block the tile falls on (prep block `block` of `blocks`)
// writes its row of is_token_in_rank. (Rank-major's rank keys E + r: prep_mark_ranks.)
template <int kSlots>
__device__ __forceinline__ void prep_mark_token(const int32_t (&ids)[kSlots], int t, int tile,
                                                int block, int blocks, int R, int e_lo, int e_hi,
                                                uint64_t rank_magic, uint32_t (*masks)[kPrepWarps],
                                                bool* is_token_in_rank) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int32_t e = ids[k];
    if (e >= e_lo && e < e_hi) atomicOr(&masks[e - e_lo][warp], 1u << lane);  // (-1 is below)
  }
  if (tile % blocks != block) return;  // most blocks: no use for the token's ranks
  const uint32_t ranks = token_ranks(ids, rank_magic);
  bool* out = is_token_in_rank + static_cast<int64_t>(t) * R;
  for (int r = 0; r < R; ++r) out[r] = ((ranks >> r) & 1u) != 0u;
}

// Rank-major, every block: each warp's mask of tokens going to rank r (key E + r, in row r of
// `rank_masks`), one ballot per rank, where a shared atomicOr per token hit the same word from
// every lane (most tokens go to most ranks). Every thread calls it (ballots); slots of an inactive
// thread are -1.
template <int kSlots>
__device__ __forceinline__ void prep_mark_ranks(const int32_t (&ids)[kSlots], int R,
                                                uint64_t rank_magic,
                                                uint32_t (*rank_masks)[kPrepWarps]) {
  const uint32_t ranks = token_ranks(ids, rank_magic);
  for (int r = 0; r < R; ++r) {
    const uint32_t voters = __ballot_sync(kFullMask, ((ranks >> r) & 1u) != 0u);
    if ((threadIdx.x & 31) == 0) {
      rank_masks[r][threadIdx.x >> 5] = voters;  // its only writer (cleared each tile)
    }
  }
}

// The shared memory of a prep block (dynamic: the notify block's lies over it).
struct PrepShared {  // keys: the block's experts, then (rank-major) the R rank keys
  static constexpr int kKeys = kPrepMaxExperts + kMaxGroupRanks;
  uint32_t masks[kKeys][kPrepWarps];
  int32_t prefix[kKeys][kPrepWarps];
  int32_t running[kKeys];
};

// Prep block `block` of `blocks` (blocks 1.. of the notify kernel). kSlots: register slots per
// token, >= K (8, 16 or kMaxTopk). Ends with the block's arrival on SyncCounters::prep_blocks_done
// (the notify block waits for all of them before it reads counts_local).
template <int kSlots>
__device__ __forceinline__ void prep_block(DeviceState* state, const CommLayout& layout,
                                           const int32_t* __restrict__ topk_idx, int T, int K,
                                           int E, int R, int experts_per_block, bool rank_major,
                                           bool* __restrict__ is_token_in_rank, int block,
                                           int blocks, PrepShared& sh) {
  uint32_t (*masks)[kPrepWarps] = sh.masks;
  int32_t (*prefix)[kPrepWarps] = sh.prefix;
  int32_t* running = sh.running;
  if (threadIdx.x == 0) {
    require_comm_bytes(state, layout.total, rank_major ? kOpDispatchRankMajor : kOpDispatch, -1);
  }
  const int e_lo = block * experts_per_block;
  const int e_hi = min(E, e_lo + experts_per_block);
  const int n_local = max(0, e_hi - e_lo);
  // rows n_local.. of masks / prefix / running: the rank keys E + r (rank-major)
  const int n_keys = n_local + (rank_major ? R : 0);
  const int warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < PrepShared::kKeys * kPrepWarps; i += blockDim.x) {
    masks[i / kPrepWarps][i % kPrepWarps] = 0u;
  }
  for (int i = threadIdx.x; i < n_keys; i += blockDim.x) running[i] = 0;
  __syncthreads();  // also: nobody touches the buffer before the stale-runtime check passed

  char* own = own_comm_buffer(state);
  int32_t* slot_rank = reinterpret_cast<int32_t*>(own + layout.slot_rank);
  const uint64_t rank_magic = divisor_magic(static_cast<uint32_t>(E / R));  // expert -> its rank
  // rank-major with K a multiple of 4 (slot_rank rows of 16-byte multiples; the buffer's tables are
  // 256-byte aligned): a token's slot ranks are written as vectors
  const bool vector_slots = rank_major && K % 4 == 0;
  const int tiles = static_cast<int>((static_cast<int64_t>(T) + kPrepThreads - 1) / kPrepThreads);
  const auto load_tile = [&](int tile, int32_t(&raw)[kSlots]) {
    const int t = tile * kPrepThreads + threadIdx.x;
    load_raw_ids<kSlots>(topk_idx + static_cast<int64_t>(t < T ? t : 0) * K, t < T ? K : 0, raw);
  };
  // the next tile's ids in flight while this one is walked (8 slots only: with 16 they spill)
  constexpr bool kPrefetch = kSlots <= 8;
  int32_t next[kSlots];
  if constexpr (kPrefetch) load_tile(0, next);
  for (int tile = 0; tile < tiles; ++tile) {
    const int t = tile * kPrepThreads + threadIdx.x;
    const bool active = t < T;
    int32_t ids[kSlots];
    if constexpr (kPrefetch) {
      sanitize_ids<kSlots>(next, E, ids);
      if (tile + 1 < tiles) load_tile(tile + 1, next);
    } else {
      load_tile(tile, next);
      sanitize_ids<kSlots>(next, E, ids);
    }
    if (active) prep_mark_token<kSlots>(ids, t, tile, block, blocks, R, e_lo, e_hi, rank_magic,
                                        masks, is_token_in_rank);
    if (rank_major) prep_mark_ranks<kSlots>(ids, R, rank_magic, masks + n_local);
    __syncthreads();
    // per key, a warp scans its warps' counts (lane w: warp w): one thread summed the 32 in turn
    for (int i = warp; i < n_keys; i += kPrepWarps) {
      const int lane = threadIdx.x & 31;
      const int count = __popc(masks[i][lane]);
      int inclusive = count;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(kFullMask, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      const int32_t run = __shfl_sync(kFullMask, lane == 0 ? running[i] : 0, 0);
      prefix[i][lane] = run + inclusive - count;
      if (lane == 31) running[i] = run + inclusive;
    }
    __syncthreads();
    // a token's rank under the key in row `row` of this block
    const auto rank_under = [&](int row) {
      return prefix[row][warp] + __popc(masks[row][warp] & lanemask_lt());
    };
    if (rank_major) {
      // the tile's slots, all of them, from the block the tile falls on; slot k's row: its
      // destination's rank key. An unused slot gets -1 (read only for a used slot).
      const auto value = [&](int k) {  // (int32 bits)
        return static_cast<uint32_t>(
            ids[k] >= 0 ? rank_under(n_local + divide_by_magic(ids[k], rank_magic)) : -1);
      };
      if (active && tile % blocks == block) {
        if (vector_slots) {  // a warp's stores of one slot index each touched 32 sectors
#pragma unroll
          for (int k0 = 0; k0 < kSlots; k0 += 4) {
            if (k0 >= K) break;
            *reinterpret_cast<uint4*>(slot_rank + static_cast<int64_t>(t) * K + k0) =
                make_uint4(value(k0), value(k0 + 1), value(k0 + 2), value(k0 + 3));
          }
        } else {
#pragma unroll
          for (int k = 0; k < kSlots; ++k) {
            if (k < K) slot_rank[static_cast<int64_t>(t) * K + k] = static_cast<int32_t>(value(k));
          }
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (ids[k] < 0) continue;  // (also every slot of an inactive thread)
        const int key = ids[k];
        if (key < e_lo || key >= e_hi) continue;  // most slots name another block's experts
        slot_rank[static_cast<int64_t>(t) * K + k] = rank_under(key - e_lo);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_keys * kPrepWarps; i += blockDim.x) {
      masks[i / kPrepWarps][i % kPrepWarps] = 0u;
    }
    __syncthreads();
  }
  int32_t* counts_local = reinterpret_cast<int32_t*>(own + layout.counts_local);
  for (int i = threadIdx.x; i < n_local; i += blockDim.x) counts_local[e_lo + i] = running[i];
  // the rank keys' counts (every block has them): from block 0
  if (rank_major && block == 0) {
    for (int r = threadIdx.x; r < R; r += blockDim.x) counts_local[E + r] = running[n_local + r];
  }
  // Arrival: the barrier orders every thread's writes above (counts_local, slot_rank,
  // is_token_in_rank) before thread 0's add in causality order, and the add's release is
  // cumulative, so the notify block, which acquires after seeing the count, sees them all.
  __syncthreads();
  if (threadIdx.x == 0) atomic_add_acq_rel_gpu(&state->sync.prep_blocks_done, uint64_t{1});
}

// ---- 2. notify (block 0 of the notify kernel) ------------------------------------------------
// This rank's counts [E] into counts[me][:] of every linked rank (its own included), then one flag
// per linked rank; on return (thread r < R) rank r's counts are here, and zero for a rank that is
// not linked (masked: its tokens go nowhere, and it is not waited for). Every thread calls it.
// (Rank-major dispatch passes E + R: its per-destination token counts travel with the expert
// counts.) Shrink mode: a linked rank whose counts do not come within the bound leaves the call
// (drop_missed; it is then as masked for everything after: segments, data), instead of a trap.
__device__ __forceinline__ void exchange_counts(DeviceState* state, const CommLayout& layout,
                                                OpInfo& info, int R, int E, int32_t op_id,
                                                bool shrink) {
  const int me = info.rank;
  char* own = own_comm_buffer(state);
  const int32_t* counts_local = reinterpret_cast<const int32_t*>(own + layout.counts_local);
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(R) * E; i += blockDim.x) {
    const int r = static_cast<int>(i / E);
    const int e = static_cast<int>(i % E);
    if (!has_rank(info.linked, r)) {  // row r of this rank's table: nothing from rank r
      reinterpret_cast<int32_t*>(own + layout.counts)[i] = 0;
      continue;
    }
    char* peer = comm_buffer_of(state, info.ordinals[r]);
    reinterpret_cast<int32_t*>(peer + layout.counts)[static_cast<int64_t>(me) * E + e] =
        __ldcg(counts_local + e);
  }
  // The block's count stores, then each flag: a barrier, then the flag thread's release (a
  // fence.acq_rel.sys and a relaxed store), not a __threadfence_system() (MEMBAR.SC.SYS, ~0.5 us)
  // in each of the 1024 threads. PTX memory model: bar.sync orders every thread's stores above
  // before the flag thread's later operations (causality order at CTA scope), and the release
  // fence is cumulative: it orders what precedes it in causality order, other threads' stores
  // included, before the flag store at system scope; the peer's acquire (wait_peer_flag: relaxed
  // polls, then fence.acq_rel.sys) then sees them. The low-latency kernels release their slot flags
  // the same way after a block barrier (cuda/low_latency.cu).
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < R && has_rank(info.linked, static_cast<int>(threadIdx.x))) {
    const int r = threadIdx.x;
    char* peer = comm_buffer_of(state, info.ordinals[r]);
    release_store_sys(reinterpret_cast<uint64_t*>(peer + layout.count_flags) + me, info.expected);
    wait_peer_flag(reinterpret_cast<const uint64_t*>(own + layout.count_flags) + r, state, info,
                   op_id, r, shrink ? &info.missed : nullptr, 2);
  }
  if (shrink) {
    __syncthreads();  // every wait is over
    if (threadIdx.x == 0) drop_missed(state, &info, op_id, 2);
  }
}

// This rank's segments (as jax_ep.reference.dispatch), from its own counts table: local expert j
// gets n_j rows (from the active sources), offset_j = sum_{j'<j} round_up(n_j', align),
// offset'_j = min(offset_j, C), kept_j = min(n_j, C - offset'_j) (0 on a masked rank); rows of
// source s start at offset'_j + sum_{s'<s active} count. Writes the segment tables, the outputs,
// and the receive-side tables base_row / limit [s][j] by which the receivers place every row
// (a sender's view of the counts never matters here). Adds to *total_rows and *dropped (shared):
// the capacity drops of the local experts, and this rank's own pairs that go nowhere (masked
// source or destination), counted at their source, since a masked rank hears from nobody.
// `n_local` [E_local] (shared): rows per local expert from the active sources. Every thread; warp 0
// walks the local experts 32 at a time with a warp scan of the rounded counts (each expert rounded
// once), where a thread per expert summing its predecessors took O(E_local) steps each.
__device__ __forceinline__ void segment_tables(char* own, const CommLayout& layout,
                                               const int32_t* n_local, uint32_t active, int me,
                                               int R, int E, int C, int align,
                                               int32_t* group_sizes, int32_t* expert_counts,
                                               int32_t* total_rows, unsigned long long* dropped) {
  const int local = E / R;
  const int32_t* counts = reinterpret_cast<const int32_t*>(own + layout.counts);
  int32_t* base_row = reinterpret_cast<int32_t*>(own + layout.base_row);
  int32_t* limit = reinterpret_cast<int32_t*>(own + layout.limit);
  int32_t* seg_off = reinterpret_cast<int32_t*>(own + layout.seg_off);
  int32_t* seg_kept = reinterpret_cast<int32_t*>(own + layout.seg_kept);
  // Sums in registers, one shared atomic per warp: 64-bit shared atomicAdd is a CAS loop
  // (ATOMS.CAST.SPIN.64) in which the 32 lanes of a warp on one address serialise. Sums mod 2^64
  // (and total_rows mod 2^32) in any order: the results are those of the per-lane atomics.
  unsigned long long own_dropped = 0ull;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (!has_rank(active, me) || !has_rank(active, e / local)) {  // own pairs to expert e: nowhere
      const int32_t own_pairs = __ldcg(counts + static_cast<int64_t>(me) * E + e);
      own_dropped += static_cast<unsigned long long>(own_pairs);
    }
  }
  own_dropped = warp_sum(own_dropped);  // (warp-uniform: the skip below is too)
  if ((threadIdx.x & 31) == 0 && own_dropped != 0ull) atomicAdd(dropped, own_dropped);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int64_t carry = 0;  // rounded rows of the local experts before this group of 32
    unsigned long long lane_dropped = 0ull;  // this lane's capacity drops and rows
    uint32_t lane_rows = 0u;
    for (int j0 = 0; j0 < local; j0 += 32) {
      const int j = j0 + lane;
      const bool valid = j < local;
      const int64_t n = valid ? n_local[j] : 0;
      const int64_t rounded = round_up_i64(n, align);
      int64_t inclusive = rounded;
      for (int step = 1; step < 32; step <<= 1) {
        const int64_t up = __shfl_up_sync(kFullMask, inclusive, step);
        if (lane >= step) inclusive += up;
      }
      const int64_t offset = carry + inclusive - rounded;
      carry += __shfl_sync(kFullMask, inclusive, 31);
      if (!valid) continue;
      const int64_t offset_c = offset < C ? offset : C;
      const int64_t room = has_rank(active, me) ? C - offset_c : 0;
      const int64_t kept = n < room ? n : room;
      const int64_t size = round_up_i64(kept, align);
      group_sizes[j] = static_cast<int32_t>(size);
      expert_counts[j] = static_cast<int32_t>(kept);
      seg_off[j] = static_cast<int32_t>(offset_c);
      seg_kept[j] = static_cast<int32_t>(kept);
      lane_rows += static_cast<uint32_t>(size);
      lane_dropped += static_cast<unsigned long long>(n - kept);
    }
    lane_rows = warp_sum(lane_rows);
    lane_dropped = warp_sum(lane_dropped);
    if (lane == 0) {
      atomicAdd(total_rows, static_cast<int32_t>(lane_rows));
      atomicAdd(dropped, lane_dropped);
    }
  }
  __syncthreads();  // seg_off / seg_kept
  for (int i = threadIdx.x; i < R * local; i += blockDim.x) {
    const int s = i / local, j = i % local;
    int64_t before = 0;  // rows of local expert j from active sources before s
    for (int r = 0; r < s; ++r) {
      if (has_rank(active, r)) before += __ldcg(counts + static_cast<int64_t>(r) * E + me * local + j);
    }
    base_row[i] = static_cast<int32_t>(seg_off[j] + before);
    limit[i] = static_cast<int32_t>(seg_kept[j] - before);  // kept iff rank < limit (may be < 0)
  }
}

// The arguments of the notify kernel: the launch itself (passed by value) plus what it adds.
struct NotifyArgs : DispatchLaunch {
  OpFingerprint fp;
  int32_t experts_per_block;  // prep: experts per prep block
};

// The shared memory of the notify block (dynamic, over a prep block's): the call, the sums of
// segment_tables, then n_local [E_local] (expert-major).
struct NotifyShared {
  OpInfo info;
  unsigned long long dropped;
  int32_t total_rows;
};
constexpr size_t kNotifySharedBytes = (sizeof(NotifyShared) + 15) / 16 * 16;  // n_local from here
static_assert(sizeof(PrepShared) <= 48 * 1024 &&
                  kNotifySharedBytes + kMaxExperts * sizeof(int32_t) <= 48 * 1024,
              "the notify kernel's dynamic shared memory needs no opt-in");

// The notify block (every thread), after discovery: waits until the `blocks` prep blocks have
// arrived (SyncCounters::prep_blocks_done), acquires what they wrote (counts_local), and clears
// the counter for the next call: every prep block's add is in (the count says so) and the next
// dispatch's kernel runs after this one (stream order). Bounded like every wait: when no prep block
// arrives within the bound, the fault names the op and this rank (waited for itself: its own prep
// blocks did not come, e.g. a GPU shared with a kernel that holds every SM), with `blocks` expected
// and the count seen, then traps. The bound is 4x the peers', and restarts at each arrival: nothing
// but scheduling delays this device's own blocks, and a false fault would kill a healthy call (on
// the emulator's loaded CPUs, where the prep blocks run one after the other, one took over 3 s). In
// shrink mode every poll bumps this device's heartbeat, as a shrink-mode wait on a peer does, so a
// peer that waits for this rank's counts meanwhile takes it for alive (PollBound).
__device__ __forceinline__ void wait_prep_blocks(DeviceState* state, uint64_t blocks,
                                                 int32_t op_id, int32_t rank, bool shrink) {
  if (threadIdx.x == 0) {
    uint64_t* done = &state->sync.prep_blocks_done;
    PollBound bound{4 * state->tables.timeout_ns, 256};
    if (shrink) bound.state = state;  // (peer -1: the heartbeat only, no liveness check)
    for (uint64_t seen = 0;;) {  // seen: arrivals so far; each poll ends at the next arrival
      uint64_t observed, elapsed;
      if (!poll_flag(done, [blocks, seen](uint64_t v) { return v >= blocks || v > seen; }, bound,
                     &observed, &elapsed)) {
        record_fault_and_trap(state, kFaultTimeout, op_id, rank, rank, state->tables.slot, blocks,
                              observed, static_cast<int64_t>(elapsed), kFieldPrepBlocks);
      }
      if (observed >= blocks) break;
      seen = observed;
    }
    fence_acquire_sys();
    store_relaxed_sys(done, 0);
  }
  __syncthreads();  // thread 0's acquire is ordered before every thread's reads
}

// Expert-major notify (block 0): discovery, the counts exchange, then this rank's segments and
// tables (segment_tables), group_sizes, expert_counts, num_dropped, active, and the OpInfo of the
// later kernels.
__device__ __forceinline__ void notify_expert_major(const NotifyArgs& a, char* shared, int blocks) {
  NotifyShared& sh = *reinterpret_cast<NotifyShared*>(shared);
  // [E_local]: rows per local expert over the sources
  int32_t* n_local = reinterpret_cast<int32_t*>(shared + kNotifySharedBytes);
  OpInfo& info = sh.info;
  const OpFingerprint fp = a.fp;  // (a copy: a reference into the kernel's parameters would
                                  // copy all of them to local memory, for peer_call_differs)
  const int R = fp.ranks, E = fp.experts, C = fp.capacity, align = fp.alignment;
  const bool shrink = a.shrink != 0;
  DeviceState* state = a.state;
  const CommLayout& layout = a.layout;
  discover_group(state, a.rank, a.group, a.rank_mask, a.axis_slot, layout.total, fp, shrink, &info);
  wait_prep_blocks(state, blocks, kOpDispatch, info.rank, shrink);
  char* own = own_comm_buffer(state);
  exchange_counts(state, layout, info, R, E, kOpDispatch, shrink);
  if (threadIdx.x == 0) {
    sh.total_rows = 0;
    sh.dropped = 0ull;
  }
  __syncthreads();

  const int32_t* counts = reinterpret_cast<const int32_t*>(own + layout.counts);
  const int local = E / R;
  for (int j = threadIdx.x; j < local; j += blockDim.x) {
    int32_t n = 0;  // a masked rank's own row is in its table, but its pairs go nowhere
    for (int s = 0; s < R; ++s) {
      if (has_rank(info.active, s)) {
        n += __ldcg(counts + static_cast<int64_t>(s) * E + info.rank * local + j);
      }
    }
    n_local[j] = n;
  }
  __syncthreads();
  segment_tables(own, layout, n_local, info.active, info.rank, R, E, C, align, a.group_sizes,
                 a.expert_counts, &sh.total_rows, &sh.dropped);
  __syncthreads();
  if (a.active != nullptr && static_cast<int>(threadIdx.x) < R) {
    a.active[threadIdx.x] = has_rank(info.active, static_cast<int>(threadIdx.x)) ? 1 : 0;
  }
  if (threadIdx.x == 0) {
    *a.num_dropped = static_cast<int32_t>(sh.dropped);
    publish_op_info(state, layout, info, sh.total_rows);
  }
}

// Rank-major notify (block 0): discovery and the same counts exchange, with each rank's tokens per
// destination rank (keys E + r) after its expert counts; then, from its [R][E + R] table, the
// outputs tokens_per_rank (rows from each source) and tokens_per_expert (pairs per local expert;
// nothing drops), the first row here of every source (base_row[s]: the rows of earlier sources
// here; the receivers place the rows) and total_rows (rows received here). Rank masking: all of
// these count active sources only (a masked rank's own row is in its table: it receives nothing,
// itself included).
__device__ __forceinline__ void notify_rank_major(const NotifyArgs& a, char* shared, int blocks) {
  OpInfo& info = reinterpret_cast<NotifyShared*>(shared)->info;
  const OpFingerprint fp = a.fp;  // (a copy: a reference into the kernel's parameters would
                                  // copy all of them to local memory, for peer_call_differs)
  const int R = fp.ranks, E = fp.experts;
  DeviceState* state = a.state;
  const CommLayout& layout = a.layout;
  discover_group(state, a.rank, a.group, a.rank_mask, a.axis_slot, layout.total, fp,
                 a.shrink != 0, &info);
  wait_prep_blocks(state, blocks, kOpDispatchRankMajor, info.rank, a.shrink != 0);
  char* own = own_comm_buffer(state);
  const int keys = E + R;
  exchange_counts(state, layout, info, R, keys, kOpDispatchRankMajor, a.shrink != 0);
  __syncthreads();  // every rank's counts are here (each thread r < R waited for rank r's)
  const int me = info.rank;
  const int32_t* counts = reinterpret_cast<const int32_t*>(own + layout.counts);
  int32_t* base_row = reinterpret_cast<int32_t*>(own + layout.base_row);
  // source s's count of key k, 0 for a masked source
  const auto count = [&](int s, int k) {
    return has_rank(info.active, s) ? __ldcg(counts + static_cast<int64_t>(s) * keys + k) : 0;
  };
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    a.tokens_per_rank[r] = count(r, E + me);
    int32_t before = 0;
    for (int s = 0; s < r; ++s) before += count(s, E + me);
    base_row[r] = before;
  }
  const int local = E / R;
  for (int j = threadIdx.x; j < local; j += blockDim.x) {
    int32_t n = 0;
    for (int s = 0; s < R; ++s) n += count(s, me * local + j);
    a.expert_counts[j] = n;  // tokens_per_expert
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int s = 0; s < R; ++s) total += count(s, E + me);
    publish_op_info(state, layout, info, total);
  }
}

// The notify kernel: block 0 is the notify block (above), blocks 1.. are the prep blocks (one
// launch where prep and notify were two: ~2-4 us of launch gap and ramp at small batches, and the
// discovery, the call's start barrier, overlaps prep). Only block 0 waits for other blocks of the
// kernel (after its discovery, for the prep blocks' arrivals); the prep blocks wait for nothing.
// Why that cannot deadlock without co-residency (no cooperative launch, which CUDA graphs and
// XLA's stream would have to allow): a prep block, once resident, finishes in bounded time
// whatever else runs, and frees its SM; block 0 holds one block's worth of one SM, and the grid is
// at most num_blocks + 1 <= the SMs (DispatchLaunch::num_blocks < SMs), so the SMs other than
// block 0's take prep blocks as they come, and every prep block is eventually scheduled (one after
// the other at worst: no prep block needs another to be resident). Whether block 0 starts first or last does not
// matter: its wait only counts arrivals. Only other work holding every other SM indefinitely could
// starve the prep blocks (as it would starve any later kernel of the op); the wait is bounded
// (wait_prep_blocks), so that is a named fault, not a hang. The emulator runs block 0 alongside the prep blocks run one at a time
// (JAX_EP_LAUNCH_BLOCK0_WAITS), the weakest of these schedules.
template <int kSlots, bool kRankMajor>
__global__ void __launch_bounds__(kNotifyThreads) dispatch_notify_kernel(NotifyArgs a) {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);
  char* shared = reinterpret_cast<char*>(dynamic_shared);
  const int blocks = static_cast<int>(gridDim.x) - 1;  // prep blocks
  if (blockIdx.x != 0) {
    prep_block<kSlots>(a.state, a.layout, a.topk_idx, a.num_tokens, a.num_topk, a.num_experts,
                       a.num_ranks, a.experts_per_block, kRankMajor, a.is_token_in_rank,
                       static_cast<int>(blockIdx.x) - 1, blocks,
                       *reinterpret_cast<PrepShared*>(shared));
  } else if constexpr (kRankMajor) {
    notify_rank_major(a, shared, blocks);
  } else {
    notify_expert_major(a, shared, blocks);
  }
}

// ---- 3. pending (shrink mode only) ------------------------------------------------------------
// A row that no chunk has filled yet (shrink mode: src_index of every received row starts as this,
// so that the fixup kernel finds the rows of a source whose chunks never came).
constexpr int32_t kPendingRow = -3;

// src_index of the received rows (below total_rows) is kPendingRow. A kernel of its own between
// notify (total_rows) and main (whose receivers overwrite it row by row, in any block).
__global__ void __launch_bounds__(kRowsThreads)
    dispatch_pending_kernel(DeviceState* state, CommLayout layout, int32_t* __restrict__ src_index) {
  const char* own = own_comm_buffer(state);
  const int32_t total = reinterpret_cast<const OpInfo*>(own + layout.op_info)->total_rows;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < total;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    src_index[r] = kPendingRow;
  }
}

// ---- 4. main -------------------------------------------------------------------------------
// The launch itself (passed by value) plus the row sizes derived from it.
struct MainArgs : DispatchLaunch {
  int32_t x_row_bytes;  // H * sizeof(x)
  int32_t row_bytes;    // H * sizeof(row)
  int32_t num_scales;   // per row (0 unless FP8)

  __device__ const char* x_row(int64_t t) const {
    return static_cast<const char*>(x) + t * x_row_bytes;
  }
  __device__ char* row_at(int64_t r) const { return static_cast<char*>(rows) + r * row_bytes; }
};

// The part of a row a work item moves: slices [it.k0, it.k1) of the row (CommLayout::num_slices),
// bytes [lo, hi) of the row format, its elements [e0, e0 + n) and, for FP8, its scales
// [e0 / 128, + n / 128) (a slice is a whole number of kSliceBytes: of 128-channel groups).
struct RowSlice {
  int64_t lo, hi;
  int e0, n;
};
__device__ __forceinline__ RowSlice row_slice(const MainArgs& a, const ChunkSlices& it) {
  const int row_elem = a.row_bytes / a.hidden;  // bytes per element of the rows
  RowSlice rs;
  rs.lo = slice_begin(a.layout, it.k0);
  rs.hi = slice_end(a.layout, it.k1, a.row_bytes);
  rs.e0 = static_cast<int>(rs.lo / row_elem);
  rs.n = static_cast<int>((rs.hi - rs.lo) / row_elem);
  return rs;
}

// Slice rs of a row of x into the row format of the destinations: raw when the dtypes agree, else
// converted in registers. my_dst / my_scales: lane j's destination row and its scales (whole).
template <int kConv, bool kTma>
__device__ __forceinline__ void copy_x(const MainArgs& a, TmaWarp& tma, const char* x_row,
                                       const RowSlice& rs, uint32_t dst_mask, char* my_dst,
                                       float* my_scales, int lane) {
  char* dst = my_dst != nullptr ? my_dst + rs.lo : nullptr;
  float* scales = my_scales != nullptr ? my_scales + rs.e0 / kFp8Block : nullptr;
  const char* src = x_row + static_cast<int64_t>(rs.e0) * (a.x_row_bytes / a.hidden);
  if constexpr (kConv == kConvCopy) {
    warp_copy_row<kTma>(tma, src, rs.hi - rs.lo, dst_mask, dst, lane);
  } else if constexpr (kConv == kConvF32ToBF16) {
    // register copies: 2 steps per batch (4 spill there, two batches being alive)
    warp_copy_convert<true, kRowBF16, kTma ? 4 : 2, kTma>(src, rs.n, dst_mask, dst, scales, lane,
                                                          &tma);
  } else if constexpr (kConv == kConvBF16ToFP8) {
    // 4 steps per batch, the next batch's loads in flight meanwhile (warp_copy_convert)
    warp_copy_convert<false, kRowFP8, 4, kTma>(src, rs.n, dst_mask, dst, scales, lane, &tma);
  } else {
    warp_copy_convert<true, kRowFP8, 2, kTma>(src, rs.n, dst_mask, dst, scales, lane, &tma);
  }
}

// Slot `lane` of this rank's token t: its sanitised expert (-1: unused slot; sanitised here, from
// topk_idx), its rank among this rank's tokens of that expert (rank-major: of its destination
// rank; prep's slot_rank, meaningful for a used slot only) and its gate weight. Every lane calls it.
__device__ __forceinline__ void token_slot(const MainArgs& a, const char* own, int64_t t, int lane,
                                           int* expert, int* rank, float* weight) {
  const int K = a.num_topk;
  const bool slot = lane < K;
  const int64_t i = t * K + lane;
  const int32_t id = slot ? __ldg(a.topk_idx + i) : -1;
  *rank = slot ? __ldcg(reinterpret_cast<const int32_t*>(own + a.layout.slot_rank) + i) : -1;
  *weight = slot ? __ldg(a.topk_weights + i) : 0.f;
  *expert = sanitized_expert_warp(id, a.num_experts);
}

// Lane k's top-k slot of token t of source rank s as this rank receives it: the slot's number
// n = s*T + t, its local expert here (-1: not here) and gate weight (this rank's own tokens from x's
// routing, a peer's from the metadata it staged), and for this rank's own tokens (token_slot's) the
// slot's rank among them for that expert (-1 for a peer's: each receiver reads its own table).
struct SourceSlot {
  int64_t slot;
  int local;
  float weight;
  int own_rank;
};

__device__ __forceinline__ SourceSlot source_slot(const MainArgs& a, const DataWarp& d, int s,
                                                  int64_t t) {
  const int K = a.num_topk;
  SourceSlot r{static_cast<int64_t>(s) * a.num_tokens + t, -1, 0.f, -1};
  if (s == d.me) {
    int expert;
    token_slot(a, d.own, t, d.lane, &expert, &r.own_rank, &r.weight);
    const int experts_per_rank = a.num_experts / d.R;
    r.local = expert >= 0 && expert / experts_per_rank == d.me ? expert % experts_per_rank : -1;
  } else if (d.lane < K) {
    const int64_t meta = r.slot * K + d.lane;
    r.local = __ldcg(reinterpret_cast<const int32_t*>(d.own + a.layout.meta_rows) + meta);
    r.weight = __ldcg(reinterpret_cast<const float*>(d.own + a.layout.meta_w) + meta);
  }
  return r;
}

// Expert-major: the row here of source s's pair of local expert j (-1: none) whose rank among s's
// tokens of that expert is `rank`, from this rank's own tables: DROPPED past the room s has.
__device__ __forceinline__ int receive_row(const MainArgs& a, const char* own, int s, int j,
                                           int rank) {
  if (j < 0) return -1;
  const int64_t i = static_cast<int64_t>(s) * (a.num_experts / a.num_ranks) + j;
  const int32_t limit = __ldcg(reinterpret_cast<const int32_t*>(own + a.layout.limit) + i);
  return rank < limit ? __ldcg(reinterpret_cast<const int32_t*>(own + a.layout.base_row) + i) + rank
                      : -2;
}

// This rank's token t into the staging [me][t] of every remote rank in `ranks`, ONCE each (the
// row in the wire format, FP8 scales alongside); none to a rank that is not linked. Pulled
// (a.pull): once into this rank's own staging [me][t] if it goes to any of them, where they load
// it. Every lane calls it.
template <int kConv, bool kTma>
__device__ __forceinline__ void stage_token(const MainArgs& a, const DataWarp& d, TmaWarp& tma,
                                            int64_t t, const RowSlice& rs, uint32_t ranks) {
  const CommLayout& L = a.layout;
  const uint32_t remote = ranks & d.linked & ~(1u << d.me);
  if (remote == 0u) return;
  const int64_t slot = static_cast<int64_t>(d.me) * a.num_tokens + t;
  char* my_dst = nullptr;
  float* my_scales = nullptr;
  if (d.lane < d.R) {
    my_dst = d.lane_peer + L.stage_data + slot * L.data_row_bytes;
    my_scales = reinterpret_cast<float*>(d.lane_peer + L.stage_scales + slot * L.scale_row_bytes);
  }
  // (lane me's lane_peer is this rank's own buffer)
  copy_x<kConv, kTma>(a, tma, a.x_row(t), rs, a.pull ? 1u << d.me : remote, my_dst, my_scales,
                      d.lane);
}

// Senders: per (chunk, slice) item, every token's slot metadata to every other rank (the same
// values from each slice's item, so that any one slice's flag covers them), and the slice of each
// token routed to a remote rank ONCE into that rank's staging [me][t]; then the item's flags. Metadata per slot: the
// local expert there (or -1) and the gate weight; expert-major adds the slot's rank among this
// rank's tokens of its expert, rank-major per token its rank among this rank's tokens sent there
// (meta_pos, -1 none). The receiver places the rows from them.
template <int kConv, bool kTma, bool kRankMajor>
__device__ __forceinline__ void dispatch_send(const MainArgs& a, const DataWarp& d, TmaWarp& tma) {
  const CommLayout& L = a.layout;
  const int lane = d.lane;
  const int me = d.me;
  const int K = a.num_topk;
  const int experts_per_rank = a.num_experts / d.R;
  send_chunks<kTma>(L, d, a.num_tokens, true, [&](int64_t t, const ChunkSlices& it) {
    int expert, rank;
    float weight;
    token_slot(a, d.own, t, lane, &expert, &rank, &weight);
    const int local = expert >= 0 ? expert % experts_per_rank : -1;
    const int dest = expert >= 0 ? expert / experts_per_rank : -1;
    const int64_t slot = static_cast<int64_t>(me) * a.num_tokens + t;
    for (int r = 0; r < d.R; ++r) {
      char* peer = peer_buffer(d, r);
      if (peer == nullptr) continue;  // (warp-uniform) rank r is masked: nothing to it
      if constexpr (kRankMajor) {  // the token's rank among those sent to r: any of its slots'
        const uint32_t on_r = __ballot_sync(kFullMask, dest == r);
        const int rank_r = on_r != 0u ? __shfl_sync(kFullMask, rank, __ffs(on_r) - 1) : -1;
        if (r != me && lane == 0) reinterpret_cast<int32_t*>(peer + L.meta_pos)[slot] = rank_r;
      }
      if (r == me || lane >= K) continue;
      reinterpret_cast<int32_t*>(peer + L.meta_rows)[slot * K + lane] = dest == r ? local : -1;
      if (!kRankMajor && dest == r) {
        reinterpret_cast<int32_t*>(peer + L.meta_rank)[slot * K + lane] = rank;
      }
      reinterpret_cast<float*>(peer + L.meta_w)[slot * K + lane] = weight;
    }
    stage_token<kConv, kTma>(a, d, tma, t, row_slice(a, it),
                             __reduce_or_sync(kFullMask, dest >= 0 ? 1u << dest : 0u));
  });
}

// Receiver work item: the alignment padding of local expert `expert` is zero rows.
__device__ __forceinline__ void dispatch_zero_padding(const MainArgs& a, const DataWarp& d,
                                                      int expert) {
  const CommLayout& L = a.layout;
  const int32_t off = __ldcg(reinterpret_cast<const int32_t*>(d.own + L.seg_off) + expert);
  const int32_t kept = __ldcg(reinterpret_cast<const int32_t*>(d.own + L.seg_kept) + expert);
  const int64_t end = off + round_up_i64(kept, a.alignment);
  for (int64_t row = off + kept; row < end; ++row) {
    warp_zero(a.row_at(row), a.row_bytes, d.lane);
    for (int i = d.lane; i < a.num_scales; i += 32) a.scales[row * a.num_scales + i] = 0.f;
    if (d.lane == 0) {
      a.src_index[row] = -1;
      a.row_weights[row] = 0.f;
    }
  }
}

// Receiver work item: rows [item * kTailRows, ...) past total_rows (the unused tail) get their
// handle fields only (the rows stay unspecified).
__device__ __forceinline__ void dispatch_unused_tail(const MainArgs& a, int item, int total_rows,
                                                     int lane) {
  const int64_t lo = static_cast<int64_t>(item) * kTailRows;
  const int64_t r0 = lo > total_rows ? lo : total_rows;
  const int64_t r1 = lo + kTailRows < a.capacity ? lo + kTailRows : a.capacity;
  for (int64_t row = r0 + lane; row < r1; row += 32) {
    a.src_index[row] = -1;
    a.row_weights[row] = 0.f;
  }
}

// The FP8 scales of slice rs of a staged row to each receive row in `kept` (lane j holds row j's
// scales).
__device__ __forceinline__ void copy_staged_scales(const float* from, const RowSlice& rs,
                                                   uint32_t kept, float* my_scales, int lane) {
  const int first = rs.e0 / kFp8Block;
  const int end = first + rs.n / kFp8Block;
  for (int i0 = first; i0 < end; i0 += 32) {  // uniform trip count (shuffles)
    const int i = i0 + lane;
    const float value = i < end ? __ldcg(from + i) : 0.f;
    for (uint32_t m = kept; m != 0u; m &= m - 1u) {
      const int j = __ffs(m) - 1;
      float* to = reinterpret_cast<float*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_scales), j));
      if (i < end) to[i] = value;
    }
  }
}

// Slice rs of source s's token t to each receive row in `kept` (lane j holds row j and its scales):
// this rank's own tokens straight from x, the others' from the staging [s][t]: this rank's, or
// pulled (a.pull), s's own, over NVLink.
template <int kConv, bool kTma>
__device__ __forceinline__ void receive_token_row(const MainArgs& a, const DataWarp& d,
                                                  TmaWarp& tma, int s, int64_t t,
                                                  const RowSlice& rs, uint32_t kept, char* my_dst,
                                                  float* my_scales) {
  const CommLayout& L = a.layout;
  if (s == d.me) {
    copy_x<kConv, kTma>(a, tma, a.x_row(t), rs, kept, my_dst, my_scales, d.lane);
    return;
  }
  // (s is linked: its flags came; warp-uniform, every lane shuffles)
  const char* from = a.pull ? peer_buffer(d, s) : d.own;
  const int64_t slot = static_cast<int64_t>(s) * a.num_tokens + t;
  warp_copy_row<kTma>(tma, from + L.stage_data + slot * L.data_row_bytes + rs.lo, rs.hi - rs.lo,
                      kept, my_dst != nullptr ? my_dst + rs.lo : nullptr, d.lane);
  if (a.num_scales > 0) {
    copy_staged_scales(
        reinterpret_cast<const float*>(from + L.stage_scales + slot * L.scale_row_bytes), rs,
        kept, my_scales, d.lane);
  }
}

// Token t of source rank s: its handle fields (token_rows, row_weights, src_index: the item of the
// first slice writes them), and slice rs of its row to each receive row.
template <int kConv, bool kTma>
__device__ __forceinline__ void dispatch_receive_token(const MainArgs& a, const DataWarp& d,
                                                       TmaWarp& tma, int s, int64_t t,
                                                       const RowSlice& rs) {
  const int lane = d.lane;
  const int K = a.num_topk;
  const SourceSlot src = source_slot(a, d, s, t);
  const int64_t slot = src.slot;
  // the slot's rank among s's tokens of its local expert
  const int rank =
      s == d.me || src.local < 0
          ? src.own_rank
          : __ldcg(reinterpret_cast<const int32_t*>(d.own + a.layout.meta_rank) + slot * K + lane);
  const int row = receive_row(a, d.own, s, src.local, rank);
  if (rs.lo == 0) {
    if (lane < K) a.token_rows[slot * K + lane] = row;
    if (row >= 0) {
      a.row_weights[row] = src.weight;
      a.src_index[row] = static_cast<int32_t>(slot);
    }
  }
  const uint32_t kept = __ballot_sync(kFullMask, row >= 0);
  if (kept == 0u) return;
  char* my_dst = row >= 0 ? a.row_at(row) : nullptr;
  float* my_scales =
      row >= 0 && a.num_scales > 0 ? a.scales + static_cast<int64_t>(row) * a.num_scales : nullptr;
  receive_token_row<kConv, kTma>(a, d, tma, s, t, rs, kept, my_dst, my_scales);
}

// Receivers (dynamic work list): the local experts' alignment padding, the unused tail, then the
// chunks, this rank's own first, each remote one as soon as its flag arrives.
template <int kConv, bool kTma>
__device__ __forceinline__ void dispatch_receive(const MainArgs& a, const DataWarp& d,
                                                 TmaWarp& tma) {
  const CommLayout& L = a.layout;
  const int local_experts = a.num_experts / d.R;
  // widened: capacity + kTailRows - 1 wraps in int32 from C = 2^31 - 8191 (CheckAttrs admits C < 2^31)
  const int n_tail = static_cast<int>((static_cast<int64_t>(a.capacity) + kTailRows - 1) / kTailRows);
  const int n_chunk_items = chunk_items(L, true) * d.R;  // own items, then (item, other rank)
  const int total_rows = d.info->total_rows;
  for (;;) {
    int item = next_item(&d.info->work[1]);
    if (item >= local_experts + n_tail + n_chunk_items) break;
    if (item < local_experts) {
      dispatch_zero_padding(a, d, item);
      continue;
    }
    item -= local_experts;
    if (item < n_tail) {
      dispatch_unused_tail(a, item, total_rows, d.lane);
      continue;
    }
    item -= n_tail;
    int s;
    ChunkSlices it;
    if (!receive_chunk_item<kTma>(item, d.state, L, d.info, d.own, kOpDispatch, a.shrink != 0,
                                  true, d.lane, &s, &it) ||
        !has_rank(d.info->active, s)) {
      // a masked source (this rank's own chunks too, when it is masked), or in shrink mode one
      // whose chunk never came: none of its slots has a row here (NOT_ROUTED), as if it routed
      // nothing (the rows kept for them stay kPendingRow: the fixup kernel empties them); the
      // chunk's first slice's item writes it
      if (it.k0 != 0) continue;
      const int64_t base = static_cast<int64_t>(s) * a.num_tokens;
      const int64_t lo = (base + chunk_begin(L, it.c)) * a.num_topk;
      const int64_t hi = (base + chunk_end(L, it.c, a.num_tokens)) * a.num_topk;
      for (int64_t i = lo + d.lane; i < hi; i += 32) a.token_rows[i] = -1;
      continue;
    }
    for (int64_t t = chunk_begin(L, it.c); t < chunk_end(L, it.c, a.num_tokens); ++t) {
      dispatch_receive_token<kConv, kTma>(a, d, tma, s, t, row_slice(a, it));
    }
  }
}

// ---- rank-major receivers ------------------------------------------------------------------
// Receiver work item: rows [item * kEmptyRows, ...) past total_rows are empty: zero row and
// scales, ids -1, weights 0, src_index -1 (every row of the R * T is written).
__device__ __forceinline__ void dispatch_empty_rows(const MainArgs& a, int item, int total_rows,
                                                    int lane) {
  const int K = a.num_topk;
  const int64_t lo = static_cast<int64_t>(item) * kEmptyRows;
  const int64_t r0 = lo > total_rows ? lo : total_rows;
  const int64_t r1 = lo + kEmptyRows < a.capacity ? lo + kEmptyRows : a.capacity;
  for (int64_t row = r0; row < r1; ++row) {
    warp_zero(a.row_at(row), a.row_bytes, lane);
    for (int i = lane; i < a.num_scales; i += 32) a.scales[row * a.num_scales + i] = 0.f;
    for (int k = lane; k < K; k += 32) {
      a.row_ids[row * K + k] = -1;
      a.row_topk_weights[row * K + k] = 0.f;
    }
    if (lane == 0) a.src_index[row] = -1;
  }
}

// Token t of source rank s, if it came here: slice rs of its row (this rank's own tokens straight
// from x, the others' from the staging), and (the item of the first slice) its local expert ids,
// gate weights and src_index.
template <int kConv, bool kTma>
__device__ __forceinline__ void dispatch_rank_major_token(const MainArgs& a, const DataWarp& d,
                                                          TmaWarp& tma, int s, int64_t t,
                                                          const RowSlice& rs) {
  const CommLayout& L = a.layout;
  const int lane = d.lane;
  const int K = a.num_topk;
  const SourceSlot src = source_slot(a, d, s, t);
  int rank;  // the token's rank among s's tokens sent here (-1: it did not come here)
  if (s == d.me) {
    const uint32_t on_me = __ballot_sync(kFullMask, src.local >= 0);
    rank = on_me != 0u ? __shfl_sync(kFullMask, src.own_rank, __ffs(on_me) - 1) : -1;
  } else {
    rank = __ldcg(reinterpret_cast<const int32_t*>(d.own + L.meta_pos) + src.slot);
  }
  if (rank < 0) return;  // (warp-uniform) the token did not come here
  const int row = __ldcg(reinterpret_cast<const int32_t*>(d.own + L.base_row) + s) + rank;
  if (rs.lo == 0 && lane < K) {
    a.row_ids[static_cast<int64_t>(row) * K + lane] = src.local;
    a.row_topk_weights[static_cast<int64_t>(row) * K + lane] = src.local >= 0 ? src.weight : 0.f;
  }
  if (rs.lo == 0 && lane == 0) a.src_index[row] = static_cast<int32_t>(src.slot);
  char* my_dst = lane == 0 ? a.row_at(row) : nullptr;  // one destination: lane 0 names it
  float* my_scales =
      lane == 0 && a.num_scales > 0 ? a.scales + static_cast<int64_t>(row) * a.num_scales : nullptr;
  receive_token_row<kConv, kTma>(a, d, tma, s, t, rs, 1u, my_dst, my_scales);
}

// Rank-major receivers (dynamic work list): the empty rows past total_rows, then the chunks, this
// rank's own first, each remote one as soon as its flag arrives.
template <int kConv, bool kTma>
__device__ __forceinline__ void dispatch_rank_major_receive(const MainArgs& a, const DataWarp& d,
                                                            TmaWarp& tma) {
  const CommLayout& L = a.layout;
  const int n_empty = static_cast<int>((static_cast<int64_t>(a.capacity) + kEmptyRows - 1) / kEmptyRows);
  const int n_chunk_items = chunk_items(L, true) * d.R;  // own items, then (item, other rank)
  const int total_rows = d.info->total_rows;
  for (;;) {
    int item = next_item(&d.info->work[1]);
    if (item >= n_empty + n_chunk_items) break;
    if (item < n_empty) {
      dispatch_empty_rows(a, item, total_rows, d.lane);
      continue;
    }
    item -= n_empty;
    int s;
    ChunkSlices it;
    if (!receive_chunk_item<kTma>(item, d.state, L, d.info, d.own, kOpDispatchRankMajor,
                                  a.shrink != 0, true, d.lane, &s, &it) ||
        !has_rank(d.info->active, s)) {
      // a masked source (this rank's own chunks too, when it is masked): no rows here; in shrink
      // mode one whose chunk never came: its rows stay kPendingRow (the fixup kernel empties them)
      continue;
    }
    for (int64_t t = chunk_begin(L, it.c); t < chunk_end(L, it.c, a.num_tokens); ++t) {
      dispatch_rank_major_token<kConv, kTma>(a, d, tma, s, t, row_slice(a, it));
    }
  }
}

template <int kConv, bool kTma, bool kRankMajor>
__global__ void __launch_bounds__(kDataThreads, 1)
    dispatch_main_kernel(MainArgs a) {
  run_data_warps<kTma>(
      a.state, a.layout, a.send_warps,
      [&](const DataWarp& d, TmaWarp& tma) { dispatch_send<kConv, kTma, kRankMajor>(a, d, tma); },
      [&](const DataWarp& d, TmaWarp& tma) {
        if constexpr (kRankMajor) {
          dispatch_rank_major_receive<kConv, kTma>(a, d, tma);
        } else {
          dispatch_receive<kConv, kTma>(a, d, tma);
        }
      });
}

// ---- 5. fixup (shrink mode only) -------------------------------------------------------------
// After the main kernel, when it gave up on sources (OpInfo::missed: their chunks did not all
// come): the rows kept for what never came (still kPendingRow) become empty rows (zero rows and
// scales, src_index -1, weight 0; rank-major: ids -1) and leave the counts (expert_counts;
// rank-major: tokens_per_rank, tokens_per_expert recounted), the call's rank_mask output loses
// those sources, and num_dropped gets this rank's own pairs to them (they went to a rank that
// died). The lost source's own pairs are not counted here: lost with it, as a masked rank's.
// Grid-stride over the received rows, one warp per row.
__global__ void __launch_bounds__(kRowsThreads) dispatch_fixup_kernel(MainArgs a) {
  char* own = own_comm_buffer(a.state);
  const OpInfo* info = reinterpret_cast<const OpInfo*>(own + a.layout.op_info);
  const uint32_t lost = *reinterpret_cast<const volatile uint32_t*>(&info->missed);
  if (lost == 0u) return;
  const int R = a.num_ranks, E = a.num_experts, K = a.num_topk, me = info->rank;
  const int local = E / R;
  const int total = info->total_rows;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int32_t* counts = reinterpret_cast<const int32_t*>(own + a.layout.counts);
  const int32_t* base_row = reinterpret_cast<const int32_t*>(own + a.layout.base_row);
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + (threadIdx.x >> 5);
       row < total; row += warps) {
    // one load for the warp (lane 0 rewrites src_index below, while other lanes may still read)
    const int32_t src = __shfl_sync(kFullMask, lane == 0 ? __ldcg(a.src_index + row) : 0, 0);
    if (src != kPendingRow) continue;
    warp_zero(a.row_at(row), a.row_bytes, lane);
    for (int i = lane; i < a.num_scales; i += 32) a.scales[row * a.num_scales + i] = 0.f;
    if (a.rank_major) {
      for (int k = lane; k < K; k += 32) {
        a.row_ids[row * K + k] = -1;
        a.row_topk_weights[row * K + k] = 0.f;
      }
    }
    if (lane != 0) continue;
    a.src_index[row] = -1;
    if (a.rank_major) {  // the source whose rows these are: base_row[s] <= row < base_row[s] + n_s
      for (int s = R - 1; s >= 0; --s) {
        const int32_t n = has_rank(info->active, s) ? __ldcg(counts + s * (E + R) + E + me) : 0;
        if (n > 0 && __ldcg(base_row + s) <= row) {
          atomicAdd(a.tokens_per_rank + s, -1);
          break;
        }
      }
    } else {  // the local expert whose segment holds the row
      a.row_weights[row] = 0.f;
      const int32_t* seg_off = reinterpret_cast<const int32_t*>(own + a.layout.seg_off);
      for (int j = local - 1; j >= 0; --j) {
        if (__ldcg(seg_off + j) <= row) {
          atomicAdd(a.expert_counts + j, -1);
          break;
        }
      }
    }
  }
  if (blockIdx.x != 0) return;
  if (a.rank_major) {  // pairs per local expert over the rows that came (a hole's ids are unknown)
    for (int j = threadIdx.x; j < local; j += blockDim.x) a.expert_counts[j] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(total) * K; i += blockDim.x) {
      const int32_t id = __ldcg(a.row_ids + i);
      if (__ldcg(a.src_index + i / K) >= 0 && id >= 0 && id < local) atomicAdd(a.expert_counts + id, 1);
    }
  } else if (threadIdx.x == 0) {
    const int32_t* counts_local = reinterpret_cast<const int32_t*>(own + a.layout.counts_local);
    int32_t pairs = 0;  // this rank's own pairs to the lost ranks' experts
    for (int e = 0; e < E; ++e) pairs += has_rank(lost, e / local) ? __ldcg(counts_local + e) : 0;
    atomicAdd(a.num_dropped, pairs);
    if (a.active != nullptr) {
      for (int r = 0; r < R; ++r) {
        if (has_rank(lost, r)) a.active[r] = 0;
      }
    }
  }
}

template <int kConv, bool kRankMajor>
cudaError_t launch_main(const MainArgs& a, cudaStream_t stream) {
  if (a.use_tma) {
    const auto kernel = dispatch_main_kernel<kConv, true, kRankMajor>;
    JAX_EP_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kTmaSharedBytes));
    JAX_EP_LAUNCH(kernel, a.num_blocks, kDataThreads, kTmaSharedBytes, stream)(a);
  } else {
    const auto kernel = dispatch_main_kernel<kConv, false, kRankMajor>;
    JAX_EP_LAUNCH(kernel, a.num_blocks, kDataThreads, 0, stream)(a);
  }
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

template <int kConv>
cudaError_t launch_main_mode(const MainArgs& a, cudaStream_t stream) {
  const cudaError_t status =
      a.rank_major ? launch_main<kConv, true>(a, stream) : launch_main<kConv, false>(a, stream);
  JAX_EP_CUDA_RETURN(status);
  if (a.shrink != 0) {
    JAX_EP_LAUNCH(dispatch_fixup_kernel, a.num_blocks, kRowsThreads, 0, stream)(a);
    JAX_EP_CHECK_LAUNCH();
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_dispatch(const DispatchLaunch& p, cudaStream_t stream) {
  const bool fp8 = p.row_kind == kRowFP8;
  if (p.state == nullptr || p.num_tokens < 0 || p.num_topk < 1 || p.num_topk > kMaxTopk ||
      p.num_ranks < 1 || p.num_ranks > kMaxGroupRanks || p.num_experts < 1 ||
      p.num_experts > kMaxExperts || p.num_experts % p.num_ranks != 0 || p.hidden < kRowAlignment ||
      p.hidden % kRowAlignment != 0 || (fp8 && p.hidden % kFp8Block != 0) ||
      (p.rank_major ? p.capacity != p.num_ranks * p.num_tokens : p.capacity < 1) || p.alignment < 1 ||
      p.num_blocks < 1 || p.send_warps < 1 || p.send_warps >= kDataWarps || p.axis_slot < 0 ||
      p.axis_slot >= kDirectoryAxes || (p.x_kind != kRowBF16 && p.x_kind != kRowF32) ||
      (p.pull && p.shrink != 0)) {
    return cudaErrorInvalidValue;
  }
  int conversion;
  if (p.row_kind == p.x_kind) {
    conversion = kConvCopy;
  } else if (p.x_kind == kRowF32 && p.row_kind == kRowBF16) {
    conversion = kConvF32ToBF16;
  } else if (fp8) {
    conversion = p.x_kind == kRowBF16 ? kConvBF16ToFP8 : kConvF32ToFP8;
  } else {
    return cudaErrorInvalidValue;
  }

  const int E = p.num_experts;
  // prep: the experts spread over the blocks (rank-major's rank keys are in every block)
  const int spread = std::min(p.num_blocks, E);
  const int experts_per_block = std::min(kPrepMaxExperts, (E + spread - 1) / spread);
  const int prep_blocks = (E + experts_per_block - 1) / experts_per_block;
  const bool shrink = p.shrink != 0;
  NotifyArgs notify{p, dispatch_fingerprint(p), experts_per_block};
  // dynamic shared memory: a prep block's, or the notify block's (n_local: expert-major only)
  const size_t shared_bytes = std::max(
      sizeof(PrepShared),
      kNotifySharedBytes + (p.rank_major ? 0 : E / p.num_ranks * sizeof(int32_t)));
  // register slots per token: 8 cover the usual top-k (DeepSeek-V3: 8), 16 the wider ones without
  // spills (1024 threads leave 64 registers each; kMaxTopk spills)
  const auto pick = [&](auto s8, auto s16, auto sw) {
    return p.num_topk <= 8 ? s8 : p.num_topk <= 16 ? s16 : sw;
  };
  const auto kernel = p.rank_major
                          ? pick(dispatch_notify_kernel<8, true>, dispatch_notify_kernel<16, true>,
                                 dispatch_notify_kernel<kMaxTopk, true>)
                          : pick(dispatch_notify_kernel<8, false>, dispatch_notify_kernel<16, false>,
                                 dispatch_notify_kernel<kMaxTopk, false>);
  // block 0 notifies, blocks 1.. prep (dispatch_notify_kernel)
  JAX_EP_LAUNCH_BLOCK0_WAITS(kernel, prep_blocks + 1, kNotifyThreads, shared_bytes, stream)(notify);
  JAX_EP_CHECK_LAUNCH();

  if (shrink) {
    JAX_EP_LAUNCH(dispatch_pending_kernel, p.num_blocks, kRowsThreads, 0, stream)(
        p.state, p.layout, p.src_index);
    JAX_EP_CHECK_LAUNCH();
  }

  const MainArgs args{p, static_cast<int32_t>(dispatch_row_bytes(p.hidden, p.x_kind)),
                      static_cast<int32_t>(dispatch_row_bytes(p.hidden, p.row_kind)),
                      fp8 ? p.hidden / kFp8Block : 0};
  switch (conversion) {
    case kConvCopy:
      return launch_main_mode<kConvCopy>(args, stream);
    case kConvF32ToBF16:
      return launch_main_mode<kConvF32ToBF16>(args, stream);
    case kConvBF16ToFP8:
      return launch_main_mode<kConvBF16ToFP8>(args, stream);
    default:
      return launch_main_mode<kConvF32ToFP8>(args, stream);
  }
}

}  // namespace jax_ep
