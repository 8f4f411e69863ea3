// Device helpers of the EP kernels (dispatch.cu, combine.cu, broadcast.cu, slot_values.cu,
// group.cu): group discovery, the data kernels' prologue, ready flags, warp-wide row copies with
// fused BF16/FP8 conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ep_layout.h"
#include "cuda/fingerprint.cuh"

namespace jax_ep {

constexpr unsigned kFullMask = 0xffffffffu;
// Threads of the data kernels: 16 warps, each warp a sender/reducer or a receiver/finaliser.
constexpr int kDataThreads = 512;
constexpr int kDataWarps = kDataThreads / 32;

// Bulk (TMA) row copies: every warp owns one shared-memory staging buffer and one mbarrier at the
// start of the kernel's dynamic shared memory: [kDataWarps mbarriers][kDataWarps x kTmaBufferBytes].
constexpr int kTmaBufferBytes = 13312;  // 13 KiB per warp: a 7168-wide bf16 row in two pieces
// The end of the buffer that holds a piece's FP8 scales when a converting copy goes through it
// (warp_copy_convert): 50 steps of 256 elements, 2 scales each.
constexpr int kTmaScaleBytes = 512;
constexpr int kTmaBarrierBytes = 128;   // kDataWarps mbarriers of 8 bytes, padded to 128
constexpr int kTmaSharedBytes = kTmaBarrierBytes + kDataWarps * kTmaBufferBytes;

#ifndef JAX_EP_EMULATION
__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)),
               "r"(count)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Bulk copy global -> shared (async proxy), completing `bytes` on the barrier.
__device__ __forceinline__ void tma_load(void* shared_dst, const void* global_src, uint32_t bytes,
                                         uint64_t* barrier) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   shared_address(barrier)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(shared_dst)),
      "l"(global_src), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
}

// Bulk copy shared -> global (async proxy; the destination may be a peer GPU's memory).
__device__ __forceinline__ void tma_store(void* global_dst, const void* shared_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global_dst),
               "r"(shared_address(shared_src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// The shared source of every committed bulk store has been read (the buffer may be refilled).
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Every committed bulk store has completed (its writes are performed).
__device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// 16 bytes global -> shared without registers (cp.async, L2 only: peers' writes are never stale
// in L1). Completion is tracked per thread by commit / wait groups.
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(shared_dst)),
               "l"(global_src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Asks L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) of global memory ahead of the loads
// that read them: the loads then wait for L2, not for DRAM.
__device__ __forceinline__ void prefetch_l2(const void* global_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(global_src), "r"(bytes)
               : "memory");
}
// Orders this thread's generic-proxy and async-proxy accesses to global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// Orders this thread's generic-proxy writes to shared memory before later bulk copies that read it.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif  // JAX_EP_EMULATION

// Per-warp TMA state (meaningful in lane 0, which issues every bulk operation).
struct TmaWarp {
  char* buffer;
  uint64_t* barrier;
  uint32_t parity;
};

// Sets up this warp's buffer and mbarrier (every lane calls it).
__device__ __forceinline__ TmaWarp tma_warp_setup(char* dynamic_shared, int warp, int lane) {
  TmaWarp tma;
  tma.barrier = reinterpret_cast<uint64_t*>(dynamic_shared) + warp;
  tma.buffer = dynamic_shared + kTmaBarrierBytes + warp * kTmaBufferBytes;
  tma.parity = 0;
  if (lane == 0) mbarrier_init(tma.barrier, 1);
  __syncwarp();
  return tma;
}

// Copies `bytes` (a multiple of 16, 16-byte aligned) from src to every destination of dst_mask
// (lane j holds destination j), through the warp's shared buffer: a bulk load per piece, then one
// bulk store per destination. Lane 0 issues everything; the stores stay in flight (call
// tma_store_wait_all before the data must be visible, and before the kernel exits).
__device__ __forceinline__ void warp_copy_tma(TmaWarp& tma, const char* src, int64_t bytes,
                                              uint32_t dst_mask, char* my_dst, int lane) {
  for (int64_t offset = 0; offset < bytes; offset += kTmaBufferBytes) {
    const uint32_t piece =
        static_cast<uint32_t>(bytes - offset < kTmaBufferBytes ? bytes - offset : kTmaBufferBytes);
    if (lane == 0) {
      tma_store_wait_read();  // the previous piece's stores no longer read the buffer
      tma_load(tma.buffer, src + offset, piece, tma.barrier);
      mbarrier_wait(tma.barrier, tma.parity);
      tma.parity ^= 1u;
    }
    for (uint32_t m = dst_mask; m != 0u; m &= m - 1u) {
      const int j = __ffs(m) - 1;
      char* to = reinterpret_cast<char*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
      if (lane == 0) tma_store(to + offset, tma.buffer, piece);
    }
    if (lane == 0) tma_store_commit();
  }
}

// This warp's TMA state when the kernel copies rows in bulk (kTma), else unused.
template <bool kTma>
__device__ __forceinline__ TmaWarp tma_warp_setup_if(char* dynamic_shared, int warp, int lane) {
  TmaWarp tma{};
  if constexpr (kTma) tma = tma_warp_setup(dynamic_shared, warp, lane);
  return tma;
}

// Before a warp of a data kernel leaves: its bulk stores have completed.
template <bool kTma>
__device__ __forceinline__ void tma_drain(int lane) {
  if constexpr (kTma) {
    if (lane == 0) tma_store_wait_all();
  }
}

__device__ __forceinline__ char* comm_buffer_of(DeviceState* state, int ordinal) {
  return reinterpret_cast<char*>(state->tables.comm_buffers[ordinal]);
}

__device__ __forceinline__ char* own_comm_buffer(DeviceState* state) {
  return comm_buffer_of(state, state->tables.slot);
}

