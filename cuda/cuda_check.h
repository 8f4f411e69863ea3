// Host-side CUDA error checking, usable from both nvcc (.cu) and the host compiler (.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace jax_ep {

// "cudaMalloc(&p, n) failed at file.cc:12: cudaErrorMemoryAllocation (out of memory)".
inline std::string cuda_error_message(cudaError_t status, const char* what, const char* file,
                                      int line) {
  return std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
         cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
}

}  // namespace jax_ep

// Init/teardown paths: a failing CUDA call becomes a C++ exception (a Python RuntimeError).
#define JAX_EP_CUDA_THROW(expr)                                                            \
  do {                                                                                     \
    const cudaError_t jax_ep_status_ = (expr);                                             \
    if (jax_ep_status_ != cudaSuccess) {                                                   \
      throw std::runtime_error("jax_ep: " + ::jax_ep::cuda_error_message(                  \
                                                jax_ep_status_, #expr, __FILE__, __LINE__)); \
    }                                                                                      \
  } while (0)

// Launchers: a failing CUDA call is returned to the caller (the FFI handler turns it into an
// ffi::Error, which XLA reports as a Python exception).
#define JAX_EP_CUDA_RETURN(expr)                       \
  do {                                                 \
    const cudaError_t jax_ep_status_ = (expr);         \
    if (jax_ep_status_ != cudaSuccess) {               \
      return jax_ep_status_;                           \
    }                                                  \
  } while (0)
