#include "xla_ffi/device_memory.h"

#include <cuda_runtime_api.h>

#include <algorithm>
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

// The largest fraction, in hundredths, that would leave `needed` bytes free on a GPU of `total`
// bytes that has `free_bytes` free now (one hundredth of the GPU to spare), or -1 when lowering the
// fraction cannot make room.
int SuggestedPercent(const XlaMemory& xla, uint64_t needed, uint64_t free_bytes, uint64_t total) {
  if (total == 0) return -1;
  const double shortfall = needed > free_bytes ? static_cast<double>(needed - free_bytes) : 0.0;
  const double share = 100.0 * shortfall / static_cast<double>(total);
  const int percent = static_cast<int>(std::floor(100.0 * xla.fraction - share)) - 1;
  return percent >= 1 ? percent : -1;
}

int SuggestedPercent(const DeviceMemoryReport& report, const XlaMemory& xla) {
  if (report.kind == MemoryKind::kHeapGrowth) {  // room on every process that lacks it
    int lowest = -1;
    for (const ProcessRoom& p : report.processes) {
      const int percent =
          SuggestedPercent(xla, p.heap_bytes + p.margin_bytes, p.free_bytes, p.total_bytes);
      if (percent < 0) return -1;
      lowest = lowest < 0 ? percent : std::min(lowest, percent);
    }
    return lowest;
  }
  if (!report.memory_known) return -1;
  return SuggestedPercent(xla, report.bytes_needed, report.free_bytes, report.total_bytes);
}