#ifndef JAX_EP_EMULATION
// A release store without the sequentially consistent fence of __threadfence_system() (SASS:
// MEMBAR.ALL.SYS + a strong store, where __threadfence_system() + st.release.sys is MEMBAR.SC.SYS,
// MEMBAR.ALL.SYS and an L1 invalidation): writes before it (this thread's, and those ordered before
// it by a barrier) are visible to whoever acquires the value.
__device__ __forceinline__ void release_store_sys(uint64_t* address, uint64_t value) {
  asm volatile("fence.acq_rel.sys;\n\tst.relaxed.sys.global.u64 [%0], %1;" ::"l"(address),
               "l"(value)
               : "memory");
}
#endif

// Spins until *flag == expected (a peer's release store), polling with relaxed loads and a short
// exponential back-off (poll_flag), then acquires. Bounded: records a timeout naming the op and the
// rank waited for, then traps. Flags carry (epoch << 16) | group key, so a value left by an earlier
// call, or by a call of another group, never matches.
static __device__ __noinline__ void wait_flag_equal(const uint64_t* flag, uint64_t expected,
                                                    DeviceState* state, int32_t op_id,
                                                    int32_t rank, int32_t waited_rank,
                                                    int32_t waited_ordinal) {
  uint64_t observed, elapsed;
  if (!poll_flag(flag, [expected](uint64_t v) { return v == expected; },
                 PollBound{state->tables.timeout_ns, 256}, &observed, &elapsed)) {
    // a value of another group key is no epoch of this group (the buffer reused by another call site)
    const bool foreign = ((observed ^ expected) & 0xffff) != 0;
    record_fault_and_trap(state, kFaultTimeout, op_id, rank, waited_rank, waited_ordinal,
                          expected >> 16, foreign ? 0 : observed >> 16,
                          static_cast<int64_t>(elapsed), foreign ? kFieldForeignFlag : kFieldNone);
  }
  fence_acquire_sys();
}

// The sum of v over the 32 lanes of the warp, in every lane (every lane calls it). Integer sums
// only (wrap-around, so the order does not matter).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// sanitized_expert (cuda/common.cuh) with a token's slots in a warp's lanes: lane k holds slot k's
// id (a lane past the token's K slots holds any id outside [0, E), e.g. -1) and gets its slot's
// expert, -1 for an unused one: out of range, or the id of a lower lane (an earlier slot). One
// match across the lanes instead of k loads per lane. Every lane calls it.
__device__ __forceinline__ int32_t sanitized_expert_warp(int32_t id, int E) {
  const uint32_t same = __match_any_sync(kFullMask, id);
  return id >= 0 && id < E && (same & lanemask_lt()) == 0u ? id : -1;
}

// Rank r is in `ranks`, a call's bit set of ranks (OpInfo::active, OpInfo::linked).
__device__ __forceinline__ bool has_rank(uint32_t ranks, int r) { return ((ranks >> r) & 1u) != 0u; }

// ---- the persistent rank mask (SyncCounters::rank_masks, one per EP group of an axis slot) ---------
// Every EP call ANDs its rank_mask operand with the complement (the low-latency kernels in
// ll_read_call, the throughput ones in discover_group); shrink-mode kernels set it.
__device__ __forceinline__ uint32_t persistent_mask(DeviceState* state, int axis_slot, int group) {
  return *reinterpret_cast<volatile uint32_t*>(&state->sync.rank_masks[axis_slot][group].masked);
}

// Shrink mode: masks `peer` persistently on this device (bit and event; the host reads them,
// jax_ep.runtime.rank_masks) instead of failing the call. `during`: RankMaskEvent::during.
static __device__ __noinline__ void mask_peer(DeviceState* state, int axis_slot, int group,
                                              int rank, int peer, int32_t op_id, int32_t during,
                                              uint64_t epoch) {
  if (peer < 0 || peer >= kMaxGroupRanks) return;
  SyncCounters::RankMaskState& m = state->sync.rank_masks[axis_slot][group];
  const unsigned bit = 1u << peer;
  if ((atomicOr(&m.masked, bit) & bit) != 0u) return;  // already masked: keep the first event
  m.rank = rank;
  m.events[peer].epoch = epoch;
  m.events[peer].during = during;
  m.events[peer].op = op_id;
  __threadfence_system();
}

// Bit r (r < n, r < kMaxGroupRanks): rank_mask[r] != 0, every rank when rank_mask is null. Every
// load is issued before the first is tested (predicated, unrolled: in flight together, where a
// test per load made a chain of them).
__device__ __forceinline__ uint32_t requested_ranks(const int32_t* rank_mask, int n) {
  if (rank_mask == nullptr) return n >= kMaxGroupRanks ? ~0u : n <= 0 ? 0u : (1u << n) - 1u;
  int32_t v[kMaxGroupRanks];
#pragma unroll
  for (int r = 0; r < kMaxGroupRanks; ++r) v[r] = r < n ? rank_mask[r] : 0;
  uint32_t bits = 0u;
#pragma unroll
  for (int r = 0; r < kMaxGroupRanks; ++r) bits |= v[r] != 0 ? 1u << r : 0u;
  return bits;
}

// The prologue of a call (thread 0) reads a chain of words, each followed by a check that may trap;
// nothing is hoisted past such a branch, so checking each word as it is loaded costs a round trip
// per word. Instead every word whose address is valid before any check is loaded first (all in
// flight together), the group-indexed ones after check_call_args (a second level), and then the
// checks run in their usual order, with the same faults.
struct CallStart {
  int32_t rank, group;  // the device scalars
  uint64_t comm_bytes;  // state->tables.comm_bytes
  uint32_t ll_busy;     // state->sync.ll_busy
  uint32_t requested;   // requested_ranks(rank_mask, group_size)
};

__device__ __forceinline__ CallStart load_call_start(DeviceState* state, const int32_t* rank_ptr,
                                                     const int32_t* group_ptr,
                                                     const int32_t* rank_mask,
                                                     int32_t group_size) {
  CallStart s;
  s.rank = *rank_ptr;
  s.group = *group_ptr;
  s.comm_bytes = state->tables.comm_bytes;
  s.ll_busy = state->sync.ll_busy;
  s.requested = requested_ranks(rank_mask, group_size);
  return s;
}

