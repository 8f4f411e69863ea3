// Broadcast (combine's backward; see broadcast.h): the start kernel (group.cu), then one data
// kernel whose warps are either
//   senders: copy g[t] once to every remote rank the token went to (its staging [me][t]), then a
//     release flag per (chunk, slice, rank); pulled (GroupLaunch::pull, KernelConfig.broadcast_pull;
//     not combine_bwd) once into this rank's own staging [me][t], where the receivers load it;
//   receivers: zero the rows that hold no token of a linked source (src_index -1, or a source the
//     call's mask does not link) and copy each token (own tokens straight from g, remote ones when
//     their chunk flag arrives) to each of its receive rows (token_rows).
// With keep_empty_rows (an unweighted combine's backward in place) the rows with no token keep what
// the caller's aliased buffer holds there.
// A work item is one slice of a chunk's rows (CommLayout::num_slices), except combine_bwd's
// receivers: a row's dot product runs over the whole row in order, so they take whole rows (and
// wait for every slice's flag), up to kBackwardRows of each token's rows per item
// (ceil(K / kBackwardRows) items a chunk).
// broadcast_rank_major is this kernel with K = 1 (token_rows = the handle's slot -> row table).
// combine_bwd is this kernel with a computing receiver: per receive row of a token it reads g[t]
// and y's row and writes d y = w * g (rounded to y's dtype) and d row_weight = <y_row, g[t]> (float32,
// the order of jax_ep.reference.row_dot); its senders join the receivers once their chunks are sent.
#include "cuda/broadcast.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

constexpr int kZeroRows = 256;  // rows per zero-fill work item

// What the receivers do with a token's rows.
enum class Rows { kCopy, kBackwardBF16, kBackwardF32 };

struct BroadcastArgs : DataArgs {
  const char* g;
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  const int32_t* src_index;
  char* out;      // broadcast: the rows; combine_bwd: d y
  int32_t C;
  int32_t op_id;  // kOpBroadcast, kOpBroadcastRankMajor or kOpCombineBwd (named in a timeout)
  // combine_bwd only (null otherwise)
  const char* y;
  const float* row_weights;
  float* d_row_weights;
  bool empty_rows_from_y;  // out already holds y (combine_bwd in place, broadcast keep_empty_rows):
                           // rows with no token keep y's
};

// Blocks (SMs) up to which combine_bwd asks L2 for its rows' y and g ahead of their loads
// (prefetch_l2, a round of loads at a time, kBackwardAheadRounds ahead): on few SMs the rounds' loads
// then wait for L2, not DRAM (as combine's rows, cuda/combine.cu). One H200, DeepSeek-V3 at EP1, one
// row per warp, a whole row at once, main us without / with: 24 SMs 856.9 / 693.2, 64 SMs 401.7 /
// 310.7, 131 SMs 292.4 / 296.9 (session 49).
constexpr unsigned kBackwardPrefetchMaxBlocks = 64;

// g[t] into the staging [me][t] of every remote rank the token went to; pulled (a.pull) once into
// this rank's own, where they load it.
template <bool kTma>
__device__ __forceinline__ void broadcast_send(const BroadcastArgs& a, const DataWarp& d,
                                               TmaWarp& tma) {
  const CommLayout& L = a.layout;
  send_chunks<kTma>(L, d, a.T, true, [&](int64_t t, const ChunkSlices& it) {
    const bool to_peer = d.lane_peer != nullptr && d.lane != d.me &&  // (null: masked)
                         a.is_token_in_rank[t * d.R + d.lane];
    const uint32_t remote = __ballot_sync(kFullMask, to_peer);
    if (remote == 0u) return;
    const int64_t lo = slice_begin(L, it.k0);
    const bool writes = a.pull ? d.lane == d.me : to_peer;  // (lane me's lane_peer: this rank's buffer)
    char* my_dst = writes ? d.lane_peer + L.stage_data +
                                (static_cast<int64_t>(d.me) * a.T + t) * L.data_row_bytes + lo
                          : nullptr;
    warp_copy_row<kTma>(tma, a.g + t * a.row_bytes + lo, slice_end(L, it.k1, a.row_bytes) - lo,
                        a.pull ? 1u << d.me : remote, my_dst, d.lane);
  });
}

