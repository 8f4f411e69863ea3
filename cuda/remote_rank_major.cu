// The rank-major ops over NVSHMEM puts (see remote_rank_major.h). Relocatable device code
// (kernels_rdc), device-linked with libnvshmem_device.a like remote.cu.
//
// Four kernels per op on XLA's stream (stream order makes each one's writes visible to the next):
//   start    (1 block): group discovery through puts (this rank's directory entry and config
//            fingerprint go to EVERY PE with nvshmem_uint64_p; it waits for its own directory to
//            show the call for all R ranks, then compares fingerprints), then each token's place
//            among the tokens going to each rank (token order), the per-destination counts and the
//            send headers. The discovery is the call's start barrier: every peer has entered this
//            call, so it has finished reading what the previous call put into its buffer; hence no
//            double buffering (a peer cannot put call n + 1 before this rank entered call n + 1).
//   pack     (num_blocks): the records for each destination, contiguous, in token order, into the
//            send regions (dispatch converts each row once, BF16 rounding / FP8 quantisation fused,
//            and writes it for every destination).
//   transfer (R blocks): block r does one nvshmemx_putmem_signal_nbi_block of region r (header +
//            its records) into region `me` of rank r's receive area; the signal sets rank r's
//            put_signal[my slot] to the call's flag value after the data. Then nvshmem_quiet: the
//            puts are complete before the kernel ends (the next call may refill the send regions).
//   receive  (num_blocks): bounded wait for every source's signal (a missing one records a timeout
//            naming the op, this rank and the source, then traps), then the outputs: dispatch and
//            broadcast compact the regions into rows packed from row 0, source-rank major (empty
//            tail zero); combine sums each token's returned rows in float32 in rank order.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common.cuh"
#include "cuda/ep_device.cuh"
#include "cuda/fingerprint.cuh"
#include "cuda/remote_rank_major.h"

