// Throughput combine over NVLink (see combine.h): the start kernel (group.cu), then one data
// kernel whose warps read their rows straight into registers (see below) and are either
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

// Each warp reads the rows it sums straight into registers: a unit is 512 contiguous bytes of a row
// (16 per lane, so that each load or store instruction of the warp covers 512 contiguous bytes), and a
// warp loads kUnits units of up to kRowBatch rows (4 KiB) before it sums the first, in slot order.
// Summing is one conversion and one FMA per element and row. The rows' loads need no shared memory
// and no bookkeeping per piece: the cp.async ring this replaced (48 bytes per lane and piece, 7 pieces
// in flight) took 505.6 us for a DeepSeek-V3 combine on 24 SMs of one H200, this 374.7 us, and a plain
// register-path combine of the same rows 198.5 us with 8 KiB per warp in flight (docs/benchmarks.md,
// session 47: 8 rows x 2 units here spill: 128 registers hold the kernel's other state too). A ring
// of bulk loads into shared memory instead of registers (more bytes in flight) was slower still
// (397.9 us with 2 KiB pieces, session 48): the warps wait for DRAM, so on few SMs each lane asks L2
// for its row's step kPrefetchSteps ahead (prefetch_l2) and the step's loads wait for L2 only; a
// token's row addresses are computed once (CombineWarp::rows), not at every step (292.1 us).
constexpr int kUnitBytes = 512;                 // a warp's unit of a row (16 bytes per lane)
constexpr int kUnits = 2;                       // units of a row summed at once
constexpr int kStepBytes = kUnitBytes * kUnits;  // a step of a row (1 KiB)
constexpr int kRowBatch = 4;                    // rows whose units are loaded before the first is summed
constexpr int kStagedBatch = 4;                 // the same for the staged partials (beside acc)
constexpr int kPrefetchSteps = 1;               // steps of a row asked of L2 ahead of its loads
// Blocks (SMs) up to which the rows are prefetched: with few SMs the warps wait for DRAM's latency,
// with all of them for its bandwidth, and the prefetches cost (one H200, DeepSeek-V3 combine, main us
// with / without, a step at a time: 24 SMs 292.0 / 311.4, 64 148.5 / 152.2, 96 144.8 / 136.6, 131
// 155.0 / 131.3; session 48).
constexpr int kPrefetchMaxBlocks = 64;
// Blocks up to which the prefetch asks for 4 steps every 4 steps (one bulk prefetch per row for 4
// KiB), above them a step every step: fewer prefetches, but 4x the rows' bytes held in L2 (main us,
// a step / 2 / 4 at a time: 24 SMs 292.1 / 277.0 / 270.2, 64 SMs 148.2 / 150.9 / 171.6; session 48).
constexpr int kPrefetchWideMaxBlocks = 24;

// Steps a warp's prefetch asks for at once, every that many steps (0: no prefetch), on num_blocks.
constexpr int prefetch_every(int num_blocks) {
  return num_blocks <= kPrefetchWideMaxBlocks ? 4 : num_blocks <= kPrefetchMaxBlocks ? 1 : 0;
}
static_assert(kSliceBytes % kUnitBytes == 0, "a slice of a row is a whole number of units");

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

// Shared memory of one warp: the current token's row addresses, the chunk's token_rows (then the
// rows' weights, in the same place), the row lists and four per-token counts.
__host__ __device__ constexpr int64_t combine_warp_shared_bytes(int list_stride, int topk) {
  return static_cast<int64_t>(list_stride) * 8 + static_cast<int64_t>(kMaxChunkTokens) * topk * 4 +
         static_cast<int64_t>(kMaxChunkTokens) * list_stride * 4 + 4 * kMaxChunkTokens * 4;
}
// The largest top-k and group still fit an SM (227 KiB of shared memory per block on sm_90).
static_assert(kDataWarps * combine_warp_shared_bytes(kMaxTopk + kMaxGroupRanks, kMaxTopk) <=
                  232448,
              "combine's shared memory must fit every supported top-k and group size");

