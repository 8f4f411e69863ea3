// Throughput combine over NVLink (see combine.h): the start kernel (group.cu), then one data
// kernel whose warps sum their rows from a ring of bulk loads in shared memory (see below) and are
// either
//   reducers: for every token another rank s sent here, the float32 sum over its top-k slots (in
//     slot order) of w * y[row], rounded to y's dtype, written ONCE into rank s's staging
//     [me][t] over NVLink (16-byte stores); a release flag per (chunk, slice, rank s);
//   finalisers: per chunk of this rank's tokens and slice, wait for the flags of every other rank,
//     then out[t] = sum over ranks in rank order (float32) of the partial sums, this rank's own
//     partial computed in place from y (never staged), rounded to y's dtype.
// A work item is one slice (CommLayout::num_slices: a whole number of 512-byte units) of
// a chunk's rows: elements are summed independently, so the slices change no element's order.
// Exactly jax_ep.reference.combine's summation order. combine_rank_major is this kernel with K = 1
// (token_rows = the handle's slot -> row table, launch_rank_major_rows) and rows_as_is: a rank's
// partial is its one row as it is, as jax_ep.reference.combine_rank_major.
#include <algorithm>

#include "cuda/combine.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

// Each warp sums its rows from a ring of pieces in shared memory that bulk (TMA) loads fill ahead
// of it: a piece is kUnits units of one row (a unit is 512 contiguous bytes, 16 per lane, so that
// each shared-memory load of the warp covers 512 contiguous bytes), and a token's pieces are
// loaded in the order they are summed (step by step of its row; in a step its y rows in slot
// order, then the staged partials in rank order), `stages` pieces ahead. Registers held the
// rows before (4 KiB per warp in flight: 374.7 us for a DeepSeek-V3 combine on 24 SMs of one
// H200, where a plain register combine with 8 KiB in flight took 198.5 us, docs/benchmarks.md
// session 47); the ring holds what shared memory has room for (12 KiB per warp at DeepSeek-V3's
// top-8) with no registers and one bulk load per piece.
constexpr int kUnitBytes = 512;                   // a warp's unit of a row (16 bytes per lane)
constexpr int kUnits = 4;                         // units of a piece (and of a summing step)
constexpr int kPieceBytes = kUnitBytes * kUnits;  // a piece of a row (2 KiB)
constexpr int kMaxStages = 16;                    // pieces a warp's ring holds at most
constexpr int kMinStages = 2;
constexpr int64_t kSharedLimit = 232448;          // a block's shared memory on sm_90 (227 KiB)
static_assert(kSliceBytes % 16 == 0, "a slice of a row is a whole number of 16-byte vectors");

struct CombineArgs : DataArgs {
  const char* y;
  const float* row_weights;  // null: unweighted
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  char* out;
  int32_t list_stride;   // entries per token list: K + R
  int32_t op_id;         // kOpCombine, or kOpCombineRankMajor (named in a timeout)
  bool rows_as_is;       // combine_rank_major: a partial is its one row as it is (no +0.0 added)
  int32_t stages;        // pieces of a warp's ring (combine_ring_stages)
};

// Shared memory of one warp's lists: the chunk's token_rows (then the rows' weights, in the same
// place), the row lists and four per-token counts.
__host__ __device__ constexpr int64_t combine_warp_shared_bytes(int list_stride, int topk) {
  return static_cast<int64_t>(kMaxChunkTokens) * topk * 4 +
         static_cast<int64_t>(kMaxChunkTokens) * list_stride * 4 + 4 * kMaxChunkTokens * 4;
}
// The kernel's shared memory: every warp's lists, then every warp's ring barriers (8 bytes per
// stage), then every warp's ring of pieces (each part 128-byte aligned).
__host__ __device__ constexpr int64_t combine_lists_bytes(int list_stride, int topk) {
  return (kDataWarps * combine_warp_shared_bytes(list_stride, topk) + 127) / 128 * 128;
}
__host__ __device__ constexpr int64_t combine_barrier_bytes(int stages) {
  return (kDataWarps * stages * 8 + 127) / 128 * 128;
}
__host__ __device__ constexpr int64_t combine_shared_bytes(int list_stride, int topk, int stages) {
  return combine_lists_bytes(list_stride, topk) + combine_barrier_bytes(stages) +
         static_cast<int64_t>(kDataWarps) * stages * kPieceBytes;
}
// The most pieces per warp's ring that fit beside the lists (at most kMaxStages).
__host__ __device__ constexpr int combine_ring_stages(int list_stride, int topk) {
  int stages = kMaxStages;
  while (stages > kMinStages && combine_shared_bytes(list_stride, topk, stages) > kSharedLimit) {
    --stages;
  }
  return stages;
}
// The largest top-k and group still fit an SM with a ring of at least kMinStages.
static_assert(combine_shared_bytes(kMaxTopk + kMaxGroupRanks, kMaxTopk,
                                   combine_ring_stages(kMaxTopk + kMaxGroupRanks, kMaxTopk)) <=
                  kSharedLimit,
              "combine's shared memory must fit every supported top-k and group size");

