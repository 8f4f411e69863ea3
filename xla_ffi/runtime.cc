#include "xla_ffi/runtime.h"

#include <cuda.h>  // types of cuCtxGetExecAffinity only (reached through the runtime, no libcuda link)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>

#include "cuda/cuda_check.h"
#include "xla_ffi/device_memory.h"
#include "xla_ffi/fault_message.h"
#include "xla_ffi/symmetric_heap.h"

namespace jax_ep {
namespace {

// A fault record out of the pinned memory the GPU writes, byte by byte through volatile (no field
// list to keep in step with FaultRecord). Complete once `valid` reads 1: the GPU writes it once,
// every other field first.
FaultRecord CopyFaultRecord(const volatile FaultRecord& record) {
  FaultRecord copy;
  const volatile unsigned char* from = reinterpret_cast<const volatile unsigned char*>(&record);
  unsigned char* to = reinterpret_cast<unsigned char*>(&copy);
  for (size_t i = 0; i < sizeof(copy); ++i) to[i] = from[i];
  return copy;
}

constexpr uint64_t kBufferGranularity = 2ull << 20;  // round buffers up to 2 MiB

// The size a buffer of `have` bytes grows to when `wanted` are asked for (never shrinks; at least
// one granule).
uint64_t BufferTarget(uint64_t have, uint64_t wanted) {
  const uint64_t target = std::max(have, std::max<uint64_t>(wanted, 1));
  return (target + kBufferGranularity - 1) / kBufferGranularity * kBufferGranularity;
}

// Process model 2: the symmetric heap jax_ep proposes (NVSHMEM_SYMMETRIC_SIZE, unless set) for a
// first buffer of `target` bytes: room for the state, the buffer and the growth of one more buffer
// of the same size. (NVSHMEM's default CUDA VMM heap grows on demand and ignores it.)
uint64_t ProcessGroupHeapBytes(uint64_t target) {
  return std::max<uint64_t>(1ull << 30, 2 * target + (64ull << 20));
}

// Restores the calling thread's current device (init runs on the Python thread, which XLA or the
// user may rely on).
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() { ok_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~CurrentDeviceGuard() {
    if (ok_) cudaSetDevice(device_);
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int device_ = 0;
  bool ok_ = false;
};

// SMs this process's kernels may use on `ordinal`: the device's, or the share CUDA MPS provisions
// this client (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: processes sharing a GPU, jax_ep.launch
// --share-gpus), which cuCtxGetExecAffinity reports. The fused low-latency kernels need every block
// resident at once, so their grid must fit the share, not the device. A driver without the query
// (before CUDA 11.4) has no such share: the device's count stands.
int UsableSmCount(int ordinal) {
  int sm_count = 0;
  JAX_EP_CUDA_THROW(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, ordinal));
  CurrentDeviceGuard device_guard;
  JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
  JAX_EP_CUDA_THROW(cudaFree(nullptr));  // the device's primary context is current
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  JAX_EP_CUDA_THROW(cudaGetDriverEntryPointByVersion("cuCtxGetExecAffinity", &entry, 11040,
                                                     cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || entry == nullptr) return sm_count;
  using GetExecAffinity = CUresult (*)(CUexecAffinityParam*, CUexecAffinityType);
  CUexecAffinityParam affinity{};
  const CUresult status =
      reinterpret_cast<GetExecAffinity>(entry)(&affinity, CU_EXEC_AFFINITY_TYPE_SM_COUNT);
  if (status != CUDA_SUCCESS) {
    throw std::runtime_error("jax_ep: cuCtxGetExecAffinity(SM_COUNT) failed on GPU " +
                             std::to_string(ordinal) + " (CUresult " + std::to_string(status) + ")");
  }
  const int share = static_cast<int>(affinity.param.smCount.val);
  return share > 0 && share < sm_count ? share : sm_count;
}

void SynchronizeDevices(const std::vector<int>& ordinals) {
  for (int ordinal : ordinals) {
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    JAX_EP_CUDA_THROW(cudaDeviceSynchronize());
  }
}

}  // namespace

uint64_t TimeoutNsFromEnv(double default_seconds) {
  const char* text = std::getenv("JAX_EP_TIMEOUT_S");
  if (text == nullptr || *text == '\0') {
    return static_cast<uint64_t>(default_seconds * 1e9);
  }
  char* end = nullptr;
  errno = 0;
  const double seconds = std::strtod(text, &end);
  if (errno != 0 || end == text || *end != '\0' || !std::isfinite(seconds) || seconds <= 0 ||
      seconds > 1e6) {
    throw std::invalid_argument(std::string("jax_ep: JAX_EP_TIMEOUT_S must be a positive number "
                                            "of seconds, got '") + text + "'");
  }
  return static_cast<uint64_t>(seconds * 1e9);
}

std::shared_ptr<Runtime>& Runtime::Holder() {
  static auto* holder = new std::shared_ptr<Runtime>(new Runtime());  // leaked, see header
  return *holder;
}

std::shared_ptr<Runtime> Runtime::Shared() { return Holder(); }

Runtime& Runtime::Get() { return *Holder(); }

void Runtime::Reserve(uint64_t buffer_bytes) {
  if (Model() == ProcessModel::kProcessPerGpu) {
    const uint64_t have = CommBytes();
    if (buffer_bytes > have) {
      throw std::runtime_error(
          "the op needs " + std::to_string(buffer_bytes) + " bytes of communication buffer and "
          "the symmetric buffer has " + std::to_string(have) + " (process model 2 grows it only "
          "collectively: jax_ep does it when an EP op is traced; after shutdown(), or for an "
          "executable loaded without tracing, call jax_ep.runtime.ensure_initialized(bytes) on "
          "every process first)");
    }
    return;
  }
  std::vector<int> devices;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    devices = devices_;
  }
  if (devices.empty()) {
    throw std::runtime_error("jax_ep: no GPU was handed to the runtime (jax_ep.runtime."
                             "register_targets() does it when an EP op is traced)");
  }
  Init(devices, buffer_bytes);
}

void Runtime::CheckBufferFits(uint64_t buffer_bytes) {
  if (Model() == ProcessModel::kProcessPerGpu) return;  // grown collectively at trace time
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t have = CommBytes();
  const uint64_t target = BufferTarget(have, buffer_bytes);
  if (target <= have) return;
  CurrentDeviceGuard device_guard;
  for (int ordinal : devices_) {
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    RequireFreeMemory("communication buffer", target, comm_buffers_[ordinal] != nullptr ? have : 0);
  }
}

Runtime::Runtime() {
  for (int i = 0; i < kMaxDevices; ++i) {
    states_[i].store(nullptr, std::memory_order_relaxed);
    managed_[i].store(false, std::memory_order_relaxed);
    sm_count_[i].store(0, std::memory_order_relaxed);
    side_[i].store(nullptr, std::memory_order_relaxed);
    slot_[i].store(-1, std::memory_order_relaxed);
    reachable_[i].store(false, std::memory_order_relaxed);
  }
}

int Runtime::DeviceCount() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {  // the usual answer on machines without a GPU or driver
    throw std::runtime_error(std::string("jax_ep: cudaGetDeviceCount: ") +
                             cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
  return count;
}

std::vector<std::vector<bool>> Runtime::PeerAccessMatrix(const std::vector<int>& ordinals) {
  const int count = DeviceCount();
  for (int ordinal : ordinals) {
    if (ordinal < 0 || ordinal >= count) {
      throw std::invalid_argument("jax_ep: device ordinal " + std::to_string(ordinal) +
                                  " out of range (this process sees " + std::to_string(count) +
                                  " CUDA devices)");
    }
  }
  std::vector<std::vector<bool>> matrix(ordinals.size(), std::vector<bool>(ordinals.size(), true));
  for (size_t a = 0; a < ordinals.size(); ++a) {
    for (size_t b = 0; b < ordinals.size(); ++b) {
      if (ordinals[a] == ordinals[b]) continue;
      int can_access = 0;
      JAX_EP_CUDA_THROW(cudaDeviceCanAccessPeer(&can_access, ordinals[a], ordinals[b]));
      matrix[a][b] = can_access != 0;
    }
  }
  return matrix;
}

DeviceState* Runtime::State(int ordinal) const {
  if (ordinal < 0 || ordinal >= kMaxDevices || !managed_[ordinal].load(std::memory_order_acquire)) {
    return nullptr;
  }
  return states_[ordinal].load(std::memory_order_acquire);
}

int Runtime::Slot(int ordinal) const {
  if (State(ordinal) == nullptr) return -1;
  return slot_[ordinal].load(std::memory_order_acquire);
}

bool Runtime::SlotReachable(int slot) const {
  if (slot < 0 || slot >= kMaxDevices) return false;
  if (Model() == ProcessModel::kProcessPerGpu) {
    return reachable_[slot].load(std::memory_order_acquire) && CommBytes() > 0;
  }
  return State(slot) != nullptr;
}

std::vector<int> Runtime::ReachablePes() const {
  std::vector<int> pes;
  for (int pe = 0; pe < kMaxDevices; ++pe) {
    if (reachable_[pe].load(std::memory_order_acquire)) pes.push_back(pe);
  }
  return pes;
}

int Runtime::SmCount(int ordinal) const {
  if (ordinal < 0 || ordinal >= kMaxDevices) return 0;
  return sm_count_[ordinal].load(std::memory_order_acquire);
}

const SideStream* Runtime::Side(int ordinal) const {
  if (ordinal < 0 || ordinal >= kMaxDevices || !managed_[ordinal].load(std::memory_order_acquire)) {
    return nullptr;
  }
  return side_[ordinal].load(std::memory_order_acquire);
}

std::vector<int> Runtime::ManagedDevices() const {
  std::vector<int> result;
  for (int i = 0; i < kMaxDevices; ++i) {
    if (managed_[i].load(std::memory_order_acquire)) result.push_back(i);
  }
  return result;
}

double Runtime::TimeoutSeconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<double>(timeout_ns_) * 1e-9;
}

void Runtime::Init(const std::vector<int>& requested, uint64_t buffer_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Model() == ProcessModel::kProcessPerGpu) {
    throw std::runtime_error("jax_ep.init: this process already runs process model 2 (one process "
                             "per GPU over NVSHMEM); the local-peer model cannot be mixed in");
  }