struct CombineWarp {
  const char** rows;  // [stride]: the current token's entries as row addresses (y or staging)
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
  static constexpr int kPerVec = kF32 ? 4 : 8;         // elements per 16-byte vector (a lane's unit)
  static constexpr int kElems = kUnits * kPerVec;      // elements per lane and step
};

// A step's loads and stores take this lane's 16 bytes of each unit from `at` = row + base + 16 * lane;
// a step at the end of the item's bytes (kTail) only those units before it: lim = end - base -
// 16 * lane, the bytes left from this lane's first one.
template <bool kTail>
__device__ __forceinline__ bool unit_in(int u, int lim) {
  return !kTail || kUnitBytes * u < lim;
}

// This lane's 16 bytes of the step's units of a row (L2 only: peers' writes are never stale in L1).
template <bool kTail>
__device__ __forceinline__ void load_units(const char* at, int lim, uint4 (&v)[kUnits]) {
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    if (unit_in<kTail>(u, lim)) v[u] = __ldcg(reinterpret_cast<const uint4*>(at + kUnitBytes * u));
  }
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

// Writes this lane's share of the step (rounded to y's dtype) at `at` (as load_units).
template <bool kF32, bool kTail>
__device__ __forceinline__ void write_step(char* at, int lim, const float f[Piece<kF32>::kElems]) {
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

// Carves this warp's part out of the kernel's dynamic shared memory.
__device__ __forceinline__ CombineWarp combine_warp(char* dynamic_shared, int warp, int stride,
                                                    int K) {
  CombineWarp w;
  char* base = dynamic_shared + warp * combine_warp_shared_bytes(stride, K);
  w.rows = reinterpret_cast<const char**>(base);  // (8-byte aligned: a warp's part is 8-byte sized)
  w.raw = reinterpret_cast<int32_t*>(base + stride * 8);
  w.weights = reinterpret_cast<float*>(w.raw);
  w.entries = w.raw + kMaxChunkTokens * K;
  w.n_own = w.entries + kMaxChunkTokens * stride;
  w.n_all = w.n_own + kMaxChunkTokens;
  w.in_mask = w.n_all + kMaxChunkTokens;
  w.active = w.in_mask + kMaxChunkTokens;
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

// A batch of up to kRowBatch of a token's y rows from list entry j0 (n of them; all kRowBatch when
// kFull, with no bound checks), summed in slot order into acc: loaded first, then summed.
template <bool kF32, bool kTail, bool kFull>
__device__ __forceinline__ void own_batch(const char* const* rows, const float* weights, int j0,
                                          int n, int64_t off, int lim,
                                          float acc[Piece<kF32>::kElems]) {
  constexpr int kP = Piece<kF32>::kPerVec;
  uint4 v[kRowBatch][kUnits];
  if constexpr (kTail) {  // units past the end are summed (never written): zeros, not garbage
#pragma unroll
    for (int j = 0; j < kRowBatch; ++j)
#pragma unroll
      for (int u = 0; u < kUnits; ++u) v[j][u] = make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int j = 0; j < kRowBatch; ++j) {
    if (kFull || j < n) load_units<kTail>(rows[j0 + j] + off, lim, v[j]);
  }
#pragma unroll
  for (int j = 0; j < kRowBatch; ++j) {
    if (kFull || j < n) {
      const float wj = weights[j0 + j];
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        float f[kP];
        unpack_vector<kF32>(v[j][u], f);
#pragma unroll
        for (int i = 0; i < kP; ++i) acc[kP * u + i] = __fmaf_rn(f[i], wj, acc[kP * u + i]);
      }
    }
  }
}

// This rank's partial of one step of a token: the sum over its n_own y rows in slot order of
// w * y (as the reference: from +0.0, so the first row's term is fma(f, w, +0); an unweighted sum
// has w = 1, and fma(f, 1, acc) is acc + f exactly). rows_as_is (combine_rank_major, one row per
// token and rank): the row itself, -0.0 kept, where +0.0 + row would make it +0.0. `off` =
// base + 16 * lane.
template <bool kF32, bool kTail>
__device__ __forceinline__ void own_partial(const CombineArgs& a, const char* const* rows,
                                            const float* weights, int n_own, int64_t off,
                                            int lim, float acc[Piece<kF32>::kElems]) {
  constexpr int kP = Piece<kF32>::kPerVec;
#pragma unroll
  for (int i = 0; i < Piece<kF32>::kElems; ++i) acc[i] = 0.f;
  if (a.rows_as_is) {
    if (n_own == 0) return;  // (a finaliser's token not routed here)
    uint4 v[kUnits];
    load_units<kTail>(rows[0] + off, lim, v);
#pragma unroll
    for (int u = 0; u < kUnits; ++u) unpack_vector<kF32>(v[u], acc + kP * u);
    return;
  }
  int j0 = 0;
  for (; j0 + kRowBatch <= n_own; j0 += kRowBatch) {
    own_batch<kF32, kTail, true>(rows, weights, j0, kRowBatch, off, lim, acc);
  }
  if (j0 < n_own) own_batch<kF32, kTail, false>(rows, weights, j0, n_own - j0, off, lim, acc);
}

// total += x in rank order: rank 0's term starts the sum (total = x), as the reference's
// sum over ranks from 0.
template <int kE>
__device__ __forceinline__ void add_rank_term(int r, const float x[kE], float total[kE]) {
#pragma unroll
  for (int i = 0; i < kE; ++i) total[i] = r == 0 ? x[i] : __fadd_rn(total[i], x[i]);
}

// The ranks [r, stop) that staged no partial of the token: this rank's own partial `acc`, a
// rank the token did not go to +0.0.
template <int kE>
__device__ __forceinline__ void add_unstaged_ranks(int r, int stop, int me, const float acc[kE],
                                                   float total[kE]) {
  for (; r < stop; ++r) {
    if (r == me) {
      add_rank_term<kE>(r, acc, total);
    } else {
#pragma unroll
      for (int i = 0; i < kE; ++i) total[i] = r == 0 ? 0.f : __fadd_rn(total[i], 0.f);
    }
  }
}

// A finaliser's step of a token: the sum over ranks in rank order (float32) of the partials, its
// own partial `acc` rounded to y's dtype as if it had travelled, the other ranks' staged ones
// (entries [n_own, n_all): -1 - r in rank order, their rows in rows[n_own, n_all); a rank the
// token did not go to adds zero). Returns true with the sum in total; false with no staged partial and
// no other rank, when the sum is acc itself (rounding it to y's dtype first changes nothing written).
template <bool kF32, bool kTail>
__device__ __forceinline__ bool finalise_step(const DataWarp& d, const int32_t* entries,
                                              const char* const* rows, int n_own, int n_all,
                                              int64_t off, int lim,
                                              float acc[Piece<kF32>::kElems],
                                              float total[Piece<kF32>::kElems]) {
  constexpr int kE = Piece<kF32>::kElems;
  constexpr int kP = Piece<kF32>::kPerVec;
  const int n_staged = n_all - n_own;
  if (n_staged == 0 && d.R == 1) return false;
  if constexpr (!kF32) {
#pragma unroll
    for (int i = 0; i < kE; ++i) acc[i] = __bfloat162float(__float2bfloat16_rn(acc[i]));
  }
  if (n_staged == 0) {
    // this rank's partial and +0.0 for every other rank, in rank order: partial + 0.0 (-0.0 becomes
    // +0.0), whichever rank this is
#pragma unroll
    for (int i = 0; i < kE; ++i) total[i] = __fadd_rn(acc[i], 0.f);
    return true;
  }
  int r = 0;  // the ranks below r are in total
  for (int q0 = 0; q0 < n_staged; q0 += kStagedBatch) {
    uint4 v[kStagedBatch][kUnits];
    if constexpr (kTail) {
#pragma unroll
      for (int q = 0; q < kStagedBatch; ++q)
#pragma unroll
        for (int u = 0; u < kUnits; ++u) v[q][u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int q = 0; q < kStagedBatch; ++q) {
      if (q0 + q < n_staged) load_units<kTail>(rows[n_own + q0 + q] + off, lim, v[q]);
    }
#pragma unroll
    for (int q = 0; q < kStagedBatch; ++q) {
      if (q0 + q < n_staged) {
        const int rank = -1 - entries[n_own + q0 + q];
        add_unstaged_ranks<kE>(r, rank, d.me, acc, total);
        float f[kE];
#pragma unroll
        for (int u = 0; u < kUnits; ++u) unpack_vector<kF32>(v[q][u], f + kP * u);
        add_rank_term<kE>(rank, f, total);
        r = rank + 1;
      }
    }
  }
  add_unstaged_ranks<kE>(r, d.R, d.me, acc, total);
  return true;
}

// One step (number `step` of the item) of a token's row at byte `base` (of the item's bytes, which
// end at `end`). Lane j holds row j's address in my_row (null: no row j); every kEvery steps it
// first asks L2 for the kEvery steps of its row from kPrefetchSteps ahead (kEvery 0: never).
template <bool kF32, bool kTail, int kEvery>
__device__ __forceinline__ void combine_step(const CombineArgs& a, const DataWarp& d,
                                             const int32_t* entries, const char* const* rows,
                                             const float* weights, int n_own, int n_all,
                                             bool reducer, char* dst, const char* my_row,
                                             int step, int64_t base, int64_t end) {
  constexpr int kE = Piece<kF32>::kElems;
  if constexpr (kEvery > 0) {
    const int64_t ahead = base + kPrefetchSteps * kStepBytes;
    if (my_row != nullptr && ahead < end && step % kEvery == 0) {
      constexpr int64_t kBytes = kEvery * kStepBytes;
      prefetch_l2(my_row + ahead,
                  static_cast<uint32_t>(end - ahead < kBytes ? end - ahead : kBytes));
    }
  }
  const int64_t off = base + 16 * d.lane;
  const int lim = static_cast<int>(end - off);
  float acc[kE];
  own_partial<kF32, kTail>(a, rows, weights, n_own, off, lim, acc);
  if (reducer) {
    write_step<kF32, kTail>(dst + off, lim, acc);  // rounds to y's dtype
    return;
  }
  float total[kE];
  if (finalise_step<kF32, kTail>(d, entries, rows, n_own, n_all, off, lim, acc, total)) {
    write_step<kF32, kTail>(dst + off, lim, total);
  } else {
    write_step<kF32, kTail>(dst + off, lim, acc);
  }
}

// Token tt of the chunk, step by step of the item's bytes [lo, end) of its row: a reducer writes its
// partial into rank s_rank's staging, a finaliser the output row.
template <bool kF32, int kEvery>
__device__ __forceinline__ void combine_token(const CombineArgs& a, const DataWarp& d,
                                              const CombineWarp& w, bool reducer, int s_rank,
                                              int64_t t0, int tt, int64_t lo, int64_t end) {
  const CommLayout& L = a.layout;
  const int n_own = w.n_own[tt];
  const int n_all = w.n_all[tt];
  const int32_t* entries = w.entries + tt * a.list_stride;
  const float* weights = w.weights + tt * a.K;
  // the token's rows: its y rows, then (finalisers) the other ranks' partials in this rank's
  // staging; lane j prefetches row j (up to K + R rows: those past 32 go without)
  const char* my_row = nullptr;
  for (int j = d.lane; j < n_all; j += 32) {
    const int32_t e = entries[j];
    const char* row = e >= 0 ? a.y + static_cast<int64_t>(e) * a.row_bytes
                             : d.own + L.stage_data +
                                   (static_cast<int64_t>(-1 - e) * a.T + t0 + tt) *
                                       L.data_row_bytes;
    w.rows[j] = row;
    if (j < 32) my_row = row;
  }
  __syncwarp();
  char* dst = reducer ? peer_buffer(d, s_rank) + L.stage_data +
                            (static_cast<int64_t>(d.me) * a.T + t0 + tt) * L.data_row_bytes
                      : a.out + (t0 + tt) * a.row_bytes;
  int64_t base = lo;
  int step = 0;
  for (; base + kStepBytes <= end; base += kStepBytes, ++step) {
    combine_step<kF32, false, kEvery>(a, d, entries, w.rows, weights, n_own, n_all, reducer, dst,
                                      my_row, step, base, end);
  }
  if (base < end) {
    combine_step<kF32, true, kEvery>(a, d, entries, w.rows, weights, n_own, n_all, reducer, dst,
                                     my_row, step, base, end);
  }
  __syncwarp();  // every lane has read the rows' addresses before the next token's take their place
}

// One work item: slices [it.k0, it.k1) of chunk it.c of rank s_rank's tokens (reducers) or of this
// rank's (finalisers).
template <bool kF32, int kEvery>
__device__ __forceinline__ void combine_chunk(const CombineArgs& a, const DataWarp& d,
                                              const CombineWarp& w, bool reducer,
                                              const ChunkSlices& it, int s_rank) {
  const CommLayout& L = a.layout;
  const int64_t t0 = chunk_begin(L, it.c);
  const int n_tok = static_cast<int>(chunk_end(L, it.c, a.T) - t0);
  combine_chunk_lists(a, d, w, reducer, it, s_rank, t0, n_tok);
  combine_chunk_weights(a, w, n_tok, d.lane);
  const int64_t lo = slice_begin(L, it.k0);
  const int64_t end = slice_end(L, it.k1, a.row_bytes);
  for (int tt = 0; tt < n_tok; ++tt) {
    if (w.active[tt]) combine_token<kF32, kEvery>(a, d, w, reducer, s_rank, t0, tt, lo, end);
  }
  __syncwarp();  // every lane's stores of the chunk are done
  if (reducer && d.lane == 0) {
    char* peer = comm_buffer_of(d.state, d.info->ordinals[s_rank]);
    for (int k = it.k0; k < it.k1; ++k) {
      store_release_sys(chunk_flag(peer, L, d.me, it.c, k), d.expected);
    }
  }
}

template <bool kF32, int kEvery>
__global__ void __launch_bounds__(kDataThreads, 1)
    combine_main_kernel(DeviceState* state, CombineArgs a) {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);
  const DataWarp d = data_warp(state, a.layout);
  const CombineWarp w =
      combine_warp(reinterpret_cast<char*>(dynamic_shared), d.warp, a.list_stride, a.K);
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
    combine_chunk<kF32, kEvery>(a, d, w, reducer, it, s_rank);
  }
}

