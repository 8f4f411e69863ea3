// The NVSHMEM device API subset the put kernels use (cuda/remote.cu, cuda/remote_rank_major.cu),
// on the kernel emulator: every PE is a process of driver.cc / put_driver.cc, and every PE's
// symmetric objects (its communication buffer and DeviceState) are mapped at distinct addresses
// visible to all (shared memory). A symmetric address is this PE's own address; a put translates it
// into the target PE's copy through the table the driver fills (emu_nvshmem::register_pe). A put
// completes at once (memcpy), then its signal is set with release semantics, so a receiver that
// acquires the signal sees the data, as NVSHMEM guarantees for putmem_signal.
#pragma once

#include "../emu_cuda.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace emu_nvshmem {
constexpr int kMaxPes = 32;
struct Object {  // one symmetric object: its base on every PE and its size
  uint8_t* base[kMaxPes];
  uint64_t bytes;
};
inline Object objects[2];  // 0: communication buffer, 1: DeviceState
inline int num_objects = 0;
inline int my_pe = -1;
inline int n_pes = 0;
inline bool load_store[kMaxPes];  // what nvshmem_ptr answers (the driver decides: P2P or not)

// The driver (before forking): object `index` of PE `pe` lives at `base`.
inline void register_object(int index, int pe, void* base, uint64_t bytes) {
  objects[index].base[pe] = static_cast<uint8_t*>(base);
  objects[index].bytes = bytes;
  if (index + 1 > num_objects) num_objects = index + 1;
}

// This PE's address `sym` of a symmetric object, as the address of PE pe's copy.
inline void* translate(const void* sym, int pe) {
  const uint8_t* p = static_cast<const uint8_t*>(sym);
  if (pe < 0 || pe >= n_pes) {
    std::fprintf(stderr, "emu nvshmem: PE %d out of range (%d PEs)\n", pe, n_pes);
    std::abort();
  }
  for (int i = 0; i < num_objects; ++i) {
    const uint8_t* base = objects[i].base[my_pe];
    if (p >= base && p < base + objects[i].bytes) return objects[i].base[pe] + (p - base);
  }
  std::fprintf(stderr, "emu nvshmem: %p is not a symmetric address of PE %d\n", sym, my_pe);
  std::abort();
}
}  // namespace emu_nvshmem

enum { NVSHMEM_SIGNAL_SET = 9, NVSHMEM_SIGNAL_ADD = 10 };

inline int nvshmem_my_pe() { return emu_nvshmem::my_pe; }
inline int nvshmem_n_pes() { return emu_nvshmem::n_pes; }
inline void* nvshmem_ptr(const void* sym, int pe) {
  return emu_nvshmem::load_store[pe] ? emu_nvshmem::translate(sym, pe) : nullptr;
}
inline void nvshmem_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void nvshmem_quiet() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void nvshmem_uint64_p(uint64_t* sym, uint64_t value, int pe) {
  __atomic_store_n(static_cast<uint64_t*>(emu_nvshmem::translate(sym, pe)), value, __ATOMIC_RELEASE);
}
inline void nvshmemx_signal_op(uint64_t* sig, uint64_t value, int op, int pe) {
  uint64_t* target = static_cast<uint64_t*>(emu_nvshmem::translate(sig, pe));
  if (op == NVSHMEM_SIGNAL_ADD) {
    __atomic_fetch_add(target, value, __ATOMIC_ACQ_REL);
  } else {
    __atomic_store_n(target, value, __ATOMIC_RELEASE);
  }
}
inline void nvshmem_putmem_nbi(void* dest, const void* source, size_t bytes, int pe) {
  std::memcpy(emu_nvshmem::translate(dest, pe), source, bytes);
}
inline void nvshmem_putmem_signal_nbi(void* dest, const void* source, size_t bytes, uint64_t* sig,
                                      uint64_t signal, int sig_op, int pe) {
  nvshmem_putmem_nbi(dest, source, bytes, pe);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the data before the signal
  nvshmemx_signal_op(sig, signal, sig_op, pe);
}