// Zero-fill work item `item`: the rows no chunk item writes are zero (combine_bwd: d y and
// d row_weights): those no token landed on (src_index -1) and those of a source this call does not
// link (the receivers skip its chunks; a combine mask after an unmasked dispatch leaves such rows).
__device__ __forceinline__ void broadcast_zero_rows(const BroadcastArgs& a, uint32_t linked,
                                                    int item, int lane) {
  const int64_t lo = static_cast<int64_t>(item) * kZeroRows;
  const int64_t hi = lo + kZeroRows < a.C ? lo + kZeroRows : a.C;
  for (int64_t row0 = lo; row0 < hi; row0 += 32) {
    const int64_t row = row0 + lane;
    const int32_t src = row < hi ? __ldg(a.src_index + row) : 0;
    // (src >= 0: a token of source rank src / T, so T >= 1)
    const bool dead = row < hi && (src < 0 || !has_rank(linked, src / a.T));
    if (dead && a.d_row_weights != nullptr) a.d_row_weights[row] = 0.f;
    // (empty_rows_from_y: a row with no token keeps y's value, already in place)
    const bool zero = dead && !(a.empty_rows_from_y && src < 0);
    for (uint32_t m = __ballot_sync(kFullMask, zero); m != 0u; m &= m - 1u) {
      warp_zero(a.out + (row0 + __ffs(m) - 1) * a.row_bytes, a.row_bytes, lane);
    }
  }
}

// Shrink mode: the item's slices of the rows of source s's tokens are zero (combine_bwd: whole
// rows, d y and d row_weights), as a masked source's: its chunk never came (the handle names the
// rows).
__device__ __forceinline__ void broadcast_zero_source(const BroadcastArgs& a, const CommLayout& L,
                                                      int s, const ChunkSlices& it, int lane) {
  const int64_t lo = slice_begin(L, it.k0);
  const int64_t hi = slice_end(L, it.k1, a.row_bytes);
  for (int64_t t = chunk_begin(L, it.c); t < chunk_end(L, it.c, a.T); ++t) {
    const int64_t slot = static_cast<int64_t>(s) * a.T + t;
    const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
    if (row >= 0 && a.d_row_weights != nullptr) a.d_row_weights[row] = 0.f;
    for (uint32_t m = __ballot_sync(kFullMask, row >= 0); m != 0u; m &= m - 1u) {
      const int64_t r = __shfl_sync(kFullMask, row, __ffs(m) - 1);
      warp_zero(a.out + r * a.row_bytes + lo, hi - lo, lane);
    }
  }
}

// Rows of a token one warp takes at once in combine_bwd: the warp loads g's step once for all of
// them, so g is read from L2 once per kBackwardRows rows, not once per row (with one row per warp, g's
// re-reads were a third of the bytes the SMs moved). One H200, DeepSeek-V3 at EP1, main us on 24 /
// 64 / 131 SMs: one row per warp 693.8 / 311.4 / 288.8, 2 rows 611.5 / 290.9 / 277.4, 3 rows 579.4 /
// 276.6 / 271.8 (session 50: 3 rows spill 16-48 bytes with 128 registers, 4 rows 16-268 bytes and
// were slower). What bounds it on 24 SMs is the SMs' request path to L2 (ncu, session 51: 86% busy):
// d y's writes take one cycle per 32 bytes there, as dispatch's do, and the requests for y, g and
// the prefetches add ~60%; the writes and reads alone are 1.34x dispatch's cycles on that path.
constexpr int kBackwardRows = 3;
// Steps of its rows a lane loads before it computes: the rows are one warp's chain of
// steps / kBackwardUnroll dependent rounds of loads (the latency floor of the rows), each round
// (kBackwardRows + 1) * kBackwardUnroll loads of 16 (bf16) or 32 (f32) bytes per lane (f32 at 2
// spills).
template <bool kF32>
constexpr int kBackwardUnroll = kF32 ? 1 : 2;
// Rounds ahead of the loads that a warp's prefetch asks for (each round asks for one more): only the
// rows' next bytes are held in L2, not whole rows (2-4 rows of 14 KiB a warp overflowed L2 on 64 SMs:
// 331.9-389.7 us; 2 or 3 rounds ahead: no better, session 50).
constexpr int kBackwardAheadRounds = 1;