// kHeapGrowth: the first paragraph: the buffer, every process that lacks room with its numbers,
// how the heap takes memory.
std::string HeapGrowthFacts(const DeviceMemoryReport& report, const std::string& heap_setting) {
  std::string m = "jax_ep: the " + report.buffer +
                  " does not fit in the memory of every GPU of the process group: it needs " +
                  FormatBytes(report.bytes_needed);
  if (report.held_bytes > 0) {
    m += ", beside the " + FormatBytes(report.held_bytes) +
         " of jax_ep's current buffer (freed once the new one is in place)";
  }
  const size_t short_count = report.processes.size();
  const size_t group = std::max<size_t>(report.group_size, short_count);
  m += ". It lives on the NVSHMEM symmetric heap (process model 2: one process per GPU), and " +
       std::to_string(short_count) + " of " + std::to_string(group) +
       (group == 1 ? " process" : " processes") + (short_count == 1 ? " lacks" : " lack") +
       " room:";
  for (const ProcessRoom& p : report.processes) {
    m += "\n  * process " + std::to_string(p.process) + " (GPU " +
         std::to_string(p.device_ordinal) + "): " +
         (report.heap_starting ? "NVSHMEM would take " : "the heap would grow by ") +
         FormatBytes(p.heap_bytes) + ", and jax_ep keeps " + FormatBytes(p.margin_bytes) +
         " free beside it; the GPU has " + FormatBytes(p.free_bytes) + " free of " +
         FormatBytes(p.total_bytes) + ".";
  }
  m += "\nEvery process checked its GPU before NVSHMEM was asked for the memory and every process "
       "raises this error; nothing was allocated (NVSHMEM 3.4.5 does not return NULL when its heap "
       "cannot grow: the job dies).";
  if (report.heap_dynamic) {
    m += "\nThe heap is CUDA VMM memory that NVSHMEM maps on demand, in steps of "
         "NVSHMEM_CUMEM_GRANULARITY (" + FormatBytes(report.heap_granularity) + "): an allocation "
         "that does not fit in "
         "the heap grows it by its size rounded up to a whole step (jax_ep assumes no free space "
         "left inside the heap); NVSHMEM_SYMMETRIC_SIZE does not limit it.";
    if (report.heap_starting) {
      m += " NVSHMEM starts in this step: its own allocations (team pSync pools, about 4 MiB for "
           "each of its 32 teams) and jax_ep's device state take the first steps.";
    }
  } else {
    m += "\nNVSHMEM allocates its whole heap when it starts (NVSHMEM_DISABLE_CUDA_VMM is set: no "
         "CUDA VMM heap): " + heap_setting + ", plus NVSHMEM's own allocations.";
  }
  return m;
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

  const std::string nvshmem_size = EnvOf(report, "NVSHMEM_SYMMETRIC_SIZE");
  const std::string heap_setting =
      "NVSHMEM_SYMMETRIC_SIZE=" + (nvshmem_size.empty() ? std::string("unset") : nvshmem_size) +
      " (jax_ep sets max(1 GiB, 2 x buffer + 64 MiB) when it is unset)";
  std::string m;
  if (report.kind == MemoryKind::kHeapGrowth) {
    m = HeapGrowthFacts(report, heap_setting);
  } else {
    // What failed, with the numbers.
    m = "jax_ep: the " + report.buffer + " does not fit in the memory of GPU " +
        std::to_string(report.device_ordinal) + ": it needs " + FormatBytes(report.bytes_needed);
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
  }
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
  bool larger_than_gpu = report.memory_known && report.bytes_needed > report.total_bytes;
  uint64_t advice_total = report.total_bytes;  // the GPU a lower fraction is computed for
  if (report.kind == MemoryKind::kHeapGrowth) {
    larger_than_gpu = false;
    advice_total = 0;
    for (const ProcessRoom& p : report.processes) {
      larger_than_gpu = larger_than_gpu || p.heap_bytes > p.total_bytes;
      advice_total = advice_total == 0 ? p.total_bytes : std::min(advice_total, p.total_bytes);
    }
  }
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
        const double freed = (xla.fraction - percent / 100.0) * static_cast<double>(advice_total);
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
    } else if (report.kind == MemoryKind::kHeapReservation ||
               (report.kind == MemoryKind::kHeapGrowth && !report.heap_dynamic)) {
      m += "\n  * set a smaller NVSHMEM_SYMMETRIC_SIZE on every process (at least the largest "
           "communication buffer + 64 MiB);";
    } else if (report.kind == MemoryKind::kHeapGrowth &&
               report.heap_granularity > kGpuGranularity) {
      // A finer step alone makes room when the rounding is what is short on every process.
      bool finer_fits = true;
      HeapShape finer;
      finer.granularity = kGpuGranularity;
      for (const ProcessRoom& p : report.processes) {
        const uint64_t grows = HeapDeviceBytes(finer, report.heap_starting, 0, report.bytes_needed);
        finer_fits = finer_fits && grows + p.margin_bytes <= p.free_bytes;
      }
      if (finer_fits) {
        m += "\n  * set NVSHMEM_CUMEM_GRANULARITY=2m" + every + " before NVSHMEM starts (jax_ep "
             "starts it at the first EP op" + (report.heap_starting ? "" : ": restart the job") +
             "): the heap then grows by what the buffer needs, not by whole steps of " +
             FormatBytes(report.heap_granularity) + ";";
      }
    }
  }
  m += "\n  * make the buffer smaller: it grows with EPConfig.max_tokens_per_rank x hidden x the EP "
       "size (jax_ep.cuda_backend.comm_bytes(cfg, ep_size) is a config's need, ll_comm_bytes "
       "for the low-latency ops); lower "
       "max_tokens_per_rank, e.g. by splitting the batch.";
  return m;
}

uint64_t HeapDeviceBytes(const HeapShape& shape, bool starting, uint64_t static_heap_bytes,
                         uint64_t allocation_bytes) {
  if (!shape.on_device) return 0;
  const uint64_t step = std::max<uint64_t>(shape.granularity, 1);
  const auto round_up = [step](uint64_t bytes) { return (bytes + step - 1) / step * step; };
  if (!shape.dynamic) {  // one cudaMalloc of the whole heap at start; nvshmem_malloc takes nothing
    return starting ? round_up(static_heap_bytes + kStartupHeapBytes) : 0;
  }
  if (!starting) return allocation_bytes > 0 ? round_up(allocation_bytes) : 0;
  // NVSHMEM's own allocations take the first steps; the buffer goes into what they leave, or
  // grows the heap by its own size rounded up to whole steps (the new step joins the free tail).
  const uint64_t first = round_up(kStartupHeapBytes);
  const bool fits_first = allocation_bytes <= first - kStartupHeapBytes;
  return first + (fits_first ? 0 : round_up(allocation_bytes));
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
