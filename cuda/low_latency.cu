// Low-latency dispatch / combine (see low_latency.h). One kernel per op and phase; every block:
//
//  begin: thread 0 reads the group (rank, group: device scalars), the group epoch (+1: this call)
//    and the op's call count n in the group (+1; half n % 2 of the receive regions), checks the
//    double-buffering rules, then the lanes of warp 0 publish this device's directory entry for the
//    epoch and the call's config fingerprint (group discovery, as the throughput ops' start kernel
//    does, without a kernel of its own; cuda/fingerprint.cuh) while the other warps fill tables.
//  send (fused, kLLSend): before its first remote write a block waits until every rank of the group
//    has published its entry for this epoch: the peers have entered the call, so every earlier
//    kernel of theirs has finished, and the ordinals of the ranks are known; a peer whose
//    fingerprint differs (or whose call count is more than one ahead) makes the block trap. Then
//    dispatch: every block builds the expert x token bit table of this rank's (sanitised) routing
//      in shared memory; slot i of (expert e, this rank) is the i-th token routed to e in token
//      order (a popcount of the table). Block b sends the counts of experts b, b + grid, ... (one
//      64-bit flag each: epoch, key, count), then its items b, b + grid, ... (token, part: with
//      fewer tokens than blocks a token's destination ranks are split over up to K parts): each
//      warp loads its steps of the row once, casts them (bf16, or fp8 with the per-128-channel
//      scale) and stores them once to every destination rank of the part (the token's record
//      there, however many of its experts the rank has); after a block barrier, lane k of warp 0
//      raises the flag of slot k's receive slot on the destination with a release store; the flag
//      carries the slot's source (token, top-k).
//    combine: warps take (slot, piece) items round-robin, slot index major over the (local expert,
//      source rank) pairs, 32 at a time (lane j loads item j's src_slot entry); each filled slot's
//      piece of the expert output is copied to its source's (token, top-k) row, then the lanes
//      raise the pieces' flags there (release stores). A slot of this rank's own tokens is not
//      copied: its row index goes to ret_local, under its piece-0 flag.
//  receive (fused, kLLRecv):
//    dispatch: warps serve the P = E_local * R (local expert, source rank) pairs, about W / P warps
//      each (W warps in all): lane 0 waits for the pair's count flag, then the warp copies its share
//      of the pair's slots, each as soon as its own flag is up (the source token's record: row and
//      scales; src_slot from the flag); one warp per pair writes counts and -1 into src_slot past
//      the count.
//    combine: warps take (token, 512-element chunk) items; lanes k < K wait for the flags of the
//      chunk's piece of the token's used slots (weight != 0; a slot on this rank: its ret_local
//      entry, and the row is read from y), then every lane sums its 16 elements
//      over k in top-k order in float32 (no FMA), skipping weight-0 slots, and stores bf16.
//    dispatch's handle slots (topk_weights, dest_rank [T, K], num_dropped): lanes k < K of warp 0
//      write them for the block's tokens as the call's ranks keep them (the receive of a two-phase
//      call copies its send's), the blocks' dropped counts add up in SyncCounters::ll_dropped.
//  end: the last block to finish publishes the call: group epoch, call count, the half's state;
//    for dispatch also `active`, num_dropped, and, only where a rank was masked during the call
//    (shrink mode), the handle slots of the pairs to it dropped (one pass of the block).
//
// Flags that guard data are raised with release stores (fence.acq_rel.sys + a relaxed store: no
// sequentially consistent MEMBAR.SC.SYS; dispatch's count flags, whose word is their whole message,
// with relaxed stores) and polled with relaxed loads, a growing pause between them, then one
// acquire load (not fence.acq_rel, which would also wait for the poller's own stores in flight).
// Flags carry the group epoch of their call (unique per call of the group, throughput ops
// included) and the group key, so a flag left by an earlier call, another op or another group never
// matches. Every wait is bounded (op and ranks named in the fault). Every block sends before it
// waits, so the fused kernels cannot deadlock while all blocks are resident (the grid is at most the
// SMs - 1); the send kernels never wait on their own device and the receive kernels only on
// completed sends, so the two-phase form needs no residency at all.
#include "cuda/ep_device.cuh"
#include "cuda/low_latency.h"

namespace jax_ep {
namespace {

constexpr int kWarps = kLLThreads / 32;
constexpr int kPieceVectors = static_cast<int>(kLLPieceBytes / 16);  // uint4 per piece
static_assert(kPieceVectors % 32 == 0 && kLLPieceBytes % 512 == 0, "piece of whole warp steps");
enum LLOp : int { kLLOpDispatch = 0, kLLOpCombine = 1 };

// The call, in shared memory (written by thread 0 / the discovery threads, read by all).
struct LLCall {
  uint64_t epoch;  // group epoch of the call: its flags carry it
  uint64_t call;   // n: the op's call count in the group
  int32_t rank, group, key, half;
  uint32_t active;                   // bit r: rank r takes part (rank masking; kMaxGroupRanks 32)
  uint32_t missed;                   // shrink mode: peers this block gave up waiting for
  int32_t last;                      // ll_end: this block is the last to finish
  uint32_t lost;                     // ll_end, last block: ranks masked during the call
  int32_t dropped;                   // ll_end, last block: the call's dropped pairs
  OpFingerprint fp;                  // the call's config fingerprint (ll_fingerprint)
  int32_t ordinals[kMaxGroupRanks];  // slot of each rank (after discovery)
  char* peers[kMaxGroupRanks];       // rank r's communication buffer (after discovery)
};
constexpr int kCallBytes = 512;
static_assert(sizeof(LLCall) <= kCallBytes, "LLCall fits its shared-memory slot");

// The dynamic shared memory of a kernel (layout of ll_shared_bytes).
struct LLShared {
  LLCall* call;
  uint32_t* bits;  // dispatch: [E][words] expert x token table
};

__device__ __forceinline__ LLShared ll_shared() {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);
  char* base = reinterpret_cast<char*>(dynamic_shared);
  LLShared s;
  s.call = reinterpret_cast<LLCall*>(base);
  s.bits = reinterpret_cast<uint32_t*>(base + kCallBytes);
  return s;
}

__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x >> 5); }
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }
__device__ __forceinline__ int global_warp() { return blockIdx.x * kWarps + warp_id(); }
__device__ __forceinline__ int total_warps() { return gridDim.x * kWarps; }

// Rank r takes part in the call (not masked).
__device__ __forceinline__ bool is_active(const LLCall* call, int r) {
  return r >= 0 && r < 32 && ((call->active >> r) & 1u) != 0u;
}

__device__ __forceinline__ uint64_t call_tag(const LLCall* call) {
  return (call->epoch << 16) | static_cast<uint64_t>(call->key);
}
// combine: the piece-0 flag of a (token, top-k) whose row stays on this rank (its ret_local entry
// is set) carries this bit besides the tag, so a flag a peer raised never satisfies a wait for a
// local row (an inconsistent call token then times out, naming the op, instead of reading a stale entry)
constexpr uint64_t kLLLocalRow = uint64_t{1} << 63;

// dispatch's slot flags: (epoch << 32) | (key << 24) | the slot's source t * K + k (what a sender
// stores; the receiver waits for slot_flag_want == flag >> 24: the epoch's low 32 bits, the key)
__device__ __forceinline__ uint64_t slot_flag(const LLCall* call, int64_t source) {
  return (call->epoch << 32) | (static_cast<uint64_t>(call->key) << 24) |
         static_cast<uint64_t>(source);
}
__device__ __forceinline__ uint64_t slot_flag_want(const LLCall* call) {
  return ((call->epoch & 0xFFFFFFFFull) << 8) | static_cast<uint64_t>(call->key);
}
// Flag fields: the slot flags' source (t * K + k) takes 24 bits and the group key 8.
static_assert(static_cast<int64_t>(kLLMaxTokens) * kMaxTopk <= (int64_t{1} << 24),
              "a slot flag's source fits 24 bits");
