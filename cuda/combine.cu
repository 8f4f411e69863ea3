// Throughput combine over NVLink (see combine.h): the start kernel (group.cu), then one data
// kernel whose warps stream their rows through a cp.async ring (see below) and are either
//   reducers: for every token another rank s sent here, the float32 sum over its top-k slots (in
//     slot order) of w * y[row], rounded to y's dtype, written ONCE into rank s's staging
//     [me][t] over NVLink (16-byte stores); a release flag per (chunk, slice, rank s);
//   finalisers: per chunk of this rank's tokens and slice, wait for the flags of every other rank,
//     then out[t] = sum over ranks in rank order (float32) of the partial sums, this rank's own
//     partial computed in place from y (never staged), rounded to y's dtype.
// A work item is one slice (CommLayout::num_slices: a whole number of combine's 1.5 KiB pieces) of
// a chunk's rows: elements are summed independently, so the slices change no element's order.
// Exactly jax_ep.reference.combine's summation order. combine_rank_major is this kernel with K = 1
// (token_rows = the handle's slot -> row table, launch_rank_major_rows) and rows_as_is: a rank's
// partial is its one row as it is, as jax_ep.reference.combine_rank_major.
#include <algorithm>

#include "cuda/combine.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

// Each warp streams the rows it reduces through a per-lane ring of cp.async copies in shared
// memory (cp.async): a piece is 1.5 KiB of one row (48 bytes per lane; kSliceBytes, so a slice of
// the row is a range of pieces), and every lane always has
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
static_assert(kSliceBytes % kStepBytes == 0, "a slice of a row is a whole number of pieces");

struct CombineArgs : DataArgs {
  const char* y;
  const float* row_weights;  // null: unweighted
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  char* out;
  int32_t list_stride;   // entries per token list: K + R
  int32_t op_id;         // kOpCombine, or kOpCombineRankMajor (named in a timeout)
  bool rows_as_is;       // combine_rank_major: a partial is its one row as it is (no +0.0 added)
};

// Shared memory of one warp: the ring, the chunk's token_rows (then the rows' weights, in the same
// place), the row lists and four per-token counts.
__host__ __device__ constexpr int64_t combine_warp_shared_bytes(int list_stride, int topk) {
  return static_cast<int64_t>(kCombineRing) * kStepBytes +
         static_cast<int64_t>(kMaxChunkTokens) * topk * 4 +
         static_cast<int64_t>(kMaxChunkTokens) * list_stride * 4 + 4 * kMaxChunkTokens * 4;
}
// The largest top-k and group still fit an SM (227 KiB of shared memory per block on sm_90).
static_assert(kDataWarps * combine_warp_shared_bytes(kMaxTopk + kMaxGroupRanks, kMaxTopk) <=
                  232448,
              "combine's shared memory must fit every supported top-k and group size");

struct CombineWarp {
  char* ring;         // [kCombineRing][1.5 KiB]: lane l owns bytes 16 l + 512 j, j < kCombineVecs
  int32_t* raw;       // [kMaxChunkTokens][K]: token_rows of the chunk, until the lists are built
  float* weights;     // [kMaxChunkTokens][K]: then the gate weight of each y row (raw's place)
  int32_t* entries;   // [kMaxChunkTokens][stride]: y row (>= 0) or -1 - r (rank r's staged partial)
  int32_t* n_own;     // [kMaxChunkTokens]: y rows of the token
  int32_t* n_all;     // [kMaxChunkTokens]: y rows + staged partials
  int32_t* in_mask;   // [kMaxChunkTokens]: ranks the token went to (finalisers)
  int32_t* active;    // [kMaxChunkTokens]: the token has an output row (reducers: sent here)
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

// Carves this warp's part out of the kernel's dynamic shared memory.
__device__ __forceinline__ CombineWarp combine_warp(char* dynamic_shared, int warp, int stride,
                                                    int K) {
  CombineWarp w;
  char* base = dynamic_shared + warp * combine_warp_shared_bytes(stride, K);
  w.ring = base;
  w.raw = reinterpret_cast<int32_t*>(base + kCombineRing * kStepBytes);
  w.weights = reinterpret_cast<float*>(w.raw);
  w.entries = w.raw + kMaxChunkTokens * K;
  w.n_own = w.entries + kMaxChunkTokens * stride;
  w.n_all = w.n_own + kMaxChunkTokens;
  w.in_mask = w.n_all + kMaxChunkTokens;
  w.active = w.in_mask + kMaxChunkTokens;
  return w;
}

// The piece stream of one chunk: issue() loads the next piece (token tt, step s, entry i) into the
// ring and commits one cp.async group (empty once the stream is exhausted), so that exactly one
// group per consumed piece keeps the count of outstanding groups fixed; pop() returns the ring slot
// of the next piece once it has landed. The cursor is kept in registers: an issue costs one shared
// load (the entry), the row address and the copies (the kernel is bound by instruction issue).
struct PieceStream {
  // what the chunk reads
  const int32_t* entries;   // CombineWarp::entries
  const int32_t* n_all;     // CombineWarp::n_all
  char* ring_lane;          // this lane's bytes of ring slot 0
  const char* y;
  const char* staged;       // this rank's staging (the other ranks' partials)
  int64_t T, t0;
  int64_t row_bytes;
  uint64_t data_row_bytes;  // of the staging
  int stride, n_tok, lane;
  int s_begin, s_end;       // the item's steps of a row (its slices)
  // the cursor
  int tt, s, i;             // next piece to issue
  int n;                    // pieces per step of token tt (its rows and staged partials)
  int64_t offset;           // piece_offset(s, lane)
  uint32_t issue_slot;      // ring slot of the next piece issued
  uint32_t consume_slot;    // ring slot of the next piece consumed (each chunk drains the ring)