// The slot -> row table of a rank-major handle (launch_rank_major_rows), after a memset to -1.
__global__ void __launch_bounds__(256)
    rank_major_rows_kernel(const int32_t* __restrict__ src_index, int32_t n,
                           int32_t* __restrict__ slot_rows) {
  // int64 index: i + the grid's stride would wrap in int32 for n near 2^31
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int32_t slot = __ldg(src_index + i);
    if (slot >= 0 && slot < n) slot_rows[slot] = static_cast<int32_t>(i);  // (dispatch_rank_major's: unique)
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
  if (!group_launch_ok(g) || row_bytes == 0 || (rank_major && (g.num_topk != 1 || row_weights)) ||
      g.pull) {
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
  const bool f32 = y_kind == kRowF32;
  const int every = prefetch_every(g.num_blocks);
  const auto kernel =
      every == 4   ? (f32 ? combine_main_kernel<true, 4> : combine_main_kernel<false, 4>)
      : every == 1 ? (f32 ? combine_main_kernel<true, 1> : combine_main_kernel<false, 1>)
                   : (f32 ? combine_main_kernel<true, 0> : combine_main_kernel<false, 0>);
  JAX_EP_CUDA_RETURN(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  JAX_EP_LAUNCH(kernel, g.num_blocks, kDataThreads, shared_bytes, stream)(g.state, a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