static_assert(kDirectoryAxes * kMaxGroups <= 256, "the group key fits 8 bits of the flags");

// Shape keys of the double-buffering checks: combine's region depends on (T, K, H), dispatch's
// on (R, E, slot bytes) besides.
__device__ __forceinline__ uint64_t shape_key(const LLCommon& a) {
  return static_cast<uint64_t>(a.num_tokens) | (static_cast<uint64_t>(a.num_topk) << 16) |
         (static_cast<uint64_t>(a.hidden) << 24);
}
__device__ __forceinline__ uint64_t dispatch_key(const LLCommon& a) {
  return static_cast<uint64_t>(a.num_ranks) | (static_cast<uint64_t>(a.num_experts) << 6) |
         (a.L.slot_bytes << 20);
}

// What a receive checks against its send: the layout both use.
template <int kOp>
__device__ __forceinline__ uint32_t half_shape(const LLCommon& a) {
  const uint64_t key = shape_key(a) * 0x9E3779B97F4A7C15ull ^
                       (kOp == kLLOpDispatch ? dispatch_key(a) : 0ull);
  return static_cast<uint32_t>(key ^ (key >> 32));
}

__device__ __forceinline__ void ll_fault(DeviceState* state, int32_t op_id, int32_t rank,
                                         int32_t what, uint64_t expected, uint64_t observed) {
  record_fault_and_trap(state, kFaultLLInFlight, op_id, rank, -1, what, expected, observed, 0);
}

// Thread 0 of every block: reads and checks the call (no barrier: the block's other threads work
// meanwhile; a barrier must follow before anyone reads *call). As discover_group (CallStart): the
// words at fixed addresses first, all in flight together (both halves' state: which one is the
// call's is known only from n) with the group-indexed ones of group 0 (loaded again after the range
// check for another group), then the checks in order; one round of loads for group 0 instead of
// one per check.
template <int kOp>
__device__ void ll_read_call(const LLCommon& a, int32_t row_kind, LLCall* call) {
  DeviceState* state = a.state;
  constexpr int32_t op_id = kOp == kLLOpDispatch ? kOpLLDispatch : kOpLLCombine;
  SyncCounters& sync = state->sync;
  const bool recv = a.mode == kLLRecv;
  // level 1: fixed addresses
  const int32_t rank = *a.rank;
  const int32_t group = *a.group;
  const uint64_t comm_bytes = state->tables.comm_bytes;
  const SyncCounters::LLHalf halves[2] = {sync.ll_half[kOp][0], sync.ll_half[kOp][1]};
  const uint32_t busy = sync.ll_busy;
  const uint64_t busy_shape = sync.ll_busy_shape;
  const uint32_t busy_dispatches = sync.ll_busy_dispatches;
  const uint64_t busy_dispatch = sync.ll_busy_dispatch;
  // level 2 speculated for group 0 (the usual one: one EP group per device set), in flight with
  // level 1; reloaded below for another group
  uint32_t masked = 0;
  uint64_t last_epoch = 0, last_call = 0;
  if (!recv) {
    masked = persistent_mask(state, a.axis_slot, 0);
    last_epoch = sync.group_epoch[a.axis_slot][0];
    last_call = sync.ll_calls[kOp][a.axis_slot][0];
  }
  uint64_t epoch = 0, n = 0;
  if (recv) {
    epoch = static_cast<uint64_t>(a.token[0]) | (static_cast<uint64_t>(a.token[1]) << 32);
    n = static_cast<uint64_t>(a.token[2]) | (static_cast<uint64_t>(a.token[3]) << 32);
  }
  const uint32_t requested = recv ? 0u : requested_ranks(a.rank_mask, a.num_ranks);
  if (rank < 0 || rank >= a.num_ranks || group < 0 || group >= kMaxGroups) {
    record_fault_and_trap(state, kFaultBadArgument, op_id, rank, -1, -1,
                          static_cast<uint64_t>(a.num_ranks), static_cast<uint64_t>(group), 0);
  }
  uint32_t active = 0;
  if (!recv) {  // level 2: indexed by the group (in range now)
    if (group != 0) {
      masked = persistent_mask(state, a.axis_slot, group);
      last_epoch = sync.group_epoch[a.axis_slot][group];
      last_call = sync.ll_calls[kOp][a.axis_slot][group];
    }
    // ranks masked by an earlier timeout (shrink mode) take no part until the host clears them
    active = requested & ~masked;
    epoch = last_epoch + 1;
    n = last_call + 1;
  }
  check_comm_bytes(state, comm_bytes, a.L.base.total, op_id, rank);
  const SyncCounters::LLHalf half = (n & 1) != 0 ? halves[1] : halves[0];
  if (recv) {
    if (half.busy == 0 || half.call != n || half.epoch != epoch) {
      ll_fault(state, op_id, rank, kLLFaultStaleToken, n, half.call);
    }
    if (half.shape != half_shape<kOp>(a)) {
      ll_fault(state, op_id, rank, kLLFaultShape, half_shape<kOp>(a), half.shape);
    }
    active = half.active;  // the ranks its send served
  } else {
    if (half.busy != 0) ll_fault(state, op_id, rank, kLLFaultTooMany, n, half.call);
    if (busy != 0 && busy_shape != shape_key(a)) {
      ll_fault(state, op_id, rank, kLLFaultShape, shape_key(a), busy_shape);
    }
    if (kOp == kLLOpDispatch && busy_dispatches != 0 && busy_dispatch != dispatch_key(a)) {
      ll_fault(state, op_id, rank, kLLFaultShape, dispatch_key(a), busy_dispatch);
    }
  }
  call->epoch = epoch;
  call->call = n;
  call->rank = rank;
  call->group = group;
  call->key = a.axis_slot * kMaxGroups + group;
  call->half = static_cast<int32_t>(n & 1);
  call->active = active;
  call->missed = 0;
  call->fp = ll_fingerprint(a, op_id, row_kind);
}

// Sending kernels, the lanes of warp 0 right after thread 0's ll_read_call (a __syncwarp between):
// publishes this device's directory entry for the call's epoch, then the call's fingerprint, on
// every managed device (lane o: device o), while the other warps still fill the block's tables;
// the block barrier after it is then off the handshake's path. Every block does: a peer may wait
// on it before this device's first block has run.
__device__ __forceinline__ void ll_publish(const LLCommon& a, const LLCall* call) {
  static_assert(kMaxDevices <= 32, "one lane of warp 0 per managed device");
  DeviceState* state = a.state;
  const uint64_t entry = (call->epoch << 16) | static_cast<uint64_t>(state->tables.slot);
  for (int o = lane_id(); o < kMaxDevices; o += 32) {
    DeviceState* device = state->tables.peer_states[o];
    if (device != nullptr) {
      release_store_sys(&device->sync.directory[a.axis_slot][call->group][call->rank], entry);
      publish_fingerprint(device, a.axis_slot, call->group, call->rank, call->epoch, call->fp);
    }
  }
}