  __device__ __forceinline__ void next_token(int from) {
    while (from < n_tok && n_all[from] == 0) ++from;
    tt = from;
    n = from < n_tok ? n_all[from] : 0;
  }

  __device__ __forceinline__ void issue() {
    if (tt < n_tok) {
      const int32_t e = entries[tt * stride + i];
      const char* row;
      if (e >= 0) {
        row = y + static_cast<int64_t>(e) * row_bytes;
      } else {
        row = staged + (static_cast<int64_t>(-1 - e) * T + t0 + tt) * data_row_bytes;
      }
      issue_piece(ring_lane + issue_slot * kStepBytes, row + offset, row_bytes - offset);
      issue_slot = issue_slot + 1 == kCombineRing ? 0 : issue_slot + 1;
      if (++i == n) {
        i = 0;
        offset += kStepBytes;
        if (++s == s_end) {
          s = s_begin;
          offset = piece_offset(s_begin, lane);
          next_token(tt + 1);
        }
      }
    }
    cp_async_commit();
  }

  __device__ __forceinline__ uint32_t pop() {
    cp_async_wait<kCombineRing - 1>();
    const uint32_t slot = consume_slot;
    consume_slot = slot + 1 == kCombineRing ? 0 : slot + 1;
    return slot;
  }
};

// The stream of slices [it.k0, it.k1) of chunk [t0, t0 + n_tok), at its first piece (nothing issued
// yet).
__device__ __forceinline__ PieceStream piece_stream(const CombineArgs& a, const DataWarp& d,
                                                    const CombineWarp& w, const ChunkSlices& it,
                                                    int64_t t0, int n_tok) {
  PieceStream ps;
  ps.entries = w.entries;
  ps.n_all = w.n_all;
  ps.ring_lane = w.ring + d.lane * 16;
  ps.y = a.y;
  ps.staged = d.own + a.layout.stage_data;
  ps.T = a.T;
  ps.t0 = t0;
  ps.row_bytes = a.row_bytes;
  ps.data_row_bytes = a.layout.data_row_bytes;
  ps.stride = a.list_stride;
  ps.s_begin = static_cast<int>(slice_begin(a.layout, it.k0) / kStepBytes);
  ps.s_end = static_cast<int>((slice_end(a.layout, it.k1, ps.row_bytes) + kStepBytes - 1) /
                              kStepBytes);
  ps.n_tok = n_tok;
  ps.lane = d.lane;
  ps.tt = ps.i = ps.n = 0;
  ps.s = ps.s_begin;
  ps.offset = piece_offset(ps.s_begin, d.lane);
  ps.issue_slot = ps.consume_slot = 0;
  ps.next_token(0);
  return ps;
}

// The chunk's lists: per token its y rows in slot order (entries >= 0) and, for finalisers, the
// other ranks whose partials it adds (-1 - r, rank order), with the counts. Finalisers first wait
// for the other ranks' partials of the item (wait_chunk_flags).
__device__ __forceinline__ void combine_chunk_lists(const CombineArgs& a, const DataWarp& d,
                                                    const CombineWarp& w, bool reducer,
                                                    const ChunkSlices& it, int s_rank, int64_t t0,
                                                    int n_tok) {
  const CommLayout& L = a.layout;
  const int K = a.K;
  const int stride = a.list_stride;
  const int lane = d.lane;
  const int me = d.me;
  const int R = d.R;
  int32_t* raw = w.raw;
  const int32_t* rows_src = a.token_rows + (static_cast<int64_t>(s_rank) * a.T + t0) * K;
  for (int f = lane; f < n_tok * K; f += 32) raw[f] = __ldg(rows_src + f);
  if (!reducer) {
    // the other linked ranks' partials of this chunk have arrived (a masked rank's count as +0.0,
    // and so, in shrink mode, does one whose partials never came: `lost`)
    const uint32_t lost = wait_chunk_flags(d.own, L, d.state, d.info, a.op_id, a.shrink,
                                           d.linked & ~(1u << me), it, lane);
    if (lane < n_tok) {
      int32_t mask = 0;
      for (int r = 0; r < R; ++r) mask |= a.is_token_in_rank[(t0 + lane) * R + r] ? 1 << r : 0;
      w.in_mask[lane] = mask & static_cast<int32_t>(d.linked & ~lost);
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
}

// The gate weight of each y row of the chunk's lists (1 unweighted), in token_rows' place.
__device__ __forceinline__ void combine_chunk_weights(const CombineArgs& a, const CombineWarp& w,
                                                      int n_tok, int lane) {
  const int K = a.K;
  for (int f = lane; f < n_tok * K; f += 32) {  // token_rows are read: weights take their place
    const int tt = f / K;
    const int i = f - tt * K;
    if (i < w.n_own[tt]) {
      w.weights[f] = a.row_weights != nullptr
                         ? __ldg(a.row_weights + w.entries[tt * a.list_stride + i])
                         : 1.f;
    }
  }
  __syncwarp();
}

// This rank's partial of one step of a token: the sum over its n_own y rows in slot order of
// w * y (as the reference; an unweighted sum has w = 1, and fma(f, 1, acc) is acc + f exactly).
// rows_as_is (combine_rank_major, one row per token and rank): the row itself, -0.0 kept, where
// +0.0 + row would make it +0.0.
template <bool kF32>
__device__ __forceinline__ void own_partial(const CombineWarp& w, PieceStream& ps,
                                            const float* weights, int n_own, bool rows_as_is,
                                            int lane, float acc[Piece<kF32>::kElems]) {
  constexpr int kE = Piece<kF32>::kElems;
  constexpr int kP = Piece<kF32>::kPerVec;
  if (n_own == 0) {  // (a finaliser's token not routed here)
#pragma unroll
    for (int i = 0; i < kE; ++i) acc[i] = 0.f;
  } else if (rows_as_is) {
    const uint32_t slot = ps.pop();
#pragma unroll
    for (int v = 0; v < kCombineVecs; ++v) ring_vector<kF32>(w, slot, lane, v, acc + kP * v);
    ps.issue();
  } else {  // the first row: fma(f, w, +0), exactly as from acc = 0
    const uint32_t slot = ps.pop();
    const float w0 = weights[0];
#pragma unroll
    for (int v = 0; v < kCombineVecs; ++v) {
      float f[kP];
      ring_vector<kF32>(w, slot, lane, v, f);
#pragma unroll
      for (int i = 0; i < kP; ++i) acc[kP * v + i] = __fmaf_rn(f[i], w0, 0.f);
    }
    ps.issue();
  }
  for (int j = 1; j < n_own; ++j) {
    const uint32_t slot = ps.pop();
    const float wj = weights[j];
#pragma unroll
    for (int v = 0; v < kCombineVecs; ++v) {
      float f[kP];
      ring_vector<kF32>(w, slot, lane, v, f);
#pragma unroll
      for (int i = 0; i < kP; ++i) acc[kP * v + i] = __fmaf_rn(f[i], wj, acc[kP * v + i]);
    }
    ps.issue();
  }
}

// A finaliser's step of a token: the sum over ranks in rank order (float32) of the partials, its
// own partial `acc` rounded to y's dtype as if it had travelled, the other ranks' from the ring
// (those in `mask`; a rank the token did not go to adds zero).
template <bool kF32>
__device__ __forceinline__ void finalise_step(const CombineWarp& w, PieceStream& ps, int me,
                                              int R, int32_t mask, int lane,
                                              float acc[Piece<kF32>::kElems],
                                              float total[Piece<kF32>::kElems]) {
  constexpr int kE = Piece<kF32>::kElems;
  constexpr int kP = Piece<kF32>::kPerVec;
  if constexpr (!kF32) {
#pragma unroll
    for (int i = 0; i < kE; ++i) acc[i] = __bfloat162float(__float2bfloat16_rn(acc[i]));
  }
  for (int r = 0; r < R; ++r) {
    if (r == me) {
#pragma unroll
      for (int i = 0; i < kE; ++i) total[i] = r == 0 ? acc[i] : __fadd_rn(total[i], acc[i]);
    } else if ((mask >> r) & 1) {
      const uint32_t slot = ps.pop();
#pragma unroll
      for (int v = 0; v < kCombineVecs; ++v) {
        float f[kP];
        ring_vector<kF32>(w, slot, lane, v, f);
#pragma unroll
        for (int i = 0; i < kP; ++i) {
          total[kP * v + i] = r == 0 ? f[i] : __fadd_rn(total[kP * v + i], f[i]);
        }
      }
      ps.issue();
    } else {
#pragma unroll
      for (int i = 0; i < kE; ++i) total[i] = r == 0 ? 0.f : __fadd_rn(total[i], 0.f);
    }
  }
}

// Token tt of the chunk, step by step of its row: a reducer writes its partial into rank s_rank's
// staging, a finaliser the output row.
template <bool kF32>
__device__ __forceinline__ void combine_token(const CombineArgs& a, const DataWarp& d,
                                              const CombineWarp& w, PieceStream& ps, bool reducer,
                                              int s_rank, int64_t t0, int tt) {
  constexpr int kE = Piece<kF32>::kElems;
  const CommLayout& L = a.layout;
  const int64_t row_bytes = a.row_bytes;
  const int n_own = w.n_own[tt];
  const int32_t mask = reducer ? 0 : w.in_mask[tt];
  const float* weights = w.weights + tt * a.K;
  char* dst = reducer ? reinterpret_cast<char*>(__shfl_sync(
                            kFullMask, reinterpret_cast<unsigned long long>(d.lane_peer), s_rank)) +
                            L.stage_data + (static_cast<int64_t>(d.me) * a.T + t0 + tt) *
                                               L.data_row_bytes
                      : a.out + (t0 + tt) * row_bytes;
  for (int s = ps.s_begin; s < ps.s_end; ++s) {
    float acc[kE];
    own_partial<kF32>(w, ps, weights, n_own, a.rows_as_is, d.lane, acc);
    const int64_t offset = piece_offset(s, d.lane);
    if (reducer) {
      write_piece<kF32>(dst, offset, row_bytes, acc);  // rounds to y's dtype
      continue;
    }
    float total[kE];
    finalise_step<kF32>(w, ps, d.me, d.R, mask, d.lane, acc, total);
    write_piece<kF32>(dst, offset, row_bytes, total);
  }
}

// One work item: slices [it.k0, it.k1) of chunk it.c of rank s_rank's tokens (reducers) or of this
// rank's (finalisers).
template <bool kF32>
__device__ __forceinline__ void combine_chunk(const CombineArgs& a, const DataWarp& d,
                                              const CombineWarp& w, bool reducer,
                                              const ChunkSlices& it, int s_rank) {
  const CommLayout& L = a.layout;
  const int64_t t0 = chunk_begin(L, it.c);
  const int n_tok = static_cast<int>(chunk_end(L, it.c, a.T) - t0);
  combine_chunk_lists(a, d, w, reducer, it, s_rank, t0, n_tok);
  combine_chunk_weights(a, w, n_tok, d.lane);
  PieceStream ps = piece_stream(a, d, w, it, t0, n_tok);
  for (int k = 0; k < kCombineRing; ++k) ps.issue();
  for (int tt = 0; tt < n_tok; ++tt) {
    if (w.active[tt]) combine_token<kF32>(a, d, w, ps, reducer, s_rank, t0, tt);
  }
  cp_async_wait<0>();
  __syncwarp();  // every lane's stores of the chunk are done
  if (reducer && d.lane == 0) {
    char* peer = comm_buffer_of(d.state, d.info->ordinals[s_rank]);
    for (int k = it.k0; k < it.k1; ++k) {
      store_release_sys(chunk_flag(peer, L, d.me, it.c, k), d.expected);
    }
  }
}

template <bool kF32>
__global__ void __launch_bounds__(kDataThreads, 1)
    combine_main_kernel(DeviceState* state, CombineArgs a) {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);
  const DataWarp d = data_warp(state, a.layout);
  const CombineWarp w =
      combine_warp(reinterpret_cast<char*>(dynamic_shared), d.warp, a.list_stride, a.K);
  const bool reducer = d.warp < a.send_warps;
  // (chunk, slice) items (chunk_item), reducers' per other rank
  const int per_rank = chunk_items(a.layout, true);
  const int n_items = reducer ? per_rank * (d.R - 1) : per_rank;
  uint32_t* counter = &d.info->work[reducer ? 0 : 1];
  for (;;) {
    const int item = next_item(counter);
    if (item >= n_items) break;
    int s_rank = d.me;  // reducers: the rank whose tokens these are
    ChunkSlices it;
    if (reducer) {
      it = chunk_item(a.layout, item / (d.R - 1), true);
      s_rank = other_rank(item % (d.R - 1), d.me);
      if (!has_rank(d.linked, s_rank)) continue;  // a masked rank: nothing goes there
    } else {
      it = chunk_item(a.layout, item, true);
    }
    combine_chunk<kF32>(a, d, w, reducer, it, s_rank);
  }
}

// The slot -> row table of a rank-major handle (launch_rank_major_rows), after a memset to -1.
__global__ void __launch_bounds__(256)
    rank_major_rows_kernel(const int32_t* __restrict__ src_index, int32_t n,
                           int32_t* __restrict__ slot_rows) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int32_t slot = __ldg(src_index + i);
    if (slot >= 0 && slot < n) slot_rows[slot] = i;  // (a handle of dispatch_rank_major: unique)
  }
}

}  // namespace

