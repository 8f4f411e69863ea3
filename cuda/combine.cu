// Throughput combine over NVLink, plus broadcast and slot_values (backward passes).
//
// combine: a one-block start kernel (group discovery = the start barrier of the call), then one
// data kernel whose warps stream their rows through a cp.async ring (see below) and are either
//   reducers: for every token another rank s sent here, the float32 sum over its top-k slots (in
//     slot order) of w * y[row], rounded to y's dtype, written ONCE into rank s's staging
//     [me][t] over NVLink (16-byte stores); a release flag per (chunk, rank s);
//   finalisers: per chunk of this rank's tokens, wait for the flags of every other rank, then
//     out[t] = sum over ranks in rank order (float32) of the partial sums, this rank's own
//     partial computed in place from y (never staged), rounded to y's dtype.
// Exactly jax_ep.reference.combine's summation order.
//
// broadcast: start kernel, then senders copy g[t] once to every remote rank the token went to,
// receivers zero the rows whose src_index is -1 and copy each token (own tokens straight from g,
// remote ones when their chunk flag arrives) to each of its receive rows (token_rows).
//
// slot_values: one block: discovery, [T, K] values per rank into the source's staging, a group
// barrier, sum over ranks.
#include "cuda/combine.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

constexpr int kStartThreads = 64;
constexpr int kSlotValuesThreads = 1024;
constexpr int kZeroRows = 256;  // broadcast: rows per zero-fill work item
static_assert(kStartThreads >= kMaxDevices && kStartThreads >= kMaxGroupRanks, "discovery");

__global__ void __launch_bounds__(kStartThreads)
    ep_start_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                    const int32_t* group_ptr, int R, int axis_slot, int op_id) {
  __shared__ OpInfo info;
  discover_group(state, rank_ptr, group_ptr, R, axis_slot, op_id, layout.total, &info);
  if (threadIdx.x == 0) publish_op_info(state, layout, info, 0);
}

// ---- combine ---------------------------------------------------------------------------------
// Each warp streams the rows it reduces through a per-lane ring of cp.async copies in shared
// memory (cp.async): a piece is 1.5 KiB of one row (48 bytes per lane), and every lane always has
// kCombineRing pieces in flight, so a warp keeps ~10 KiB of loads outstanding instead of waiting
// for one short batch after another. The order of pieces is fixed (token, step of 1.5 KiB of the
// row, then the token's rows in slot order, then for finalisers the staged partials of the other
// ranks in rank order), and each lane reads back only the bytes it loaded itself, so the ring
// needs no barrier: cp.async.wait_group suffices. The kernel is bound by instruction issue
// (Nsight Compute on H100: IPC 1.9, DRAM 19%), so the per-piece bookkeeping is kept small and the
// arithmetic is one conversion and one FMA per element and row. (Bulk TMA copies of 1 KiB pieces,
// and a block-wide TMA pipeline of whole rows, both measured slower on H200 at 24 SMs.)
constexpr int kCombineVecs = 3;                 // 16-byte vectors per lane and piece (4 spills)
constexpr int kStepBytes = 512 * kCombineVecs;  // a piece: one step of a row (1.5 KiB)
constexpr int kCombineRing = 7;                 // pieces in flight per lane

struct CombineArgs {
  CommLayout layout;
  const char* y;
  const float* row_weights;  // null: unweighted
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  char* out;
  int32_t T, K;
  int32_t row_bytes;     // hidden * sizeof(y)
  int32_t reduce_warps;
  int32_t list_stride;   // entries per token list: K + R
};

// Shared memory of one warp: the ring, the chunk's token_rows (then the rows' weights, in the same
// place), the row lists and four per-token counts.
__host__ __device__ constexpr int64_t combine_warp_shared_bytes(int list_stride, int topk) {
  return static_cast<int64_t>(kCombineRing) * kStepBytes +
         static_cast<int64_t>(kChunkTokens) * topk * 4 +
         static_cast<int64_t>(kChunkTokens) * list_stride * 4 + 4 * kChunkTokens * 4;
}
// The largest top-k and group still fit an SM (227 KiB of shared memory per block on sm_90).
static_assert(kDataWarps * combine_warp_shared_bytes(kMaxTopk + kMaxGroupRanks, kMaxTopk) <=
                  232448,
              "combine's shared memory must fit every supported top-k and group size");