// Shrink mode, every thread, after each peer thread's first wait: the blocks agree on the call's
// ranks. The first block to get here publishes its view (the active ranks less those it gave up
// on) in ll_decision and masks the given-up ranks persistently; every block takes that view
// (a late peer one block gave up on may have been seen by another). After it, call->active is the
// call's, and call->missed the decided ranks this block still has to wait for (they have arrived).
__device__ void ll_agree(const LLCommon& a, LLCall* call) {
  __syncthreads();  // every peer thread's missed bit
  if (threadIdx.x == 0) {
    const uint64_t tag = (call->epoch & 0xFFFFFFFFull) << 32;
    const uint64_t mine = tag | (call->active & ~call->missed);
    unsigned long long* decision =
        reinterpret_cast<unsigned long long*>(&a.state->sync.ll_decision[a.axis_slot][call->group]);
    unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(decision);
    bool won = false;
    while ((seen & ~0xFFFFFFFFull) != tag) {
      const unsigned long long prev = atomicCAS(decision, seen, mine);
      if (prev == seen) {
        seen = mine;
        won = true;
      } else {
        seen = prev;
      }
    }
    const uint32_t decided = static_cast<uint32_t>(seen & 0xFFFFFFFFull);
    if (won) {
      for (int r = 0; r < a.num_ranks; ++r) {
        if (is_active(call, r) && ((decided >> r) & 1u) == 0u) {
          mask_peer(a.state, a.axis_slot, call->group, call->rank, r, call->fp.op, 1, call->epoch);
        }
      }
    }
    call->missed &= decided;
    call->active = decided;
  }
  __syncthreads();
}

// Every thread: waits until every active rank of the group has published its entry for this epoch
// (it has entered this call), then knows their buffers; a peer that runs another call (fingerprint
// or call count) makes the block trap before it writes anything (cuda/fingerprint.cuh). Bounded: a
// timeout traps naming the op, this rank and the peer, or in shrink mode masks the peer.
__device__ void ll_discover(const LLCommon& a, LLCall* call) {
  DeviceState* state = a.state;
  const int peer = static_cast<int>(threadIdx.x);
  const bool mine = peer < a.num_ranks && is_active(call, peer);
  // (wait_directory_entry: relaxed polls with a growing pause, as every block polls the same line)
  uint64_t seen = 0;
  bool arrived = !mine || wait_directory_entry(state, a.axis_slot, call->group, peer, call->epoch,
                                               call->fp.op, call->rank, a.shrink != 0, &seen);
  if (!arrived) atomicOr(&call->missed, 1u << peer);  // (shrink mode: else it trapped)
  if (a.shrink) {
    ll_agree(a, call);
    // a decided rank this block gave up on has arrived (the deciding block saw it): wait again
    if (mine && is_active(call, peer) && !arrived) {
      wait_directory_entry(state, a.axis_slot, call->group, peer, call->epoch, call->fp.op,
                           call->rank, false, &seen);
    }
  }
  bool differs = false;
  if (peer < a.num_ranks && !is_active(call, peer)) {
    call->ordinals[peer] = -1;  // masked: never waited for, never written to
    call->peers[peer] = nullptr;
  } else if (peer < a.num_ranks) {
    const int ordinal = static_cast<int>(seen & 0xFFFF);
    call->ordinals[peer] = ordinal;
    call->peers[peer] = comm_buffer_of(state, ordinal);
    differs = peer_call_differs(state, a.axis_slot, call->group, call->rank, peer, ordinal,
                                call->epoch, seen >> 16, call->fp);
  }
  trap_if_any_differs(differs);  // a block barrier: call->ordinals / peers are complete after it
}

// Where a wait reports a timeout (plain values: a noinline function taking the kernel's parameter
// struct by reference would copy it to the stack).
struct LLWaitSite {
  DeviceState* state;
  const LLCall* call;
  int32_t op_id;
  int32_t num_ranks;
  int32_t axis_slot;
  int32_t discovered;  // call->ordinals are known (not in a receive kernel)
  int32_t shrink;      // a timeout masks the rank waited for instead of trapping
};

__device__ __forceinline__ LLWaitSite wait_site(const LLCommon& a, const LLCall* call, int op_id) {
  return LLWaitSite{a.state, call, op_id, a.num_ranks, a.axis_slot, a.mode != kLLRecv, a.shrink};
}

// What ll_wait returns in shrink mode when the rank waited for missed the bound (no flag word of
// the LL ops is all ones: its top bits are an epoch).
constexpr uint64_t kLLMissed = ~0ull;

// The rank of the group that has not entered this call yet (its directory entry is older), or -1:
// names the culprit of a timeout where the rank waited for is not known (combine's receive).
__device__ __noinline__ int ll_missing_rank(const LLWaitSite& site) {
  for (int r = 0; r < site.num_ranks; ++r) {
    if (!is_active(site.call, r)) continue;  // masked: not waited for
    const uint64_t seen = load_acquire_sys(
        &site.state->sync.directory[site.axis_slot][site.call->group][r]);
    if ((seen >> 16) < site.call->epoch) return r;
  }
  return -1;
}

// Spins until (*flag >> shift) == want (a peer's release store), then acquires. Bounded: the fault
// names the op, this rank and the rank waited for (-1: found from the directory); in shrink mode
// the rank is masked instead and kLLMissed returned (its data is treated as absent), and once it is
// masked every other wait on it gives up at once (the persistent mask is poll_flag's give-up word).
__device__ __noinline__ uint64_t ll_wait(const uint64_t* flag, uint64_t want, int shift,
                                         LLWaitSite site, int waited_rank) {
  // A flag that is up already (a wait begun after the sender's store) costs one acquire load, where
  // a relaxed poll and then the acquire took two round trips on the receive's critical path.
  const uint64_t first = load_acquire_sys(flag);
  if ((first >> shift) == want) return first;
  DeviceState* state = site.state;
  PollBound bound{state->tables.timeout_ns, 512};
  if (site.shrink && waited_rank >= 0) {
    bound.give_up = &state->sync.rank_masks[site.axis_slot][site.call->group].masked;
    bound.bit = 1u << waited_rank;
    bound.state = state;
    bound.axis_slot = site.axis_slot;
    bound.group = site.call->group;
    bound.peer = waited_rank;
    bound.epoch = site.call->epoch;
  }
  uint64_t observed, elapsed;
  if (!poll_flag(flag, [want, shift](uint64_t v) { return (v >> shift) == want; }, bound,
                 &observed, &elapsed)) {
    const int rank = waited_rank >= 0 ? waited_rank : ll_missing_rank(site);
    if (site.shrink && rank >= 0) {
      mask_peer(state, site.axis_slot, site.call->group, site.call->rank, rank, site.op_id, 2,
                site.call->epoch);
      return kLLMissed;
    }
    const int ordinal = rank >= 0 && site.discovered ? site.call->ordinals[rank] : -1;
    record_fault_and_trap(state, kFaultTimeout, site.op_id, site.call->rank, rank, ordinal,
                          site.call->epoch, observed >> (shift == 0 ? 16 : shift + 8),
                          static_cast<int64_t>(elapsed));
  }
  // an acquire load, not fence.acq_rel: the fence would also wait for this thread's own stores
  // still on their way (a warp that just sent its rows)
  return load_acquire_sys(flag);
}