  // ---- validate, before touching any state ----
  const int count = DeviceCount();
  std::set<int> wanted(requested.begin(), requested.end());
  if (wanted.size() != requested.size()) {
    throw std::invalid_argument("jax_ep.init: device_ordinals contains duplicates");
  }
  for (int ordinal : wanted) {
    if (ordinal < 0 || ordinal >= count) {
      throw std::invalid_argument("jax_ep.init: device ordinal " + std::to_string(ordinal) +
                                  " out of range (this process sees " + std::to_string(count) +
                                  " CUDA devices)");
    }
    if (ordinal >= kMaxDevices) {
      throw std::invalid_argument("jax_ep.init: device ordinal " + std::to_string(ordinal) +
                                  " exceeds the supported maximum of " +
                                  std::to_string(kMaxDevices - 1));
    }
  }
  const std::vector<int> before = ManagedDevices();
  std::set<int> all_set(before.begin(), before.end());
  all_set.insert(wanted.begin(), wanted.end());
  const std::vector<int> all(all_set.begin(), all_set.end());
  for (int a : all) {
    for (int b : all) {
      if (a == b) continue;
      int can_access = 0;
      JAX_EP_CUDA_THROW(cudaDeviceCanAccessPeer(&can_access, a, b));
      if (!can_access) {
        throw std::runtime_error(
            "jax_ep: GPU " + std::to_string(a) + " cannot access the memory of GPU " +
            std::to_string(b) + " (cudaDeviceCanAccessPeer returned 0), so they cannot be in "
            "one NVLink/P2P group. Use GPUs with peer access (see `nvidia-smi topo -m`), or "
            "restrict the process to them with CUDA_VISIBLE_DEVICES.");
      }
    }
  }
  const uint64_t timeout_ns = TimeoutNsFromEnv(kDefaultTimeoutSeconds);
  const uint64_t old_bytes = comm_bytes_.load(std::memory_order_acquire);
  const uint64_t target_bytes = BufferTarget(old_bytes, buffer_bytes);

