// Per-device runtime state shared by the host runtime (xla_ffi/) and the kernels (cuda/).
//
// Plain C++ (no CUDA syntax) so both g++ and nvcc compile it. One DeviceState lives in each GPU's
// memory for the whole process lifetime: kernels receive its address as an argument, and XLA bakes
// kernel arguments into CUDA graphs, so the address must never change. Everything that may change
// (communication buffers after growth, peers joining) is read *through* it at run time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/fingerprint.h"

namespace jax_ep {

// Slots of the device tables. A GPU's *slot* is its index in every table below and in the group
// records of the kernels: its CUDA ordinal in process model 1 (one process drives all local GPUs),
// its NVSHMEM PE (= JAX process index) in process model 2 (one process per GPU).
inline constexpr int kMaxDevices = 32;
// Ranks in one NVLink group (a group is a set of local devices, so it cannot exceed kMaxDevices).
inline constexpr int kMaxGroupRanks = kMaxDevices;
// Group discovery (see SyncCounters::directory): EP groups of one mesh partition, and directory
// slots for distinct EP mesh axes (an axis name hashes to a slot).
inline constexpr int kMaxGroups = 64;
inline constexpr int kDirectoryAxes = 4;

// The ops a device-side fault or a config fingerprint names (FaultRecord::op_id), the one list:
// X(Name, name, id) is kOp<Name> = id, named "name" in fault messages (fault_message.cc OpName). The
// ids are fixed: records are compared across processes and builds.
#define JAX_EP_FAULT_OPS(X) \
  X(PeerSmoke, peer_smoke, 1) \
  X(Dispatch, dispatch, 2) \
  X(Combine, combine, 3) \
  X(Broadcast, broadcast, 4) \
  X(SlotValues, slot_values, 5) \
  X(RemoteSmoke, remote_smoke, 6) \
  X(LLDispatch, ll_dispatch, 7) \
  X(LLCombine, ll_combine, 8) \
  X(DispatchRankMajor, dispatch_rank_major, 9) \
  X(CombineRankMajor, combine_rank_major, 10) \
  X(BroadcastRankMajor, broadcast_rank_major, 11) \
  X(CombineBwd, combine_bwd, 12)

enum OpId : int32_t {
  kOpNone = 0,
#define JAX_EP_OP_ID(Name, name, id) kOp##Name = id,
  JAX_EP_FAULT_OPS(JAX_EP_OP_ID)
#undef JAX_EP_OP_ID
};

// What went wrong, in FaultRecord::kind.
enum FaultKind : int32_t {
  kFaultNone = 0,
  kFaultTimeout = 1,         // a spin-wait on a peer exceeded the timeout
  kFaultStaleRuntime = 2,    // a kernel (e.g. a replayed CUDA graph) ran after shutdown or with a
                             // communication buffer smaller than it needs
  kFaultBadArgument = 3,     // a device-side argument (rank / group id) was out of range
  kFaultLLInFlight = 4,      // a rule of the low-latency ops' double buffering was broken (the
                             // kind of break in waited_ordinal, an LLFault; calls in expected /
                             // observed)
  kFaultMismatch = 5,        // a peer's call does not match this one (cuda/fingerprint.h): the
                             // FingerprintField in field, this rank's value in expected, the
                             // peer's (waited_rank) in observed
};

// What kFaultLLInFlight means, in FaultRecord::waited_ordinal.
enum LLFault : int32_t {
  kLLFaultTooMany = 1,     // call `expected` of an op would reuse the receive half that holds call
                           // `observed`, sent in two phases and not yet received
  kLLFaultShape = 2,       // a low-latency call of another shape ran while calls were in flight
                           // (or a receive's shape differs from its send's)
  kLLFaultStaleToken = 3,  // a receive got the call token of call `expected`, not in flight (received
                           // already, or its half reused: `observed` is the half's call)
  kLLFaultThroughput = 4,  // a throughput EP op ran while `observed` low-latency halves were in
                           // flight
};

// The first device-side fault on a device, written by the kernel into host-mapped pinned memory
// (readable by the host even after the __trap() has killed the CUDA context).
struct FaultRecord {
  int32_t valid;           // set last, after every other field is visible
  int32_t kind;            // FaultKind
  int32_t op_id;           // OpId
  int32_t device_ordinal;  // device that faulted
  int32_t rank;            // its rank in the group of the op
  int32_t waited_rank;     // rank it was waiting on (-1 if none)
  int32_t waited_ordinal;  // slot of that rank (-1 if none)
  uint64_t expected;       // value waited for (epoch) or bytes needed
  uint64_t observed;       // value seen when it gave up, or bytes available
  int64_t elapsed_ns;      // how long it waited
  int32_t field;           // FingerprintField the fault is about (kFieldNone if none)
};

// Written by the host only (init / growth / shutdown), while no kernel of the library can run.
struct DeviceTables {
  // Every reachable GPU's communication buffer and DeviceState, by slot (nullptr: no such GPU, or
  // not reachable by loads/stores, e.g. on another node).
  uint8_t* comm_buffers[kMaxDevices];
  struct DeviceState* peer_states[kMaxDevices];
  uint64_t comm_bytes;                         // size of each communication buffer (0 = none)
  uint64_t timeout_ns;                         // bound of every spin-wait
  FaultRecord* fault_record;                   // device view of this device's pinned record
  // Process model 2: this device's own communication buffer at its SYMMETRIC address (what
  // nvshmem_malloc returned), the destination address NVSHMEM puts take (NVSHMEM maps it to the
  // target PE's copy). nullptr in process model 1 (no NVSHMEM).
  uint8_t* symmetric_buffer;
  int32_t device_ordinal;                      // CUDA ordinal of the device this state lives on
  int32_t slot;                                // its slot in the tables
};

// Written by kernels only; zeroed once when the state is created and never reset, so counters stay
// consistent across calls, CUDA-graph replays and re-initialisation.
struct SyncCounters {
  // arrived[s]: how many group barriers the GPU of slot s has entered together with this device.
  // Written by that GPU (a peer store), read here.
  alignas(128) uint64_t arrived[kMaxDevices];
  // barriers_done[s]: how many group barriers this device has entered together with slot s.
  // Local bookkeeping; its parity also selects the half of a double-buffered slot.
  alignas(128) uint64_t barriers_done[kMaxDevices];
  // 0 until the first fault on this device: the faulting thread that flips it owns the (host-mapped)
  // FaultRecord. Kept in device memory because atomics on host-mapped memory need PCIe atomics.
  int32_t fault_claimed;
  // Group discovery of the EP ops (they know their rank and group only as device scalars).
  // directory[a][g][r]: (epoch << 16) | slot of rank r of group g of axis slot a, written
  // (release, system scope) by that rank into the directory of EVERY managed device at the start
  // of each op; a rank reads only its own directory. group_epoch[a][g]: how many EP ops this
  // device has run as a member of group g of axis slot a (local bookkeeping, counted on the
  // device, so CUDA-graph replays stay in step). Every member of a group runs the same ops in the
  // same order, so their epochs agree.
  alignas(128) uint64_t directory[kDirectoryAxes][kMaxGroups][kMaxGroupRanks];
  alignas(128) uint64_t group_epoch[kDirectoryAxes][kMaxGroups];
  // fingerprints[a][g][r][f]: word f of the OpFingerprint of rank r's current call in group g of
  // axis slot a, (epoch << 32) | value, stored by that rank right AFTER its directory entry, into
  // every managed device (cuda/fingerprint.cuh). Each word carries the call's epoch, so a reader
  // needs no ordering between the entry and the words (a release would make the writer wait for
  // its stores before the entry goes out): it polls until the words show the call.
  alignas(128) uint64_t fingerprints[kDirectoryAxes][kMaxGroups][kMaxGroupRanks][kFingerprintWords];
  // Process model 2, remote_smoke (NVSHMEM puts + signals): remote_signal[s] is the signal word
  // the GPU of slot s sets (NVSHMEM_SIGNAL_SET, after its data) to the number of remote_smoke
  // calls it has made together with this device; remote_calls[s]: the same count, kept here
  // (local bookkeeping). A DeviceState lives on the symmetric heap in model 2, so
  // &remote_signal[s] of this device's own state is a symmetric address.
  alignas(128) uint64_t remote_signal[kMaxDevices];
  alignas(128) uint64_t remote_calls[kMaxDevices];
  // The put transport of the rank-major ops (cuda/remote_rank_major.cu): put_signal[s] is set by the
  // GPU of slot s (NVSHMEM_SIGNAL_SET, delivered after its data) to the flag value of the call whose
  // rows it put here, (epoch << 16) | group key; the receiver waits for equality. One word per
  // source suffices: a source puts the next call's rows only after this device entered that call.
  alignas(128) uint64_t put_signal[kMaxDevices];
  // Low-latency ops (cuda/low_latency.cu), local bookkeeping written by the last block of each
  // kernel. ll_calls[op][a][g]: calls of LL op `op` (0 ll_dispatch, 1 ll_combine) this device has
  // sent as a member of group g of axis slot a; call n uses half n % 2 of the op's receive region.
  alignas(128) uint64_t ll_calls[2][kDirectoryAxes][kMaxGroups];
  // ll_half[op][h]: the call whose data half h of the op's region holds, and whether it is in
  // flight (its two-phase send ran, its receive has not).
  struct LLHalf {
    uint64_t call;
    uint64_t epoch;
    uint32_t busy;
    uint32_t shape;  // a hash of the sending call site's shape (its receive must match)
    uint32_t active; // bit r: rank r took part in the send (its receive serves the same ranks)
    uint32_t pad;
  };
  alignas(128) LLHalf ll_half[2][2];
  uint64_t ll_busy_shape;     // (T, K, H) of the halves in flight
  uint64_t ll_busy_dispatch;  // (R, E, slot bytes) of the dispatch halves in flight
  uint32_t ll_busy;           // halves in flight, both ops
  uint32_t ll_busy_dispatches;
  uint32_t ll_blocks_done;    // blocks of the running LL kernel that have finished
  uint32_t ll_dropped;        // pairs the finished blocks of a dispatch dropped (its last block
                              // reads and clears it)
  // Blocks of the running dispatch notify kernel that finished their prep work (cuda/dispatch.cu:
  // each adds 1, acq_rel; its block 0 waits for all of them, then clears it for the next call).
  uint64_t prep_blocks_done;
  // Rank masking, the persistent part (one concept for every EP op: every EP kernel reads it, the
  // shrink-mode low-latency kernels set it). rank_masks[a][g].masked bit r: rank r of
  // EP group g of axis slot a is masked on this device: every later EP call ANDs its own rank mask
  // with the complement. Set (atomicOr) by a kernel running in shrink mode when rank r missed a
  // bounded wait (events[r] says where); cleared only by the host (Runtime::ClearRankMasks), so a
  // masked rank stays masked, as DeepEP assumes, until the user says it is back.
  struct RankMaskEvent {
    int32_t op;      // OpId of the call that masked the rank (0: the bit is clear)
    int32_t during;  // 1: the rank had not entered the call (discovery); 2: it entered, then its
                     // data did not come (a receive wait)
    uint64_t epoch;  // the group epoch of that call
  };
  struct RankMaskState {
    uint32_t masked;  // bit r: rank r masked
    int32_t rank;     // this device's rank in the group (written with each event)
    RankMaskEvent events[kMaxGroupRanks];
  };
  alignas(128) RankMaskState rank_masks[kDirectoryAxes][kMaxGroups];
  // heartbeat: bumped by every poll of a shrink-mode wait of this device (any kernel, any group),
  // read by peers: a rank that sits out a wait of its own is alive, however late (PollBound,
  // cuda/common.cuh).
  alignas(128) uint64_t heartbeat;
  // ll_decision[a][g]: (epoch mod 2^32) << 32 | active ranks of the running shrink-mode LL call,
  // the view of its first block to finish discovery; the other blocks take it (they may have seen
  // a late peer arrive that this block gave up on, or the reverse), so every block sends to and
  // waits for the same ranks.
  alignas(128) uint64_t ll_decision[kDirectoryAxes][kMaxGroups];
};

struct DeviceState {
  DeviceTables tables;
  alignas(128) SyncCounters sync;
};

// The host rewrites only this prefix of a DeviceState (the sync counters must survive).
inline constexpr size_t kDeviceTablesBytes = sizeof(DeviceTables);

// Ranks taking part in one op, passed to kernels by value. Static for a given call site (derived
// from the mesh at trace time), so baking it into a CUDA graph is correct.
struct PeerGroup {
  int32_t size;                       // R
  int32_t my_rank;                    // this device's rank in the group
  int32_t ordinals[kMaxGroupRanks];   // slot of each rank
};

}  // namespace jax_ep
