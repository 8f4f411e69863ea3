#include "xla_ffi/device_memory.h"

#include <cuda_runtime_api.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cuda/cuda_check.h"

namespace jax_ep {

const char* const kMemoryEnvVars[5] = {"XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                       "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR",
                                       "NVSHMEM_SYMMETRIC_SIZE"};

namespace {

constexpr double kDefaultMemFraction = 0.75;  // XLA's default when no fraction is set
constexpr uint64_t kHeapSlack = 64ull << 20;  // what jax_ep adds to a heap beyond its buffers

std::string EnvOf(const DeviceMemoryReport& report, const std::string& name) {
  const auto found = report.env.find(name);
  return found == report.env.end() ? std::string() : found->second;
}

// How XLA uses this GPU's memory, as jaxlib reads its environment (xla_client.py:
// generate_pjrt_gpu_plugin_options): XLA_CLIENT_MEM_FRACTION, or the older name
// XLA_PYTHON_CLIENT_MEM_FRACTION; preallocation unless XLA_PYTHON_CLIENT_PREALLOCATE is
// false/False/0 or the allocator does not pool.
struct XlaMemory {
  std::string variable;  // the fraction's variable to advise: the one in use
  std::string value;     // as set, or the default
  bool fraction_set = false;
  double fraction = kDefaultMemFraction;
  bool preallocates = true;
  std::string why_not;  // the setting that turns preallocation off
};

XlaMemory ReadXlaMemory(const DeviceMemoryReport& report) {
  XlaMemory xla;
  xla.variable = "XLA_PYTHON_CLIENT_MEM_FRACTION";
  std::string text = EnvOf(report, "XLA_CLIENT_MEM_FRACTION");
  if (!text.empty()) {
    xla.variable = "XLA_CLIENT_MEM_FRACTION";
  } else {
    text = EnvOf(report, "XLA_PYTHON_CLIENT_MEM_FRACTION");
  }
  char value[32];
  std::snprintf(value, sizeof(value), "%.2f", kDefaultMemFraction);
  xla.value = value;
  if (!text.empty()) {
    char* end = nullptr;
    const double fraction = std::strtod(text.c_str(), &end);
    if (end != text.c_str() && *end == '\0' && std::isfinite(fraction) && fraction > 0) {
      xla.fraction = fraction;
      xla.fraction_set = true;
      xla.value = text;
    }
  }
  const std::string preallocate = EnvOf(report, "XLA_PYTHON_CLIENT_PREALLOCATE");
  std::string allocator = EnvOf(report, "XLA_PYTHON_CLIENT_ALLOCATOR");
  for (char& c : allocator) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (preallocate == "false" || preallocate == "False" || preallocate == "0") {
    xla.preallocates = false;
    xla.why_not = "XLA_PYTHON_CLIENT_PREALLOCATE=" + preallocate;
  } else if (allocator == "platform" || allocator == "cuda_async") {
    xla.preallocates = false;
    xla.why_not = "XLA_PYTHON_CLIENT_ALLOCATOR=" + allocator;
  }
  return xla;
}

// The largest fraction, in hundredths, that would leave room for the allocation (one hundredth
// of the GPU to spare), or -1 when lowering the fraction cannot make room.
int SuggestedPercent(const DeviceMemoryReport& report, const XlaMemory& xla) {
  if (!report.memory_known || report.total_bytes == 0) return -1;
  const double total = static_cast<double>(report.total_bytes);
  const double shortfall = report.bytes_needed > report.free_bytes
                               ? static_cast<double>(report.bytes_needed - report.free_bytes)
                               : 0.0;
  const int percent = static_cast<int>(std::floor(100.0 * xla.fraction - 100.0 * shortfall / total)) - 1;
  return percent >= 1 ? percent : -1;
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[96];
  std::snprintf(text, sizeof(text), "%.2f %s (%llu bytes)", value, kUnits[unit],
                static_cast<unsigned long long>(bytes));
  return text;
}

std::string DeviceMemoryMessage(const DeviceMemoryReport& report) {
  const XlaMemory xla = ReadXlaMemory(report);
  const bool process_group = report.kind != MemoryKind::kCudaMalloc;
  const std::string every = process_group ? " on every process" : "";
  const std::string needed = std::to_string(report.bytes_needed);

  // What failed, with the numbers.
  std::string m = "jax_ep: the " + report.buffer + " does not fit in the memory of GPU " +
                  std::to_string(report.device_ordinal) + ": it needs " +
                  FormatBytes(report.bytes_needed);
  if (report.held_bytes > 0) {
    m += ", beside the " + FormatBytes(report.held_bytes) +
         " of jax_ep's current buffer there (freed once the new one is in place)";
  }
  if (report.memory_known) {
    m += "; the GPU has " + FormatBytes(report.free_bytes) + " free of " +
         FormatBytes(report.total_bytes);
  }
  if (!report.cause.empty()) m += " [" + report.cause + "]";
  m += ".";
  const std::string nvshmem_size = EnvOf(report, "NVSHMEM_SYMMETRIC_SIZE");
  const std::string heap_setting =
      "NVSHMEM_SYMMETRIC_SIZE=" + (nvshmem_size.empty() ? std::string("unset") : nvshmem_size) +
      " (jax_ep sets max(1 GiB, 2 x buffer + 64 MiB) when it is unset)";
  if (report.kind == MemoryKind::kSymmetricHeap) {
    m += "\nIt lives on the NVSHMEM symmetric heap (process model 2: one process per GPU)";
    if (report.heap_bytes > 0) m += " of " + FormatBytes(report.heap_bytes);
    m += ", " + heap_setting + "; nvshmem_malloc fails when the heap or the GPU runs out "
         "(NVSHMEM_DEBUG=WARN prints NVSHMEM's own reason).";
  } else if (report.kind == MemoryKind::kHeapReservation) {
    m += "\nNVSHMEM reserves its symmetric heap when it starts (process model 2: one process per "
         "GPU): " + heap_setting + ".";
  }

  // Why memory is short: XLA's preallocation.
  const std::string fraction =
      xla.variable + "=" + xla.value + (xla.fraction_set ? "" : ", the default");
  if (xla.preallocates) {
    m += "\nXLA preallocates " + xla.variable + " of every GPU's memory for JAX's arrays (" +
         fraction + ") when JAX first uses the GPU; jax_ep's buffers must fit in the rest.";
  } else {
    m += "\nXLA does not preallocate here (" + xla.why_not + "): JAX's arrays take memory as they "
         "are created, up to " + xla.variable + " of the GPU (" + fraction + "), and XLA keeps "
         "what it took.";
  }

  // What to do.
  const bool larger_than_gpu = report.memory_known && report.bytes_needed > report.total_bytes;
  if (larger_than_gpu) {
    m += "\nIt is larger than the whole GPU; only a smaller buffer helps:";
  } else {
    m += "\nTo make room, do one of these:";
    const std::string start_early =
        report.kind == MemoryKind::kHeapReservation
            ? std::string("start jax_ep (jax_ep.runtime.ensure_initialized(bytes))")
            : "call jax_ep.runtime.ensure_initialized(" + needed + ")";
    if (xla.preallocates) {
      const int percent = SuggestedPercent(report, xla);
      if (percent > 0) {
        char value[32];
        std::snprintf(value, sizeof(value), "%.2f", percent / 100.0);
        const double freed = (xla.fraction - percent / 100.0) * static_cast<double>(report.total_bytes);
        m += "\n  * set " + xla.variable + "=" + value + " (or lower)" + every +
             " before JAX starts: XLA then leaves about " +
             FormatBytes(static_cast<uint64_t>(freed)) + " more free;";
      }
      m += "\n  * set XLA_PYTHON_CLIENT_PREALLOCATE=false" + every + " and " + start_early +
           " before the program creates its large arrays;";
    } else {
      m += "\n  * " + start_early + every + " before the program creates its large arrays;";
    }
    if (report.held_bytes > 0) {
      m += "\n  * size the buffer once, before the first EP op: "
           "jax_ep.runtime.ensure_initialized(the largest jax_ep.cuda_backend.comm_bytes(cfg, "
           "ep_size) of your configs)" + every + ", so that no op grows it (growing holds the old "
           "and the new buffer at once);";
    }
    if (report.kind == MemoryKind::kSymmetricHeap) {
      m += "\n  * if the heap is the limit: set NVSHMEM_SYMMETRIC_SIZE to at least " +
           FormatBytes(report.held_bytes + report.bytes_needed + kHeapSlack) + every +
           ", or call jax_ep.runtime.ensure_initialized(the largest need) on every process "
           "before the first EP op (jax_ep then sizes the heap for it);";
    } else if (report.kind == MemoryKind::kHeapReservation) {
      m += "\n  * set a smaller NVSHMEM_SYMMETRIC_SIZE on every process (at least the largest "
           "communication buffer + 64 MiB);";
    }
  }
  m += "\n  * make the buffer smaller: it grows with EPConfig.max_tokens_per_rank x hidden x the EP "
       "size (jax_ep.cuda_backend.comm_bytes(cfg, ep_size) is a config's need); lower "
       "max_tokens_per_rank, e.g. by splitting the batch.";
  return m;
}

DeviceMemoryReport MeasureDeviceMemory(const std::string& buffer, MemoryKind kind,
                                       uint64_t bytes_needed, uint64_t held_bytes,
                                       const std::string& cause) {
  DeviceMemoryReport report;
  report.buffer = buffer;
  report.kind = kind;
  report.bytes_needed = bytes_needed;
  report.held_bytes = held_bytes;
  report.cause = cause;
  if (cudaGetDevice(&report.device_ordinal) != cudaSuccess) {
    cudaGetLastError();
    report.device_ordinal = -1;
  }
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (status == cudaSuccess) {
    report.memory_known = true;
    report.free_bytes = free_bytes;
    report.total_bytes = total_bytes;
  } else {  // reported in the message, not thrown: the allocation failure is the news
    cudaGetLastError();
    report.cause += std::string(report.cause.empty() ? "" : "; ") + "cudaMemGetInfo failed: " +
                    cudaGetErrorName(status);
  }
  for (const char* name : kMemoryEnvVars) {
    if (const char* value = std::getenv(name)) report.env[name] = value;
  }
  return report;
}

std::pair<uint64_t, uint64_t> DeviceMemoryInfo(int ordinal) {
  int current = 0;
  JAX_EP_CUDA_THROW(cudaGetDevice(&current));
  size_t free_bytes = 0, total_bytes = 0;
  JAX_EP_CUDA_THROW(cudaSetDevice(ordinal));
  const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
  JAX_EP_CUDA_THROW(cudaSetDevice(current));
  JAX_EP_CUDA_THROW(status);
  return {free_bytes, total_bytes};
}

void RequireFreeMemory(const std::string& buffer, uint64_t bytes, uint64_t held_bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  JAX_EP_CUDA_THROW(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes >= bytes) return;
  throw DeviceMemoryError(DeviceMemoryMessage(
      MeasureDeviceMemory(buffer, MemoryKind::kCudaMalloc, bytes, held_bytes, "")));
}

void* DeviceMalloc(const std::string& buffer, uint64_t bytes, uint64_t held_bytes) {
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it, the context stays usable
    throw DeviceMemoryError(DeviceMemoryMessage(MeasureDeviceMemory(
        buffer, MemoryKind::kCudaMalloc, bytes, held_bytes,
        "cudaMalloc: " + std::string(cudaGetErrorName(status)))));
  }
  if (status != cudaSuccess) {
    throw std::runtime_error("jax_ep: " + cuda_error_message(status, "cudaMalloc", __FILE__, __LINE__));
  }
  return pointer;
}

}  // namespace jax_ep
