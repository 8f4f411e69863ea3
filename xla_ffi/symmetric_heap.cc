#include "xla_ffi/symmetric_heap.h"

#include <cuda_runtime_api.h>

#include <strings.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "xla_ffi/device_memory.h"

// The host API of NVSHMEM (libnvshmem_host.so.3), plus the two entry points of its device library
// (libnvshmem_device.a, linked into this extension together with the device link of our
// relocatable kernels, cuda/remote.cu): nvshmemi_init_thread and nvshmemi_finalize. They register
// this module's nvshmemi_device_state_d with the host library, which fills it in, so that our
// kernels' NVSHMEM device calls (puts, signals) work. The host library alone
// (nvshmemx_hostlib_init_attr) would leave that state empty.
#include <nvshmem_host.h>

namespace jax_ep::symmetric_heap {
namespace {

bool g_owned = false;       // jax_ep initialised NVSHMEM (finalising ends the job)
bool g_registered = false;  // this module's device state is registered with NVSHMEM
uint64_t g_heap_bytes = 0;  // the heap's size as configured (HeapBytes)
bool g_shape_known = false;  // g_shape was read when NVSHMEM started (or was found started)
HeapShape g_shape;
constexpr uint64_t kNvshmemDefaultHeap = 1ull << 30;  // NVSHMEM_SYMMETRIC_SIZE's default

uint64_t ConfiguredHeapBytes() {
  const char* text = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  return text == nullptr || *text == '\0' ? kNvshmemDefaultHeap : ParseSize(text);
}

// What the header's nvshmemx_init_attr does, without its exit() on failure: initialises NVSHMEM
// if needed (bootstrap `flags`, `attr`), and registers the device state of the device library
// linked into THIS extension (the call binds to our copy of libnvshmem_device.a: the host
// library does not define nvshmemi_init_thread). On an NVSHMEM that is already initialised the
// bootstrap arguments are ignored and only the registration happens (reference counted).
int InitThread(unsigned int flags, nvshmemx_init_attr_t* attr) {
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, flags, attr, version);
}

[[noreturn]] void Fail(const std::string& what, int status) {
  throw std::runtime_error("jax_ep: NVSHMEM " + what + " failed (status " +
                           std::to_string(status) +
                           "; NVSHMEM_DEBUG=WARN prints NVSHMEM's own reason)");
}

// NVSHMEM's reading of a boolean variable: set and not starting with 0/n/N/f/F means true.
bool EnvFlag(const char* name, bool unset) {
  const char* text = std::getenv(name);
  if (text == nullptr) return unset;
  return text[0] == '\0' || std::strchr("0nNfF", text[0]) == nullptr;
}

HeapShape ReadHeapShape() {
  HeapShape shape;
  const char* kind = std::getenv("NVSHMEM_HEAP_KIND");
  shape.on_device = kind == nullptr || strncasecmp(kind, "SYSMEM", 100) != 0;
#if defined(__powerpc64__)
  const bool vmm_off_by_default = true;  // as NVSHMEM: no VMM heap on POWER
#else
  const bool vmm_off_by_default = false;
#endif
  shape.dynamic = !EnvFlag("NVSHMEM_DISABLE_CUDA_VMM", vmm_off_by_default);
  const char* step = std::getenv("NVSHMEM_CUMEM_GRANULARITY");
  uint64_t granularity = step == nullptr ? (512ull << 20) : ParseSize(step);
  if (granularity == 0) granularity = 512ull << 20;
  constexpr uint64_t kMaxStep = 2ull << 30;  // NVSHMEMI_MAX_HANDLE_LENGTH
  if (shape.dynamic) granularity = std::max(granularity, kGpuGranularity);
  shape.granularity = std::min(granularity, kMaxStep);
  return shape;
}

}  // namespace

HeapShape CurrentHeapShape() { return g_shape_known ? g_shape : ReadHeapShape(); }

uint64_t StaticHeapBytes(uint64_t heap_bytes) {
  const char* text = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  return text == nullptr || *text == '\0' ? heap_bytes : ParseSize(text);
}

uint64_t ParseSize(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !std::isfinite(value) || value < 0) return 0;
  double scale = 1;
  switch (*end) {
    case '\0':
      break;
    case 'k': case 'K':
      scale = 0x1p10;
      break;
    case 'm': case 'M':
      scale = 0x1p20;
      break;
    case 'g': case 'G':
      scale = 0x1p30;
      break;
    case 't': case 'T':
      scale = 0x1p40;
      break;
    default:
      return 0;
  }
  const double bytes = std::ceil(value * scale);
  return bytes < 0x1p64 ? static_cast<uint64_t>(bytes) : 0;
}

uint64_t HeapBytes() { return g_heap_bytes; }