// Thread 0 at a call's start: the device scalars rank and group, and the sizes, are in range (a
// kFaultBadArgument naming the op otherwise).
__device__ __forceinline__ void check_call_args(DeviceState* state, int32_t rank, int32_t group,
                                                int32_t group_size, int32_t axis_slot,
                                                int32_t op_id) {
  if (rank < 0 || rank >= group_size || group < 0 || group >= kMaxGroups || axis_slot < 0 ||
      axis_slot >= kDirectoryAxes || group_size < 1 || group_size > kMaxGroupRanks) {
    record_fault_and_trap(state, kFaultBadArgument, op_id, rank, -1, -1,
                          static_cast<uint64_t>(group_size), static_cast<uint64_t>(group), 0);
  }
}

// Thread 0, after check_call_args (group and axis slot in range): the buffer is large enough and
// holds no low-latency data in flight; bumps this device's epoch of (axis slot, group) and fills
// info's rank, size, group and expected (epoch << 16 | directory key). The epoch is loaded before
// the checks (CallStart). Every discovery (NVLink and put transports) starts here.
__device__ __forceinline__ void begin_group_call(DeviceState* state, const CallStart& s,
                                                 int32_t group_size, int32_t axis_slot,
                                                 uint64_t needed_bytes, int32_t op_id,
                                                 OpInfo* info) {
  const uint64_t epoch = state->sync.group_epoch[axis_slot][s.group] + 1;
  check_comm_bytes(state, s.comm_bytes, needed_bytes, op_id, s.rank);
  if (s.ll_busy != 0) {  // the low-latency data in flight shares the buffer
    record_fault_and_trap(state, kFaultLLInFlight, op_id, s.rank, -1, kLLFaultThroughput, 0,
                          s.ll_busy, 0);
  }
  state->sync.group_epoch[axis_slot][s.group] = epoch;
  info->expected = (epoch << 16) | static_cast<uint64_t>(axis_slot * kMaxGroups + s.group);
  info->rank = s.rank;
  info->size = group_size;
  info->group = s.group;
}

// Waits until rank `peer` of the group has published its directory entry for `epoch` (it has
// entered this call) and returns the entry (acquired) in *seen. Bounded: a peer whose call count
// stays below this call's records a timeout fault naming the op, this rank and the peer (field:
// expected / observed are counts), then traps; or in shrink mode returns false, after twice the
// bound: a live peer can come one bound late (the wait it sat out in the previous call, on a rank
// that died there and that this rank did not wait for: not every rank waits for every peer), and
// giving up on it would mask a live rank. Every discovery (NVLink and put transports, the
// low-latency kernels) waits through it.
__device__ __forceinline__ bool wait_directory_entry(DeviceState* state, int axis_slot, int group,
                                                     int peer, uint64_t epoch, int32_t op_id,
                                                     int32_t rank, bool shrink, uint64_t* seen) {
  const uint64_t* slot = &state->sync.directory[axis_slot][group][peer];
  // Usually the entry is there already (always this rank's own): one acquire load, where a relaxed
  // poll and then the acquire took two round trips. Polling goes on with relaxed loads.
  *seen = load_acquire_sys(slot);
  if ((*seen >> 16) >= epoch) return true;
  uint64_t elapsed;
  PollBound bound{state->tables.timeout_ns, 512};
  if (shrink) {
    bound.timeout_ns *= 2;
    bound.state = state;
    bound.axis_slot = axis_slot;
    bound.group = group;
    bound.peer = peer;
    bound.epoch = epoch;
  }
  if (!poll_flag(slot, [epoch](uint64_t v) { return (v >> 16) >= epoch; }, bound, seen,
                 &elapsed)) {
    if (shrink) return false;
    record_fault(state, kFaultTimeout, op_id, rank, peer, -1, epoch, *seen >> 16,
                 static_cast<int64_t>(elapsed), kFieldSequence);
    __trap();
  }
  *seen = load_acquire_sys(slot);
  return true;
}

// The key of a call's flags (OpInfo::expected) names its axis slot and group.
__device__ __forceinline__ int axis_slot_of(const OpInfo& info) {
  return static_cast<int>((info.expected & 0xFFFF) / kMaxGroups);
}

// A wait of a throughput call on rank `peer`'s flag (its data for this call): wait_flag_equal, or
// in shrink mode (missed != null) a timeout masks the peer persistently (`during`:
// RankMaskEvent::during), sets its bit in *missed and returns false, and a wait that finds the bit
// set already (another warp gave up on that peer) gives up at once. true: the flag came (acquired).
static __device__ __noinline__ bool wait_peer_flag(const uint64_t* flag, DeviceState* state,
                                                   const OpInfo& info, int32_t op_id, int peer,
                                                   uint32_t* missed, int32_t during) {
  if (missed == nullptr) {
    wait_flag_equal(flag, info.expected, state, op_id, info.rank, peer, info.ordinals[peer]);
    return true;
  }
  uint64_t observed, elapsed;
  const uint64_t expected = info.expected;
  PollBound bound{state->tables.timeout_ns, 256, missed, 1u << peer};
  bound.state = state;
  bound.axis_slot = axis_slot_of(info);
  bound.group = info.group;
  bound.peer = peer;
  bound.epoch = info.expected >> 16;
  if (poll_flag(flag, [expected](uint64_t v) { return v == expected; }, bound, &observed, &elapsed)) {
    fence_acquire_sys();
    return true;
  }
  if ((atomicOr(missed, 1u << peer) & (1u << peer)) == 0u) {
    mask_peer(state, axis_slot_of(info), info.group, info.rank, peer, op_id, during,
              info.expected >> 16);
  }
  return false;
}

