// Runs the put transport of the rank-major ops (cuda/remote_rank_major.cu: dispatch_rank_major,
// combine_rank_major, broadcast_rank_major over NVSHMEM puts + signals) on the CPU emulation
// (emu_cuda.h + include/nvshmem*.h): one process per PE, device memory shared between them. No PE
// has a load/store address of another (every peer entry of the tables is null, as for a peer on
// another node): whatever crosses goes through the NVSHMEM shim's puts. Inputs and outputs are raw
// files in <dir> (written / read by put_run.py, which compares with jax_ep.reference).
//
//   put_driver <dir> R T H K E x_kind row_kind y_kind blocks reps [missing]
//
// Each rep runs dispatch_rank_major, then combine_rank_major of yr and broadcast_rank_major of g
// through its handle (consecutive calls on the same buffers). With `missing`, the last rank runs no
// call: every other rank must time out in dispatch_rank_major naming it (the driver prints the
// fault records and their messages).
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/remote_rank_major.h"
#include "tools/kernel_emulator/include/nvshmem.h"
#include "xla_ffi/fault_message.h"

using namespace jax_ep;

namespace {

std::string dir;

std::vector<char> read_file(const std::string& name, size_t bytes) {
  std::vector<char> data(bytes + 16);
  FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
  if (f == nullptr || std::fread(data.data(), 1, bytes, f) != bytes) {
    std::fprintf(stderr, "missing or short %s\n", name.c_str());
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

int kind_bytes(int kind) { return kind == kRowF32 ? 4 : kind == kRowBF16 ? 2 : 1; }

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %d\n", what, status);
    std::exit(3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 12 && argc != 13) {
    std::fprintf(stderr, "usage: put_driver dir R T H K E x_kind row_kind y_kind blocks reps "
                         "[missing]\n");
    return 1;
  }
  dir = argv[1];
  const int R = std::atoi(argv[2]), T = std::atoi(argv[3]), H = std::atoi(argv[4]),
            K = std::atoi(argv[5]), E = std::atoi(argv[6]), x_kind = std::atoi(argv[7]),
            row_kind = std::atoi(argv[8]), y_kind = std::atoi(argv[9]),
            blocks = std::atoi(argv[10]), reps = std::atoi(argv[11]);
  const bool missing = argc == 13 && std::string(argv[12]) == "missing";
  const bool fp8 = row_kind == kRowFP8;
  const int num_scales = fp8 ? H / 128 : 0;
  const PutLayout dispatch_layout =
      make_put_layout(R, T, K, dispatch_row_bytes(H, row_kind), num_scales * 4, true);
  const PutLayout rows_layout =
      make_put_layout(R, T, 0, static_cast<uint64_t>(H) * kind_bytes(y_kind), 0, false);
  const uint64_t buffer_bytes =
      align_up_u64(std::max(dispatch_layout.total, rows_layout.total), 4096);

  const size_t state_bytes = align_up_u64(sizeof(DeviceState), 4096);
  const size_t total = R * (state_bytes + buffer_bytes) + 4096;
  char* shared = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) return 4;
  std::memset(shared, 0, total);
  FaultRecord* faults = reinterpret_cast<FaultRecord*>(shared + total - 4096);
  emu_nvshmem::n_pes = R;
  for (int r = 0; r < R; ++r) {
    DeviceState* state = reinterpret_cast<DeviceState*>(shared + r * state_bytes);
    uint8_t* buffer = reinterpret_cast<uint8_t*>(shared + R * state_bytes + r * buffer_bytes);
    std::memset(buffer, 0x5A, buffer_bytes);  // garbage, like reused device memory
    emu_nvshmem::register_object(0, r, buffer, buffer_bytes);
    emu_nvshmem::register_object(1, r, state, sizeof(DeviceState));
    DeviceTables& t = state->tables;
    // only this PE itself has a load/store address: every peer is "on another node"
    t.comm_buffers[r] = buffer;
    t.peer_states[r] = state;
    t.symmetric_buffer = buffer;
    t.comm_bytes = buffer_bytes;
    t.timeout_ns = (missing ? 3ull : 300ull) * 1000000000ull;
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
    emu_nvshmem::my_pe = rank;
    emu_nvshmem::load_store[rank] = true;
    if (missing && rank == R - 1) _exit(0);  // never issues the call
    DeviceState* state = reinterpret_cast<DeviceState*>(shared + rank * state_bytes);
    const std::string s = std::to_string(rank);
    const int32_t rank_value = rank, group_value = 0;
    const size_t RT = size_t(R) * T;
    // the missing case reads no files: zero inputs (the call must time out before using them)
    auto input = [&](const std::string& name, size_t bytes) {
      return missing ? std::vector<char>(bytes + 16, 0) : read_file(name + s + ".bin", bytes);
    };
    auto x = input("x", size_t(T) * H * kind_bytes(x_kind));
    auto idx = input("idx", size_t(T) * K * 4);
    auto w = input("w", size_t(T) * K * 4);
    auto g = input("g", size_t(T) * H * kind_bytes(y_kind));
    auto yr = input("yr", RT * H * kind_bytes(y_kind));
    PutLaunch p{};
    p.state = state;
    p.rank = &rank_value;
    p.group = &group_value;
    p.num_ranks = R;
    p.num_tokens = T;
    p.num_topk = K;
    p.num_experts = E;
    p.hidden = H;
    p.axis_slot = 2;
    p.num_blocks = blocks;
    p.x_kind = x_kind;
    p.row_kind = row_kind;
    p.layout = dispatch_layout;
    for (int rep = 0; rep < reps; ++rep) {
      const std::string tag = s + "_" + std::to_string(rep);
      auto rm_rows = poisoned(RT * H * kind_bytes(row_kind));
      auto rm_scales = poisoned(RT * std::max(num_scales, 1) * 4);
      auto rm_ids = poisoned(RT * K * 4);
      auto rm_w = poisoned(RT * K * 4);
      auto rm_per_rank = poisoned(size_t(R) * 4);
      auto rm_per_expert = poisoned(size_t(E / R) * 4);
      auto rm_src = poisoned(RT * 4);
      auto rm_in_rank = poisoned(size_t(T) * R);
      check(launch_put_dispatch_rank_major(
                p, x.data(), reinterpret_cast<const int32_t*>(idx.data()),
                reinterpret_cast<const float*>(w.data()), rm_rows.data(),
                fp8 ? reinterpret_cast<float*>(rm_scales.data()) : nullptr,
                reinterpret_cast<int32_t*>(rm_ids.data()), reinterpret_cast<float*>(rm_w.data()),
                reinterpret_cast<int32_t*>(rm_per_rank.data()),
                reinterpret_cast<int32_t*>(rm_per_expert.data()),
                reinterpret_cast<int32_t*>(rm_src.data()),
                reinterpret_cast<bool*>(rm_in_rank.data()), nullptr),
            "put dispatch_rank_major");
      write_file("rm_rows" + tag + ".bin", rm_rows.data(), RT * H * kind_bytes(row_kind));
      if (fp8) write_file("rm_scales" + tag + ".bin", rm_scales.data(), RT * num_scales * 4);
      write_file("rm_ids" + tag + ".bin", rm_ids.data(), RT * K * 4);
      write_file("rm_w" + tag + ".bin", rm_w.data(), RT * K * 4);
      write_file("rm_per_rank" + tag + ".bin", rm_per_rank.data(), size_t(R) * 4);
      write_file("rm_per_expert" + tag + ".bin", rm_per_expert.data(), size_t(E / R) * 4);
      write_file("rm_src" + tag + ".bin", rm_src.data(), RT * 4);
      write_file("rm_in_rank" + tag + ".bin", rm_in_rank.data(), size_t(T) * R);

      PutLaunch q = p;
      q.layout = rows_layout;
      q.row_kind = y_kind;
      q.num_topk = 1;
      q.num_experts = 0;
      const size_t out_bytes = size_t(T) * H * kind_bytes(y_kind);
      auto rm_comb = poisoned(out_bytes);
      check(launch_put_combine_rank_major(q, yr.data(),
                                          reinterpret_cast<const int32_t*>(rm_src.data()),
                                          reinterpret_cast<const bool*>(rm_in_rank.data()),
                                          rm_comb.data(), nullptr),
            "put combine_rank_major");
      write_file("rm_comb" + tag + ".bin", rm_comb.data(), out_bytes);
      auto rm_bcast = poisoned(RT * H * kind_bytes(y_kind));
      check(launch_put_broadcast_rank_major(q, g.data(),
                                            reinterpret_cast<const int32_t*>(rm_src.data()),
                                            reinterpret_cast<const bool*>(rm_in_rank.data()),
                                            rm_bcast.data(), nullptr),
            "put broadcast_rank_major");
      write_file("rm_bcast" + tag + ".bin", rm_bcast.data(), RT * H * kind_bytes(y_kind));
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
      std::printf("fault on rank %d: kind %d op %d waited %d field %d expected %llu observed "
                  "%llu\n",
                  r, faults[r].kind, faults[r].op_id, faults[r].waited_rank, faults[r].field,
                  static_cast<unsigned long long>(faults[r].expected),
                  static_cast<unsigned long long>(faults[r].observed));
      std::printf("message of rank %d: %s\n", r, FaultMessage(faults[r], true).c_str());
      failed = 1;
    }
  }
  return failed;
}