size_t UniqueIdBytes() { return sizeof(nvshmemx_uniqueid_t); }

std::vector<uint8_t> NewUniqueId() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (const int status = nvshmemx_get_uniqueid(&id); status != 0) Fail("get_uniqueid", status);
  std::vector<uint8_t> bytes(sizeof(id));
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

Status Query() {
  Status status{false, -1, 0};
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    status.initialized = true;
    status.my_pe = nvshmem_my_pe();
    status.n_pes = nvshmem_n_pes();
  }
  return status;
}

void Init(const std::vector<uint8_t>& unique_id, int pe, int num_pes, uint64_t heap_bytes) {
  const Status before = Query();
  if (before.initialized) {  // XLA's NVSHMEM (or an earlier Init): one library, one job
    if (before.my_pe != pe || before.n_pes != num_pes) {
      throw std::runtime_error("jax_ep: NVSHMEM is already initialised in this process as PE " +
                               std::to_string(before.my_pe) + " of " +
                               std::to_string(before.n_pes) + ", but this is JAX process " +
                               std::to_string(pe) + " of " + std::to_string(num_pes));
    }
    g_heap_bytes = ConfiguredHeapBytes();
    if (!g_shape_known) g_shape = ReadHeapShape();
    g_shape_known = true;
    if (!g_registered) {  // our kernels need their device state filled in by this NVSHMEM too
      if (const int status = InitThread(0, nullptr); status != 0) {
        Fail("registration of jax_ep's device state (nvshmemi_init_thread on the running "
             "NVSHMEM)", status);
      }
      g_registered = true;
    }
    return;
  }
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    throw std::invalid_argument("jax_ep: unique_id has " + std::to_string(unique_id.size()) +
                                " bytes, NVSHMEM's has " +
                                std::to_string(sizeof(nvshmemx_uniqueid_t)));
  }
  // NVSHMEM reads its heap size from the environment; a value the user set wins.
  const std::string heap = std::to_string(heap_bytes);
  setenv("NVSHMEM_SYMMETRIC_SIZE", heap.c_str(), /*overwrite=*/0);
  g_heap_bytes = ConfiguredHeapBytes();
  g_shape = ReadHeapShape();  // what NVSHMEM reads now
  g_shape_known = true;

  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (const int status = nvshmemx_set_attr_uniqueid_args(pe, num_pes, &id, &attr); status != 0) {
    Fail("set_attr_uniqueid_args", status);
  }
  nvshmemx_init_init_attr_ver_only(attr);  // as nvshmemx_init_attr does
  const int status = InitThread(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (status != 0) {
    // The usual reason beside XLA's preallocation: the GPU cannot hold the heap.
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();  // no diagnosis then: NVSHMEM's status below is the error
    } else if (free_bytes < g_heap_bytes) {
      throw DeviceMemoryError(DeviceMemoryMessage(MeasureDeviceMemory(
          "NVSHMEM symmetric heap", MemoryKind::kHeapReservation, g_heap_bytes, 0,
          "NVSHMEM init failed with status " + std::to_string(status) +
              "; NVSHMEM_DEBUG=WARN prints NVSHMEM's own reason")));
    }
    Fail("init (unique-id bootstrap of " + std::to_string(num_pes) + " PEs)", status);
  }
  g_owned = true;
  g_registered = true;
  const Status after = Query();
  if (!after.initialized || after.my_pe != pe || after.n_pes != num_pes) {
    throw std::runtime_error("jax_ep: NVSHMEM initialised as PE " + std::to_string(after.my_pe) +
                             " of " + std::to_string(after.n_pes) + ", expected " +
                             std::to_string(pe) + " of " + std::to_string(num_pes));
  }
}

bool OwnedByJaxEp() { return g_owned; }

void* Allocate(const std::string& what, uint64_t bytes, uint64_t held_bytes) {
  void* pointer = nvshmem_malloc(bytes);
  if (pointer == nullptr) {
    DeviceMemoryReport report = MeasureDeviceMemory(what, MemoryKind::kSymmetricHeap, bytes,
                                                    held_bytes, "nvshmem_malloc returned NULL");
    report.heap_bytes = g_heap_bytes;
    throw DeviceMemoryError(DeviceMemoryMessage(report));
  }
  return pointer;
}

void Free(void* pointer) { nvshmem_free(pointer); }

void* PeerAddress(const void* pointer, int pe) { return nvshmem_ptr(pointer, pe); }

void BarrierAll() { nvshmem_barrier_all(); }

void Finalize() {
  if (!g_registered) return;
  // Unregisters our device state; ends the job (collectively) when nobody else holds NVSHMEM,
  // i.e. when jax_ep initialised it.
  nvshmemi_finalize();
  g_registered = false;
  g_owned = false;
}

}  // namespace jax_ep::symmetric_heap