// Thread 0, shrink mode, after a barrier that follows the waits of a one-block phase (discovery,
// the counts exchange): the ranks in info->missed leave the call (and are masked persistently,
// `during`: RankMaskEvent::during); what the rest of the call does depends on `active` /
// `linked` only.
__device__ __forceinline__ void drop_missed(DeviceState* state, OpInfo* info, int32_t op_id,
                                            int32_t during) {
  const uint32_t missed = info->missed;
  if (missed == 0u) return;
  for (int r = 0; r < info->size; ++r) {
    if (!has_rank(missed, r)) continue;
    mask_peer(state, axis_slot_of(*info), info->group, info->rank, r, op_id, during,
              info->expected >> 16);
    info->ordinals[r] = -1;
  }
  info->active &= ~missed;
  info->linked = has_rank(info->active, info->rank) ? info->active : 1u << info->rank;
}

// Group discovery, run by ONE block (every thread calls it; blockDim.x >= kMaxDevices).
//
// The op knows its rank and group only as device scalars (lax.axis_index), so the rank -> device
// table is built on the device: this device bumps its epoch of (axis slot, group), publishes
// {epoch, its ordinal} into directory[slot][group][rank] of EVERY managed device, followed by the
// call's fingerprint (fp: the op, fp.ranks = the group size R, the sizes its peers must share), and
// waits until its own directory shows the current epoch for all R ranks of its group. Afterwards
// every peer of the group has entered this call, i.e. finished all earlier calls (stream order), so
// its buffers may be overwritten, and runs the same call: a peer whose fingerprint differs, or
// whose call count is more than one ahead, makes the block trap (a kFaultMismatch naming the field)
// before the op writes anything. Fills info (shared memory): rank, size, group, ordinals, expected,
// active, linked.
//
// Rank masking (rank_mask [R] int32 on the device, nonzero = active; null = all active): only the
// linked ranks (OpInfo::linked) are waited for and have their fingerprints checked, so a masked
// peer may never enter the call (a lax.cond branch without it, a process that stopped calling). A
// masked rank publishes only to itself; an active one still publishes its directory entry to every
// managed device, since which device a masked rank is on is what discovery finds out. The
// operand is ANDed with the persistent mask (shrink mode).
//
// Shrink mode: a linked peer that has not entered the call within the bound leaves it (drop_missed:
// masked persistently, event `discovery`) instead of trapping. One block decides, so the call's
// kernels all see the same ranks; another rank may decide otherwise (the peer came in between):
// each rank's outputs follow its own set (the receivers place every row, cuda/dispatch.cu).
__device__ __forceinline__ void discover_group(DeviceState* state, const int32_t* rank_ptr,
                                               const int32_t* group_ptr,
                                               const int32_t* rank_mask, int32_t axis_slot,
                                               uint64_t needed_bytes, const OpFingerprint& fp,
                                               bool shrink, OpInfo* info) {
  const int32_t group_size = fp.ranks;
  const int32_t op_id = fp.op;
  if (threadIdx.x == 0) {
    const CallStart s = load_call_start(state, rank_ptr, group_ptr, rank_mask, group_size);
    check_call_args(state, s.rank, s.group, group_size, axis_slot, op_id);
    // ranks masked by an earlier timeout (a shrink-mode call) take no part until the host clears
    // them (loaded here: in flight with begin_group_call's epoch, before its checks)
    const uint32_t lost = persistent_mask(state, axis_slot, s.group);
    begin_group_call(state, s, group_size, axis_slot, needed_bytes, op_id, info);
    const uint32_t active = s.requested & ~lost;
    info->active = active;
    info->linked = has_rank(active, s.rank) ? active : 1u << s.rank;
    info->missed = 0u;
  }
  __syncthreads();
  const uint64_t epoch = info->expected >> 16;
  const int group = info->group;
  const int rank = info->rank;
  const uint64_t entry = (epoch << 16) | static_cast<uint64_t>(state->tables.slot);
  const bool masked = !has_rank(info->active, rank);
  for (int o = threadIdx.x; o < kMaxDevices; o += blockDim.x) {
    DeviceState* device = state->tables.peer_states[o];
    if (device != nullptr && (!masked || o == state->tables.slot)) {
      store_release_sys(&device->sync.directory[axis_slot][group][rank], entry);
      publish_fingerprint(device, axis_slot, group, rank, epoch, fp);
    }
  }
  bool differs = false;
  const int peer_rank = static_cast<int>(threadIdx.x);
  if (peer_rank < group_size && !has_rank(info->linked, peer_rank)) {
    info->ordinals[peer_rank] = -1;  // not linked: never waited for, never written to
  } else if (peer_rank < group_size) {
    const int peer = peer_rank;
    uint64_t seen;
    if (wait_directory_entry(state, axis_slot, group, peer, epoch, op_id, rank, shrink, &seen)) {
      const int32_t ordinal = static_cast<int32_t>(seen & 0xFFFF);
      info->ordinals[peer] = ordinal;
      differs =
          peer_call_differs(state, axis_slot, group, rank, peer, ordinal, epoch, seen >> 16, fp);
    } else {
      atomicOr(&info->missed, 1u << peer);  // shrink mode: it has not entered the call
    }
  }
  trap_if_any_differs(differs);  // a block barrier: info is complete after it
  if (shrink) {
    if (threadIdx.x == 0) drop_missed(state, info, op_id, 1);
    __syncthreads();
  }
}

// Writes the shared OpInfo of discover_group to the local region of the buffer for the op's later
// kernels, with zeroed work counters. One thread.
__device__ __forceinline__ void publish_op_info(DeviceState* state, const CommLayout& layout,
                                                const OpInfo& info, int32_t total_rows) {
  OpInfo* out = reinterpret_cast<OpInfo*>(own_comm_buffer(state) + layout.op_info);
  out->expected = info.expected;
  out->rank = info.rank;
  out->size = info.size;
  out->group = info.group;
  out->total_rows = total_rows;
  out->active = info.active;
  out->linked = info.linked;
  out->missed = 0u;
  for (int i = 0; i < 4; ++i) out->work[i] = 0;
  for (int r = 0; r < kMaxGroupRanks; ++r) out->ordinals[r] = r < info.size ? info.ordinals[r] : -1;
}