  const bool grow = target_bytes > old_bytes;
  std::vector<int> joining;
  for (int ordinal : all) {
    if (!managed_[ordinal].load(std::memory_order_acquire)) joining.push_back(ordinal);
  }
  if (!grow && joining.empty() && timeout_ns == timeout_ns_) return;  // nothing to do

  CurrentDeviceGuard device_guard;

  // Growing replaces buffers every kernel reads through the tables: wait until none runs.
  if (grow && !before.empty()) SynchronizeDevices(before);

  EnsureFaultRecords();

  for (int ordinal : joining) {
    sm_count_[ordinal].store(UsableSmCount(ordinal), std::memory_order_release);
    if (states_[ordinal].load(std::memory_order_acquire) != nullptr) continue;  // re-init
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    void* state = DeviceMalloc("device state", sizeof(DeviceState), 0);
    JAX_EP_CUDA_THROW(cudaMemset(state, 0, sizeof(DeviceState)));  // counters start at 0, once
    EnsureSideStream(ordinal);
    states_[ordinal].store(static_cast<DeviceState*>(state), std::memory_order_release);
  }

  for (int a : all) {
    for (int b : all) {
      if (a == b || peer_enabled_[a][b]) continue;
      JAX_EP_CUDA_THROW(cudaSetDevice(a));
      const cudaError_t status = cudaDeviceEnablePeerAccess(b, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // XLA (or an earlier init) enabled it: fine, clear the error
      } else {
        JAX_EP_CUDA_THROW(status);
      }
      peer_enabled_[a][b] = true;
    }
  }