struct CombineWarp {
  char* ring;         // [kCombineRing][1.5 KiB]: lane l owns bytes 16 l + 512 j, j < kCombineVecs
  int32_t* raw;       // [kChunkTokens][K]: token_rows of the chunk, until the lists are built
  float* weights;     // [kChunkTokens][K]: then the gate weight of each y row (raw's place)
  int32_t* entries;   // [kChunkTokens][stride]: y row (>= 0) or -1 - r (rank r's staged partial)
  int32_t* n_own;     // [kChunkTokens]: y rows of the token
  int32_t* n_all;     // [kChunkTokens]: y rows + staged partials
  int32_t* in_mask;   // [kChunkTokens]: ranks the token went to (finalisers)
  int32_t* active;    // [kChunkTokens]: the token has an output row (reducers: sent here)
};

template <bool kF32>
struct Piece {
  static constexpr int kPerVec = kF32 ? 4 : 8;             // elements per 16-byte vector
  static constexpr int kElems = kCombineVecs * kPerVec;    // elements per lane and piece
};

// A lane's share of step s: the 16-byte vectors at s * 1.5 KiB + lane * 16 + 512 j, so that each
// copy or store instruction of the warp covers 512 contiguous bytes.
__device__ __forceinline__ int64_t piece_offset(int s, int lane) {
  return static_cast<int64_t>(s) * kStepBytes + lane * 16;
}

// Loads a lane's share of a piece, `src` = row + piece_offset, into its place of a ring slot
// (`dst` = slot + lane * 16); only the bytes inside the row (`left` = row_bytes - piece_offset).
__device__ __forceinline__ void issue_piece(char* dst, const char* src, int64_t left) {
#pragma unroll
  for (int j = 0; j < kCombineVecs; ++j) {
    if (512 * j < left) cp_async_16(dst + 512 * j, src + 512 * j);
  }
}

// Vector j of this lane's share of ring slot `slot`, as floats.
template <bool kF32>
__device__ __forceinline__ void ring_vector(const CombineWarp& w, uint32_t slot, int lane, int j,
                                            float f[Piece<kF32>::kPerVec]) {
  const uint4 v = *reinterpret_cast<const uint4*>(w.ring + slot * kStepBytes + lane * 16 + 512 * j);
  if constexpr (kF32) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  } else {
    unpack_bf16x8(v, f);
  }
}

template <bool kF32>
__device__ __forceinline__ void write_piece(char* row, int64_t offset, int64_t row_bytes,
                                            const float f[Piece<kF32>::kElems]) {
  constexpr int kP = Piece<kF32>::kPerVec;
#pragma unroll
  for (int j = 0; j < kCombineVecs; ++j) {
    uint4 v;
    if constexpr (kF32) {
      v = make_uint4(__float_as_uint(f[kP * j]), __float_as_uint(f[kP * j + 1]),
                     __float_as_uint(f[kP * j + 2]), __float_as_uint(f[kP * j + 3]));
    } else {
      v = pack_bf16x8(f + kP * j);
    }
    if (offset + 512 * j < row_bytes) *reinterpret_cast<uint4*>(row + offset + 512 * j) = v;
  }
}

// The piece stream of one chunk: `issue` loads the next piece (token tt, step s, entry i) into the
// ring and commits one cp.async group (empty once the stream is exhausted), so that exactly one
// group per consumed piece keeps the count of outstanding groups fixed.
struct PieceStream {
  int tt, s, i;           // next piece to issue
  int n;                  // pieces per step of token tt (its rows and staged partials)
  int64_t offset;         // piece_offset(s, lane)
  uint32_t issue_slot;    // ring slot of the next piece issued
  uint32_t consume_slot;  // ring slot of the next piece consumed (each chunk drains the ring)
};

