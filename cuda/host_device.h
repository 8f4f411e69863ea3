// JAX_EP_HOST_DEVICE: a function both the kernels and the host code (handlers, the emulator) call,
// such as a layout's byte offsets, so that both sides compute them from one definition.
#pragma once

#ifdef __CUDACC__
#define JAX_EP_HOST_DEVICE __host__ __device__
#else
#define JAX_EP_HOST_DEVICE
#endif