  // New buffers first, old ones freed only after the tables point away from them; on failure
  // the previous buffers (and tables) are untouched. Every GPU's free memory is checked before
  // any is allocated (DeviceMemoryError names the GPU that lacks room).
  uint8_t* new_buffers[kMaxDevices] = {};
  const std::vector<int>& need_buffer = grow ? all : joining;
  for (int ordinal : need_buffer) {
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    RequireFreeMemory("communication buffer", target_bytes,
                      comm_buffers_[ordinal] != nullptr ? old_bytes : 0);
  }
  try {
    for (int ordinal : need_buffer) {
      JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
      void* buffer = DeviceMalloc("communication buffer", target_bytes,
                                  comm_buffers_[ordinal] != nullptr ? old_bytes : 0);
      new_buffers[ordinal] = static_cast<uint8_t*>(buffer);
      JAX_EP_CUDA_THROW(cudaMemset(buffer, 0, target_bytes));
    }
  } catch (...) {
    for (int ordinal : need_buffer) {
      if (new_buffers[ordinal] != nullptr) {  // best effort: the first error is the one to report
        cudaSetDevice(ordinal);
        cudaFree(new_buffers[ordinal]);
      }
    }
    throw;
  }
  uint8_t* old_buffers[kMaxDevices] = {};
  for (int ordinal : need_buffer) {
    old_buffers[ordinal] = comm_buffers_[ordinal];
    comm_buffers_[ordinal] = new_buffers[ordinal];
  }

