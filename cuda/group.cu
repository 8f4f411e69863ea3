// The start kernel of combine and broadcast (see group.h): one block discovers the group, which is
// the start barrier of the call (and checks the peers' config fingerprints), and publishes the
// call's OpInfo for the data kernel after it.
#include "cuda/ep_device.cuh"
#include "cuda/group.h"

namespace jax_ep {
namespace {

constexpr int kStartThreads = 64;
static_assert(kStartThreads >= kMaxDevices && kStartThreads >= kMaxGroupRanks, "discovery");

__global__ void __launch_bounds__(kStartThreads)
    ep_start_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                    const int32_t* group_ptr, const int32_t* rank_mask, int axis_slot,
                    OpFingerprint fp, bool shrink) {
  __shared__ OpInfo info;
  discover_group(state, rank_ptr, group_ptr, rank_mask, axis_slot, layout.total, fp, shrink, &info);
  if (threadIdx.x == 0) publish_op_info(state, layout, info, 0);
}

}  // namespace

int32_t float_row_bytes(int32_t hidden, int32_t kind) {
  if (hidden < kRowAlignment || hidden % kRowAlignment != 0 || (kind != kRowBF16 && kind != kRowF32)) return 0;
  return hidden * (kind == kRowF32 ? 4 : 2);
}

bool group_launch_ok(const GroupLaunch& g) {
  return g.state != nullptr && g.num_ranks >= 1 && g.num_ranks <= kMaxGroupRanks &&
         g.num_tokens >= 0 && g.num_topk >= 1 && g.num_topk <= kMaxTopk && g.axis_slot >= 0 &&
         g.axis_slot < kDirectoryAxes && g.num_blocks >= 1 && g.send_warps >= 1 &&
         g.send_warps < kDataWarps && !(g.pull && g.shrink != 0);
}

cudaError_t launch_start(const GroupLaunch& g, const OpFingerprint& fp, cudaStream_t stream) {
  if (fp.ranks != g.num_ranks) return cudaErrorInvalidValue;
  JAX_EP_LAUNCH(ep_start_kernel, 1, kStartThreads, 0, stream)(g.state, g.layout, g.rank, g.group,
                                                              g.rank_mask, g.axis_slot, fp,
                                                              g.shrink != 0);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