struct CombineWarp {
  int32_t* raw;       // [kMaxChunkTokens][K]: token_rows of the chunk, until the lists are built
  float* weights;     // [kMaxChunkTokens][K]: then the gate weight of each y row (raw's place)
  int32_t* entries;   // [kMaxChunkTokens][stride]: y row (>= 0) or -1 - r (rank r's staged partial)
  int32_t* n_own;     // [kMaxChunkTokens]: y rows of the token
  int32_t* n_all;     // [kMaxChunkTokens]: y rows + staged partials
  int32_t* in_mask;   // [kMaxChunkTokens]: ranks the token went to (finalisers)
  int32_t* active;    // [kMaxChunkTokens]: the token has an output row (reducers: sent here)
};

// A warp's ring of pieces. Every lane holds the consumer's place (stage, parity); lane 0, which
// issues every bulk load, also the producer's (the next piece to load: its step and list entry).
struct Ring {
  char* pieces;      // [stages][kPieceBytes]
  uint64_t* barrier; // [stages]: complete when the stage's piece has landed
  int stages;
  int stage;         // the stage of the next piece to sum
  uint32_t parity;   // bit i: the parity of stage i's next completion
  int next;          // (lane 0) the next piece to load, of the token's n pieces
  int64_t next_base; // (lane 0) its byte in the row
  int next_entry;    // (lane 0) its list entry
};

template <bool kF32>
struct Piece {
  static constexpr int kPerVec = kF32 ? 4 : 8;         // elements per 16-byte vector (a lane's unit)
  static constexpr int kElems = kUnits * kPerVec;      // elements per lane and piece
};

// A piece's loads and stores take this lane's 16 bytes of each unit from `at` = row + base + 16 *
// lane; a piece at the end of the item's bytes (kTail) only those units before it: lim = end -
// base - 16 * lane, the bytes left from this lane's first one.
template <bool kTail>
__device__ __forceinline__ bool unit_in(int u, int lim) {
  return !kTail || kUnitBytes * u < lim;
}

// A lane's 16 bytes of a row as floats.
template <bool kF32>
__device__ __forceinline__ void unpack_vector(const uint4& v, float f[Piece<kF32>::kPerVec]) {
  if constexpr (kF32) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  } else {
    unpack_bf16x8(v, f);
  }
}

// Writes this lane's share of the piece (rounded to y's dtype) at `at` (as unit_in).
template <bool kF32, bool kTail>
__device__ __forceinline__ void write_piece(char* at, int lim, const float f[Piece<kF32>::kElems]) {
  constexpr int kP = Piece<kF32>::kPerVec;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    uint4 v;
    if constexpr (kF32) {
      v = make_uint4(__float_as_uint(f[kP * u]), __float_as_uint(f[kP * u + 1]),
                     __float_as_uint(f[kP * u + 2]), __float_as_uint(f[kP * u + 3]));
    } else {
      v = pack_bf16x8(f + kP * u);
    }
    if (unit_in<kTail>(u, lim)) *reinterpret_cast<uint4*>(at + kUnitBytes * u) = v;
  }
}