// The last block of a dispatch (fused / recv), every thread, where ranks were masked during the
// call (call->lost): the pairs kept so far (`kept`: this kernel's dest_rank, or its send's) whose
// rank, or this rank, is among them are dropped after all; counted in call->dropped. On the
// receiving side the (local expert, source) pairs of such a source are emptied (count 0, src_slot
// -1), as if it had been masked: it may have sent its counts, and some slots, before it died.
__device__ void ll_drop_lost(const LLDispatchLaunch& d, LLCall* call, const int32_t* kept) {
  const int T = d.c.num_tokens, R = d.c.num_ranks;
  const int pairs = T * d.c.num_topk;
  const bool all = has_rank(call->lost, call->rank);
  int dropped = 0;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int32_t dest = __ldcg(kept + i);  // (L2: written by other blocks, fenced)
    if (dest >= 0 && (all || has_rank(call->lost, dest))) {
      d.weights[i] = 0.f;
      d.dest_rank[i] = -1;
      ++dropped;
    }
  }
  const int sources = d.c.num_experts;  // (local expert, source rank) pairs q: source q % R
  for (int q = threadIdx.x; q < sources; q += blockDim.x) {
    if (all || has_rank(call->lost, q % R)) d.counts[q] = 0;
  }
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(sources) * T; i += blockDim.x) {
    if (all || has_rank(call->lost, static_cast<int>((i / T) % R))) d.src_slot[i] = -1;
  }
  if (dropped != 0) atomicAdd(&call->dropped, dropped);
  __syncthreads();
}

// Every thread, end of the kernel: the last block to finish publishes the call, and (a receiving
// dispatch) writes `active` [R]: the ranks that took part, less those masked persistently by now
// (shrink mode: a source that died in this call, whose data did not all come; the handle then
// drops the pairs sent to it, and num_dropped counts them, as if it had been masked). A dispatch
// (`d`) adds this block's `dropped` pairs (thread 0's) to the call's; its last block writes
// num_dropped, after correcting the handle's slots where a rank was masked during the call.
template <int kOp>
__device__ void ll_end(const LLCommon& a, LLCall* call, const LLDispatchLaunch* d = nullptr,
                       int dropped = 0) {
  __syncthreads();
  if (threadIdx.x == 0) {
    SyncCounters& sync = a.state->sync;
    if (d != nullptr && dropped != 0) atomicAdd(&sync.ll_dropped, static_cast<uint32_t>(dropped));
    // release: this block's writes (its threads' before the barrier) before the count; acquire,
    // for the last block: every other block's before its reads below
    const uint32_t done = atomic_add_acq_rel_gpu(&sync.ll_blocks_done, 1u);
    call->last = done + 1 == gridDim.x ? 1 : 0;
    if (call->last) {
      sync.ll_blocks_done = 0;
      if (d != nullptr) {
        // every block's masking and adds are done (each released by its count); the count
        // is read at L2 (an atomic) and cleared for the next call, as ll_blocks_done
        call->dropped = a.mode == kLLRecv ? __ldg(d->sent_dropped)
                                          : static_cast<int32_t>(atomicAdd(&sync.ll_dropped, 0u));
        sync.ll_dropped = 0;
        const uint32_t lost = persistent_mask(a.state, a.axis_slot, call->group);
        call->lost = a.mode == kLLSend ? 0u : call->active & lost;
        if (a.mode != kLLSend) {
          for (int r = 0; r < a.num_ranks; ++r) {
            d->active[r] = is_active(call, r) && !has_rank(lost, r) ? 1 : 0;
          }
        }
      }
    }
  }
  if (d == nullptr) {  // (combine: uniform over the block, no barrier needed before returning)
    if (threadIdx.x != 0) return;
  } else {
    __syncthreads();
    if (!call->last) return;
    if (call->lost != 0u) ll_drop_lost(*d, call, a.mode == kLLRecv ? d->sent_dest : d->dest_rank);
    if (threadIdx.x != 0) return;
    *d->num_dropped = call->dropped;
  }
  if (!call->last) return;
  SyncCounters& sync = a.state->sync;
  SyncCounters::LLHalf& half = sync.ll_half[kOp][call->half];
  if (a.mode == kLLRecv) {
    half.busy = 0;
    sync.ll_busy -= 1;
    if (kOp == kLLOpDispatch) sync.ll_busy_dispatches -= 1;
  } else {
    sync.group_epoch[a.axis_slot][call->group] = call->epoch;
    sync.ll_calls[kOp][a.axis_slot][call->group] = call->call;
    half.call = call->call;
    half.epoch = call->epoch;
    half.busy = a.mode == kLLSend ? 1u : 0u;
    half.shape = half_shape<kOp>(a);
    half.active = call->active;
    if (a.mode == kLLSend) {
      sync.ll_busy += 1;
      sync.ll_busy_shape = shape_key(a);
      if (kOp == kLLOpDispatch) {
        sync.ll_busy_dispatches += 1;
        sync.ll_busy_dispatch = dispatch_key(a);
      }
    }
  }
  // (no fence after these stores: nothing follows them in this thread for a fence to order them
  // before, and they are read only by later kernels, which the kernel boundary orders after them)
}

// A warp copies `bytes` (a multiple of 16, at most kLLPieceBytes) from src to dst, every load in
// flight before the first store (L2 loads: the source may have been written by a peer).
__device__ __forceinline__ void warp_copy_piece(const char* src, char* dst, int bytes, int lane) {
  const uint4* from = reinterpret_cast<const uint4*>(src);
  uint4* to = reinterpret_cast<uint4*>(dst);
  const int vectors = bytes / 16;
  uint4 v[kPieceVectors / 32];
#pragma unroll
  for (int u = 0; u < kPieceVectors / 32; ++u) {
    const int i = u * 32 + lane;
    if (i < vectors) v[u] = __ldcg(from + i);
  }
#pragma unroll
  for (int u = 0; u < kPieceVectors / 32; ++u) {
    const int i = u * 32 + lane;
    if (i < vectors) to[i] = v[u];
  }
}

// ---- dispatch ------------------------------------------------------------------------------

// One warp step of a token row in the wire format, in registers: FP8 16 elements per lane (512
// per step; the 8 lanes of a 128-channel block reduce its amax), bf16 8 per lane (256 per step).
struct SendStep {
  uint4 packed;  // this lane's 16 bytes of the wire row
  float scale;   // FP8: the lane's 128-channel block's scale
  int e0;        // first element of the lane
  bool in;       // e0 < H
};

template <bool kXF32, int kRow>
__device__ __forceinline__ SendStep prepare_step(const char* x_row, int H, int step, int lane) {
  SendStep s;
  s.scale = 0.f;
  if constexpr (kRow == kRowFP8) {
    s.e0 = step * 512 + lane * 16;
    s.in = s.e0 < H;
    float f[16];
    if (s.in) {
      load8<kXF32>(x_row, s.e0, f);
      load8<kXF32>(x_row, s.e0 + 8, f + 8);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = 0.f;
    }
    uint2 fp8[2];
    s.scale = quantize_fp8_block<16>(f, fp8);
    s.packed = make_uint4(fp8[0].x, fp8[0].y, fp8[1].x, fp8[1].y);
  } else {
    s.e0 = step * 256 + lane * 8;
    s.in = s.e0 < H;
    s.packed = make_uint4(0, 0, 0, 0);
    if (s.in) {
      if constexpr (kXF32) {
        float f[8];
        load8<true>(x_row, s.e0, f);
        s.packed = pack_bf16x8(f);
      } else {
        s.packed = __ldg(reinterpret_cast<const uint4*>(x_row) + s.e0 / 8);
      }
    }
  }
  return s;
}