namespace jax_ep {
namespace {

constexpr int kStartThreads = 256;
constexpr int kStartWarps = kStartThreads / 32;
static_assert(kStartThreads >= kMaxDevices, "discovery needs one thread per slot");
constexpr int kPutThreads = 512;

enum PutOpKind : int32_t { kPutDispatch = 0, kPutCombine = 1, kPutBroadcast = 2 };

// The arguments of each kernel (start, pack, receive): the launch itself (passed by value) plus
// what that kernel adds.
struct PutStartArgs : PutLaunch {
  OpFingerprint fp;
  int32_t kind;                    // PutOpKind
  const int32_t* topk_idx;         // dispatch
  bool* is_token_in_rank_out;      // dispatch: written here
  const bool* is_token_in_rank;    // combine / broadcast: the handle's
  const int32_t* src_index;        // combine: the handle's
};

__device__ __forceinline__ char* own_buffer(DeviceState* state) {
  return reinterpret_cast<char*>(state->tables.symmetric_buffer);
}

// Group discovery over puts: discover_group (ep_device.cuh) with nvshmem_uint64_p instead of peer
// stores, so a peer without a load/store address (another node) takes part. Every PE of the job
// gets the entry (the rank -> PE table is what this builds), as every managed device does there.
__device__ __forceinline__ void discover_group_put(DeviceState* state, const int32_t* rank_ptr,
                                                   const int32_t* group_ptr, int32_t axis_slot,
                                                   uint64_t needed_bytes, const OpFingerprint& fp,
                                                   OpInfo* info) {
  const int32_t group_size = fp.ranks;
  const int32_t op_id = fp.op;
  if (threadIdx.x == 0) {
    const CallStart s = load_call_start(state, rank_ptr, group_ptr, nullptr, group_size);
    check_call_args(state, s.rank, s.group, group_size, axis_slot, op_id);
    if (state->tables.symmetric_buffer == nullptr) {  // model 1 (refused by the handler)
      record_fault_and_trap(state, kFaultStaleRuntime, op_id, s.rank, -1, -1, needed_bytes, 0, 0);
    }
    begin_group_call(state, s, group_size, axis_slot, needed_bytes, op_id, info);
  }
  __syncthreads();
  const uint64_t epoch = info->expected >> 16;
  const int group = info->group;
  const int rank = info->rank;
  const uint64_t entry = (epoch << 16) | static_cast<uint64_t>(state->tables.slot);
  const int num_pes = nvshmem_n_pes();
  // symmetric addresses of this PE's own state: NVSHMEM maps them to each target PE's copy
  uint64_t* const directory = &state->sync.directory[axis_slot][group][rank];
  uint64_t* const words = state->sync.fingerprints[axis_slot][group][rank];
  const uint64_t tag = epoch << 32;
  for (int pe = threadIdx.x; pe < num_pes && pe < kMaxDevices; pe += blockDim.x) {
    nvshmem_uint64_p(directory, entry, pe);
    // no ordering needed: the reader polls until the words carry this call's epoch
    for (int f = 0; f < kFingerprintWords; ++f) {
      nvshmem_uint64_p(words + f, tag | fingerprint_value(fp, f + 1), pe);
    }
  }
  bool differs = false;
  if (static_cast<int>(threadIdx.x) < group_size) {
    const int peer = static_cast<int>(threadIdx.x);
    uint64_t seen;  // (no shrink mode over puts: a timeout traps)
    wait_directory_entry(state, axis_slot, group, peer, epoch, op_id, rank, false, &seen);
    const int32_t ordinal = static_cast<int32_t>(seen & 0xFFFF);
    info->ordinals[peer] = ordinal;
    differs =
        peer_call_differs(state, axis_slot, group, rank, peer, ordinal, epoch, seen >> 16, fp);
  }
  trap_if_any_differs(differs);  // a block barrier: info is complete after it
}

// Destinations (bit r: rank r) of token t.
__device__ __forceinline__ uint32_t token_mask(const PutStartArgs& a, int64_t t, int R) {
  uint32_t mask = 0;
  if (a.kind == kPutDispatch) {
    const int K = a.num_topk;
    const int32_t* ids = a.topk_idx + t * K;
    const int local = a.num_experts / R;
    for (int k = 0; k < K; ++k) {
      const int32_t e = sanitized_expert(ids, k, a.num_experts);
      if (e >= 0) mask |= 1u << (e / local);
    }
    for (int r = 0; r < R; ++r) a.is_token_in_rank_out[t * R + r] = ((mask >> r) & 1u) != 0;
  } else {
    for (int r = 0; r < R; ++r) mask |= a.is_token_in_rank[t * R + r] ? 1u << r : 0u;
  }
  return mask;
}

__global__ void __launch_bounds__(kStartThreads) put_start_kernel(PutStartArgs a) {
  __shared__ OpInfo info;
  __shared__ int32_t carry[kMaxGroupRanks];
  __shared__ int32_t warp_total[kStartWarps][kMaxGroupRanks];
  DeviceState* const state = a.state;
  const PutLayout& L = a.layout;
  discover_group_put(state, a.rank, a.group, a.axis_slot, L.total, a.fp, &info);
  char* const own = own_buffer(state);
  const int R = info.size;
  const int me = info.rank;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    OpInfo* out = reinterpret_cast<OpInfo*>(own + L.op_info);
    out->expected = info.expected;
    out->rank = me;
    out->size = R;
    out->group = info.group;
    out->total_rows = 0;
    for (int i = 0; i < 4; ++i) out->work[i] = 0;
    for (int r = 0; r < kMaxGroupRanks; ++r) out->ordinals[r] = r < R ? info.ordinals[r] : -1;
  }
  if (static_cast<int>(threadIdx.x) < kMaxGroupRanks) carry[threadIdx.x] = 0;
  __syncthreads();