template <bool kF32>
__global__ void __launch_bounds__(kDataThreads, 1)
    combine_main_kernel(DeviceState* state, CombineArgs a) {
  constexpr int kE = Piece<kF32>::kElems;
  constexpr int kP = Piece<kF32>::kPerVec;
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const CommLayout& L = a.layout;
  char* own = own_comm_buffer(state);
  OpInfo* info = reinterpret_cast<OpInfo*>(own + L.op_info);
  const int me = info->rank;
  const int R = info->size;
  const uint64_t expected = info->expected;
  const int64_t T = a.T;
  const int K = a.K;
  const int stride = a.list_stride;
  const bool weighted = a.row_weights != nullptr;
  const int64_t row_bytes = a.row_bytes;
  const int steps = static_cast<int>((row_bytes + kStepBytes - 1) / kStepBytes);
  const bool reducer = warp < a.reduce_warps;
  char* lane_peer = lane < R ? comm_buffer_of(state, info->ordinals[lane]) : nullptr;

  CombineWarp w;
  {
    char* base =
        reinterpret_cast<char*>(dynamic_shared) + warp * combine_warp_shared_bytes(stride, K);
    w.ring = base;
    w.raw = reinterpret_cast<int32_t*>(base + kCombineRing * kStepBytes);
    w.weights = reinterpret_cast<float*>(w.raw);
    w.entries = w.raw + kChunkTokens * K;
    w.n_own = w.entries + kChunkTokens * stride;
    w.n_all = w.n_own + kChunkTokens;
    w.in_mask = w.n_all + kChunkTokens;
    w.active = w.in_mask + kChunkTokens;
  }


  const int n_items = reducer ? L.num_chunks * (R - 1) : L.num_chunks;
  uint32_t* counter = &info->work[reducer ? 0 : 1];
  for (;;) {
    const int item = next_item(counter);
    if (item >= n_items) break;
    int c, s_rank;  // chunk; reducers: the rank whose tokens these are
    if (reducer) {
      c = item / (R - 1);
      s_rank = other_rank(item % (R - 1), me);
    } else {
      c = item;
      s_rank = me;
    }
    const int64_t t0 = static_cast<int64_t>(c) * kChunkTokens;
    const int n_tok = static_cast<int>(chunk_end(c, T) - t0);

    // ---- the chunk's lists ----
    int32_t* raw = w.raw;
    const int32_t* rows_src = a.token_rows + (static_cast<int64_t>(s_rank) * T + t0) * K;
    for (int f = lane; f < n_tok * K; f += 32) raw[f] = __ldg(rows_src + f);
    if (!reducer) {
      if (lane < R && lane != me) {  // the other ranks' partials of this chunk have arrived
        wait_flag_equal(reinterpret_cast<const uint64_t*>(own + L.chunk_flags) +
                            (static_cast<int64_t>(lane) * L.num_chunks + c),
                        expected, state, kOpCombine, me, lane, info->ordinals[lane]);
      }
      if (lane < n_tok) {
        int32_t mask = 0;
        for (int r = 0; r < R; ++r) mask |= a.is_token_in_rank[(t0 + lane) * R + r] ? 1 << r : 0;
        w.in_mask[lane] = mask;
      }
    }
    __syncwarp();
    for (int tt = 0; tt < n_tok; ++tt) {
      const int32_t row = lane < K ? raw[tt * K + lane] : -1;
      const uint32_t valid = __ballot_sync(kFullMask, row >= 0);
      const int n = __popc(valid);
      if (row >= 0) w.entries[tt * stride + __popc(valid & lanemask_lt())] = row;
      if (reducer) {
        const bool sent = __any_sync(kFullMask, row != -1);  // rank s_rank reads its partial
        if (lane == 0) {
          w.n_own[tt] = n;
          w.n_all[tt] = sent ? n : 0;
          w.active[tt] = sent ? 1 : 0;
        }
      } else {
        const int32_t mask = w.in_mask[tt];
        const int32_t remote = mask & ~(1 << me);
        if (lane < R && ((remote >> lane) & 1)) {
          w.entries[tt * stride + n + __popc(remote & static_cast<int32_t>(lanemask_lt()))] =
              -1 - lane;
        }
        if (lane == 0) {
          w.n_own[tt] = n;
          w.n_all[tt] = n + __popc(remote);
          w.active[tt] = 1;
        }
      }
    }
    __syncwarp();
    for (int f = lane; f < n_tok * K; f += 32) {  // token_rows are read: weights take their place
      const int tt = f / K;
      const int i = f - tt * K;
      if (i < w.n_own[tt]) {
        w.weights[f] = weighted ? __ldg(a.row_weights + w.entries[tt * stride + i]) : 1.f;
      }
    }
    __syncwarp();

    // ---- the piece stream ----
    // The stream's cursor is kept in registers: an issue costs one shared load (the entry), the
    // row address and the copies (the kernel is bound by instruction issue).
    PieceStream ps{0, 0, 0, 0, piece_offset(0, lane), 0, 0};
    auto next_token = [&](int tt) {
      while (tt < n_tok && w.n_all[tt] == 0) ++tt;
      ps.tt = tt;
      ps.n = tt < n_tok ? w.n_all[tt] : 0;
    };
    next_token(0);
    char* const ring_lane = w.ring + lane * 16;
    auto issue = [&]() {
      if (ps.tt < n_tok) {
        const int32_t e = w.entries[ps.tt * stride + ps.i];
        const char* row;
        if (e >= 0) {
          row = a.y + static_cast<int64_t>(e) * row_bytes;
        } else {
          row = own + L.stage_data +
                (static_cast<int64_t>(-1 - e) * T + t0 + ps.tt) * L.data_row_bytes;
        }
        issue_piece(ring_lane + ps.issue_slot * kStepBytes, row + ps.offset, row_bytes - ps.offset);
        ps.issue_slot = ps.issue_slot + 1 == kCombineRing ? 0 : ps.issue_slot + 1;
        if (++ps.i == ps.n) {
          ps.i = 0;
          ps.offset += kStepBytes;
          if (++ps.s == steps) {
            ps.s = 0;
            ps.offset = piece_offset(0, lane);
            next_token(ps.tt + 1);
          }
        }
      }
      cp_async_commit();
    };
    auto pop = [&]() {  // ring slot of the next piece, once it has landed
      cp_async_wait<kCombineRing - 1>();
      const uint32_t slot = ps.consume_slot;
      ps.consume_slot = slot + 1 == kCombineRing ? 0 : slot + 1;
      return slot;
    };
    for (int k = 0; k < kCombineRing; ++k) issue();

    for (int tt = 0; tt < n_tok; ++tt) {
      if (!w.active[tt]) continue;
      const int n_own = w.n_own[tt];
      const int32_t mask = reducer ? 0 : w.in_mask[tt];
      const float* weights = w.weights + tt * K;
      char* dst = reducer ? reinterpret_cast<char*>(__shfl_sync(
                                kFullMask, reinterpret_cast<unsigned long long>(lane_peer), s_rank)) +
                                L.stage_data + (static_cast<int64_t>(me) * T + t0 + tt) *
                                                   L.data_row_bytes
                          : a.out + (t0 + tt) * row_bytes;
      for (int s = 0; s < steps; ++s) {
        // this rank's partial: sum over its rows in slot order of w * y (as the reference; an
        // unweighted sum has w = 1, and fma(f, 1, acc) is acc + f exactly)
        float acc[kE];
        if (n_own == 0) {  // (a finaliser's token not routed here)
#pragma unroll
          for (int i = 0; i < kE; ++i) acc[i] = 0.f;
        } else {  // the first row: fma(f, w, +0), exactly as from acc = 0
          const uint32_t slot = pop();
          const float w0 = weights[0];
#pragma unroll
          for (int v = 0; v < kCombineVecs; ++v) {
            float f[kP];
            ring_vector<kF32>(w, slot, lane, v, f);
#pragma unroll
            for (int i = 0; i < kP; ++i) acc[kP * v + i] = __fmaf_rn(f[i], w0, 0.f);
          }
          issue();
        }
        for (int j = 1; j < n_own; ++j) {
          const uint32_t slot = pop();
          const float wj = weights[j];
#pragma unroll
          for (int v = 0; v < kCombineVecs; ++v) {
            float f[kP];
            ring_vector<kF32>(w, slot, lane, v, f);
#pragma unroll
            for (int i = 0; i < kP; ++i) acc[kP * v + i] = __fmaf_rn(f[i], wj, acc[kP * v + i]);
          }
          issue();
        }
        const int64_t offset = piece_offset(s, lane);
        if (reducer) {
          write_piece<kF32>(dst, offset, row_bytes, acc);  // rounds to y's dtype
          continue;
        }
        // out = sum over ranks in rank order of the partials, own partial rounded like the others
        if constexpr (!kF32) {
#pragma unroll
          for (int i = 0; i < kE; ++i) acc[i] = __bfloat162float(__float2bfloat16_rn(acc[i]));
        }
        float total[kE];
        for (int r = 0; r < R; ++r) {
          if (r == me) {
#pragma unroll
            for (int i = 0; i < kE; ++i) total[i] = r == 0 ? acc[i] : __fadd_rn(total[i], acc[i]);
          } else if ((mask >> r) & 1) {
            const uint32_t slot = pop();
#pragma unroll
            for (int v = 0; v < kCombineVecs; ++v) {
              float f[kP];
              ring_vector<kF32>(w, slot, lane, v, f);
#pragma unroll
              for (int i = 0; i < kP; ++i) {
                total[kP * v + i] = r == 0 ? f[i] : __fadd_rn(total[kP * v + i], f[i]);
              }
            }
            issue();
          } else {
#pragma unroll
            for (int i = 0; i < kE; ++i) total[i] = r == 0 ? 0.f : __fadd_rn(total[i], 0.f);
          }
        }
        write_piece<kF32>(dst, offset, row_bytes, total);
      }
    }
    cp_async_wait<0>();
    __syncwarp();  // every lane's stores of the chunk are done
    if (reducer && lane == 0) {
      char* peer = comm_buffer_of(state, info->ordinals[s_rank]);
      store_release_sys(reinterpret_cast<uint64_t*>(peer + L.chunk_flags) +
                            (static_cast<int64_t>(me) * L.num_chunks + c),
                        expected);
    }
  }
}