// Carves this warp's lists and ring out of the kernel's dynamic shared memory; lane 0 sets up the
// ring's barriers (every lane calls it).
__device__ __forceinline__ CombineWarp combine_warp(char* dynamic_shared, int warp, int lane,
                                                    int stride, int K, int stages, Ring* ring) {
  CombineWarp w;
  char* base = dynamic_shared + warp * combine_warp_shared_bytes(stride, K);
  w.raw = reinterpret_cast<int32_t*>(base);
  w.weights = reinterpret_cast<float*>(w.raw);
  w.entries = w.raw + kMaxChunkTokens * K;
  w.n_own = w.entries + kMaxChunkTokens * stride;
  w.n_all = w.n_own + kMaxChunkTokens;
  w.in_mask = w.n_all + kMaxChunkTokens;
  w.active = w.in_mask + kMaxChunkTokens;
  char* barriers = dynamic_shared + combine_lists_bytes(stride, K);
  ring->barrier = reinterpret_cast<uint64_t*>(barriers) + warp * stages;
  ring->pieces = barriers + combine_barrier_bytes(stages) +
                 static_cast<int64_t>(warp) * stages * kPieceBytes;
  ring->stages = stages;
  ring->stage = 0;
  ring->parity = 0u;
  if (lane == 0) {
    for (int i = 0; i < stages; ++i) mbarrier_init(ring->barrier + i, 1);
  }
  __syncwarp();
  return w;
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
    // (bulk loads, in the async proxy, read the staged partials these flags acquired)
    if (lane == 0 && R > 1) fence_proxy_async_global();
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

// A token's pieces: for each piece of its row's bytes [lo, end), its list's n_all entries in order.
struct TokenPieces {
  const int32_t* entries;
  int n_all;
  int64_t t;         // the token (its staged partials' row)
  int64_t end;       // the item's bytes end here
  int n;             // pieces: n_all per piece of [lo, end)
};

// (lane 0) Loads the ring's next piece of the token into `stage`, and moves on to the one after.
__device__ __forceinline__ void ring_load(const CombineArgs& a, const DataWarp& d,
                                          const TokenPieces& tp, Ring& ring, int stage) {
  const int32_t e = tp.entries[ring.next_entry];
  const char* row = e >= 0 ? a.y + static_cast<int64_t>(e) * a.row_bytes
                           : d.own + a.layout.stage_data +
                                 (static_cast<int64_t>(-1 - e) * a.T + tp.t) *
                                     static_cast<int64_t>(a.layout.data_row_bytes);
  const int64_t left = tp.end - ring.next_base;
  const uint32_t bytes = static_cast<uint32_t>(left < kPieceBytes ? left : kPieceBytes);
  tma_load(ring.pieces + static_cast<int64_t>(stage) * kPieceBytes, row + ring.next_base, bytes,
           ring.barrier + stage);
  ++ring.next;
  if (++ring.next_entry == tp.n_all) {
    ring.next_entry = 0;
    ring.next_base += kPieceBytes;
  }
}

// Starts the token's pieces: the first `stages` of them are loaded (lane 0).
__device__ __forceinline__ void ring_start(const CombineArgs& a, const DataWarp& d,
                                           const TokenPieces& tp, int64_t lo, Ring& ring) {
  if (d.lane != 0) return;
  ring.next = 0;
  ring.next_base = lo;
  ring.next_entry = 0;
  int stage = ring.stage;
  for (int i = 0; i < ring.stages && i < tp.n; ++i) {
    ring_load(a, d, tp, ring, stage);
    stage = stage + 1 == ring.stages ? 0 : stage + 1;
  }
}

// This lane's 16 bytes of each unit of the ring's current piece, once it has landed (units past
// the item's end: zeros, summed but never written).
template <bool kTail>
__device__ __forceinline__ void ring_take(const Ring& ring, int lane, int lim,
                                          uint4 (&v)[kUnits]) {
  mbarrier_wait(ring.barrier + ring.stage, (ring.parity >> ring.stage) & 1u);
  const char* at = ring.pieces + static_cast<int64_t>(ring.stage) * kPieceBytes + 16 * lane;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    v[u] = unit_in<kTail>(u, lim) ? *reinterpret_cast<const uint4*>(at + kUnitBytes * u)
                                  : make_uint4(0, 0, 0, 0);
  }
}

// The current piece is summed by every lane: its stage takes the token's next piece to load.
__device__ __forceinline__ void ring_release(const CombineArgs& a, const DataWarp& d,
                                             const TokenPieces& tp, Ring& ring) {
  __syncwarp();
  if (d.lane == 0 && ring.next < tp.n) ring_load(a, d, tp, ring, ring.stage);
  ring.parity ^= 1u << ring.stage;
  ring.stage = ring.stage + 1 == ring.stages ? 0 : ring.stage + 1;
}