  // positions[t][r]: token t's place among the tokens with bit r, in token order (ballot + popc
  // per warp, warp totals in shared memory, a running carry per rank across tiles).
  int32_t* const positions = reinterpret_cast<int32_t*>(own + L.positions);
  const int64_t T = a.num_tokens;
  for (int64_t base = 0; base < T; base += kStartThreads) {
    const int64_t t = base + threadIdx.x;
    const uint32_t mask = t < T ? token_mask(a, t, R) : 0u;
    for (int r = 0; r < R; ++r) {
      const unsigned bits = __ballot_sync(kFullMask, (mask >> r) & 1u);
      if (lane == 0) warp_total[warp][r] = __popc(bits);
    }
    __syncthreads();
    for (int r = 0; r < R; ++r) {
      const unsigned bits = __ballot_sync(kFullMask, (mask >> r) & 1u);
      if (t < T) {
        int32_t place = -1;
        if ((mask >> r) & 1u) {
          place = carry[r] + __popc(bits & lanemask_lt());
          for (int w = 0; w < warp; ++w) place += warp_total[w][r];
        }
        positions[t * R + r] = place;
      }
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < R) {
      for (int w = 0; w < kStartWarps; ++w) carry[threadIdx.x] += warp_total[w][threadIdx.x];
    }
    __syncthreads();
  }

