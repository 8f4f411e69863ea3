// Runs jax_ep's low-latency dispatch / combine kernels (cuda/low_latency.cu) on the CPU emulation
// (emu_cuda.h), one process per rank, device memory shared between them. Inputs and outputs are raw
// files in <dir>, written / read by ll_run.py, which compares them with jax_ep.reference.
//
//   ll_driver <dir> R T H K E x_kind row_kind reps
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/low_latency.h"

using namespace jax_ep;

namespace {

std::string dir;

std::vector<char> read_file(const std::string& name, size_t bytes) {
  std::vector<char> data(bytes + 16);
  FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
  if (f == nullptr || std::fread(data.data(), 1, bytes, f) != bytes) {
    std::fprintf(stderr, "cannot read %s\n", name.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return data;
}

void write_file(const std::string& name, const void* data, size_t bytes) {
  FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
  std::fwrite(data, 1, bytes, f);
  std::fclose(f);
}

std::vector<char> poisoned(size_t bytes) { return std::vector<char>(bytes + 16, char(0xA5)); }

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %d\n", what, status);
    std::exit(3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: ll_driver dir R T H K E x_kind row_kind reps\n");
    return 1;
  }
  dir = argv[1];
  const int R = std::atoi(argv[2]), T = std::atoi(argv[3]), H = std::atoi(argv[4]),
            K = std::atoi(argv[5]), E = std::atoi(argv[6]), x_kind = std::atoi(argv[7]),
            row_kind = std::atoi(argv[8]), reps = std::atoi(argv[9]);
  const bool fp8 = row_kind == kRowFP8;
  const int num_scales = fp8 ? H / 128 : 0;
  const int local = E / R;
  const int x_bytes = x_kind == kRowF32 ? 4 : 2;
  const int row_bytes = fp8 ? 1 : 2;
  const LLLayout dispatch_layout =
      make_ll_layout(R, T, K, E, H, uint64_t(H) * row_bytes, uint64_t(num_scales) * 4);
  const LLLayout combine_layout = make_ll_layout(R, T, K, E, H, uint64_t(H) * 2, 0);
  const uint64_t buffer_bytes =
      align_up_u64(std::max(dispatch_layout.base.total, combine_layout.base.total), 4096);

  const size_t state_bytes = align_up_u64(sizeof(DeviceState), 4096);
  const size_t total = R * (state_bytes + buffer_bytes) + 4096;
  char* shared = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) return 4;
  std::memset(shared, 0, total);
  FaultRecord* faults = reinterpret_cast<FaultRecord*>(shared + total - 4096);
  std::vector<DeviceState*> states(R);
  std::vector<uint8_t*> buffers(R);
  for (int r = 0; r < R; ++r) {
    states[r] = reinterpret_cast<DeviceState*>(shared + r * state_bytes);
    buffers[r] = reinterpret_cast<uint8_t*>(shared + R * state_bytes + r * buffer_bytes);
    std::memset(buffers[r], 0x5A, buffer_bytes);  // garbage, like reused device memory
  }
  for (int r = 0; r < R; ++r) {
    DeviceTables& t = states[r]->tables;
    for (int p = 0; p < R; ++p) {
      t.comm_buffers[p] = buffers[p];
      t.peer_states[p] = states[p];
    }
    t.comm_bytes = buffer_bytes;
    t.timeout_ns = 300ull * 1000000000ull;
    t.fault_record = &faults[r];
    t.device_ordinal = r;
    t.slot = r;
  }

  std::vector<pid_t> children;
  for (int rank = 0; rank < R; ++rank) {
    const pid_t pid = fork();
    if (pid != 0) {
      children.push_back(pid);
      continue;
    }
    const std::string s = std::to_string(rank);
    const int32_t rank_value = rank, group_value = 0;
    auto x = read_file("x" + s + ".bin", size_t(T) * H * x_bytes);
    auto idx = read_file("idx" + s + ".bin", size_t(T) * K * 4);
    auto w = read_file("w" + s + ".bin", size_t(T) * K * 4);
    auto y = read_file("y" + s + ".bin", size_t(local) * R * T * H * 2);
    for (int rep = 0; rep < reps; ++rep) {
      const std::string tag = s + "_" + std::to_string(rep);
      const size_t slots = size_t(local) * R * T;
      auto rows = poisoned(slots * H * row_bytes);
      auto scales = poisoned(slots * std::max(num_scales, 1) * 4);
      auto counts = poisoned(size_t(local) * R * 4);
      auto src = poisoned(slots * 4);
      LLDispatchLaunch d{};
      d.g.state = states[rank];
      d.g.layout = dispatch_layout.base;
      d.g.rank = &rank_value;
      d.g.group = &group_value;
      d.g.num_ranks = R;
      d.g.num_tokens = T;
      d.g.num_topk = K;
      d.g.axis_slot = 2;
      d.g.num_blocks = 8;
      d.g.send_warps = 1;
      d.L = dispatch_layout;
      d.x = x.data();
      d.topk_idx = reinterpret_cast<const int32_t*>(idx.data());
      d.rows = rows.data();
      d.scales = fp8 ? reinterpret_cast<float*>(scales.data()) : nullptr;
      d.counts = reinterpret_cast<int32_t*>(counts.data());
      d.src_slot = reinterpret_cast<int32_t*>(src.data());
      d.num_experts = E;
      d.hidden = H;
      d.x_kind = x_kind;
      d.row_kind = row_kind;
      check(launch_ll_dispatch(d, nullptr), "ll_dispatch");
      write_file("rows" + tag + ".bin", rows.data(), slots * H * row_bytes);
      if (fp8) write_file("scales" + tag + ".bin", scales.data(), slots * num_scales * 4);
      write_file("counts" + tag + ".bin", counts.data(), size_t(local) * R * 4);
      write_file("src" + tag + ".bin", src.data(), slots * 4);

      LLCombineLaunch c{};
      c.g = d.g;
      c.g.layout = combine_layout.base;
      c.L = combine_layout;
      c.y = y.data();
      c.src_slot = d.src_slot;
      c.topk_weights = reinterpret_cast<const float*>(w.data());
      auto out = poisoned(size_t(T) * H * 2);
      c.out = out.data();
      c.num_experts = E;
      c.hidden = H;
      check(launch_ll_combine(c, nullptr), "ll_combine");
      write_file("out" + tag + ".bin", out.data(), size_t(T) * H * 2);
    }
    std::fflush(stdout);
    _exit(0);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  for (int r = 0; r < R; ++r) {
    if (faults[r].valid) {
      std::printf("fault on rank %d: kind %d op %d waited %d\n", r, faults[r].kind,
                  faults[r].op_id, faults[r].waited_rank);
      failed = 1;
    }
  }
  return failed;
}
