// slot_values (see slot_values.h): one block: group discovery, [T, K] values per rank into the
// source's staging, a group barrier, sum over ranks.
#include "cuda/ep_device.cuh"
#include "cuda/slot_values.h"

namespace jax_ep {
namespace {

constexpr int kSlotValuesThreads = 1024;
constexpr int kBatch = 8;  // elements per thread in flight

__global__ void __launch_bounds__(kSlotValuesThreads)
    slot_values_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                       const int32_t* group_ptr, const int32_t* rank_mask, OpFingerprint fp,
                       int axis_slot, bool shrink,
                       const float* values, const int32_t* token_rows, int T, int K, float* out) {
  __shared__ OpInfo info;
  __shared__ PeerGroup group;
  const int R = fp.ranks;
  discover_group(state, rank_ptr, group_ptr, rank_mask, axis_slot, layout.total, fp, shrink, &info);
  const int me = info.rank;
  if (threadIdx.x == 0) {
    group.size = R;
    group.my_rank = me;
    for (int r = 0; r < kMaxGroupRanks; ++r) group.ordinals[r] = r < R ? info.ordinals[r] : -1;
  }
  const int64_t per_rank = static_cast<int64_t>(T) * K;
  // One block does it all (the barrier is a block's), so each thread keeps kBatch independent
  // loads in flight instead of one dependent chain (token row, then value) per element.
  // token_rows is [R * T, K]: rows [s * T, (s + 1) * T) belong to source rank s.
  for (int s = 0; s < R; ++s) {
    if (info.ordinals[s] < 0) continue;  // a masked rank: nothing goes there
    float* to = reinterpret_cast<float*>(comm_buffer_of(state, info.ordinals[s]) + layout.meta_w) +
                me * per_rank;
    const int32_t* rows = token_rows + s * per_rank;
    for (int64_t j0 = threadIdx.x; j0 < per_rank; j0 += kBatch * blockDim.x) {
      int32_t row[kBatch];
      float value[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t j = j0 + b * blockDim.x;
        row[b] = j < per_rank ? __ldg(rows + j) : -1;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) value[b] = row[b] >= 0 ? __ldg(values + row[b]) : 0.f;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t j = j0 + b * blockDim.x;
        if (j < per_rank) to[j] = value[b];
      }
    }
  }
  __threadfence_system();
  // with the linked ranks only (a masked rank's ordinal is -1); in shrink mode a rank that does not
  // arrive leaves the call (its values count as 0, as a masked rank's)
  group_barrier_block(state, group, kOpSlotValues, shrink ? &info.missed : nullptr);
  if (shrink) {  // (info.missed is complete: the barrier ends with __syncthreads)
    if (threadIdx.x == 0) {
      drop_missed(state, &info, kOpSlotValues, 2);
      for (int r = 0; r < R; ++r) group.ordinals[r] = info.ordinals[r];
    }
    __syncthreads();
  }
  const float* staged = reinterpret_cast<const float*>(own_comm_buffer(state) + layout.meta_w);
  for (int64_t j0 = threadIdx.x; j0 < per_rank; j0 += kBatch * blockDim.x) {
    float acc[kBatch];  // jnp.sum over ranks: 0 + v_0 + v_1 + ... (a masked rank's v is 0)
#pragma unroll
    for (int b = 0; b < kBatch; ++b) acc[b] = 0.f;
    for (int r = 0; r < R; ++r) {
      if (group.ordinals[r] < 0) {  // a masked rank adds +0.0, as the reference does
#pragma unroll
        for (int b = 0; b < kBatch; ++b) acc[b] = __fadd_rn(acc[b], 0.f);
        continue;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t j = j0 + b * blockDim.x;
        acc[b] = __fadd_rn(acc[b], j < per_rank ? __ldcg(staged + r * per_rank + j) : 0.f);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t j = j0 + b * blockDim.x;
      if (j < per_rank) out[j] = acc[b];
    }
  }
}

}  // namespace

cudaError_t launch_slot_values(const GroupLaunch& g, const float* values,
                               const int32_t* token_rows, float* out, cudaStream_t stream) {
  if (!group_launch_ok(g) || g.pull) return cudaErrorInvalidValue;
  JAX_EP_LAUNCH(slot_values_kernel, 1, kSlotValuesThreads, 0, stream)(
      g.state, g.layout, g.rank, g.group, g.rank_mask, group_fingerprint(g, kOpSlotValues, 0, kRowF32),
      g.axis_slot, g.shrink != 0, values, token_rows, g.num_tokens, g.num_topk, out);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