// This rank's partial of one piece of a token: the sum over its n_own y rows in slot order of
// w * y (as the reference: from +0.0, so the first row's term is fma(f, w, +0); an unweighted sum
// has w = 1, and fma(f, 1, acc) is acc + f exactly). rows_as_is (combine_rank_major, one row per
// token and rank): the row itself, -0.0 kept, where +0.0 + row would make it +0.0.
template <bool kF32, bool kTail>
__device__ __forceinline__ void own_partial(const CombineArgs& a, const DataWarp& d,
                                            const TokenPieces& tp, const float* weights,
                                            int n_own, int lim, Ring& ring,
                                            float acc[Piece<kF32>::kElems]) {
  constexpr int kP = Piece<kF32>::kPerVec;
#pragma unroll
  for (int i = 0; i < Piece<kF32>::kElems; ++i) acc[i] = 0.f;
  if (a.rows_as_is) {
    if (n_own == 0) return;  // (a finaliser's token not routed here)
    uint4 v[kUnits];
    ring_take<kTail>(ring, d.lane, lim, v);
#pragma unroll
    for (int u = 0; u < kUnits; ++u) unpack_vector<kF32>(v[u], acc + kP * u);
    ring_release(a, d, tp, ring);
    return;
  }
  for (int j = 0; j < n_own; ++j) {
    uint4 v[kUnits];
    ring_take<kTail>(ring, d.lane, lim, v);
    const float wj = weights[j];
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      float f[kP];
      unpack_vector<kF32>(v[u], f);
#pragma unroll
      for (int i = 0; i < kP; ++i) acc[kP * u + i] = __fmaf_rn(f[i], wj, acc[kP * u + i]);
    }
    ring_release(a, d, tp, ring);
  }
}

// This rank's own partial of a piece as y's dtype, as if it had travelled: bf16 packed in pairs
// (half the registers of floats, beside the finaliser's float32 total).
template <bool kF32>
struct OwnPartial {
  static constexpr int kWords = kF32 ? Piece<kF32>::kElems : Piece<kF32>::kElems / 2;
  uint32_t w[kWords];
  __device__ __forceinline__ explicit OwnPartial(const float acc[Piece<kF32>::kElems]) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (kF32) {
        w[i] = __float_as_uint(acc[i]);
      } else {
        w[i] = pack_bf16x2(acc[2 * i], acc[2 * i + 1]);
      }
    }
  }
  __device__ __forceinline__ float operator[](int i) const {
    if constexpr (kF32) return __uint_as_float(w[i]);
    return __uint_as_float((i & 1) ? w[i >> 1] & 0xFFFF0000u : w[i >> 1] << 16);
  }
};

// The ranks [r, stop) that staged no partial of the token: this rank's own partial, a rank the
// token did not go to +0.0.
template <bool kF32>
__device__ __forceinline__ void add_unstaged_ranks(int r, int stop, int me,
                                                   const OwnPartial<kF32>& own,
                                                   float total[Piece<kF32>::kElems]) {
  constexpr int kE = Piece<kF32>::kElems;
  for (; r < stop; ++r) {
    if (r == me) {
#pragma unroll
      for (int i = 0; i < kE; ++i) total[i] = r == 0 ? own[i] : __fadd_rn(total[i], own[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kE; ++i) total[i] = r == 0 ? 0.f : __fadd_rn(total[i], 0.f);
    }
  }
}

// A finaliser's piece of a token: the sum over ranks in rank order (float32) of the partials, its
// own partial `acc` rounded to y's dtype as if it had travelled, the other ranks' staged ones
// (entries [n_own, n_all): -1 - r in rank order; a rank the token did not go to adds zero).
template <bool kF32, bool kTail>
__device__ __forceinline__ void finalise_piece(const DataWarp& d, const CombineArgs& a,
                                               const TokenPieces& tp, int n_own, int lim,
                                               Ring& ring, const float acc[Piece<kF32>::kElems],
                                               float total[Piece<kF32>::kElems]) {
  constexpr int kP = Piece<kF32>::kPerVec;
  const OwnPartial<kF32> own(acc);
  int r = 0;  // the ranks below r are in total
  for (int q = n_own; q < tp.n_all; ++q) {
    const int rank = -1 - tp.entries[q];
    add_unstaged_ranks<kF32>(r, rank, d.me, own, total);
    uint4 v[kUnits];
    ring_take<kTail>(ring, d.lane, lim, v);
    ring_release(a, d, tp, ring);
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      float f[kP];
      unpack_vector<kF32>(v[u], f);
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        total[kP * u + i] = rank == 0 ? f[i] : __fadd_rn(total[kP * u + i], f[i]);
      }
    }
    r = rank + 1;
  }
  add_unstaged_ranks<kF32>(r, d.R, d.me, own, total);
}