// Stores a prepared step to every destination slot of dst_mask (lane j holds destination j's slot).
template <int kRow>
__device__ __forceinline__ void store_step(const SendStep& s, uint32_t dst_mask, char* my_dst,
                                           uint64_t row_bytes, int lane) {
  constexpr int kElementBytes = kRow == kRowFP8 ? 1 : 2;
  for (uint32_t m = dst_mask; m != 0u; m &= m - 1u) {
    const int j = __ffs(m) - 1;
    char* to = reinterpret_cast<char*>(
        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
    if (s.in) {
      *reinterpret_cast<uint4*>(to + static_cast<int64_t>(s.e0) * kElementBytes) = s.packed;
      if (kRow == kRowFP8 && (lane & 7) == 0) {
        *reinterpret_cast<float*>(to + row_bytes + (s.e0 / kFp8Block) * 4) = s.scale;
      }
    }
  }
}

// Zeroes the expert x token table (every thread; a barrier must follow).
__device__ __forceinline__ void zero_table(const LLDispatchLaunch& p, const LLShared& s) {
  const int words = (p.c.num_tokens + 31) / 32;
  for (int i = threadIdx.x; i < p.c.num_experts * words; i += blockDim.x) s.bits[i] = 0u;
}

// Fills the table from this rank's sanitised routing: bit t of row e = token t routes to expert e.
// Warps first_warp.. (the kernels pass 1: thread 0 reads the call meanwhile, and the lanes of its
// warp would run the two chains of cold loads one after the other); a barrier must follow. A warp
// takes 32 consecutive (token, top-k) pairs per round: one coalesced load, and the earlier slots of
// a token (sanitized_expert's rule: a slot naming an expert an earlier slot named is unused) come
// from the lanes holding them, or, for a token that began in the previous round, from memory.
__device__ __forceinline__ void fill_table(const LLDispatchLaunch& p, const LLShared& s,
                                           int first_warp) {
  const int T = p.c.num_tokens, K = p.c.num_topk, E = p.c.num_experts;
  const int words = (T + 31) / 32;
  const int pairs = T * K;
  const int lane = lane_id(), warp = warp_id();
  const int step = (static_cast<int>(blockDim.x) / 32 - first_warp) * 32;
  for (int i0 = (warp - first_warp) * 32; warp >= first_warp && i0 < pairs; i0 += step) {
    const int i = i0 + lane;
    const int32_t id = i < pairs ? __ldg(p.topk_idx + i) : -1;
    const int k = i % K;
    bool used = id >= 0 && id < E;
    for (int j = 1; j < K; ++j) {  // slot k - j of the same token (every lane shuffles)
      const int32_t earlier = __shfl_up_sync(kFullMask, id, j);
      if (j <= k) used &= (lane >= j ? earlier : __ldg(p.topk_idx + i - j)) != id;
    }
    if (used) atomicOr(&s.bits[id * words + (i / K) / 32], 1u << ((i / K) & 31));
  }
}

// Lane k < K of warp 0, for token t of its block: the handle's slot (t, k) as the call's ranks
// keep it (dest: the expert's rank where the pair is sent, else -1; e: the sanitised id; weight:
// topk_weights[t, k], loaded early by the caller so no store waits for it). Returns 1 where a used
// pair is dropped.
__device__ __forceinline__ int write_handle_slot(const LLDispatchLaunch& p, int t, int k, int32_t e,
                                                 int dest, float weight) {
  const int64_t i = static_cast<int64_t>(t) * p.c.num_topk + k;
  p.weights[i] = dest >= 0 ? weight : 0.f;
  p.dest_rank[i] = dest;
  return e >= 0 && dest < 0 ? 1 : 0;
}

// The parts each token's send is split into (dispatch_send's items): as many as the blocks allow,
// at most one per destination rank a token can have (min(K, R)).
__device__ __forceinline__ int parts_per_token(int T, int K, int R) {
  const int most = K < R ? K : R;
  const int g = T > 0 ? static_cast<int>(gridDim.x) / T : 1;
  return g < 1 ? 1 : (g > most ? most : g);
}

// Warp 0: the sum of its lanes' counts, in every lane.
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// After the table and the call (a barrier since both; the entry is published): prepares this warp's
// first steps of the block's first token while the peers' entries arrive, then sends the counts and
// the block's tokens, and writes their handle slots (lanes k < K of warp 0). Returns the block's
// dropped pairs (warp 0's lanes; 0 elsewhere).
template <bool kXF32, int kRow>
__device__ int dispatch_send(const LLDispatchLaunch& p, const LLShared& s) {
  const LLCommon& a = p.c;
  const LLLayout& L = a.L;
  LLCall* call = s.call;
  const int T = a.num_tokens, K = a.num_topk, E = a.num_experts, R = a.num_ranks, H = a.hidden;
  const int local = E / R;
  const int words = (T + 31) / 32;
  const int lane = lane_id(), warp = warp_id();
  const uint64_t half = static_cast<uint64_t>(call->half) * L.disp_half_bytes;
  const int64_t x_row_bytes = static_cast<int64_t>(H) * (kXF32 ? 4 : 2);
  const int steps = kRow == kRowFP8 ? (H + 511) / 512 : (H + 255) / 256;
  const char* x = static_cast<const char*>(p.x);

  // Work items (token, part): part g of a token sends it to its ranks r with r % G == g (below). G > 1
  // when the tokens are fewer than the blocks, so a small batch's records leave from up to
  // min(K, R) SMs at once instead of one per token.
  const int G = parts_per_token(T, K, R);
  const int items = T * G;
  // this warp's steps warp and warp + 16 of the first item's token, loaded and cast before the wait
  SendStep first[2] = {};
  const int t0 = static_cast<int>(blockIdx.x) / G;
  if (static_cast<int>(blockIdx.x) < items) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (warp + u * kWarps < steps) {
        first[u] = prepare_step<kXF32, kRow>(x + t0 * x_row_bytes, H, warp + u * kWarps, lane);
      }
    }
  }
  const int me = call->rank;
  int dropped = 0;
  // A masked rank sends nothing (it needs no peer, so it waits for none): every used pair dropped.
  if (!is_active(call, me)) {
    if (warp != 0) return 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const int t = item / G;
      if (lane < K && lane % G == item % G) {
        const int32_t e = sanitized_expert(p.topk_idx + static_cast<int64_t>(t) * K, lane, E);
        dropped += write_handle_slot(p, t, lane, e, -1, 0.f);
      }
    }
    return warp_sum(dropped);
  }
  ll_discover(a, call);

  // counts: experts blockIdx.x + gridDim.x * i, one flag each on the expert's rank
  for (int e = blockIdx.x + gridDim.x * threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    const int dest = e / local, le = e % local;
    if (!is_active(call, dest)) continue;  // a masked rank gets nothing: its pairs are dropped
    int count = 0;
    for (int w = 0; w < words; ++w) count += __popc(s.bits[e * words + w]);
    uint64_t* flag = reinterpret_cast<uint64_t*>(call->peers[dest] + L.count_flags + half) +
                     (static_cast<int64_t>(le) * R + me);
    // relaxed: the flag word is the whole message (no data goes before it), and the slots it
    // counts have flags of their own (a release fence here cost ~1 us on every block's path)
    store_relaxed_sys(flag, (call->epoch << 24) | (static_cast<uint64_t>(call->key) << 16) |
                                static_cast<uint64_t>(count));
  }

  // items blockIdx.x, + gridDim.x, ...: lane k of every warp holds top-k slot k. A token's pairs to
  // one rank belong to one part (the rank's: rank % G), which stores the token's record there once
  // and then raises those pairs' slot flags; a pair sent nowhere belongs to part k % G (its handle
  // slot).
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int t = item / G;
    float weight = 0.f;  // warp 0: its handle slot's, in flight while the row goes out
    if (warp == 0 && lane < K) weight = __ldg(p.topk_weights + static_cast<int64_t>(t) * K + lane);
    int32_t e = -1;
    int dest = -1;  // the pair's rank where it is sent (a pair to a masked rank is dropped)
    if (lane < K) {
      e = sanitized_expert(p.topk_idx + static_cast<int64_t>(t) * K, lane, E);
      if (e >= 0 && is_active(call, e / local)) dest = e / local;
    }
    const bool mine = lane < K && (dest >= 0 ? dest : lane) % G == item % G;
    const bool sent = mine && dest >= 0;
    int64_t block_slot = 0;
    if (sent) {
      const uint32_t* row = s.bits + e * words;
      int i = __popc(row[t / 32] & ((1u << (t & 31)) - 1u));
      for (int w = 0; w < t / 32; ++w) i += __popc(row[w]);
      block_slot = (static_cast<int64_t>(e % local) * R + me) * T + i;
    }
    // the first sent lane of each rank stores the record
    const uint32_t same = __match_any_sync(kFullMask, sent ? dest : -1 - lane);
    char* my_dst = nullptr;
    if (sent && __ffs(same) - 1 == lane) {
      my_dst = call->peers[dest] + L.records + half +
               (static_cast<int64_t>(me) * T + t) * static_cast<int64_t>(L.slot_bytes);
    }
    const uint32_t dst_mask = __ballot_sync(kFullMask, my_dst != nullptr);
    const char* x_row = x + t * x_row_bytes;
    for (int s0 = warp; dst_mask != 0u && s0 < steps; s0 += 2 * kWarps) {
      SendStep step[2];
      if (item == static_cast<int>(blockIdx.x) && s0 == warp) {
        step[0] = first[0];
        step[1] = first[1];
      } else {
        step[0] = prepare_step<kXF32, kRow>(x_row, H, s0, lane);
        if (s0 + kWarps < steps) step[1] = prepare_step<kXF32, kRow>(x_row, H, s0 + kWarps, lane);
      }
      store_step<kRow>(step[0], dst_mask, my_dst, L.row_bytes, lane);
      if (s0 + kWarps < steps) store_step<kRow>(step[1], dst_mask, my_dst, L.row_bytes, lane);
    }
    __syncthreads();  // the block's stores of the records, then the slots' flags
    if (warp == 0 && sent) {  // the flag carries the slot's source (token, top-k)
      release_store_sys(reinterpret_cast<uint64_t*>(call->peers[dest] + L.slot_flags + half) +
                            block_slot,
                        slot_flag(call, static_cast<int64_t>(t) * K + lane));
    }
    // after the token's flags: off the path to the peers
    if (warp == 0 && mine) dropped += write_handle_slot(p, t, lane, e, dest, weight);
  }
  return warp == 0 ? warp_sum(dropped) : 0;
}

