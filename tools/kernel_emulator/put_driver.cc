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
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/remote_rank_major.h"
#include "tools/kernel_emulator/emu_driver.h"
#include "tools/kernel_emulator/include/nvshmem.h"

using namespace jax_ep;
using namespace emu_driver;

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
  // only a PE itself has a load/store address: every peer is "on another node"
  const Devices devices = make_devices(R, std::max(dispatch_layout.total, rows_layout.total),
                                       missing ? 3 : 300, /*peers=*/false);
  emu_nvshmem::n_pes = R;
  for (int r = 0; r < R; ++r) {  // the symmetric objects: each PE's buffer and DeviceState
    emu_nvshmem::register_object(0, r, devices.buffers[r], devices.buffer_bytes);
    emu_nvshmem::register_object(1, r, devices.states[r], sizeof(DeviceState));
    devices.states[r]->tables.symmetric_buffer = devices.buffers[r];
  }

  const int failed = run_ranks(R, [&](int rank) {
    emu_nvshmem::my_pe = rank;
    emu_nvshmem::load_store[rank] = true;
    if (missing && rank == R - 1) return;  // never issues the call
    DeviceState* state = devices.states[rank];
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
      RankMajorOutputs rm(R, T, H, K, E, row_kind, y_kind);
      rm.put_dispatch(p, x, idx, w);

      PutLaunch q = p;
      q.layout = rows_layout;
      q.row_kind = y_kind;
      q.num_topk = 1;
      q.num_experts = 0;
      check(launch_put_combine_rank_major(q, yr.data(), rm.i32(rm.src), rm.in_rank_data(),
                                          rm.comb.data(), nullptr),
            "put combine_rank_major");
      check(launch_put_broadcast_rank_major(q, g.data(), rm.i32(rm.src), rm.in_rank_data(),
                                            rm.bcast.data(), nullptr),
            "put broadcast_rank_major");
      rm.write(tag);
    }
  });
  return report_faults(devices, /*per_process=*/true) | failed;
}