cudaError_t launch_rank_major_rows(const int32_t* src_index, int32_t num_rows, int32_t num_blocks,
                                   int32_t* slot_rows, cudaStream_t stream) {
  if (num_rows < 0 || num_blocks < 1) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  // -1 everywhere first (0xFF bytes), so a slot no row names is "not here" whatever src_index holds
  JAX_EP_CUDA_RETURN(cudaMemsetAsync(slot_rows, 0xFF, static_cast<size_t>(num_rows) * 4, stream));
  const int blocks = std::min<int32_t>(num_blocks, (num_rows + 255) / 256);
  JAX_EP_LAUNCH(rank_major_rows_kernel, blocks, 256, 0, stream)(src_index, num_rows, slot_rows);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_combine(const GroupLaunch& g, const void* y, const float* row_weights,
                           const int32_t* token_rows, const bool* is_token_in_rank, int32_t hidden,
                           int32_t y_kind, bool rank_major, void* out, cudaStream_t stream) {
  const int32_t row_bytes = float_row_bytes(hidden, y_kind);
  if (!group_launch_ok(g) || row_bytes == 0 || (rank_major && (g.num_topk != 1 || row_weights))) {
    return cudaErrorInvalidValue;
  }
  const int32_t op_id = rank_major ? kOpCombineRankMajor : kOpCombine;
  JAX_EP_CUDA_RETURN(launch_start(g, group_fingerprint(g, op_id, hidden, y_kind), stream));
  const CombineArgs a{data_args(g, row_bytes),     static_cast<const char*>(y),
                      row_weights,                 token_rows,
                      is_token_in_rank,            static_cast<char*>(out),
                      g.num_topk + g.num_ranks,    op_id,
                      rank_major};
  const int shared_bytes =
      static_cast<int>(kDataWarps * combine_warp_shared_bytes(a.list_stride, a.K));
  const auto kernel = y_kind == kRowF32 ? combine_main_kernel<true> : combine_main_kernel<false>;
  JAX_EP_CUDA_RETURN(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  JAX_EP_LAUNCH(kernel, g.num_blocks, kDataThreads, shared_bytes, stream)(g.state, a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