// Receive: virtual warps v = gw, gw + W, ... < V = max(W, P) (W warps, P = E_local * R pairs);
// virtual warp v serves pair q = v % P as the j-th (j = v / P) of the pair's J(q) = V / P +
// (q < V % P) virtual warps: lane 0 waits for the pair's count (J(q) pollers per count flag, not a
// block-wide wait), then the warp copies slots i = j, j + J, ... < count, each as soon as its own
// flag is up; j == 0 also writes the count and -1 into src_slot past it.
template <int kRow>
__device__ void dispatch_recv(const LLDispatchLaunch& p, const LLShared& s) {
  const LLCommon& a = p.c;
  const LLLayout& L = a.L;
  const LLCall* call = s.call;
  const int T = a.num_tokens, R = a.num_ranks, K = a.num_topk;
  const int num_pairs = a.num_experts;  // E_local * R
  const int lane = lane_id();
  const uint64_t half = static_cast<uint64_t>(call->half) * L.disp_half_bytes;
  const char* own = own_comm_buffer(a.state);
  const LLWaitSite site = wait_site(a, call, kOpLLDispatch);
  const uint64_t want = (call->epoch << 8) | static_cast<uint64_t>(call->key);  // count flag >> 16
  const uint64_t* count_flags = reinterpret_cast<const uint64_t*>(own + L.count_flags + half);
  const uint64_t slot_want = slot_flag_want(call);
  const uint64_t* slot_flags = reinterpret_cast<const uint64_t*>(own + L.slot_flags + half);
  const char* records = own + L.records + half;
  char* rows = static_cast<char*>(p.rows);
  const int num_scales = kRow == kRowFP8 ? a.hidden / kFp8Block : 0;
  const int64_t W = total_warps();
  const int64_t V = W > num_pairs ? W : num_pairs;
  for (int64_t v = global_warp(); v < V; v += W) {
    const int q = static_cast<int>(v % num_pairs);
    const int j = static_cast<int>(v / num_pairs);
    const int J = static_cast<int>(V / num_pairs) + (q < V % num_pairs ? 1 : 0);
    // a masked source sends nothing, and a masked rank receives nothing: count 0, no wait
    const bool live = is_active(call, call->rank) && is_active(call, q % R);
    unsigned long long count_flag = 0;
    if (lane == 0 && live) count_flag = ll_wait(count_flags + q, want, 16, site, q % R);
    if (count_flag == kLLMissed) count_flag = 0;  // shrink: the source died in the call, nothing came
    const int count = static_cast<int>(__shfl_sync(kFullMask, count_flag, 0) & 0xFFFFull);
    for (int i = j; i < count; i += J) {
      const int64_t slot = static_cast<int64_t>(q) * T + i;  // = the output row
      unsigned long long got = 0;
      if (lane == 0) got = ll_wait(slot_flags + slot, slot_want, 24, site, q % R);
      got = __shfl_sync(kFullMask, got, 0);
      if (got == kLLMissed) {  // shrink: the slot never came: empty
        if (lane == 0) p.src_slot[slot] = -1;
        continue;
      }
      __syncwarp();  // lane 0's acquire, then every lane's loads
      // the flag names the slot's source (token, top-k): no load between the flag and the row
      const int32_t src = static_cast<int32_t>(got & 0xFFFFFFull);
      const char* from =
          records + (static_cast<int64_t>(q % R) * T + src / K) * static_cast<int64_t>(L.slot_bytes);
      // the slot's scales are loaded with its first piece (in flight together), not after the
      // row: each dependent round trip to L2 is ~0.5 us here
      const float* scales = reinterpret_cast<const float*>(from + L.row_bytes);
      float scale[2];  // hidden up to 8192 (64 scales); any further ones are copied after the row
      if constexpr (kRow == kRowFP8) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int c = lane + 32 * u;
          if (c < num_scales) scale[u] = __ldcg(scales + c);
        }
      }
      for (uint64_t offset = 0; offset < L.row_bytes; offset += kLLPieceBytes) {
        const uint64_t rest = L.row_bytes - offset;
        warp_copy_piece(from + offset, rows + slot * L.row_bytes + offset,
                        static_cast<int>(rest < kLLPieceBytes ? rest : kLLPieceBytes), lane);
      }
      if constexpr (kRow == kRowFP8) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int c = lane + 32 * u;
          if (c < num_scales) p.scales[slot * num_scales + c] = scale[u];
        }
        for (int c = lane + 64; c < num_scales; c += 32) {
          p.scales[slot * num_scales + c] = __ldcg(scales + c);
        }
      }
      if (lane == 0) p.src_slot[slot] = src;
    }
    if (j == 0) {
      if (lane == 0) p.counts[q] = count;
      for (int i = count + lane; i < T; i += 32) p.src_slot[static_cast<int64_t>(q) * T + i] = -1;
    }
  }
}