  // Rewrite the tables of every managed device (new peers, new buffers, timeout).
  for (int ordinal : all) {
    DeviceTables tables;
    std::memset(&tables, 0, sizeof(tables));
    for (int peer : all) {
      tables.comm_buffers[peer] = comm_buffers_[peer];
      tables.peer_states[peer] = states_[peer].load(std::memory_order_acquire);
    }
    tables.comm_bytes = target_bytes;
    tables.timeout_ns = timeout_ns;
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    UploadTables(ordinal, ordinal, tables);
  }
  for (int ordinal : need_buffer) {
    if (old_buffers[ordinal] != nullptr) {
      JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
      JAX_EP_CUDA_THROW(cudaFree(old_buffers[ordinal]));
    }
  }
  SynchronizeDevices(all);  // tables visible before any handler can launch against them

  timeout_ns_ = timeout_ns;
  comm_bytes_.store(target_bytes, std::memory_order_release);
  for (int ordinal : all) {
    slot_[ordinal].store(ordinal, std::memory_order_release);
    managed_[ordinal].store(true, std::memory_order_release);
  }
  devices_ = all;  // every GPU ever given (all includes the managed ones)
  model_.store(ProcessModel::kLocalPeers, std::memory_order_release);
}

void Runtime::EnsureSideStream(int ordinal) {
  if (side_[ordinal].load(std::memory_order_acquire) != nullptr) return;
  auto side = std::make_unique<SideStream>();
  int least = 0, greatest = 0;
  JAX_EP_CUDA_THROW(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  JAX_EP_CUDA_THROW(cudaStreamCreateWithPriority(&side->stream, cudaStreamNonBlocking, greatest));
  JAX_EP_CUDA_THROW(cudaEventCreateWithFlags(&side->fork, cudaEventDisableTiming));
  JAX_EP_CUDA_THROW(cudaEventCreateWithFlags(&side->join, cudaEventDisableTiming));
  side_[ordinal].store(side.release(), std::memory_order_release);
}

void Runtime::EnsureFaultRecords() {
  if (fault_records_.load(std::memory_order_acquire) != nullptr) return;
  void* records = nullptr;
  // Portable: one allocation visible to every device; mapped: kernels write it directly.
  JAX_EP_CUDA_THROW(cudaHostAlloc(&records, sizeof(FaultRecord) * kMaxDevices,
                                  cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(records, 0, sizeof(FaultRecord) * kMaxDevices);
  fault_records_.store(static_cast<FaultRecord*>(records), std::memory_order_release);
}

void Runtime::InitProcessGroup(int ordinal, const std::vector<uint8_t>& unique_id, int process,
                               int num_processes, uint64_t buffer_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Model() == ProcessModel::kLocalPeers) {
    throw std::runtime_error("jax_ep: this process already drives its GPUs in process model 1 "
                             "(local peers); process model 2 cannot be mixed in");
  }
  const int count = DeviceCount();
  if (ordinal < 0 || ordinal >= count || ordinal >= kMaxDevices) {
    throw std::invalid_argument("jax_ep: device ordinal " + std::to_string(ordinal) +
                                " out of range (this process sees " + std::to_string(count) +
                                " CUDA devices)");
  }
  if (num_processes < 1 || num_processes > kMaxDevices || process < 0 || process >= num_processes) {
    throw std::invalid_argument(
        "jax_ep: process model 2 got process " + std::to_string(process) + " of " +
        std::to_string(num_processes) + " processes; this build supports 1 to " +
        std::to_string(kMaxDevices) + " processes (the device tables have one slot per PE)");
  }
  if (Model() == ProcessModel::kProcessPerGpu &&
      (ordinal != pg_ordinal_ || process != pe_ || num_processes != num_pes_)) {
    throw std::runtime_error("jax_ep: process model 2 was set up as PE " + std::to_string(pe_) +
                             " of " + std::to_string(num_pes_) + " on GPU " +
                             std::to_string(pg_ordinal_) + "; got PE " + std::to_string(process) +
                             " of " + std::to_string(num_processes) + " on GPU " +
                             std::to_string(ordinal));
  }
  const uint64_t timeout_ns = TimeoutNsFromEnv(kProcessGroupTimeoutSeconds);
  const uint64_t target = BufferTarget(CommBytes(), buffer_bytes);
  const bool first = Model() == ProcessModel::kNone;
  // Decided by sizes only, which agree on every process (the rebuild is collective).
  if (!first && target <= CommBytes()) return;

  CurrentDeviceGuard device_guard;
  JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
  if (first) {
    EnsureFaultRecords();
    sm_count_[ordinal].store(UsableSmCount(ordinal), std::memory_order_release);
    symmetric_heap::Init(unique_id, process, num_processes, ProcessGroupHeapBytes(target));
    void* state = symmetric_heap::Allocate("device state", sizeof(DeviceState), 0);
    JAX_EP_CUDA_THROW(cudaMemset(state, 0, sizeof(DeviceState)));  // counters start at 0, once
    JAX_EP_CUDA_THROW(cudaDeviceSynchronize());
    symmetric_heap::BarrierAll();  // no peer writes into a state before its owner zeroed it
    EnsureSideStream(ordinal);
    states_[ordinal].store(static_cast<DeviceState*>(state), std::memory_order_release);
    pe_ = process;
    num_pes_ = num_processes;
    pg_ordinal_ = ordinal;
    for (int pe = 0; pe < num_processes; ++pe) {
      reachable_[pe].store(symmetric_heap::PeerAddress(state, pe) != nullptr,
                           std::memory_order_release);
    }
    model_.store(ProcessModel::kProcessPerGpu, std::memory_order_release);
  }
  if (first) timeout_ns_ = timeout_ns;  // read once: a rebuild must not depend on local settings
  RebuildProcessGroupBuffer(target, timeout_ns_);
  slot_[ordinal].store(process, std::memory_order_release);
  managed_[ordinal].store(true, std::memory_order_release);
  devices_ = {ordinal};
}

Runtime::ProcessGroupPlan Runtime::PlanProcessGroup(uint64_t buffer_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  ProcessGroupPlan plan;
  const uint64_t have = CommBytes();
  plan.first = Model() == ProcessModel::kNone;
  plan.buffer_bytes = BufferTarget(have, buffer_bytes);
  plan.held_bytes = plan.first ? 0 : have;
  plan.shape = symmetric_heap::CurrentHeapShape();
  if (!plan.first && plan.buffer_bytes <= have) return plan;  // InitProcessGroup does nothing
  plan.nvshmem_starting = plan.first && !symmetric_heap::Query().initialized;
  const uint64_t static_heap =
      symmetric_heap::StaticHeapBytes(ProcessGroupHeapBytes(plan.buffer_bytes));
  if (plan.first && !plan.nvshmem_starting) {  // NVSHMEM started by XLA: our state, then the buffer
    plan.device_bytes = HeapDeviceBytes(plan.shape, false, 0, sizeof(DeviceState)) +
                        HeapDeviceBytes(plan.shape, false, 0, plan.buffer_bytes);
  } else {
    plan.device_bytes =
        HeapDeviceBytes(plan.shape, plan.nvshmem_starting, static_heap, plan.buffer_bytes);
  }
  return plan;
}

void Runtime::RebuildProcessGroupBuffer(uint64_t bytes, uint64_t timeout_ns) {
  const int ordinal = pg_ordinal_;
  DeviceState* state = states_[ordinal].load(std::memory_order_acquire);
  // Every kernel reading the old buffer (ours, and peers' writes into it) has finished once every
  // PE has synchronised its GPU: the collective allocation below waits for all of them.
  JAX_EP_CUDA_THROW(cudaDeviceSynchronize());
  uint8_t* old_buffer = comm_buffers_[ordinal];
  uint8_t* buffer =
      bytes > 0 ? static_cast<uint8_t*>(symmetric_heap::Allocate(
                      "communication buffer", bytes, old_buffer != nullptr ? CommBytes() : 0))
                : nullptr;
  if (buffer != nullptr) JAX_EP_CUDA_THROW(cudaMemset(buffer, 0, bytes));
  DeviceTables tables;
  std::memset(&tables, 0, sizeof(tables));
  for (int pe = 0; pe < num_pes_ && buffer != nullptr; ++pe) {
    if (!reachable_[pe].load(std::memory_order_acquire)) continue;
    tables.comm_buffers[pe] = static_cast<uint8_t*>(symmetric_heap::PeerAddress(buffer, pe));
    tables.peer_states[pe] =
        static_cast<DeviceState*>(symmetric_heap::PeerAddress(state, pe));
  }
  tables.comm_bytes = buffer != nullptr ? bytes : 0;  // 0: replays after shutdown trap
  tables.timeout_ns = timeout_ns;
  tables.symmetric_buffer = buffer;  // the symmetric address NVSHMEM puts go to (remote.cu)
  UploadTables(ordinal, pe_, tables);
  if (old_buffer != nullptr) symmetric_heap::Free(old_buffer);
  comm_buffers_[ordinal] = buffer;
  JAX_EP_CUDA_THROW(cudaDeviceSynchronize());
  symmetric_heap::BarrierAll();  // tables of every PE are up to date before any op runs
  comm_bytes_.store(tables.comm_bytes, std::memory_order_release);
}

void Runtime::FinalizeProcessGroup() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Model() != ProcessModel::kProcessPerGpu) return;
  if (Holders() > 0) {
    throw std::runtime_error("jax_ep: finalize refused: instantiated EP call sites of live "
                             "executables hold the runtime");
  }
  CurrentDeviceGuard device_guard;
  JAX_EP_CUDA_THROW(cudaSetDevice(pg_ordinal_));
  managed_[pg_ordinal_].store(false, std::memory_order_release);
  comm_bytes_.store(0, std::memory_order_release);
  RebuildProcessGroupBuffer(0, timeout_ns_);  // frees the buffer
  DeviceState* state = states_[pg_ordinal_].exchange(nullptr, std::memory_order_acq_rel);
  if (state != nullptr) symmetric_heap::Free(state);
  symmetric_heap::Finalize();
  for (int pe = 0; pe < kMaxDevices; ++pe) reachable_[pe].store(false, std::memory_order_release);
  model_.store(ProcessModel::kNone, std::memory_order_release);
  devices_.clear();
}

