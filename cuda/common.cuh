// Device utilities shared by every kernel family: error checking, the launch macro, system-scope
// loads/stores, bounded spin-waits that turn a hang into a named error, top-k sanitising and the
// group barrier.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/cuda_check.h"
#include "cuda/device_state.h"

// After a launch: report a bad launch configuration (or an earlier sticky error) to the caller.
#define JAX_EP_CHECK_LAUNCH() JAX_EP_CUDA_RETURN(cudaGetLastError())

namespace jax_ep {

#ifndef JAX_EP_EMULATION
// Kernel launch: JAX_EP_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...). A macro so
// that tools/kernel_emulator can run the kernels on the CPU.
#define JAX_EP_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>
// The same for a kernel whose block 0 waits for its other blocks (which wait for nothing): the
// emulator then runs block 0 alongside the others (tools/kernel_emulator/emu_cuda.h).
#define JAX_EP_LAUNCH_BLOCK0_WAITS(kernel, grid, block, shared_bytes, stream) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>
// Dynamically sized shared memory of a kernel: JAX_EP_DYNAMIC_SHARED(type, name);
#define JAX_EP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]

// Nanoseconds since an arbitrary epoch, the same clock on every SM of a GPU.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Acquire load at system scope: later reads of this thread see what the releasing peer wrote
// before its release store (peers are other GPUs, hence .sys rather than .gpu).
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void store_release_sys(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(address), "l"(value) : "memory");
}

// Relaxed (strong, system-scope) load: polling with it keeps the SM's L1 intact, whereas every
// acquire load also invalidates L1, which slows down every other warp of the SM while one spins.
__device__ __forceinline__ uint64_t load_relaxed_sys(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// Plain (weak, coherent) global loads that stay where the program issues them: ptxas may sink
// non-coherent loads (__ldg) past barriers to their first use, which undoes a load issued early
// to overlap its latency with other work (dispatch's prep loads the next tile's ids that way).
__device__ __forceinline__ int32_t load_early(const int32_t* address) {
  int32_t value;
  asm volatile("ld.global.b32 %0, [%1];" : "=r"(value) : "l"(address));
  return value;
}
__device__ __forceinline__ int4 load_early4(const int32_t* address) {  // 16-byte aligned
  int4 v;
  asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

// Relaxed (strong, system-scope) store: no ordering with this thread's other accesses.
__device__ __forceinline__ void store_relaxed_sys(uint64_t* address, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" : : "l"(address), "l"(value) : "memory");
}

// Atomic add at device scope with acquire and release semantics: a block's last-one-out counter in
// one instruction (what it did before is ordered before the add; the last block sees it all after
// the add), where a fence and a relaxed atomic took two round trips.
__device__ __forceinline__ uint32_t atomic_add_acq_rel_gpu(uint32_t* address, uint32_t value) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(address), "r"(value)
               : "memory");
  return old;
}
// 64-bit: a counter that a bounded wait (poll_flag) watches.
__device__ __forceinline__ uint64_t atomic_add_acq_rel_gpu(uint64_t* address, uint64_t value) {
  uint64_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;"
               : "=l"(old)
               : "l"(address), "l"(value)
               : "memory");
  return old;
}

// With a preceding relaxed load that observed a release store: an acquire pattern.
__device__ __forceinline__ void fence_acquire_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void backoff_sleep(uint32_t ns) { __nanosleep(ns); }
#endif  // JAX_EP_EMULATION

// What a bounded wait watches besides its flag (poll_flag).
struct PollBound {
  uint64_t timeout_ns;     // the bound
  uint32_t max_sleep_ns;   // the longest pause between two polls
  const uint32_t* give_up = nullptr;  // give up at once when bit `bit` is set here (another warp of
  uint32_t bit = 0u;                  //   the call gave up on that rank; null: never)
  // Shrink mode (state non-null): the wait is on rank `peer` of group `group` of axis slot
  // `axis_slot` in this device's call `epoch`. Every poll bumps this device's heartbeat, and past
  // the bound the wait goes on while the peer is alive and not past this call: its heartbeat moved
  // within the last quarter bound (it is sitting out a wait of its own, on a rank that died) and
  // its latest call in the group (this device's directory) is not beyond this one; up to four
  // bounds. A live rank that is late because it waited for a dead one is thus not taken for dead
  // (and masked in turn), nor are two ranks that wait for each other's next call held forever.
  DeviceState* state = nullptr;
  int32_t axis_slot = 0, group = 0, peer = -1;
  uint64_t epoch = 0;
};