// ---- broadcast -------------------------------------------------------------------------------
struct BroadcastArgs {
  CommLayout layout;
  const char* g;
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  const int32_t* src_index;
  char* out;
  int32_t T, K, C;
  int32_t row_bytes;
  int32_t send_warps;
};

template <bool kTma>
__global__ void __launch_bounds__(kDataThreads, 1)
    broadcast_main_kernel(DeviceState* state, BroadcastArgs a) {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);  // TMA: per-warp barriers and buffers
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  TmaWarp tma{};
  if constexpr (kTma) tma = tma_warp_setup(reinterpret_cast<char*>(dynamic_shared), warp, lane);
  auto copy_raw = [&](const char* src, uint32_t dst_mask, char* my_dst) {
    if constexpr (kTma) {
      warp_copy_tma(tma, src, a.row_bytes, dst_mask, my_dst, lane);
    } else {
      warp_copy_raw<8>(src, a.row_bytes, dst_mask, my_dst, lane);
    }
  };
  const CommLayout& L = a.layout;
  char* own = own_comm_buffer(state);
  OpInfo* info = reinterpret_cast<OpInfo*>(own + L.op_info);
  const int me = info->rank;
  const int R = info->size;
  const uint64_t expected = info->expected;
  const int64_t T = a.T;
  char* lane_peer = lane < R ? comm_buffer_of(state, info->ordinals[lane]) : nullptr;

  if (warp < a.send_warps) {
    for (;;) {
      const int c = next_item(&info->work[0]);
      if (c >= L.num_chunks) break;
      for (int64_t t = static_cast<int64_t>(c) * kChunkTokens; t < chunk_end(c, T); ++t) {
        const bool to_peer = lane < R && lane != me && a.is_token_in_rank[t * R + lane];
        const uint32_t remote = __ballot_sync(kFullMask, to_peer);
        if (remote == 0u) continue;
        char* my_dst = to_peer ? lane_peer + L.stage_data +
                                     (static_cast<int64_t>(me) * T + t) * L.data_row_bytes
                               : nullptr;
        copy_raw(a.g + t * a.row_bytes, remote, my_dst);
      }
      release_chunk<kTma>(L, lane_peer, c, me, R, expected, lane);
    }
    if constexpr (kTma) {
      if (lane == 0) tma_store_wait_all();
    }
    return;
  }

  const int n_zero = (a.C + kZeroRows - 1) / kZeroRows;
  const int n_chunk_items = L.num_chunks * R;  // own chunks, then (chunk, other rank) pairs
  for (;;) {
    int item = next_item(&info->work[1]);
    if (item >= n_zero + n_chunk_items) break;
    if (item < n_zero) {  // rows no token landed on are zero
      const int64_t lo = static_cast<int64_t>(item) * kZeroRows;
      const int64_t hi = lo + kZeroRows < a.C ? lo + kZeroRows : a.C;
      for (int64_t row0 = lo; row0 < hi; row0 += 32) {
        const int64_t row = row0 + lane;
        const bool empty = row < hi && __ldg(a.src_index + row) < 0;
        for (uint32_t m = __ballot_sync(kFullMask, empty); m != 0u; m &= m - 1u) {
          warp_zero(a.out + (row0 + __ffs(m) - 1) * a.row_bytes, a.row_bytes, lane);
        }
      }
      continue;
    }
    item -= n_zero;
    int s, c;
    receive_chunk_item<kTma>(item, state, L, info, own, kOpBroadcast, lane, &s, &c);
    for (int64_t t = static_cast<int64_t>(c) * kChunkTokens; t < chunk_end(c, T); ++t) {
      const int64_t slot = static_cast<int64_t>(s) * T + t;
      const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
      const uint32_t kept = __ballot_sync(kFullMask, row >= 0);
      if (kept == 0u) continue;
      char* my_dst = row >= 0 ? a.out + static_cast<int64_t>(row) * a.row_bytes : nullptr;
      const char* src = s == me ? a.g + t * a.row_bytes : own + L.stage_data + slot * L.data_row_bytes;
      copy_raw(src, kept, my_dst);
    }
  }
  if constexpr (kTma) {
    if (lane == 0) tma_store_wait_all();
  }
}