void Runtime::UploadTables(int ordinal, int slot, DeviceTables tables) {
  void* record_on_device = nullptr;
  FaultRecord* records = fault_records_.load(std::memory_order_acquire);
  JAX_EP_CUDA_THROW(cudaHostGetDevicePointer(&record_on_device, &records[ordinal], 0));
  tables.fault_record = static_cast<FaultRecord*>(record_on_device);
  tables.device_ordinal = ordinal;
  tables.slot = slot;
  JAX_EP_CUDA_THROW(cudaMemcpy(states_[ordinal].load(std::memory_order_acquire), &tables,
                               kDeviceTablesBytes, cudaMemcpyHostToDevice));
}

void Runtime::Shutdown() {
  std::lock_guard<std::mutex> lock(mutex_);
  const long holders = Holders();
  if (holders > 0) {
    throw std::runtime_error(
        "jax_ep: shutdown() refused: " + std::to_string(holders) + " instantiated EP call "
        "site(s) of live executables hold the runtime. Delete the jitted functions that use EP "
        "ops and call jax.clear_caches() first.");
  }
  const std::vector<int> managed = ManagedDevices();
  if (managed.empty()) return;
  CurrentDeviceGuard device_guard;
  if (Model() == ProcessModel::kProcessPerGpu) {  // collective: every process shuts down
    managed_[pg_ordinal_].store(false, std::memory_order_release);
    comm_bytes_.store(0, std::memory_order_release);
    JAX_EP_CUDA_THROW(cudaSetDevice(pg_ordinal_));
    RebuildProcessGroupBuffer(0, timeout_ns_);
    return;
  }
  // Handlers stop launching first, then whatever was launched drains.
  for (int ordinal : managed) managed_[ordinal].store(false, std::memory_order_release);
  comm_bytes_.store(0, std::memory_order_release);
  SynchronizeDevices(managed);
  for (int ordinal : managed) {
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    DeviceTables tables;
    std::memset(&tables, 0, sizeof(tables));  // comm_bytes = 0: stale graph replays trap
    tables.timeout_ns = timeout_ns_;
    UploadTables(ordinal, ordinal, tables);
    if (comm_buffers_[ordinal] != nullptr) {
      JAX_EP_CUDA_THROW(cudaFree(comm_buffers_[ordinal]));
      comm_buffers_[ordinal] = nullptr;
    }
  }
}