// The peer of a shrink-mode wait past its bound: still worth waiting for (PollBound). `beat` /
// `changed`: the peer's heartbeat last seen and when it last moved (this device's clock).
__device__ __forceinline__ bool peer_alive(const PollBound& b, uint64_t now, uint64_t* beat,
                                           uint64_t* changed) {
  const uint64_t entry = *reinterpret_cast<const volatile uint64_t*>(
      &b.state->sync.directory[b.axis_slot][b.group][b.peer]);
  if ((entry >> 16) > b.epoch) return false;  // it has gone on to a later call: this one is over
  if ((entry >> 16) == 0) return false;       // never seen: which GPU it is, is not known
  const DeviceState* peer = b.state->tables.peer_states[entry & 0xFFFF];
  if (peer == nullptr) return false;
  const uint64_t now_beat = *reinterpret_cast<const volatile uint64_t*>(&peer->sync.heartbeat);
  if (now_beat != *beat) {
    *beat = now_beat;
    *changed = now;
  }
  return now - *changed < b.timeout_ns / 4;
}

// The bounded poll of every spin-wait of the EP kernels: relaxed loads of *flag (an acquire load
// would also invalidate the SM's L1 each time, slowing every other warp of the SM), a pause growing
// from 32 ns to b.max_sleep_ns between them, until done(value). Returns true with the value in
// *value; false once the bound has passed (the caller traps, naming the op and the rank waited for,
// or in shrink mode masks that rank), or at once when the give-up bit is set (PollBound). *elapsed:
// how long it waited. The caller acquires (a fence or an acquire load) before it reads what the
// flag guards.
template <typename Done>
__device__ __forceinline__ bool poll_flag(const uint64_t* flag, Done done, const PollBound& b,
                                          uint64_t* value, uint64_t* elapsed) {
  uint64_t v = load_relaxed_sys(flag);
  *elapsed = 0;
  if (!done(v)) {
    const uint64_t start = global_timer_ns();
    uint64_t beat = 0, changed = start;
    if (b.state != nullptr && b.peer >= 0) {
      const uint64_t entry = *reinterpret_cast<const volatile uint64_t*>(
          &b.state->sync.directory[b.axis_slot][b.group][b.peer]);
      const DeviceState* peer = b.state->tables.peer_states[entry & 0xFFFF];
      if (peer != nullptr) {
        beat = *reinterpret_cast<const volatile uint64_t*>(&peer->sync.heartbeat);
      }
    }
    uint32_t sleep_ns = 32;
    while (!done(v)) {
      if (b.give_up != nullptr &&
          (*reinterpret_cast<const volatile uint32_t*>(b.give_up) & b.bit) != 0u) {
        break;
      }
      backoff_sleep(sleep_ns);
      if (sleep_ns < b.max_sleep_ns) sleep_ns *= 2;
      const uint64_t now = global_timer_ns();
      *elapsed = now - start;
      if (b.state != nullptr) {  // (a plain increment: racing pollers still move it)
        volatile uint64_t* own = &b.state->sync.heartbeat;
        *own = *own + 1;
      }
      if (*elapsed > b.timeout_ns &&
          (b.state == nullptr || b.peer < 0 || *elapsed > 4 * b.timeout_ns ||
           !peer_alive(b, now, &beat, &changed))) {
        break;
      }
      v = load_relaxed_sys(flag);
    }
  }
  *value = v;
  return done(v);
}

// The op's name as the host's fault messages give it (xla_ffi/fault_message.cc OpName), so that a
// printed line reads like the record's text ("jax_ep: dispatch on GPU 1 (rank 1) ...").
static __device__ __noinline__ const char* fault_op_name(int32_t op_id) {
  switch (op_id) {
#define JAX_EP_DEVICE_OP_NAME(Name, name, id) \
  case id:                                    \
    return #name;
    JAX_EP_FAULT_OPS(JAX_EP_DEVICE_OP_NAME)
#undef JAX_EP_DEVICE_OP_NAME
    default:
      return "unknown op";
  }
}