// Next work item of a warp from a dynamic counter (lane 0 takes it, the warp shares it).
__device__ __forceinline__ int next_item(uint32_t* counter) {
  int item = 0;
  if ((threadIdx.x & 31) == 0) item = static_cast<int>(atomicAdd(counter, 1u));
  return __shfl_sync(kFullMask, item, 0);
}

// ---- the data kernels' prologue ------------------------------------------------------------
// What every warp of a data kernel (the main kernels of dispatch, combine and broadcast) starts
// from: the call's OpInfo, which the op's first kernel published after group discovery, and the
// peer buffer each lane names.
struct DataWarp {
  DeviceState* state;
  int warp, lane;
  char* own;          // this device's communication buffer
  OpInfo* info;       // the call: rank, group size, ordinals, work counters
  int me, R;          // info->rank, info->size
  uint64_t expected;  // value of this call's ready flags
  uint32_t linked;    // info->linked: the ranks this call exchanges data with
  char* lane_peer;    // lane r < R, r linked: rank r's communication buffer (shuffled to name a
                      // peer); null for a rank that is not linked (masked)
};

__device__ __forceinline__ DataWarp data_warp(DeviceState* state, const CommLayout& L) {
  DataWarp d;
  d.state = state;
  d.warp = threadIdx.x >> 5;
  d.lane = threadIdx.x & 31;
  d.own = own_comm_buffer(state);
  d.info = reinterpret_cast<OpInfo*>(d.own + L.op_info);
  d.me = d.info->rank;
  d.R = d.info->size;
  d.expected = d.info->expected;
  d.linked = d.info->linked;
  d.lane_peer = d.lane < d.R && has_rank(d.linked, d.lane)
                    ? comm_buffer_of(state, d.info->ordinals[d.lane])
                    : nullptr;
  return d;
}

// Rank r's communication buffer as lane r of the warp holds it (DataWarp::lane_peer; null: r is not
// linked). Every lane calls it.
__device__ __forceinline__ char* peer_buffer(const DataWarp& d, int r) {
  return reinterpret_cast<char*>(
      __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(d.lane_peer), r));
}

// ---- chunks: the unit of work of the data kernels and of the per-chunk ready flags ----------
// Chunk c holds tokens [chunk_begin(L, c), chunk_end(L, c, T)).
__device__ __forceinline__ int64_t chunk_begin(const CommLayout& L, int c) {
  return static_cast<int64_t>(c) * L.chunk_tokens;
}
__device__ __forceinline__ int64_t chunk_end(const CommLayout& L, int c, int64_t T) {
  const int64_t end = (static_cast<int64_t>(c) + 1) * L.chunk_tokens;
  return end < T ? end : T;
}

// ---- slices: columns of a chunk's rows (CommLayout::num_slices), the rest of a work item -----
// Slices [k0, k1) of a row cover its bytes [slice_begin(L, k0), slice_end(L, k1, row_bytes)) (bytes
// of the staged row, or of a row of the same element size; the last slice runs to the row's end).
__device__ __forceinline__ int64_t slice_begin(const CommLayout& L, int k) {
  return static_cast<int64_t>(k) * static_cast<int64_t>(L.slice_bytes);
}
__device__ __forceinline__ int64_t slice_end(const CommLayout& L, int k1, int64_t row_bytes) {
  if (k1 >= L.num_slices) return row_bytes;
  const int64_t end = slice_begin(L, k1);
  return end < row_bytes ? end : row_bytes;
}

// A work item of a data kernel: slices [k0, k1) of the rows of chunk c's tokens.
struct ChunkSlices {
  int c, k0, k1;
};

// Per-chunk items of a kernel that moves row slices (sliced: one item per (chunk, slice), chunk
// major, so that a chunk's slices are taken together) or whole rows (one per chunk, every slice).
__device__ __forceinline__ int chunk_items(const CommLayout& L, bool sliced) {
  return L.num_chunks * (sliced ? L.num_slices : 1);
}
__device__ __forceinline__ ChunkSlices chunk_item(const CommLayout& L, int item, bool sliced) {
  if (!sliced) return ChunkSlices{item, 0, L.num_slices};
  const int k = item % L.num_slices;
  return ChunkSlices{item / L.num_slices, k, k + 1};
}

// The ready flag of slice k of chunk c from (or for) rank s in `buffer`'s chunk_flags.
__device__ __forceinline__ uint64_t* chunk_flag(char* buffer, const CommLayout& L, int s, int c,
                                                int k) {
  return reinterpret_cast<uint64_t*>(buffer + L.chunk_flags) +
         (static_cast<int64_t>(s) * L.num_chunks + c) * L.num_slices + k;
}

// The warp waits for the flags of item `it` from each rank in `ranks` (wait_peer_flag), in this
// rank's buffer: lanes take the (rank, slice) flags in parallel, so a whole-row item (every slice)
// costs one poll round, not one per slice. In shrink mode every slice of the chunk is waited for,
// so that a token has all of a source's slices or none of them (a source whose slices stopped
// midway is treated alike by every item of the chunk). Returns the ranks whose flags did not all
// come (shrink mode only: otherwise a timeout traps); the others' are acquired, and a warp barrier
// orders the lanes' acquires before every lane's later reads. Every lane calls it.
__device__ __forceinline__ uint32_t wait_chunk_flags(char* own, const CommLayout& L,
                                                     DeviceState* state, OpInfo* info,
                                                     int32_t op_id, bool shrink, uint32_t ranks,
                                                     const ChunkSlices& it, int lane) {
  const int k0 = shrink ? 0 : it.k0;
  const int n = (shrink ? L.num_slices : it.k1) - k0;  // flags per rank
  uint32_t lost = 0u;
  for (int j = lane; j < info->size * n; j += 32) {
    const int r = j / n;
    if (!has_rank(ranks, r) || has_rank(lost, r)) continue;
    if (!wait_peer_flag(chunk_flag(own, L, r, it.c, k0 + j % n), state, *info, op_id, r,
                        shrink ? &info->missed : nullptr, 2)) {
      lost |= 1u << r;
    }
  }
  __syncwarp();  // (a shuffle or reduction gives no memory order)
  return __reduce_or_sync(kFullMask, lost);
}