std::vector<RankMaskInfo> Runtime::RankMasks() const {
  std::vector<RankMaskInfo> result;
  for (int ordinal : ManagedDevices()) {
    const DeviceState* state = State(ordinal);
    if (state == nullptr) continue;
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    JAX_EP_CUDA_THROW(cudaDeviceSynchronize());  // no kernel may be setting a bit meanwhile
    std::vector<SyncCounters::RankMaskState> masks(kDirectoryAxes * kMaxGroups);
    JAX_EP_CUDA_THROW(cudaMemcpy(masks.data(), &state->sync.rank_masks[0][0],
                                 masks.size() * sizeof(masks[0]), cudaMemcpyDeviceToHost));
    for (int a = 0; a < kDirectoryAxes; ++a) {
      for (int g = 0; g < kMaxGroups; ++g) {
        const SyncCounters::RankMaskState& m = masks[a * kMaxGroups + g];
        for (int r = 0; r < kMaxGroupRanks; ++r) {
          if (((m.masked >> r) & 1u) == 0u) continue;
          const SyncCounters::RankMaskEvent& e = m.events[r];
          result.push_back(RankMaskInfo{ordinal, a, g, m.rank, r, OpName(e.op),
                                        e.during == 1 ? "discovery" : "receive", e.epoch});
        }
      }
    }
  }
  return result;
}

