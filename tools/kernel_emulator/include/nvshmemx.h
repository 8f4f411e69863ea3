// The block- and warp-scoped NVSHMEM puts on the kernel emulator (see nvshmem.h): every thread of
// the block (warp) calls them with the same arguments; one thread moves the data, between barriers
// of the block (warp), as the collective call's contract lets the real one do.
#pragma once

#include "nvshmem.h"

inline void nvshmemx_putmem_nbi_block(void* dest, const void* source, size_t bytes, int pe) {
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_putmem_nbi(dest, source, bytes, pe);
  __syncthreads();
}
inline void nvshmemx_putmem_signal_nbi_block(void* dest, const void* source, size_t bytes,
                                             uint64_t* sig, uint64_t signal, int sig_op, int pe) {
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_putmem_signal_nbi(dest, source, bytes, sig, signal, sig_op, pe);
  __syncthreads();
}
inline void nvshmemx_putmem_nbi_warp(void* dest, const void* source, size_t bytes, int pe) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) nvshmem_putmem_nbi(dest, source, bytes, pe);
  __syncwarp();
}
inline void nvshmemx_putmem_signal_nbi_warp(void* dest, const void* source, size_t bytes,
                                            uint64_t* sig, uint64_t signal, int sig_op, int pe) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) nvshmem_putmem_signal_nbi(dest, source, bytes, sig, signal, sig_op, pe);
  __syncwarp();
}