// ---- slot_values -----------------------------------------------------------------------------
__global__ void __launch_bounds__(kSlotValuesThreads)
    slot_values_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                       const int32_t* group_ptr, int R, int axis_slot, const float* values,
                       const int32_t* token_rows, int T, int K, float* out) {
  __shared__ OpInfo info;
  __shared__ PeerGroup group;
  discover_group(state, rank_ptr, group_ptr, R, axis_slot, kOpSlotValues, layout.total, &info);
  const int me = info.rank;
  if (threadIdx.x == 0) {
    group.size = R;
    group.my_rank = me;
    for (int r = 0; r < kMaxGroupRanks; ++r) group.ordinals[r] = r < R ? info.ordinals[r] : -1;
  }
  const int64_t per_rank = static_cast<int64_t>(T) * K;
  // token_rows is [R * T, K]: element i belongs to source rank i / (T * K).
  for (int64_t i = threadIdx.x; i < R * per_rank; i += blockDim.x) {
    const int s = static_cast<int>(i / per_rank);
    const int32_t row = __ldg(token_rows + i);
    const float value = row >= 0 ? __ldg(values + row) : 0.f;
    char* peer = comm_buffer_of(state, info.ordinals[s]);
    reinterpret_cast<float*>(peer + layout.meta_w)[me * per_rank + (i - s * per_rank)] = value;
  }
  __threadfence_system();
  group_barrier_block(state, group, kOpSlotValues);  // starts with __syncthreads
  const float* staged = reinterpret_cast<const float*>(own_comm_buffer(state) + layout.meta_w);
  for (int64_t j = threadIdx.x; j < per_rank; j += blockDim.x) {
    float acc = 0.f;  // jnp.sum over ranks: 0 + v_0 + v_1 + ...
    for (int r = 0; r < R; ++r) acc = __fadd_rn(acc, __ldcg(staged + r * per_rank + j));
    out[j] = acc;
  }
}