// The index-th rank other than `me` (index in [0, R - 1)).
__device__ __forceinline__ int other_rank(int index, int me) { return index < me ? index : index + 1; }

// Sender side, after writing item `it` into every other rank's staging: its stores (bulk stores
// completed first) are visible before its flags are raised on each of them. Lane r holds rank r's
// buffer in lane_peer (null: rank r is not linked, nothing goes there). Every lane calls it.
template <bool kTma>
__device__ __forceinline__ void release_chunk(const CommLayout& L, char* lane_peer,
                                              const ChunkSlices& it, int me, int R,
                                              uint64_t expected, int lane) {
  if constexpr (kTma) {
    if (lane == 0) {
      tma_store_wait_all();
      fence_proxy_async_global();
      __threadfence_system();
    }
  }
  __syncwarp();
  if (lane < R && lane != me && lane_peer != nullptr) {
    for (int k = it.k0; k < it.k1; ++k) {
      store_release_sys(chunk_flag(lane_peer, L, me, it.c, k), expected);
    }
  }
}

// Senders' loop: items of this rank's chunks (chunk_item) from the data kernel's first work list;
// send_token(t, it) for each token of the item's chunk, then its flags on every other rank. Every
// lane calls it.
template <bool kTma, typename SendToken>
__device__ __forceinline__ void send_chunks(const CommLayout& L, const DataWarp& d, int64_t T,
                                            bool sliced, SendToken send_token) {
  const int n_items = chunk_items(L, sliced);
  for (;;) {
    const int item = next_item(&d.info->work[0]);
    if (item >= n_items) break;
    const ChunkSlices it = chunk_item(L, item, sliced);
    for (int64_t t = chunk_begin(L, it.c); t < chunk_end(L, it.c, T); ++t) send_token(t, it);
    release_chunk<kTma>(L, d.lane_peer, it, d.me, d.R, d.expected, d.lane);
  }
}

// The body of a data kernel whose warps copy rows (bulk copies when kTma): warps below send_warps
// run send(d, tma), the others receive(d, tma); then each drains its bulk stores.
template <bool kTma, typename Send, typename Receive>
__device__ __forceinline__ void run_data_warps(DeviceState* state, const CommLayout& L,
                                               int send_warps, Send send, Receive receive) {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);  // TMA: per-warp barriers and buffers
  const DataWarp d = data_warp(state, L);
  TmaWarp tma = tma_warp_setup_if<kTma>(reinterpret_cast<char*>(dynamic_shared), d.warp, d.lane);
  if (d.warp < send_warps) {
    send(d, tma);
  } else {
    receive(d, tma);
  }
  tma_drain<kTma>(d.lane);
}

// Receiver side: work item `item` over this rank's chunk items (chunk_item), then (chunk item,
// other rank) pairs: chunk_items(L, sliced) * R items. Sets the source rank *s and the item *it;
// for another rank's chunk, the warp waits for its flags (wait_chunk_flags: bounded, the op named
// in a timeout), with bulk loads ordered after the acquires. Returns false (no wait) for a rank that is
// not linked (masked): nothing came from it; in shrink mode also for a source this call gave up on
// (its chunk never came). Every lane calls it.
template <bool kTma>
__device__ __forceinline__ bool receive_chunk_item(int item, DeviceState* state,
                                                   const CommLayout& L, OpInfo* info, char* own,
                                                   int32_t op_id, bool shrink, bool sliced,
                                                   int lane, int* s, ChunkSlices* it) {
  const int me = info->rank;
  const int per_rank = chunk_items(L, sliced);
  if (item < per_rank) {
    *s = me;
    *it = chunk_item(L, item, sliced);
    return true;
  }
  item -= per_rank;
  *it = chunk_item(L, item / (info->size - 1), sliced);
  *s = other_rank(item % (info->size - 1), me);
  if (!has_rank(info->linked, *s)) return false;
  const uint32_t lost = wait_chunk_flags(own, L, state, info, op_id, shrink, 1u << *s, *it, lane);
  if constexpr (kTma) {
    if (lane == 0) fence_proxy_async_global();  // (after the warp barrier of wait_chunk_flags)
  }
  return lost == 0u;
}

// ---- row copies -----------------------------------------------------------------------------
// A warp copies one source row to up to 32 destinations: for every set bit j of dst_mask, lane j
// holds destination j's pointer (lanes name ranks or top-k slots). Each lane issues U 16-byte
// loads before the first store.

template <int U>
__device__ __forceinline__ void warp_copy_raw(const char* src, int64_t bytes, uint32_t dst_mask,
                                              char* my_dst, int lane) {
  const uint4* from = reinterpret_cast<const uint4*>(src);
  const int64_t vectors = bytes / 16;
  for (int64_t base = 0; base < vectors; base += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < vectors) v[u] = __ldcg(from + i);
    }
    for (uint32_t m = dst_mask; m != 0u; m &= m - 1u) {
      const int j = __ffs(m) - 1;
      uint4* to = reinterpret_cast<uint4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < vectors) to[i] = v[u];
      }
    }
  }
}

// A raw row copy of a data kernel: bulk (TMA) copies through the warp's shared buffer, or 16-byte
// register copies.
template <bool kTma>
__device__ __forceinline__ void warp_copy_row(TmaWarp& tma, const char* src, int64_t bytes,
                                              uint32_t dst_mask, char* my_dst, int lane) {
  if constexpr (kTma) {
    warp_copy_tma(tma, src, bytes, dst_mask, my_dst, lane);
  } else {
    warp_copy_raw<8>(src, bytes, dst_mask, my_dst, lane);
  }
}