// Records the first fault of this device in host-mapped pinned memory (the host can read it even
// after the trap has killed the context; jax_ep.runtime's fault watcher prints its text) and prints
// one line naming op and ranks, from the thread that claimed the record only (every waiting thread
// of the call may get here), prefixed "jax_ep kernel:" (not the record text's "jax_ep: <op> on
// GPU", which jax_ep.failure_report collects: a line per thread crowded the record out). The caller
// traps (record_fault_and_trap, or every thread of a block after a barrier, see cuda/fingerprint.cuh).
// noinline: keeps the cold path out of the registers of the spin loops.
static __device__ __noinline__ void record_fault(DeviceState* state, int32_t kind, int32_t op_id,
                                                 int32_t rank, int32_t waited_rank,
                                                 int32_t waited_ordinal, uint64_t expected,
                                                 uint64_t observed, int64_t elapsed_ns,
                                                 int32_t field) {
  const DeviceTables& tables = state->tables;
  if (atomicCAS(&state->sync.fault_claimed, 0, 1) != 0) {  // not the device's first fault
    // the thread that claimed it may still be writing the record: our caller's trap would end it
    // there, and the host would find no record. Give it up to 1 ms (a cold path).
    if (tables.fault_record != nullptr) {
      const volatile FaultRecord* record = tables.fault_record;  // volatile: reread each poll
      const uint64_t start = global_timer_ns();
      while (record->valid == 0 && global_timer_ns() - start < 1000000) {
      }
    }
    return;
  }
  if (tables.fault_record != nullptr) {
    volatile FaultRecord* record = tables.fault_record;
    record->kind = kind;
    record->op_id = op_id;
    record->device_ordinal = tables.device_ordinal;
    record->rank = rank;
    record->waited_rank = waited_rank;
    record->waited_ordinal = waited_ordinal;
    record->expected = expected;
    record->observed = observed;
    record->elapsed_ns = elapsed_ns;
    record->field = field;
    __threadfence_system();  // every field before the flag that tells the host to read them
    record->valid = 1;
    __threadfence_system();
  }
  if (kind == kFaultTimeout && field == kFieldPrepBlocks) {
    printf("jax_ep kernel: %s on GPU %d (rank %d) timed out after %lld ns waiting for its own prep "
           "blocks (%llu of %llu ran): the GPU did not schedule them; trapping.\n",
           fault_op_name(op_id), tables.device_ordinal, rank, static_cast<long long>(elapsed_ns),
           static_cast<unsigned long long>(observed), static_cast<unsigned long long>(expected));
  } else if (kind == kFaultTimeout) {
    printf("jax_ep kernel: %s on GPU %d (rank %d) timed out after %lld ns waiting for rank %d "
           "(GPU or process %d): expected %llu, saw %llu; trapping (the fault record says more).\n",
           fault_op_name(op_id), tables.device_ordinal, rank, static_cast<long long>(elapsed_ns),
           waited_rank, waited_ordinal, static_cast<unsigned long long>(expected),
           static_cast<unsigned long long>(observed));
  } else if (kind == kFaultMismatch) {
    printf("jax_ep kernel: %s on GPU %d (rank %d): rank %d (GPU or process %d) runs a call that "
           "does not match: fingerprint field %d is %llu here, %llu there; trapping.\n",
           fault_op_name(op_id), tables.device_ordinal, rank, waited_rank, waited_ordinal, field,
           static_cast<unsigned long long>(expected), static_cast<unsigned long long>(observed));
  } else if (kind == kFaultLLInFlight) {
    printf("jax_ep kernel: %s on GPU %d (rank %d): low-latency double-buffering rule %d broken "
           "(call %llu, found %llu): receive a sent call n before the op's call n + 2 (fused or "
           "sent), each once, no other EP op in between but low-latency calls of the same shape; "
           "trapping.\n",
           fault_op_name(op_id), tables.device_ordinal, rank, waited_ordinal,
           static_cast<unsigned long long>(expected), static_cast<unsigned long long>(observed));
  } else if (kind == kFaultBadArgument) {
    printf("jax_ep kernel: %s on GPU %d got rank %d (group size %llu) / group %llu out of range; "
           "trapping.\n",
           fault_op_name(op_id), tables.device_ordinal, rank,
           static_cast<unsigned long long>(expected), static_cast<unsigned long long>(observed));
  } else {
    printf("jax_ep kernel: %s on GPU %d (rank %d) ran with a stale runtime: needs %llu bytes of "
           "communication buffer, %llu available (shutdown() called, or the buffer is too "
           "small); trapping.\n",
           fault_op_name(op_id), tables.device_ordinal, rank,
           static_cast<unsigned long long>(expected), static_cast<unsigned long long>(observed));
  }
}

static __device__ __noinline__ void record_fault_and_trap(DeviceState* state, int32_t kind,
                                                          int32_t op_id, int32_t rank,
                                                          int32_t waited_rank,
                                                          int32_t waited_ordinal,
                                                          uint64_t expected, uint64_t observed,
                                                          int64_t elapsed_ns,
                                                          int32_t field = kFieldNone) {
  record_fault(state, kind, op_id, rank, waited_rank, waited_ordinal, expected, observed,
               elapsed_ns, field);
  __trap();
}