// One piece of token tp.t's row at byte `base`: a reducer writes its partial at dst, a finaliser
// the output row.
template <bool kF32, bool kTail>
__device__ __forceinline__ void combine_piece(const CombineArgs& a, const DataWarp& d,
                                              const TokenPieces& tp, const float* weights,
                                              int n_own, bool reducer, char* dst, int64_t base,
                                              Ring& ring) {
  constexpr int kE = Piece<kF32>::kElems;
  const int64_t off = base + 16 * d.lane;
  const int lim = static_cast<int>(tp.end - off);
  float acc[kE];
  own_partial<kF32, kTail>(a, d, tp, weights, n_own, lim, ring, acc);
  if (reducer) {
    write_piece<kF32, kTail>(dst + off, lim, acc);  // rounds to y's dtype
    return;
  }
  float total[kE];
  finalise_piece<kF32, kTail>(d, a, tp, n_own, lim, ring, acc, total);
  write_piece<kF32, kTail>(dst + off, lim, total);
}

// Token tt of the chunk, piece by piece of the item's bytes [lo, end) of its row: a reducer writes
// its partial into rank s_rank's staging, a finaliser the output row.
template <bool kF32>
__device__ __forceinline__ void combine_token(const CombineArgs& a, const DataWarp& d,
                                              const CombineWarp& w, bool reducer, int s_rank,
                                              int64_t t0, int tt, int64_t lo, int64_t end,
                                              Ring& ring) {
  const CommLayout& L = a.layout;
  const int n_own = w.n_own[tt];
  TokenPieces tp;
  tp.entries = w.entries + tt * a.list_stride;
  tp.n_all = w.n_all[tt];
  tp.t = t0 + tt;
  tp.end = end;
  // (a rank-major finaliser's token that came from no rank has no pieces, and its output is zeros)
  tp.n = static_cast<int>((end - lo + kPieceBytes - 1) / kPieceBytes) * tp.n_all;
  const float* weights = w.weights + tt * a.K;
  char* dst = reducer ? reinterpret_cast<char*>(__shfl_sync(
                            kFullMask, reinterpret_cast<unsigned long long>(d.lane_peer), s_rank)) +
                            L.stage_data + (static_cast<int64_t>(d.me) * a.T + t0 + tt) *
                                               L.data_row_bytes
                      : a.out + (t0 + tt) * a.row_bytes;
  ring_start(a, d, tp, lo, ring);
  int64_t base = lo;
  for (; base + kPieceBytes <= end; base += kPieceBytes) {
    combine_piece<kF32, false>(a, d, tp, weights, n_own, reducer, dst, base, ring);
  }
  if (base < end) {
    combine_piece<kF32, true>(a, d, tp, weights, n_own, reducer, dst, base, ring);
  }
}

// One work item: slices [it.k0, it.k1) of chunk it.c of rank s_rank's tokens (reducers) or of this
// rank's (finalisers).
template <bool kF32>
__device__ __forceinline__ void combine_chunk(const CombineArgs& a, const DataWarp& d,
                                              const CombineWarp& w, bool reducer,
                                              const ChunkSlices& it, int s_rank, Ring& ring) {
  const CommLayout& L = a.layout;
  const int64_t t0 = chunk_begin(L, it.c);
  const int n_tok = static_cast<int>(chunk_end(L, it.c, a.T) - t0);
  combine_chunk_lists(a, d, w, reducer, it, s_rank, t0, n_tok);
  combine_chunk_weights(a, w, n_tok, d.lane);
  const int64_t lo = slice_begin(L, it.k0);
  const int64_t end = slice_end(L, it.k1, a.row_bytes);
  for (int tt = 0; tt < n_tok; ++tt) {
    if (w.active[tt]) combine_token<kF32>(a, d, w, reducer, s_rank, t0, tt, lo, end, ring);
  }
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
  Ring ring;
  const CombineWarp w = combine_warp(reinterpret_cast<char*>(dynamic_shared), d.warp, d.lane,
                                     a.list_stride, a.K, a.stages, &ring);
  // (with no other rank there is nothing to reduce and send: every warp finalises)
  const bool reducer = d.R > 1 && d.warp < a.send_warps;
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
    combine_chunk<kF32>(a, d, w, reducer, it, s_rank, ring);
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
                      rank_major,
                      combine_ring_stages(g.num_topk + g.num_ranks, g.num_topk)};
  const int shared_bytes =
      static_cast<int>(combine_shared_bytes(a.list_stride, a.K, a.stages));
  const auto kernel = y_kind == kRowF32 ? combine_main_kernel<true> : combine_main_kernel<false>;
  JAX_EP_CUDA_RETURN(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  JAX_EP_LAUNCH(kernel, g.num_blocks, kDataThreads, shared_bytes, stream)(g.state, a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