bool group_launch_ok(const GroupLaunch& g) {
  return g.state != nullptr && g.num_ranks >= 1 && g.num_ranks <= kMaxGroupRanks &&
         g.num_tokens >= 0 && g.num_topk >= 1 && g.num_topk <= kMaxTopk && g.axis_slot >= 0 &&
         g.axis_slot < kDirectoryAxes && g.num_blocks >= 1 && g.send_warps >= 1 &&
         g.send_warps < kDataWarps;
}

cudaError_t launch_start(const GroupLaunch& g, int op_id, cudaStream_t stream) {
  JAX_EP_LAUNCH(ep_start_kernel, 1, kStartThreads, 0, stream)(g.state, g.layout, g.rank, g.group,
                                                    g.num_ranks, g.axis_slot, op_id);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_combine(const GroupLaunch& g, const void* y, const float* row_weights,
                           const int32_t* token_rows, const bool* is_token_in_rank, int32_t hidden,
                           int32_t y_kind, void* out, cudaStream_t stream) {
  if (!group_launch_ok(g) || hidden < 8 || hidden % 8 != 0 ||
      (y_kind != kRowBF16 && y_kind != kRowF32)) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_CUDA_RETURN(launch_start(g, kOpCombine, stream));
  CombineArgs a;
  a.layout = g.layout;
  a.y = static_cast<const char*>(y);
  a.row_weights = row_weights;
  a.token_rows = token_rows;
  a.is_token_in_rank = is_token_in_rank;
  a.out = static_cast<char*>(out);
  a.T = g.num_tokens;
  a.K = g.num_topk;
  a.row_bytes = hidden * (y_kind == kRowF32 ? 4 : 2);
  a.reduce_warps = g.send_warps;
  a.list_stride = g.num_topk + g.num_ranks;
  const int shared_bytes =
      static_cast<int>(kDataWarps * combine_warp_shared_bytes(a.list_stride, a.K));
  const auto kernel = y_kind == kRowF32 ? combine_main_kernel<true> : combine_main_kernel<false>;
  JAX_EP_CUDA_RETURN(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  JAX_EP_LAUNCH(kernel, g.num_blocks, kDataThreads, shared_bytes, stream)(g.state, a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             void* out, cudaStream_t stream) {
  if (!group_launch_ok(g) || hidden < 8 || hidden % 8 != 0 || capacity < 1 ||
      (g_kind != kRowBF16 && g_kind != kRowF32)) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_CUDA_RETURN(launch_start(g, kOpBroadcast, stream));
  BroadcastArgs a;
  a.layout = g.layout;
  a.g = static_cast<const char*>(grad);
  a.token_rows = token_rows;
  a.is_token_in_rank = is_token_in_rank;
  a.src_index = src_index;
  a.out = static_cast<char*>(out);
  a.T = g.num_tokens;
  a.K = g.num_topk;
  a.C = capacity;
  a.row_bytes = hidden * (g_kind == kRowF32 ? 4 : 2);
  a.send_warps = g.send_warps;
  if (use_tma) {
    JAX_EP_CUDA_RETURN(cudaFuncSetAttribute(broadcast_main_kernel<true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kTmaSharedBytes));
    JAX_EP_LAUNCH(broadcast_main_kernel<true>, g.num_blocks, kDataThreads, kTmaSharedBytes,
                  stream)(g.state, a);
  } else {
    JAX_EP_LAUNCH(broadcast_main_kernel<false>, g.num_blocks, kDataThreads, 0, stream)(g.state, a);
  }
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_slot_values(const GroupLaunch& g, const float* values,
                               const int32_t* token_rows, float* out, cudaStream_t stream) {
  if (!group_launch_ok(g)) return cudaErrorInvalidValue;
  JAX_EP_LAUNCH(slot_values_kernel, 1, kSlotValuesThreads, 0, stream)(g.state, g.layout, g.rank, g.group,
                                                            g.num_ranks, g.axis_slot, values,
                                                            token_rows, g.num_tokens, g.num_topk,
                                                            out);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