// Spins until *flag >= target (flag written by a peer with a release store), then acquires.
// Bounded: after tables.timeout_ns the fault is recorded and the kernel traps instead of hanging
// the process, or with `missed` (shrink mode) bit waited_rank is set there and false returned.
__device__ __forceinline__ bool wait_at_least(const uint64_t* flag, uint64_t target,
                                              DeviceState* state, int32_t op_id, int32_t rank,
                                              int32_t waited_rank, int32_t waited_ordinal,
                                              uint32_t* missed = nullptr) {
  uint64_t observed, elapsed;
  if (poll_flag(flag, [target](uint64_t v) { return v >= target; },
                PollBound{state->tables.timeout_ns, 256}, &observed, &elapsed)) {
    fence_acquire_sys();
    return true;
  }
  if (missed == nullptr) {
    record_fault_and_trap(state, kFaultTimeout, op_id, rank, waited_rank, waited_ordinal, target,
                          observed, static_cast<int64_t>(elapsed));
  }
  atomicOr(missed, 1u << waited_rank);
  return false;
}

// A kernel about to use `needed` bytes of every communication buffer checks that the runtime is
// still alive and large enough. The host checks the same before launching; this catches CUDA
// graphs replayed after shutdown(). Call from one thread.
// check_comm_bytes: the same with `available` (state->tables.comm_bytes) loaded by the caller, in
// flight with the other words of its prologue.
__device__ __forceinline__ void check_comm_bytes(DeviceState* state, uint64_t available,
                                                 uint64_t needed, int32_t op_id, int32_t rank) {
  if (available < needed) {
    record_fault_and_trap(state, kFaultStaleRuntime, op_id, rank, -1, -1, needed, available, 0);
  }
}
__device__ __forceinline__ void require_comm_bytes(DeviceState* state, uint64_t needed,
                                                   int32_t op_id, int32_t rank) {
  check_comm_bytes(state, state->tables.comm_bytes, needed, op_id, rank);
}

// Top-k sanitising, the one rule of every kernel (and of jax_ep.reference): slot k of a token names
// expert ids[k] unless that id is outside [0, E) or an earlier slot of the token named the same
// expert; then the slot is unused (-1). `ids` is the token's row (a pointer), or a register array
// when k is a compile-time index (in an unrolled loop this loop unrolls too: no local memory).
template <typename Ids>
__device__ __forceinline__ int32_t sanitized_expert(const Ids& ids, int k, int E) {
  const int32_t e = ids[k];
  if (e < 0 || e >= E) return -1;
  bool repeat = false;
  for (int j = 0; j < k; ++j) repeat |= ids[j] == e;
  return repeat ? -1 : e;
}

// Barrier of one thread block with the same-numbered barrier of every other rank of the group.
// Every thread of the block must call it; blockDim.x >= group.size. On return, whatever any rank's
// block wrote (to any GPU) before its call is visible to every thread of this block. With `missed`
// (shared; shrink mode), a rank that does not arrive within the bound sets its bit there instead
// of trapping (its writes may or may not be visible).
//
// Epochs are counted on the device per pair of devices (never passed from the host), so a CUDA
// graph replays correctly, and a device may alternate between groups without confusing them: a
// pair's count advances exactly when both devices pass a barrier together.
__device__ __forceinline__ void group_barrier_block(DeviceState* state, const PeerGroup& group,
                                                   int32_t op_id, uint32_t* missed = nullptr) {
  __syncthreads();  // this block's earlier writes are ordered before the release below
  const int peer_rank = static_cast<int>(threadIdx.x);
  if (peer_rank < group.size && group.ordinals[peer_rank] >= 0) {  // (-1: a masked rank)
    const int peer = group.ordinals[peer_rank];
    const int me = state->tables.slot;
    const uint64_t epoch = state->sync.barriers_done[peer] + 1;  // only this thread owns the slot
    state->sync.barriers_done[peer] = epoch;
    __threadfence_system();
    store_release_sys(&state->tables.peer_states[peer]->sync.arrived[me], epoch);
    wait_at_least(&state->sync.arrived[peer], epoch, state, op_id, group.my_rank, peer_rank, peer,
                  missed);
  }
  __syncthreads();  // the acquires above are ordered before every thread's later reads
}

}  // namespace jax_ep