// Zeroes `bytes` (a multiple of 16) at dst, lane-strided.
__device__ __forceinline__ void warp_zero(char* dst, int64_t bytes, int lane) {
  uint4* to = reinterpret_cast<uint4*>(dst);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t i = lane; i < bytes / 16; i += 32) to[i] = zero;
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half)
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ uint4 pack_bf16x8(const float f[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

// 8 consecutive elements of a bf16 or f32 row as loaded (16 or 32 bytes; unpack8 makes them
// floats): a batch of loads in flight costs 4 (bf16) or 8 (f32) registers per step, not 8 floats
// (warp_copy_convert; combine_bwd in cuda/broadcast.cu).
template <bool kF32>
struct Raw8 {
  uint4 v[kF32 ? 2 : 1];
};
template <bool kF32>
__device__ __forceinline__ Raw8<kF32> load_raw8(const char* row, int64_t e0) {
  const uint4* p = reinterpret_cast<const uint4*>(row + e0 * (kF32 ? 4 : 2));
  Raw8<kF32> raw;
  raw.v[0] = __ldcg(p);
  if constexpr (kF32) raw.v[1] = __ldcg(p + 1);
  return raw;
}
template <bool kF32>
__device__ __forceinline__ void unpack8(const Raw8<kF32>& raw, float f[8]) {
  if constexpr (kF32) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      f[4 * h] = __uint_as_float(raw.v[h].x);
      f[4 * h + 1] = __uint_as_float(raw.v[h].y);
      f[4 * h + 2] = __uint_as_float(raw.v[h].z);
      f[4 * h + 3] = __uint_as_float(raw.v[h].w);
    }
  } else {
    unpack_bf16x8(raw.v[0], f);
  }
}

// 8 consecutive elements starting at element e0 of a bf16 or f32 row, as floats.
template <bool kF32>
__device__ __forceinline__ void load8(const char* row, int64_t e0, float f[8]) {
  unpack8<kF32>(load_raw8<kF32>(row, e0), f);
}

template <bool kF32>
__device__ __forceinline__ void store8(char* row, int64_t e0, const float f[8]) {
  if constexpr (kF32) {
    float4* p = reinterpret_cast<float4*>(row + e0 * 4);
    p[0] = make_float4(f[0], f[1], f[2], f[3]);
    p[1] = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    *reinterpret_cast<uint4*>(row + e0 * 2) = pack_bf16x8(f);
  }
}

// FP8 e4m3 of 8 floats (round to nearest even, saturating), byte i = element i.
__device__ __forceinline__ uint2 pack_fp8x8(const float f[8]) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(f[4 * h], f[4 * h + 1]), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(f[4 * h + 2], f[4 * h + 3]), __NV_SATFINITE, __NV_E4M3);
    w[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  return make_uint2(w[0], w[1]);
}

// FP8 e4m3 of one 128-channel block held by 128 / kN aligned consecutive lanes, kN elements each
// (consecutive channels): amax = max(max|x|, kFp8MinAmax) over the block, q = e4m3(x * (448 / amax)),
// scale = amax / 448; bit-exact with jax_ep.fp8.quantize_fp8 (fmaxf leaves a NaN out of the amax, as
// its abs_for_amax does: only the NaN channel is NaN). Writes this lane's kN bytes to fp8 (8 per uint2, element
// order) and returns the block's scale. Every lane of the warp calls it, converged, in a
// one-dimensional thread block (the lane is threadIdx.x & 31; kN = 8: lanes 0-15 and 16-31 are the
// two blocks); the exchanges stay inside a block's lanes.
template <int kN>
__device__ __forceinline__ float quantize_fp8_block(const float* f, uint2* fp8) {
  static_assert(kN % 8 == 0 && 128 % kN == 0, "a block is whole lanes of whole uint2s");
  static_assert(kN <= 64, "a block of at least 2 lanes (the division is shared by lane pairs)");
  const int lane = threadIdx.x & 31;
  float amax = 0.f;  // fmaxf drops NaN: never NaN, never negative
#pragma unroll
  for (int i = 0; i < kN; ++i) amax = fmaxf(amax, fabsf(f[i]));
  if constexpr (kN == 8) {
    // two half-warp blocks: one max reduction each over the whole warp (a non-negative float's
    // bits order as unsigned), in place of 4 dependent shuffle + max rounds
    const unsigned bits = __float_as_uint(amax);
    const unsigned lo = __reduce_max_sync(kFullMask, lane < 16 ? bits : 0u);
    const unsigned hi = __reduce_max_sync(kFullMask, lane < 16 ? 0u : bits);
    amax = __uint_as_float(lane < 16 ? lo : hi);
  } else {
#pragma unroll
    for (int offset = 128 / kN / 2; offset >= 1; offset >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    }
  }
  amax = fmaxf(amax, kFp8MinAmax);
  // one IEEE division per lane: even lanes 448 / amax, odd lanes amax / 448, swapped in pairs
  // (a block is at least 2 lanes)
  const bool odd = (lane & 1) != 0;
  const float mine = __fdiv_rn(odd ? amax : 448.0f, odd ? 448.0f : amax);
  const float other = __shfl_xor_sync(kFullMask, mine, 1);
  const float inv_scale = odd ? other : mine;
  const float scale = odd ? mine : other;
  float q[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) q[i] = __fmul_rn(f[i], inv_scale);
#pragma unroll
  for (int k = 0; k < kN / 8; ++k) fp8[k] = pack_fp8x8(q + 8 * k);
  return scale;
}

// This lane's 8 elements of one 256-element step, converted: kOut = kRowBF16 (round to nearest
// even) into *bf16, or kRowFP8 (quantize_fp8_block; a half-warp covers one 128-channel block) into
// *fp8 and *scale. Every lane of the warp calls it (FP8 shuffles).
template <int kOut>
__device__ __forceinline__ void convert8(const float f[8], uint4* bf16, uint2* fp8, float* scale) {
  if constexpr (kOut == kRowFP8) {
    *scale = quantize_fp8_block<8>(f, fp8);
  } else {
    *bf16 = pack_bf16x8(f);
  }
}