template <bool kXF32, int kRow, int kMode>
__global__ void __launch_bounds__(kLLThreads) ll_dispatch_kernel(LLDispatchLaunch p) {
  const LLShared s = ll_shared();
  if constexpr (kMode != kLLRecv) {
    zero_table(p, s);
    __syncthreads();
  }
  if (threadIdx.x == 0) ll_read_call<kLLOpDispatch>(p.c, kRow, s.call);
  if constexpr (kMode != kLLRecv) {
    if (warp_id() == 0) {
      __syncwarp();  // thread 0's call
      ll_publish(p.c, s.call);
    }
    fill_table(p, s, 1);  // meanwhile, warps 1..
  }
  __syncthreads();
  int dropped = 0;
  if constexpr (kMode != kLLRecv) {
    dropped = dispatch_send<kXF32, kRow>(p, s);
  } else {  // the handle's slots as the send wrote them (the last block corrects them if need be)
    const int pairs = p.c.num_tokens * p.c.num_topk;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
      p.weights[i] = __ldg(p.sent_weights + i);
      p.dest_rank[i] = __ldg(p.sent_dest + i);
    }
  }
  if constexpr (kMode == kLLSend) {
    if (blockIdx.x == 0 && threadIdx.x < 4) {
      const uint64_t v = threadIdx.x < 2 ? s.call->epoch : s.call->call;
      p.c.token[threadIdx.x] = static_cast<uint32_t>(v >> (32 * (threadIdx.x & 1)));
    }
  }
  if constexpr (kMode != kLLSend) dispatch_recv<kRow>(p, s);
  ll_end<kLLOpDispatch>(p.c, s.call, &p, dropped);
}

// ---- combine -------------------------------------------------------------------------------

// Lane j of a warp examines the warp's (k0 + j)-th (slot, piece) item of combine's send: items
// are slot-index major over the (local expert, source rank) pairs (item g: piece g % pieces of slot
// index i = f / P of pair f % P, f = g / pieces), so the few filled slots of every pair spread over
// all warps without a count pass.
struct CombineItem {
  int64_t slot;  // receive slot = row of y: (pair) * T + i
  int32_t tk;    // its src_slot entry (-1: unfilled or past the items)
  int piece;
};

__device__ __forceinline__ CombineItem combine_item(const LLCombineLaunch& p, int64_t k0) {
  const LLCommon& a = p.c;
  const int pieces = a.L.ret_pieces;
  const int64_t items = static_cast<int64_t>(a.num_experts) * a.num_tokens * pieces;
  const int64_t g = global_warp() + (k0 + lane_id()) * static_cast<int64_t>(total_warps());
  CombineItem item{0, -1, 0};
  if (g < items) {
    const int64_t f = g / pieces;
    item.piece = static_cast<int>(g % pieces);
    item.slot = (f % a.num_experts) * a.num_tokens + f / a.num_experts;
    item.tk = __ldg(p.src_slot + item.slot);
  }
  return item;
}

// After the call (a barrier since; the entry is published): waits for the peers', then returns every
// filled slot's rows piece by piece. `first`: this lane's first item, loaded before the barrier.
__device__ void combine_send(const LLCombineLaunch& p, const LLShared& s, CombineItem item) {
  const LLCommon& a = p.c;
  const LLLayout& L = a.L;
  LLCall* call = s.call;
  const int T = a.num_tokens, K = a.num_topk, R = a.num_ranks;
  const int lane = lane_id();
  const uint64_t half = static_cast<uint64_t>(call->half) * L.ret_half_bytes;
  const int pieces = L.ret_pieces;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int64_t items = static_cast<int64_t>(a.num_experts) * T * pieces;
  const int64_t gw = global_warp(), W = total_warps();
  if (!is_active(call, call->rank)) return;  // a masked rank returns nothing
  ll_discover(a, call);

  const uint64_t tag = call_tag(call);
  for (int64_t k0 = 0; gw + k0 * W < items; k0 += 32) {
    if (k0 > 0) item = combine_item(p, k0);
    const char* from = nullptr;
    char* to = nullptr;
    uint64_t* flag = nullptr;
    int bytes = 0;
    const int source = static_cast<int>((item.slot / T) % R);
    // filled (a bad handle must not write out of bounds), to a source that takes part
    const bool filled = item.tk >= 0 && item.tk < T * K && is_active(call, source);
    if (filled && source == call->rank) {
      // a slot of this rank's own tokens is not copied: its row's index goes to the receive,
      // which reads y there (piece 0's item; its flag covers the entry)
      if (item.piece == 0) {
        char* peer = call->peers[source];
        reinterpret_cast<int32_t*>(peer + L.ret_local + half)[item.tk] =
            static_cast<int32_t>(item.slot);
        release_store_sys(reinterpret_cast<uint64_t*>(peer + L.ret_flags + half) +
                              static_cast<int64_t>(item.tk) * pieces,
                          tag | kLLLocalRow);
      }
    } else if (filled) {
      const int64_t offset = static_cast<int64_t>(item.piece) * static_cast<int64_t>(kLLPieceBytes);
      const int64_t rest = row_bytes - offset;
      bytes = static_cast<int>(rest < static_cast<int64_t>(kLLPieceBytes) ? rest : kLLPieceBytes);
      char* peer = call->peers[source];
      from = static_cast<const char*>(p.y) + item.slot * row_bytes + offset;
      to = peer + L.ret_rows + half + static_cast<int64_t>(item.tk) * L.ret_row_bytes + offset;
      flag = reinterpret_cast<uint64_t*>(peer + L.ret_flags + half) +
             (static_cast<int64_t>(item.tk) * pieces + item.piece);
    }
    for (uint32_t m = __ballot_sync(kFullMask, to != nullptr); m != 0u; m &= m - 1u) {
      const int j = __ffs(m) - 1;
      warp_copy_piece(reinterpret_cast<const char*>(__shfl_sync(
                          kFullMask, reinterpret_cast<unsigned long long>(from), j)),
                      reinterpret_cast<char*>(__shfl_sync(
                          kFullMask, reinterpret_cast<unsigned long long>(to), j)),
                      __shfl_sync(kFullMask, bytes, j), lane);
    }
    __syncwarp();  // the warp's stores of every piece, then the pieces' flags
    if (to != nullptr) {
      release_store_sys(flag, tag);
    }
  }
}