// combine_bwd of n (1..kBackwardRows) receive rows of one token on this rank, rows[0..n): per row
// d y = w * g (one float32 product, rounded to the row dtype) and d row_weight = the float32 dot
// product of y's row and g in jax_ep.reference.row_dot's order: lane l takes the 8 elements at
// 256 s + 8 l of step s (zeros past H), sums each element's products over the steps in order (no
// FMA), then its 8 sums pairwise (i + 4, + 2, + 1), then the warp's butterfly over lanes (l ^ 16,
// ..., l ^ 1). g is read once for the n rows (from L2); y is read and d y written once. Every lane
// calls it with the same rows and n.
template <bool kF32>
__device__ __forceinline__ void combine_bwd_rows(const BroadcastArgs& a, const char* g_row,
                                                 const int32_t (&rows)[kBackwardRows], int n,
                                                 int lane) {
  constexpr int kN = kBackwardRows;
  constexpr int kU = kBackwardUnroll<kF32>;
  const int H = a.row_bytes / (kF32 ? 4 : 2);
  const int steps = (H + 255) / 256;
  const int64_t dy_minus_y = a.out - a.y;  // (d y's row = y's row + this)
  const char* y_rows[kN];
  float w[kN];
#pragma unroll
  for (int r = 0; r < kN; ++r) {
    y_rows[r] = r < n ? a.y + static_cast<int64_t>(rows[r]) * a.row_bytes : nullptr;
    w[r] = r < n ? __ldg(a.row_weights + rows[r]) : 0.f;
  }
  // the prefetch: lane r asks for y's row r, lane kN for g (null: no prefetch)
  const char* mine = nullptr;
  if (gridDim.x <= kBackwardPrefetchMaxBlocks) {
#pragma unroll
    for (int r = 0; r < kN; ++r) mine = lane == r ? y_rows[r] : mine;
    if (lane == kN) mine = g_row;
  }
  constexpr int64_t kRoundBytes = kU * 256 * (kF32 ? 4 : 2);
  const auto ask = [&](int64_t round0, int rounds) {  // rounds [round0, + rounds) of my row
    const int64_t lo = round0 * kRoundBytes;
    const int64_t end = lo + rounds * kRoundBytes;
    const int64_t hi = end < a.row_bytes ? end : a.row_bytes;
    if (mine != nullptr && lo < hi) prefetch_l2(mine + lo, static_cast<uint32_t>(hi - lo));
  };
  ask(1, kBackwardAheadRounds);  // (round 0's loads follow at once)
  float acc[kN][8] = {};  // (step 0 sets them)
  for (int s0 = 0; s0 < steps; s0 += kU) {
    if (s0 > 0) ask(s0 / kU + kBackwardAheadRounds, 1);
    Raw8<kF32> g[kU], y[kU][kN];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int e0 = (s0 + u) * 256 + lane * 8;
      const bool in = s0 + u < steps && e0 < H;
      g[u] = in ? load_raw8<kF32>(g_row, e0) : Raw8<kF32>{};  // (zeros: bits 0 are 0.f)
#pragma unroll
      for (int r = 0; r < kN; ++r) {
        y[u][r] = in && r < n ? load_raw8<kF32>(y_rows[r], e0) : Raw8<kF32>{};
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (s0 + u >= steps) break;
      const int e0 = (s0 + u) * 256 + lane * 8;
      float gf[8];
      unpack8<kF32>(g[u], gf);
#pragma unroll
      for (int r = 0; r < kN; ++r) {
        if (r >= n) break;
        float yf[8], dy[8];
        unpack8<kF32>(y[u][r], yf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dy[i] = __fmul_rn(gf[i], w[r]);
          const float p = __fmul_rn(yf[i], gf[i]);
          acc[r][i] = s0 + u == 0 ? p : __fadd_rn(acc[r][i], p);
        }
        if (e0 < H) store8<kF32>(const_cast<char*>(y_rows[r]) + dy_minus_y, e0, dy);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kN; ++r) {
    if (r >= n) break;
#pragma unroll
    for (int half = 4; half >= 1; half >>= 1) {
#pragma unroll
      for (int i = 0; i < half; ++i) acc[r][i] = __fadd_rn(acc[r][i], acc[r][i + half]);
    }
    float dot = acc[r][0];
#pragma unroll
    for (int offset = 16; offset >= 1; offset >>= 1) {
      dot = __fadd_rn(dot, __shfl_xor_sync(kFullMask, dot, offset));
    }
    if (lane == 0) a.d_row_weights[rows[r]] = dot;
  }
}

template <bool kTma, Rows kRows>
__device__ __forceinline__ void broadcast_receive(const BroadcastArgs& a, const DataWarp& d,
                                                  TmaWarp& tma) {
  const CommLayout& L = a.layout;
  const int64_t T = a.T;
  const int lane = d.lane;
  // widened: C + kZeroRows - 1 wraps in int32 near C = 2^31
  const int n_zero = static_cast<int>((static_cast<int64_t>(a.C) + kZeroRows - 1) / kZeroRows);
  constexpr bool kSliced = kRows == Rows::kCopy;  // (combine_bwd: whole rows, see the top)
  // combine_bwd: `parts` items per chunk, part j taking rows j kBackwardRows .. + kBackwardRows - 1
  // of each token's rows here (in slot order), so that a token's rows run on several warps at once
  // (rows are a chain of dependent loads: one warp per token was ~100 us at 128 tokens). In shrink
  // mode one part: every row of a token from a source, or none (wait_chunk_flags).
  const int parts = kSliced || a.shrink ? 1 : (a.K + kBackwardRows - 1) / kBackwardRows;
  // own items, then (item, other rank); a chunk's parts next to each other
  const int n_chunk_items = chunk_items(L, kSliced) * d.R * parts;
  for (;;) {
    int item = next_item(&d.info->work[1]);
    if (item >= n_zero + n_chunk_items) break;
    if (item < n_zero) {
      broadcast_zero_rows(a, d.linked, item, lane);
      continue;
    }
    item -= n_zero;
    const int part = item % parts;
    item /= parts;
    int s;
    ChunkSlices it;
    if (!receive_chunk_item<kTma>(item, d.state, L, d.info, d.own, a.op_id, a.shrink, kSliced,
                                  lane, &s, &it)) {
      // a source not linked: its rows are the zero-fill's (broadcast_zero_rows); in shrink mode a
      // linked one whose chunk never came: its tokens' rows are zero here, as a masked source's
      if (has_rank(d.linked, s)) broadcast_zero_source(a, L, s, it, lane);  // (parts == 1)
      continue;
    }
    const int64_t lo = slice_begin(L, it.k0);  // the item's bytes of each row
    const int64_t bytes = slice_end(L, it.k1, a.row_bytes) - lo;
    // a remote source's staging: this rank's, or pulled (broadcast only), the source's own
    const char* staging = kRows == Rows::kCopy && a.pull ? peer_buffer(d, s) : d.own;
    for (int64_t t = chunk_begin(L, it.c); t < chunk_end(L, it.c, T); ++t) {
      const int64_t slot = static_cast<int64_t>(s) * T + t;
      const char* src =
          s == d.me ? a.g + t * a.row_bytes : staging + L.stage_data + slot * L.data_row_bytes;
      if constexpr (kRows == Rows::kCopy) {
        const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
        const uint32_t kept = __ballot_sync(kFullMask, row >= 0);
        if (kept == 0u) continue;
        char* my_dst = row >= 0 ? a.out + static_cast<int64_t>(row) * a.row_bytes + lo : nullptr;
        warp_copy_row<kTma>(tma, src + lo, bytes, kept, my_dst, lane);
      } else {
        const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
        // the lanes of the token's rows not yet taken (slot order), past the other parts' groups
        const auto skip = [](uint32_t m, int groups) {
          for (int j = 0; j < groups * kBackwardRows && m != 0u; ++j) m &= m - 1u;
          return m;
        };
        uint32_t here = skip(__ballot_sync(kFullMask, row >= 0), part);
        while (here != 0u) {  // (the same rows in every lane)
          int32_t rows[kBackwardRows];
          int n = 0;
#pragma unroll
          for (int r = 0; r < kBackwardRows; ++r) {
            rows[r] = __shfl_sync(kFullMask, row, here != 0u ? __ffs(here) - 1 : 0);
            n += here != 0u;
            here &= here - 1u;
          }
          combine_bwd_rows<kRows == Rows::kBackwardF32>(a, src, rows, n, lane);
          here = skip(here, parts - 1);
        }
      }
    }
  }
}

template <bool kTma, Rows kRows>
__global__ void __launch_bounds__(kDataThreads, 1)
    broadcast_main_kernel(DeviceState* state, BroadcastArgs a) {
  run_data_warps<kTma>(
      state, a.layout, a.send_warps,
      [&](const DataWarp& d, TmaWarp& tma) {
        broadcast_send<kTma>(a, d, tma);
        // combine_bwd: the receivers' work (y read, d y written) dwarfs the sends of g
        if constexpr (kRows != Rows::kCopy) broadcast_receive<kTma, kRows>(a, d, tma);
      },
      [&](const DataWarp& d, TmaWarp& tma) { broadcast_receive<kTma, kRows>(a, d, tma); });
}

// The start kernel, then the data kernel (bulk-copy senders when use_tma).
template <Rows kRows>
cudaError_t launch_broadcast_kernels(const GroupLaunch& g, const BroadcastArgs& a, int32_t hidden,
                                     int32_t kind, bool use_tma, cudaStream_t stream) {
  JAX_EP_CUDA_RETURN(launch_start(g, group_fingerprint(g, a.op_id, hidden, kind), stream));
  if (use_tma) {
    const auto kernel = broadcast_main_kernel<true, kRows>;
    JAX_EP_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kTmaSharedBytes));
    JAX_EP_LAUNCH(kernel, g.num_blocks, kDataThreads, kTmaSharedBytes, stream)(g.state, a);
  } else {
    const auto kernel = broadcast_main_kernel<false, kRows>;
    JAX_EP_LAUNCH(kernel, g.num_blocks, kDataThreads, 0, stream)(g.state, a);
  }
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             bool rank_major, bool keep_empty_rows, void* out,
                             cudaStream_t stream) {
  const int32_t row_bytes = float_row_bytes(hidden, g_kind);
  if (!group_launch_ok(g) || row_bytes == 0 || (rank_major ? g.num_topk != 1 : capacity < 1) ||
      (rank_major && keep_empty_rows)) {
    return cudaErrorInvalidValue;
  }
  const BroadcastArgs a{data_args(g, row_bytes), static_cast<const char*>(grad), token_rows,
                        is_token_in_rank, src_index, static_cast<char*>(out), capacity,
                        rank_major ? kOpBroadcastRankMajor : kOpBroadcast, nullptr, nullptr,
                        nullptr, keep_empty_rows};
  return launch_broadcast_kernels<Rows::kCopy>(g, a, hidden, g_kind, use_tma, stream);
}

