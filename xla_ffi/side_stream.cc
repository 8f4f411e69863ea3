// The fork to and join from jax_ep's side stream of a device (Runtime::Side; jax_ep.overlap), and the
// side_join target: an EP op's "_side" target enqueues its kernels on the side stream after what XLA
// enqueued before it (ForkSideStream), so XLA's stream runs the work placed after it (an expert GEMM)
// at the same time; side_join makes XLA's stream wait for the side stream before anything reads the
// op's results. Stream-ordered events only: nothing blocks the host, allocates or takes a lock, and
// neither target is captured into a CUDA graph.
#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace jax_ep {
namespace {

ffi::Error SideOf(int32_t device_ordinal, const char* what, const SideStream** side) {
  *side = Runtime::Get().Side(device_ordinal);
  if (*side == nullptr) {
    return ffi::Error::Internal(std::string("jax_ep: ") + what + ": GPU " +
                                std::to_string(device_ordinal) + " is not managed by jax_ep's runtime");
  }
  return ffi::Error::Success();
}

ffi::Error SideJoinImpl(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs /*kept*/,
                        ffi::ResultBuffer<ffi::S32> /*token: int32[1], ordering only, not written*/) {
  JAX_EP_RETURN_IF_ERROR(CountCall(side_join_counters, stream, kSideJoinTarget));
  return JoinSideStream(stream, device_ordinal);
}

}  // namespace

ffi::Error ForkSideStream(cudaStream_t stream, int32_t device_ordinal, cudaStream_t* side_stream) {
  const SideStream* side = nullptr;
  JAX_EP_RETURN_IF_ERROR(SideOf(device_ordinal, "fork to the side stream", &side));
  cudaError_t status = cudaEventRecord(side->fork, stream);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(side->stream, side->fork, 0);
  if (status != cudaSuccess) {
    return CudaError(status, "fork to the side stream of GPU " + std::to_string(device_ordinal));
  }
  *side_stream = side->stream;
  return ffi::Error::Success();
}

ffi::Error JoinSideStream(cudaStream_t stream, int32_t device_ordinal) {
  const SideStream* side = nullptr;
  JAX_EP_RETURN_IF_ERROR(SideOf(device_ordinal, "join of the side stream", &side));
  cudaError_t status = cudaEventRecord(side->join, side->stream);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, side->join, 0);
  if (status != cudaSuccess) {
    return CudaError(status, "join of the side stream of GPU " + std::to_string(device_ordinal));
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep

// Operands: whatever must stay allocated until the side stream is done (the op's operands and
// results, the work it ran beside); result: an int32[1] token (not written: overlap.JOIN_TOKEN) that
// orders its readers after the join.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSideJoin, jax_ep::SideJoinImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