void Runtime::ClearRankMasks(int axis_slot, int group) const {
  for (int ordinal : ManagedDevices()) {
    DeviceState* state = State(ordinal);
    if (state == nullptr) continue;
    JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
    JAX_EP_CUDA_THROW(cudaDeviceSynchronize());  // no kernel may be setting a bit meanwhile
    for (int a = 0; a < kDirectoryAxes; ++a) {
      if (axis_slot >= 0 && a != axis_slot) continue;
      for (int g = 0; g < kMaxGroups; ++g) {
        if (group >= 0 && g != group) continue;
        JAX_EP_CUDA_THROW(cudaMemset(&state->sync.rank_masks[a][g], 0,
                                     sizeof(SyncCounters::RankMaskState)));
      }
    }
    JAX_EP_CUDA_THROW(cudaDeviceSynchronize());
  }
}

std::string Runtime::FaultMessages() const {
  std::string text;
  for (const FaultInfo& fault : Faults()) text += "\n" + fault.message;
  return text;
}

std::vector<FaultInfo> Runtime::Faults() const {
  std::vector<FaultInfo> faults;
  const FaultRecord* records = fault_records_.load(std::memory_order_acquire);
  if (records == nullptr) return faults;
  for (int ordinal = 0; ordinal < kMaxDevices; ++ordinal) {
    // volatile: written by the GPU behind the compiler's back.
    const volatile FaultRecord& record = records[ordinal];
    if (record.valid == 0) continue;
    FaultInfo info;
    info.record = CopyFaultRecord(record);
    info.kind = FaultKindName(info.record.kind);
    info.op = OpName(info.record.op_id);
    info.field = FingerprintFieldName(info.record.field);
    info.message = FaultMessage(info.record, Model() == ProcessModel::kProcessPerGpu);
    faults.push_back(std::move(info));
  }
  return faults;
}

}  // namespace jax_ep