cudaError_t launch_combine_bwd(const GroupLaunch& g, const void* grad, const void* y,
                               const float* row_weights, const int32_t* token_rows,
                               const bool* is_token_in_rank, const int32_t* src_index,
                               int32_t capacity, int32_t hidden, int32_t kind, bool use_tma,
                               void* dy, float* d_row_weights, cudaStream_t stream) {
  const int32_t row_bytes = float_row_bytes(hidden, kind);
  // (no pull form: its receivers read g once per group of rows, which over NVLink would cross it
  // ~K / kBackwardRows times)
  if (!group_launch_ok(g) || row_bytes == 0 || capacity < 1 || y == nullptr ||
      row_weights == nullptr || d_row_weights == nullptr || g.pull) {
    return cudaErrorInvalidValue;
  }
  const BroadcastArgs a{data_args(g, row_bytes), static_cast<const char*>(grad), token_rows,
                        is_token_in_rank, src_index, static_cast<char*>(dy), capacity,
                        kOpCombineBwd, static_cast<const char*>(y), row_weights, d_row_weights,
                        dy == y};
  return kind == kRowF32
             ? launch_broadcast_kernels<Rows::kBackwardF32>(g, a, hidden, kind, use_tma, stream)
             : launch_broadcast_kernels<Rows::kBackwardBF16>(g, a, hidden, kind, use_tma, stream);
}

}  // namespace jax_ep