  int32_t* const counts = reinterpret_cast<int32_t*>(own + L.counts);
  int32_t* const offsets = reinterpret_cast<int32_t*>(own + L.offsets);
  if (a.kind == kPutCombine) {
    // What goes back: this rank's rows of source s are y[offsets[s], + counts[s]) (the handle's
    // rows are source-rank major, token order within), returned in that order.
    __shared__ int32_t from_source[kMaxGroupRanks];
    if (static_cast<int>(threadIdx.x) < R) from_source[threadIdx.x] = 0;
    __syncthreads();
    const int64_t rows = static_cast<int64_t>(R) * T;
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
      const int32_t src = a.src_index[i];
      if (src >= 0 && src / T < R) atomicAdd(&from_source[src / T], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t at = 0;
      for (int s = 0; s < R; ++s) {
        counts[s] = from_source[s];
        offsets[s] = at;
        at += from_source[s];
      }
    }
  } else if (static_cast<int>(threadIdx.x) < R) {
    counts[threadIdx.x] = carry[threadIdx.x];
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < R) {
    *reinterpret_cast<int32_t*>(own + L.send + threadIdx.x * L.region_bytes) =
        counts[threadIdx.x];
  }
  (void)me;
}

// What the kernels after put_start_kernel read first: this rank's symmetric buffer and the call's
// group as the start kernel wrote it there (its size R and this rank's place me in it), with the
// tokens per rank T and top-k K of the launch.
struct PutCall {
  char* own;
  const OpInfo* info;
  int R;
  int me;
  int64_t T;
  int K;
};

__device__ __forceinline__ PutCall put_call(const PutLaunch& a) {
  char* const own = own_buffer(a.state);
  const OpInfo* info = reinterpret_cast<const OpInfo*>(own + a.layout.op_info);
  return {own, info, info->size, info->rank, a.num_tokens, a.num_topk};
}

// ---- pack ------------------------------------------------------------------------------------
struct PutPackArgs : PutLaunch {
  int32_t kind;
  const char* x;               // dispatch: x; broadcast: g; combine: y
  const int32_t* topk_idx;     // dispatch
  const float* topk_weights;   // dispatch
  const int32_t* src_index;    // combine
};

template <bool kXF32, int kOut>
__device__ __forceinline__ void pack_converted(const char* x_row, int H, uint32_t mask,
                                               char* my_dst, float* my_scales, int lane) {
  warp_copy_convert<kXF32, kOut, 1>(x_row, H, mask, my_dst, my_scales, lane);
}

__global__ void __launch_bounds__(kPutThreads) put_pack_kernel(PutPackArgs a) {
  const PutLayout& L = a.layout;
  const auto [own, info, R, me, T, K] = put_call(a);
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int32_t* positions = reinterpret_cast<const int32_t*>(own + L.positions);
  const int32_t* offsets = reinterpret_cast<const int32_t*>(own + L.offsets);
  char* const send = own + L.send;
  const uint64_t rec = L.record_bytes;
  const int64_t row_bytes = static_cast<int64_t>(L.row_bytes);
  if (a.kind == kPutCombine) {
    // row i of y goes back to its source s, at its place among s's rows here
    const int64_t rows = R * T;
    for (int64_t i = warp; i < rows; i += warps) {
      const int32_t src = a.src_index[i];
      if (src < 0 || src / T >= R) continue;
      const int s = static_cast<int>(src / T);
      char* dst = send + s * L.region_bytes + kPutHeaderBytes + (i - offsets[s]) * rec;
      warp_copy_raw<4>(a.x + i * row_bytes, row_bytes, 1u, dst, lane);
    }
    return;
  }
  // dispatch / broadcast: token t once per destination (lane r holds destination r's record)
  const int local = a.num_experts > 0 ? a.num_experts / R : 0;
  const int64_t x_row_bytes = a.kind == kPutDispatch
                                  ? static_cast<int64_t>(a.hidden) * (a.x_kind == kRowF32 ? 4 : 2)
                                  : row_bytes;
  for (int64_t t = warp; t < T; t += warps) {
    const int32_t place = lane < R ? positions[t * R + lane] : -1;
    const uint32_t mask = __ballot_sync(kFullMask, place >= 0);
    if (mask == 0u) continue;
    char* my_dst = place >= 0 ? send + lane * L.region_bytes + kPutHeaderBytes + place * rec
                              : nullptr;
    const char* x_row = a.x + t * x_row_bytes;
    if (a.kind == kPutBroadcast || a.x_kind == a.row_kind) {
      warp_copy_raw<4>(x_row, row_bytes, mask, my_dst, lane);
    } else {
      float* my_scales =
          my_dst != nullptr ? reinterpret_cast<float*>(my_dst + L.scales_at) : nullptr;
      const bool xf32 = a.x_kind == kRowF32;
      if (a.row_kind == kRowFP8) {
        if (xf32) {
          pack_converted<true, kRowFP8>(x_row, a.hidden, mask, my_dst, my_scales, lane);
        } else {
          pack_converted<false, kRowFP8>(x_row, a.hidden, mask, my_dst, my_scales, lane);
        }
      } else {  // f32 x, bf16 rows
        pack_converted<true, kRowBF16>(x_row, a.hidden, mask, my_dst, my_scales, lane);
      }
    }
    if (a.kind == kPutDispatch && my_dst != nullptr) {
      // lane r: the slots' local ids on rank r and their gate weights, and the source slot
      int32_t* ids = reinterpret_cast<int32_t*>(my_dst + L.ids_at);
      float* weights = reinterpret_cast<float*>(my_dst + L.weights_at);
      const int32_t* token_ids = a.topk_idx + t * K;
      for (int k = 0; k < K; ++k) {
        const int32_t e = sanitized_expert(token_ids, k, a.num_experts);
        const bool here = e >= 0 && e / local == lane;
        ids[k] = here ? e - lane * local : -1;
        weights[k] = here ? a.topk_weights[t * K + k] : 0.0f;
      }
      *reinterpret_cast<int32_t*>(my_dst + L.src_at) = static_cast<int32_t>(me * T + t);
    }
  }
}

// ---- transfer ----------------------------------------------------------------------------------
__global__ void __launch_bounds__(kPutThreads) put_transfer_kernel(PutLaunch a) {
  DeviceState* const state = a.state;
  const PutLayout& L = a.layout;
  const auto [own, info, R, me, T, K] = put_call(a);
  const int dest = blockIdx.x;
  const int32_t* counts = reinterpret_cast<const int32_t*>(own + L.counts);
  const uint64_t bytes = kPutHeaderBytes + static_cast<uint64_t>(counts[dest]) * L.record_bytes;
  // this PE's symmetric addresses; NVSHMEM maps destination and signal to the PE's copies
  nvshmemx_putmem_signal_nbi_block(own + L.recv + me * L.region_bytes,
                                   own + L.send + dest * L.region_bytes, bytes,
                                   &state->sync.put_signal[state->tables.slot], info->expected,
                                   NVSHMEM_SIGNAL_SET, info->ordinals[dest]);
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_quiet();  // delivered and the source reusable before the end
}

// ---- receive -----------------------------------------------------------------------------------
struct PutReceiveArgs : PutLaunch {
  int32_t kind;
  int32_t op_id;
  char* rows;                    // dispatch / broadcast: [R*T] rows; combine: out [T]
  float* scales;                 // dispatch FP8
  int32_t* row_ids;
  float* row_weights;
  int32_t* tokens_per_rank;
  int32_t* tokens_per_expert;
  int32_t* src_index;
};

template <bool kF32>
__device__ __forceinline__ void combine_token(const PutReceiveArgs& a, const char* recv,
                                              const int32_t* positions, int R, int64_t t,
                                              int lane) {
  const PutLayout& L = a.layout;
  const uint64_t rec = L.record_bytes;
  char* out = a.rows + t * static_cast<int64_t>(L.row_bytes);
  for (int64_t e0 = static_cast<int64_t>(lane) * 8; e0 < a.hidden; e0 += 256) {
    float total[8];
    for (int r = 0; r < R; ++r) {
      const int32_t place = positions[t * R + r];
      float v[8];
      if (place >= 0) {
        load8<kF32>(recv + r * L.region_bytes + kPutHeaderBytes + place * rec, e0, v);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;  // a rank the token did not go to adds +0.0
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) total[i] = r == 0 ? v[i] : __fadd_rn(total[i], v[i]);
    }
    store8<kF32>(out, e0, total);
  }
}

__global__ void __launch_bounds__(kPutThreads) put_receive_kernel(PutReceiveArgs a) {
  __shared__ int32_t first_row[kMaxGroupRanks + 1];
  JAX_EP_DYNAMIC_SHARED(int32_t, expert_count);  // dispatch, block 0: [E_local]
  DeviceState* const state = a.state;
  const PutLayout& L = a.layout;
  const auto [own, info, R, me, T, K] = put_call(a);
  const int lane = threadIdx.x & 31;
  const char* const recv = own + L.recv;
  if (static_cast<int>(threadIdx.x) < R) {
    const int source = threadIdx.x;
    const int32_t slot = info->ordinals[source];
    wait_flag_equal(&state->sync.put_signal[slot], info->expected, state, a.op_id, me, source,
                    slot);
  }
  __syncthreads();  // every source's rows are here (the waits end with an acquire)
  if (threadIdx.x == 0) {
    int32_t at = 0;
    for (int s = 0; s < R; ++s) {
      first_row[s] = at;
      at += __ldcv(reinterpret_cast<const int32_t*>(recv + s * L.region_bytes));
    }
    first_row[R] = at;
  }
  __syncthreads();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const uint64_t rec = L.record_bytes;
  const int64_t row_bytes = static_cast<int64_t>(L.row_bytes);

  if (a.kind == kPutCombine) {
    const int32_t* positions = reinterpret_cast<const int32_t*>(own + L.positions);
    for (int64_t t = warp; t < T; t += warps) {
      if (a.row_kind == kRowF32) {
        combine_token<true>(a, recv, positions, R, t, lane);
      } else {
        combine_token<false>(a, recv, positions, R, t, lane);
      }
    }
    return;
  }

  // dispatch / broadcast: output row o is record (o - first_row[s]) of source s, or empty
  const int64_t rows = R * T;
  const bool dispatch = a.kind == kPutDispatch;
  const int num_scales = a.scales != nullptr ? static_cast<int>(a.hidden / kFp8Block) : 0;
  for (int64_t o = warp; o < rows; o += warps) {
    int s = 0;
    while (s < R && o >= first_row[s + 1]) ++s;
    char* out = a.rows + o * row_bytes;
    if (s >= R) {  // the empty tail: zero rows, ids -1, weights 0, src_index -1
      warp_zero(out, row_bytes, lane);
      if (dispatch) {
        for (int i = lane; i < num_scales; i += 32) a.scales[o * num_scales + i] = 0.0f;
        for (int k = lane; k < K; k += 32) {
          a.row_ids[o * K + k] = -1;
          a.row_weights[o * K + k] = 0.0f;
        }
        if (lane == 0) a.src_index[o] = -1;
      }
      continue;
    }
    const char* record = recv + s * L.region_bytes + kPutHeaderBytes + (o - first_row[s]) * rec;
    warp_copy_raw<4>(record, row_bytes, 1u, out, lane);
    if (dispatch) {
      const float* sc = reinterpret_cast<const float*>(record + L.scales_at);
      for (int i = lane; i < num_scales; i += 32) a.scales[o * num_scales + i] = sc[i];
      const int32_t* ids = reinterpret_cast<const int32_t*>(record + L.ids_at);
      const float* weights = reinterpret_cast<const float*>(record + L.weights_at);
      for (int k = lane; k < K; k += 32) {
        a.row_ids[o * K + k] = ids[k];
        a.row_weights[o * K + k] = weights[k];
      }
      if (lane == 0) a.src_index[o] = *reinterpret_cast<const int32_t*>(record + L.src_at);
    }
  }
  if (!dispatch || blockIdx.x != 0) return;
  // block 0: rows per source, and (token, local expert) pairs per local expert
  if (static_cast<int>(threadIdx.x) < R) {
    a.tokens_per_rank[threadIdx.x] = first_row[threadIdx.x + 1] - first_row[threadIdx.x];
  }
  const int local_experts = a.num_experts / a.num_ranks;
  for (int e = threadIdx.x; e < local_experts; e += blockDim.x) expert_count[e] = 0;
  __syncthreads();
  const int64_t filled = first_row[R];
  for (int64_t i = threadIdx.x; i < filled * K; i += blockDim.x) {
    const int64_t o = i / K;
    int s = 0;
    while (s < R && o >= first_row[s + 1]) ++s;
    const char* record = recv + s * L.region_bytes + kPutHeaderBytes + (o - first_row[s]) * rec;
    const int32_t id = reinterpret_cast<const int32_t*>(record + L.ids_at)[i % K];
    if (id >= 0 && id < local_experts) atomicAdd(&expert_count[id], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < local_experts; e += blockDim.x) {
    a.tokens_per_expert[e] = expert_count[e];
  }
}

bool put_launch_ok(const PutLaunch& p) {
  return p.state != nullptr && p.num_ranks >= 1 && p.num_ranks <= kMaxGroupRanks &&
         p.num_tokens >= 0 && p.hidden >= 0 && p.hidden % kRowAlignment == 0 &&
         p.num_blocks >= 1;
}

int blocks_for(const PutLaunch& p) { return p.num_blocks < 1 ? 1 : p.num_blocks; }

cudaError_t launch_start(const PutLaunch& p, int32_t kind, const OpFingerprint& fp,
                         const int32_t* topk_idx, bool* in_rank_out, const bool* in_rank,
                         const int32_t* src_index, cudaStream_t stream) {
  const PutStartArgs a{p, fp, kind, topk_idx, in_rank_out, in_rank, src_index};
  JAX_EP_LAUNCH(put_start_kernel, 1, kStartThreads, 0, stream)(a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_pack_transfer(const PutLaunch& p, int32_t kind, const void* x,
                                 const int32_t* topk_idx, const float* topk_weights,
                                 const int32_t* src_index, cudaStream_t stream) {
  const PutPackArgs a{p, kind, static_cast<const char*>(x), topk_idx, topk_weights, src_index};
  JAX_EP_LAUNCH(put_pack_kernel, blocks_for(p), kPutThreads, 0, stream)(a);
  JAX_EP_CHECK_LAUNCH();
  JAX_EP_LAUNCH(put_transfer_kernel, p.num_ranks, kPutThreads, 0, stream)(p);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

OpFingerprint put_fingerprint(const PutLaunch& p, int32_t op, int32_t topk, int32_t experts) {
  OpFingerprint fp{};
  fp.op = op;
  fp.ranks = p.num_ranks;
  fp.tokens = p.num_tokens;
  fp.hidden = p.hidden;
  fp.topk = topk;
  fp.experts = experts;
  fp.dtype = p.row_kind;
  fp.transport = kTransportPut;  // the NVLink forms publish kTransportLoadStore (cuda/fingerprint.h)
  return fp;
}

}  // namespace

cudaError_t launch_put_dispatch_rank_major(const PutLaunch& p, const void* x,
                                           const int32_t* topk_idx, const float* topk_weights,
                                           void* rows, float* scales, int32_t* row_ids,
                                           float* row_weights, int32_t* tokens_per_rank,
                                           int32_t* tokens_per_expert, int32_t* src_index,
                                           bool* is_token_in_rank, cudaStream_t stream) {
  if (!put_launch_ok(p) || p.num_topk < 1 || p.num_topk > kMaxTopk || p.num_experts < p.num_ranks ||
      p.num_experts % p.num_ranks != 0 || p.num_experts > kMaxExperts ||
      (p.row_kind == kRowFP8) != (scales != nullptr) ||
      (p.row_kind == kRowFP8 && p.hidden % kFp8Block != 0) || (p.x_kind != kRowBF16 && p.x_kind != kRowF32) ||
      (p.row_kind == kRowF32 && p.x_kind != kRowF32)) {
    return cudaErrorInvalidValue;
  }
  const OpFingerprint fp = put_fingerprint(p, kOpDispatchRankMajor, p.num_topk, p.num_experts);
  JAX_EP_CUDA_RETURN(launch_start(p, kPutDispatch, fp, topk_idx, is_token_in_rank, nullptr,
                                  nullptr, stream));
  JAX_EP_CUDA_RETURN(
      launch_pack_transfer(p, kPutDispatch, x, topk_idx, topk_weights, nullptr, stream));
  const PutReceiveArgs a{p, kPutDispatch, kOpDispatchRankMajor, static_cast<char*>(rows), scales,
                         row_ids, row_weights, tokens_per_rank, tokens_per_expert, src_index};
  const size_t shared = static_cast<size_t>(p.num_experts / p.num_ranks) * sizeof(int32_t);
  JAX_EP_LAUNCH(put_receive_kernel, blocks_for(p), kPutThreads, shared, stream)(a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

namespace {
cudaError_t launch_rows_op(const PutLaunch& p, int32_t kind, int32_t op_id, const void* data,
                           const int32_t* src_index, const bool* in_rank, void* out,
                           cudaStream_t stream) {
  if (!put_launch_ok(p) || (p.row_kind != kRowBF16 && p.row_kind != kRowF32)) {
    return cudaErrorInvalidValue;
  }
  const OpFingerprint fp = put_fingerprint(p, op_id, 1, 0);  // K = 1, as the NVLink forms
  JAX_EP_CUDA_RETURN(launch_start(p, kind, fp, nullptr, nullptr, in_rank, src_index, stream));
  JAX_EP_CUDA_RETURN(launch_pack_transfer(p, kind, data, nullptr, nullptr, src_index, stream));
  // the dispatch-only outputs stay null
  const PutReceiveArgs a{p, kind, op_id, static_cast<char*>(out), nullptr, nullptr, nullptr,
                         nullptr, nullptr, nullptr};
  JAX_EP_LAUNCH(put_receive_kernel, blocks_for(p), kPutThreads, 0, stream)(a);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}
}  // namespace

cudaError_t launch_put_combine_rank_major(const PutLaunch& p, const void* y,
                                          const int32_t* src_index, const bool* is_token_in_rank,
                                          void* out, cudaStream_t stream) {
  return launch_rows_op(p, kPutCombine, kOpCombineRankMajor, y, src_index, is_token_in_rank, out,
                        stream);
}

cudaError_t launch_put_broadcast_rank_major(const PutLaunch& p, const void* g,
                                            const int32_t* src_index, const bool* is_token_in_rank,
                                            void* out, cudaStream_t stream) {
  return launch_rows_op(p, kPutBroadcast, kOpBroadcastRankMajor, g, src_index, is_token_in_rank,
                        out, stream);
}

}  // namespace jax_ep
