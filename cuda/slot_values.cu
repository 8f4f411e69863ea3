// slot_values (see slot_values.h): one block: group discovery, [T, K] values per rank into the
// source's staging, a group barrier, sum over ranks.
#include "cuda/ep_device.cuh"
#include "cuda/slot_values.h"

namespace jax_ep {
namespace {

constexpr int kSlotValuesThreads = 1024;

__global__ void __launch_bounds__(kSlotValuesThreads)
    slot_values_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                       const int32_t* group_ptr, const int32_t* rank_mask, OpFingerprint fp,
                       int axis_slot,
                       const float* values, const int32_t* token_rows, int T, int K, float* out) {
  __shared__ OpInfo info;
  __shared__ PeerGroup group;
  const int R = fp.ranks;
  discover_group(state, rank_ptr, group_ptr, rank_mask, axis_slot, layout.total, fp, &info);
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
    if (info.ordinals[s] < 0) continue;  // a masked rank: nothing goes there
    const int32_t row = __ldg(token_rows + i);
    const float value = row >= 0 ? __ldg(values + row) : 0.f;
    char* peer = comm_buffer_of(state, info.ordinals[s]);
    reinterpret_cast<float*>(peer + layout.meta_w)[me * per_rank + (i - s * per_rank)] = value;
  }
  __threadfence_system();
  // with the linked ranks only (a masked rank's ordinal is -1)
  group_barrier_block(state, group, kOpSlotValues);  // starts with __syncthreads
  const float* staged = reinterpret_cast<const float*>(own_comm_buffer(state) + layout.meta_w);
  for (int64_t j = threadIdx.x; j < per_rank; j += blockDim.x) {
    float acc = 0.f;  // jnp.sum over ranks: 0 + v_0 + v_1 + ... (a masked rank's v is 0)
    for (int r = 0; r < R; ++r) {
      acc = __fadd_rn(acc, group.ordinals[r] >= 0 ? __ldcg(staged + r * per_rank + j) : 0.f);
    }
    out[j] = acc;
  }
}

}  // namespace

cudaError_t launch_slot_values(const GroupLaunch& g, const float* values,
                               const int32_t* token_rows, float* out, cudaStream_t stream) {
  if (!group_launch_ok(g)) return cudaErrorInvalidValue;
  JAX_EP_LAUNCH(slot_values_kernel, 1, kSlotValuesThreads, 0, stream)(
      g.state, g.layout, g.rank, g.group, g.rank_mask, group_fingerprint(g, kOpSlotValues, 0, kRowF32),
      g.axis_slot, values, token_rows, g.num_tokens, g.num_topk, out);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
