// jax_ep's side stream per device and the side_join target (jax_ep.overlap): an EP op's "_side"
// target enqueues its kernels there after what XLA enqueued before it (ForkSideStream), so XLA's
// stream runs the work placed after it (an expert GEMM) at the same time; side_join makes XLA's
// stream wait for the side stream before anything reads the op's results. Neither blocks the host,
// and neither is captured into a CUDA graph: the fork and the join are stream-ordered events.
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"

namespace jax_ep {
namespace {

struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;  // recorded on XLA's stream, waited for by the side stream
  cudaEvent_t join = nullptr;  // recorded on the side stream, waited for by XLA's stream
};

std::mutex side_mutex;
std::map<int32_t, SideStream> side_streams;  // by device ordinal; they live as long as the process

// The device's side stream, made on first use (on that device, the caller's current device kept).
ffi::Error GetSideStream(int32_t device_ordinal, SideStream* out) {
  std::lock_guard<std::mutex> lock(side_mutex);
  auto found = side_streams.find(device_ordinal);
  if (found != side_streams.end()) {
    *out = found->second;
    return ffi::Error::Success();
  }
  const std::string what = "side stream of GPU " + std::to_string(device_ordinal);
  int current = 0;
  cudaError_t status = cudaGetDevice(&current);
  if (status != cudaSuccess) return CudaError(status, what + ": cudaGetDevice");
  if (current != device_ordinal && (status = cudaSetDevice(device_ordinal)) != cudaSuccess) {
    return CudaError(status, what + ": cudaSetDevice");
  }
  SideStream side;
  int least = 0, greatest = 0;
  status = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (status == cudaSuccess) {
    status = cudaStreamCreateWithPriority(&side.stream, cudaStreamNonBlocking, greatest);
  }
  if (status == cudaSuccess) status = cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming);
  if (status == cudaSuccess) status = cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming);
  if (current != device_ordinal) cudaSetDevice(current);
  if (status != cudaSuccess) return CudaError(status, what + ": create");
  side_streams.emplace(device_ordinal, side);
  *out = side;
  return ffi::Error::Success();
}

ffi::Error SideJoinImpl(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs /*kept*/,
                        ffi::ResultBuffer<ffi::S32> token) {
  JAX_EP_RETURN_IF_ERROR(CountCall(side_join_counters, stream, kSideJoinTarget));
  JAX_EP_RETURN_IF_ERROR(JoinSideStream(stream, device_ordinal));
  // the token orders its readers after the join; its value means nothing, but it is written
  const cudaError_t status = cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream);
  if (status != cudaSuccess) return CudaError(status, std::string(kSideJoinTarget) + " token");
  return ffi::Error::Success();
}

}  // namespace

ffi::Error ForkSideStream(cudaStream_t stream, int32_t device_ordinal, cudaStream_t* side) {
  SideStream got;
  JAX_EP_RETURN_IF_ERROR(GetSideStream(device_ordinal, &got));
  cudaError_t status = cudaEventRecord(got.fork, stream);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(got.stream, got.fork, 0);
  if (status != cudaSuccess) {
    return CudaError(status, "fork to the side stream of GPU " + std::to_string(device_ordinal));
  }
  *side = got.stream;
  return ffi::Error::Success();
}

ffi::Error JoinSideStream(cudaStream_t stream, int32_t device_ordinal) {
  SideStream got;
  JAX_EP_RETURN_IF_ERROR(GetSideStream(device_ordinal, &got));
  cudaError_t status = cudaEventRecord(got.join, got.stream);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, got.join, 0);
  if (status != cudaSuccess) {
    return CudaError(status, "join of the side stream of GPU " + std::to_string(device_ordinal));
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep

// Operands: whatever must stay allocated until the side stream is done (the op's inputs and
// results, the work it ran beside); result: an int32[1] token (0).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSideJoin, jax_ep::SideJoinImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