// Items (token, 512-element chunk): lanes k < K wait for the chunk's piece of the token's used
// slots, then each lane sums its 16 elements over k in top-k order.
__device__ void combine_recv(const LLCombineLaunch& p, const LLShared& s) {
  const LLCommon& a = p.c;
  const LLLayout& L = a.L;
  const LLCall* call = s.call;
  const int T = a.num_tokens, K = a.num_topk, H = a.hidden;
  const int lane = lane_id();
  const uint64_t half = static_cast<uint64_t>(call->half) * L.ret_half_bytes;
  const char* own = own_comm_buffer(a.state);
  const uint64_t tag = call_tag(call);
  const LLWaitSite site = wait_site(a, call, kOpLLCombine);
  const int pieces = L.ret_pieces;
  const int chunks = (H + 511) / 512;
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(own + L.ret_flags + half);
  const char* returned = own + L.ret_rows + half;
  char* out = static_cast<char*>(p.out);
  // items go to warp g / grid of block g % grid: a small batch's few items land on as many SMs,
  // one warp each, not all in block 0
  const int64_t first = static_cast<int64_t>(warp_id()) * gridDim.x + blockIdx.x;
  for (int64_t g = first; g < static_cast<int64_t>(T) * chunks; g += total_warps()) {
    const int64_t t = g / chunks;
    const int c = static_cast<int>(g % chunks);
    const int piece = static_cast<int>(static_cast<uint64_t>(c) * 1024 / kLLPieceBytes);
    // A top-k slot with weight 0 (unused ids have 0 in the handle) is skipped: its row may be
    // garbage, even NaN, or still on its way.
    // So is a slot whose rank is masked in this call (it returned nothing: +0.0), and every slot
    // of a masked rank (it received nothing).
    float weight = 0.f;
    const int dest = lane < K ? __ldg(p.dest_rank + t * K + lane) : -1;
    if (lane < K && is_active(call, call->rank) && is_active(call, dest)) {
      weight = __ldg(p.topk_weights + t * K + lane);
    }
    // lane k: where row k is (returned by its rank, or this rank's own row of y)
    const char* row = returned + (t * K + lane) * static_cast<int64_t>(L.ret_row_bytes);
    if (weight != 0.f) {
      const bool local = dest == call->rank;
      // shrink: a rank that died in the call returned nothing: +0.0 (the slot is skipped)
      if (ll_wait(flags + (t * K + lane) * pieces + (local ? 0 : piece),
                  local ? tag | kLLLocalRow : tag, 0, site, dest) == kLLMissed) {
        weight = 0.f;
      } else if (local) {
        const int32_t y_row = __ldcg(reinterpret_cast<const int32_t*>(own + L.ret_local + half) +
                                     t * K + lane);
        row = static_cast<const char*>(p.y) + static_cast<int64_t>(y_row) * H * 2;
      }
    }
    __syncwarp();  // lane k's acquire, then every lane's loads of row k
    const uint32_t used_mask = __ballot_sync(kFullMask, weight != 0.f);
    float acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the lane's two groups of 8: elements e0 and e0 + 256
      const int e0 = c * 512 + h * 256 + lane * 8;
      const bool in = e0 < H;
      for (int k0 = 0; k0 < K; k0 += 8) {  // loads of 8 slots in flight, then sums in order
        float v[8][8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int k = k0 + u;
          const char* from = reinterpret_cast<const char*>(__shfl_sync(
              kFullMask, reinterpret_cast<unsigned long long>(row), k < K ? k : 0));
          if (in && k < K && ((used_mask >> k) & 1u)) load8<false>(from, e0, v[u]);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int k = k0 + u;
          const float w = __shfl_sync(kFullMask, weight, k < K ? k : 0);  // every lane
          if (!in || k >= K || !((used_mask >> k) & 1u)) continue;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            acc[h * 8 + i] = __fadd_rn(acc[h * 8 + i], __fmul_rn(w, v[u][i]));
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e0 = c * 512 + h * 256 + lane * 8;
      if (e0 < H) store8<false>(out + t * static_cast<int64_t>(H) * 2, e0, acc + h * 8);
    }
  }
}

template <int kMode>
__global__ void __launch_bounds__(kLLThreads) ll_combine_kernel(LLCombineLaunch p) {
  const LLShared s = ll_shared();
  CombineItem first{0, -1, 0};
  if (threadIdx.x == 0) ll_read_call<kLLOpCombine>(p.c, kRowBF16, s.call);
  if constexpr (kMode != kLLRecv) {
    if (threadIdx.x != 0) first = combine_item(p, 0);  // meanwhile
    if (warp_id() == 0) {
      __syncwarp();  // thread 0's call
      ll_publish(p.c, s.call);
    }
  }
  __syncthreads();
  if constexpr (kMode != kLLRecv) {
    if (threadIdx.x == 0) first = combine_item(p, 0);
    combine_send(p, s, first);
  }
  if constexpr (kMode == kLLSend) {
    if (blockIdx.x == 0 && threadIdx.x < 4) {
      const uint64_t v = threadIdx.x < 2 ? s.call->epoch : s.call->call;
      p.c.token[threadIdx.x] = static_cast<uint32_t>(v >> (32 * (threadIdx.x & 1)));
    }
  }
  if constexpr (kMode != kLLSend) combine_recv(p, s);
  ll_end<kLLOpCombine>(p.c, s.call);
}

// ---- launch --------------------------------------------------------------------------------

bool ll_ok(const LLCommon& c) {
  return c.state != nullptr && c.num_ranks >= 1 && c.num_ranks <= kMaxGroupRanks &&
         c.num_tokens >= 0 && c.num_tokens <= kLLMaxTokens && c.num_topk >= 1 &&
         c.num_topk <= kMaxTopk && c.num_experts >= c.num_ranks &&
         c.num_experts % c.num_ranks == 0 && c.num_experts <= kMaxExperts && c.hidden >= kRowAlignment &&
         c.hidden % kRowAlignment == 0 && c.axis_slot >= 0 && c.axis_slot < kDirectoryAxes &&
         c.num_blocks >= 1 && c.mode >= kLLFused && c.mode <= kLLRecv &&
         (c.mode == kLLFused || c.token != nullptr);
}

template <typename Kernel, typename Params>
cudaError_t launch_ll(Kernel kernel, const Params& p, uint64_t shared_bytes, cudaStream_t stream) {
  if (shared_bytes > 48 * 1024) {
    JAX_EP_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(shared_bytes)));
  }
  JAX_EP_LAUNCH(kernel, p.c.num_blocks, kLLThreads, shared_bytes, stream)(p);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

template <bool kXF32, int kRow>
cudaError_t launch_dispatch_mode(const LLDispatchLaunch& p, uint64_t shared, cudaStream_t stream) {
  switch (p.c.mode) {
    case kLLSend:
      return launch_ll(ll_dispatch_kernel<kXF32, kRow, kLLSend>, p, shared, stream);
    case kLLRecv:
      return launch_ll(ll_dispatch_kernel<false, kRow, kLLRecv>, p, shared, stream);
    default:
      return launch_ll(ll_dispatch_kernel<kXF32, kRow, kLLFused>, p, shared, stream);
  }
}

}  // namespace

cudaError_t launch_ll_dispatch(const LLDispatchLaunch& p, cudaStream_t stream) {
  const bool fp8 = p.row_kind == kRowFP8;
  const uint64_t shared =
      ll_shared_bytes(true, p.c.num_ranks, p.c.num_tokens, p.c.num_experts);
  if (!ll_ok(p.c) || (fp8 && p.c.hidden % kFp8Block != 0) ||
      (p.x_kind != kRowBF16 && p.x_kind != kRowF32) ||
      !(p.row_kind == kRowFP8 || p.row_kind == kRowBF16) ||
      (p.c.mode != kLLSend && p.active == nullptr) || shared == 0 ||
      shared > kLLMaxSharedBytes) {
    return cudaErrorInvalidValue;
  }
  const bool x_f32 = p.x_kind == kRowF32;
  if (fp8) {
    return x_f32 ? launch_dispatch_mode<true, kRowFP8>(p, shared, stream)
                 : launch_dispatch_mode<false, kRowFP8>(p, shared, stream);
  }
  return x_f32 ? launch_dispatch_mode<true, kRowBF16>(p, shared, stream)
               : launch_dispatch_mode<false, kRowBF16>(p, shared, stream);
}

cudaError_t launch_ll_combine(const LLCombineLaunch& p, cudaStream_t stream) {
  const uint64_t shared =
      ll_shared_bytes(false, p.c.num_ranks, p.c.num_tokens, p.c.num_experts);
  // (T = 0: XLA gives a zero-size dest_rank no storage)
  if (!ll_ok(p.c) || (p.c.mode != kLLSend && p.c.num_tokens > 0 && p.dest_rank == nullptr) ||
      shared == 0 || shared > kLLMaxSharedBytes) {
    return cudaErrorInvalidValue;
  }
  switch (p.c.mode) {
    case kLLSend:
      return launch_ll(ll_combine_kernel<kLLSend>, p, shared, stream);
    case kLLRecv:
      return launch_ll(ll_combine_kernel<kLLRecv>, p, shared, stream);
    default:
      return launch_ll(ll_combine_kernel<kLLFused>, p, shared, stream);
  }
}

}  // namespace jax_ep