// Copies one token row of x (bf16 or f32, H elements) to the destinations, converting it to the
// wire/row format kOut (convert8). Lane j holds destination j's row (my_dst) and, for FP8, its
// scales (my_scales). Each lane handles 8 consecutive elements per step of 256, U steps' loads in
// flight; for FP8, H % 128 == 0.
//
// kTma: the converted row goes through the warp's shared buffer (tma) in pieces of whole steps and
// lane 0 bulk-stores each piece to every destination (stores left in flight, as warp_copy_tma);
// without it every lane stores its 8 elements to every destination itself, which made the FP8
// dispatch bound by instruction issue (2x H200: no faster than BF16; one H200: 123 us at T=4096,
// top-8, against 148 for the raw BF16 bulk copies). With kTma the FP8 scales of a piece also
// collect in the buffer's last kTmaScaleBytes and go to each destination once per piece, 32 per
// store (stored per step and destination, 2 lanes of 32 active, they were half the instructions of
// an expert-major FP8 row with 8 receive rows); without it they are stored per step.
template <bool kXF32, int kOut, int U, bool kTma = false>
__device__ __forceinline__ void warp_copy_convert(const char* x_row, int H, uint32_t dst_mask,
                                                  char* my_dst, float* my_scales, int lane,
                                                  TmaWarp* tma = nullptr) {
  static_assert(kOut == kRowBF16 || kOut == kRowFP8, "converting copy writes bf16 or fp8");
  constexpr int kOutBytes = kOut == kRowFP8 ? 1 : 2;
  constexpr bool kSharedScales = kTma && kOut == kRowFP8;
  constexpr int kPieceSteps =  // FP8: 50, BF16: 26
      (kTmaBufferBytes - (kSharedScales ? kTmaScaleBytes : 0)) / (256 * kOutBytes);
  static_assert(!kSharedScales || kPieceSteps * 2 * 4 <= kTmaScaleBytes, "a piece's scales fit");
  float* piece_scales =
      kSharedScales ? reinterpret_cast<float*>(tma->buffer + kPieceSteps * 256) : nullptr;
  const int steps = (H + 255) / 256;
  // U steps' loads, raw (this lane's 8 elements of each), zero past the piece's end p1 or H
  auto load_batch = [&](Raw8<kXF32>(&batch)[U], int s0, int p1) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e0 = (s0 + u) * 256 + lane * 8;
      batch[u] = s0 + u < p1 && e0 < H ? load_raw8<kXF32>(x_row, e0) : Raw8<kXF32>{};
    }
  };
  for (int p0 = 0; p0 < steps; p0 += kTma ? kPieceSteps : steps) {
    const int p1 = kTma ? min(steps, p0 + kPieceSteps) : steps;
    // software pipeline: the next batch's loads are in flight while this one converts
    Raw8<kXF32> next[U];
    load_batch(next, p0, p1);
    for (int s0 = p0; s0 < p1; s0 += U) {
      Raw8<kXF32> batch[U];
#pragma unroll
      for (int u = 0; u < U; ++u) batch[u] = next[u];
      if (s0 + U < p1) load_batch(next, s0 + U, p1);
      if constexpr (kTma) {
        // the previous piece's bulk stores (to a peer: NVLink's pace) must have read the buffer
        // before it is rewritten; waited for once this piece's first loads are in flight
        if (s0 == p0) {
          if (lane == 0) tma_store_wait_read();
          __syncwarp();
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int e0 = (s0 + u) * 256 + lane * 8;
        const bool in = s0 + u < p1 && e0 < H;
        float f[8];
        unpack8<kXF32>(batch[u], f);
        uint4 bf16;
        uint2 fp8;
        float scale = 0.f;
        convert8<kOut>(f, &bf16, &fp8, &scale);
        if constexpr (kTma) {
          char* at = tma->buffer + static_cast<int64_t>(e0 - p0 * 256) * kOutBytes;
          if (in && kOut == kRowFP8) *reinterpret_cast<uint2*>(at) = fp8;
          if (in && kOut == kRowBF16) *reinterpret_cast<uint4*>(at) = bf16;
          if (kSharedScales && in && (lane & 15) == 0) {
            piece_scales[(s0 + u - p0) * 2 + (lane >> 4)] = scale;
          }
        }
        if constexpr (!kTma) {
          for (uint32_t m = dst_mask; m != 0u; m &= m - 1u) {
            const int j = __ffs(m) - 1;
            char* to = reinterpret_cast<char*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
            float* scales = nullptr;
            if constexpr (kOut == kRowFP8) {
              scales = reinterpret_cast<float*>(
                  __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_scales), j));
            }
            if (!in) continue;
            if constexpr (kOut == kRowFP8) {
              if ((lane & 15) == 0) scales[e0 / kFp8Block] = scale;
              *reinterpret_cast<uint2*>(to + e0) = fp8;
            } else {
              *reinterpret_cast<uint4*>(to + static_cast<int64_t>(e0) * 2) = bf16;
            }
          }
        }
      }
    }
    if constexpr (kTma) {
      fence_proxy_async_shared();  // this lane's shared writes, before the bulk stores read them
      __syncwarp();
      const int64_t begin = static_cast<int64_t>(p0) * 256 * kOutBytes;
      const int64_t end = static_cast<int64_t>(min(H, p1 * 256)) * kOutBytes;
      for (uint32_t m = dst_mask; m != 0u; m &= m - 1u) {
        const int j = __ffs(m) - 1;
        char* to = reinterpret_cast<char*>(
            __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
        if (lane == 0) tma_store(to + begin, tma->buffer, static_cast<uint32_t>(end - begin));
        if constexpr (kSharedScales) {  // the piece's scales [2 * p0, ...), 32 per store
          float* scales = reinterpret_cast<float*>(
              __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_scales), j));
          const int n = static_cast<int>((end - begin) / kFp8Block);
          for (int i = lane; i < n; i += 32) scales[2 * p0 + i] = piece_scales[i];
        }
      }
      // every lane's reads of piece_scales before anything (this warp's next piece, call or
      // bulk load) writes the buffer again
      if constexpr (kSharedScales) __syncwarp();
      if (lane == 0) tma_store_commit();
    }
  }
}

}  // namespace jax_ep
