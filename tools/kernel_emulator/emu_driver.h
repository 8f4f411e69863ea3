// What the emulator drivers (driver.cc, ll_driver.cc, put_driver.cc) share: the raw input / output
// files their run script writes and reads, poisoned outputs, checked launches, the ranks' "device
// memory" (a DeviceState and a communication buffer each, shared by the rank processes at the same
// address), one process per rank, and the fault records printed for the script to parse.
#pragma once

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "xla_ffi/fault_message.h"

namespace emu_driver {

using jax_ep::DeviceState;
using jax_ep::FaultRecord;

inline std::string dir;  // where the run script put the inputs and reads the outputs

// `bytes` of <dir>/<name> (16 spare bytes after them: kernels may read a vector past a short row).
inline std::vector<char> read_file(const std::string& name, size_t bytes) {
  std::vector<char> data(bytes + 16);
  FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
  const bool ok = f != nullptr && std::fread(data.data(), 1, bytes, f) == bytes;
  if (f != nullptr) std::fclose(f);
  if (!ok) {
    std::fprintf(stderr, "missing or short %s\n", name.c_str());
    std::exit(2);
  }
  return data;
}

inline void write_file(const std::string& name, const void* data, size_t bytes) {
  FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
  if (f == nullptr || std::fwrite(data, 1, bytes, f) != bytes) {
    std::fprintf(stderr, "cannot write %s\n", name.c_str());
    std::exit(2);
  }
  std::fclose(f);
}

// An output buffer full of a byte pattern no kernel writes, so an unwritten element shows.
inline std::vector<char> poisoned(size_t bytes) { return std::vector<char>(bytes + 16, char(0xA5)); }

inline int kind_bytes(int kind) {
  return kind == jax_ep::kRowF32 ? 4 : kind == jax_ep::kRowBF16 ? 2 : 1;
}

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %d\n", what, status);
    std::exit(3);
  }
}

// The outputs of one rank's dispatch_rank_major (R ranks, T tokens, H, K, E, its row kind) and of
// the combine_rank_major / broadcast_rank_major (y_kind rows) through its handle, poisoned. The
// NVLink kernels (driver.cc) and the put transport (put_driver.cc) write the same ones.
struct RankMajorOutputs {
  RankMajorOutputs(int R, int T, int H, int K, int E, int row_kind, int y_kind)
      : RT(size_t(R) * T),
        num_scales(row_kind == jax_ep::kRowFP8 ? H / 128 : 0),
        rows(poisoned(RT * H * kind_bytes(row_kind))),
        scales(poisoned(RT * (num_scales > 0 ? num_scales : 1) * 4)),
        ids(poisoned(RT * K * 4)),
        w(poisoned(RT * K * 4)),
        per_rank(poisoned(size_t(R) * 4)),
        per_expert(poisoned(size_t(E / R) * 4)),
        src(poisoned(RT * 4)),
        in_rank(poisoned(size_t(T) * R)),
        comb(poisoned(size_t(T) * H * kind_bytes(y_kind))),
        bcast(poisoned(RT * H * kind_bytes(y_kind))) {}

  size_t RT;
  int num_scales;  // per row (0 unless FP8)
  std::vector<char> rows, scales, ids, w, per_rank, per_expert, src, in_rank, comb, bcast;

  float* scales_or_null() {
    return num_scales > 0 ? reinterpret_cast<float*>(scales.data()) : nullptr;
  }
  static int32_t* i32(std::vector<char>& v) { return reinterpret_cast<int32_t*>(v.data()); }
  static float* f32(std::vector<char>& v) { return reinterpret_cast<float*>(v.data()); }
  bool* in_rank_data() { return reinterpret_cast<bool*>(in_rank.data()); }

  // dispatch_rank_major over the put transport (launch_put_dispatch_rank_major, declared in
  // cuda/remote_rank_major.h, which the caller includes) of the raw inputs x, topk_idx and
  // topk_weights into these outputs; exits on an error. A template on the launch type so that the
  // call binds where it is used (argument-dependent lookup): ll_driver.cc, which includes this
  // header but does not link cuda/remote_rank_major.cu, never references it.
  template <class PutLaunch>
  void put_dispatch(const PutLaunch& p, const std::vector<char>& x,
                    const std::vector<char>& topk_idx, const std::vector<char>& topk_weights) {
    check(launch_put_dispatch_rank_major(
              p, x.data(), reinterpret_cast<const int32_t*>(topk_idx.data()),
              reinterpret_cast<const float*>(topk_weights.data()), rows.data(), scales_or_null(),
              i32(ids), f32(w), i32(per_rank), i32(per_expert), i32(src), in_rank_data(), nullptr),
          "put dispatch_rank_major");
  }

  // As the run scripts read them: rm_<name><tag>.bin (without the poison's 16 spare bytes).
  void write(const std::string& tag) const {
    const auto out = [&](const char* name, const std::vector<char>& data) {
      write_file(name + tag + ".bin", data.data(), data.size() - 16);
    };
    out("rm_rows", rows);
    if (num_scales > 0) out("rm_scales", scales);
    out("rm_ids", ids);
    out("rm_w", w);
    out("rm_per_rank", per_rank);
    out("rm_per_expert", per_expert);
    out("rm_src", src);
    out("rm_in_rank", in_rank);
    out("rm_comb", comb);
    out("rm_bcast", bcast);
  }
};

// Every rank's DeviceState and communication buffer in one shared mapping (inherited by the rank
// processes at the same address), the fault records after them.
struct Devices {
  std::vector<DeviceState*> states;
  std::vector<uint8_t*> buffers;
  FaultRecord* faults;
  uint64_t buffer_bytes;
};

// The bound of every spin-wait: JAX_EP_EMU_TIMEOUT_S seconds (the shrink and dying-rank cases set
// it), else `fallback`.
inline double timeout_s(double fallback) {
  const char* v = std::getenv("JAX_EP_EMU_TIMEOUT_S");
  return v != nullptr && *v != '\0' ? std::atof(v) : fallback;
}

// JAX_EP_EMU_DIE = rank,launch,flags (the run scripts' dying-rank cases): in `rank`'s process,
// arms emu::die for its kernel launch number `launch` (0-based over the process), at its start
// (flags -1) or after `flags` flag stores into the communication buffers (`buffers`).
inline void arm_death(int rank, const std::vector<uint8_t*>& buffers, uint64_t buffer_bytes) {
  long die_rank = -1, launch = -1, flags = -1;
  const char* v = std::getenv("JAX_EP_EMU_DIE");
  if (v == nullptr || std::sscanf(v, "%ld,%ld,%ld", &die_rank, &launch, &flags) < 2 ||
      die_rank != rank) {
    return;
  }
  emu::die_launch = launch;
  emu::die_flags = flags;
  emu::die_lo = reinterpret_cast<const char*>(buffers.front());
  emu::die_hi = emu::die_lo + buffers.size() * buffer_bytes;
}

// R ranks with buffers of buffer_bytes (rounded up to 4 KiB) full of garbage, like reused device
// memory. peers: every rank has every peer's buffer and state (NVLink); otherwise only its own,
// as for peers on other nodes. Spin-waits time out after timeout_s seconds.
inline Devices make_devices(int R, uint64_t buffer_bytes, double timeout_s, bool peers) {
  Devices d;
  d.buffer_bytes = jax_ep::align_up_u64(buffer_bytes, 4096);
  const size_t state_bytes = jax_ep::align_up_u64(sizeof(DeviceState), 4096);
  const size_t total = R * (state_bytes + d.buffer_bytes) + 4096;
  char* shared = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) {
    std::perror("mmap of the emulated device memory");
    std::exit(4);
  }
  std::memset(shared, 0, total);
  d.faults = reinterpret_cast<FaultRecord*>(shared + total - 4096);
  for (int r = 0; r < R; ++r) {
    d.states.push_back(reinterpret_cast<DeviceState*>(shared + r * state_bytes));
    d.buffers.push_back(reinterpret_cast<uint8_t*>(shared + R * state_bytes + r * d.buffer_bytes));
    std::memset(d.buffers[r], 0x5A, d.buffer_bytes);
  }
  for (int r = 0; r < R; ++r) {
    jax_ep::DeviceTables& t = d.states[r]->tables;
    for (int p = 0; p < R; ++p) {
      if (!peers && p != r) continue;
      t.comm_buffers[p] = d.buffers[p];
      t.peer_states[p] = d.states[p];
    }
    t.comm_bytes = d.buffer_bytes;
    t.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
    t.fault_record = &d.faults[r];
    t.device_ordinal = r;
    t.slot = r;
  }
  return d;
}

// One process per rank runs body(rank) (it may _exit itself); 1 when any of them failed (a trap
// kills it), else 0.
template <class Body>
int run_ranks(int R, Body body) {
  std::vector<pid_t> children;
  for (int rank = 0; rank < R; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork of a rank process");
      std::exit(4);
    }
    if (pid == 0) {
      body(rank);
      std::fflush(stdout);
      _exit(0);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = 1;
    }
  }
  return failed;
}

// Prints every rank's fault record and its host message (xla_ffi/fault_message.cc) in the form the
// run scripts parse (harness.py FAULT_LINE); 1 when there was one.
inline int report_faults(const Devices& d, bool per_process) {
  int faulted = 0;
  for (int r = 0; r < static_cast<int>(d.states.size()); ++r) {
    const FaultRecord& f = d.faults[r];
    if (!f.valid) continue;
    std::printf("fault on rank %d: kind %d op %d waited %d what %d field %d expected %llu "
                "observed %llu\n",
                r, f.kind, f.op_id, f.waited_rank, f.waited_ordinal, f.field,
                static_cast<unsigned long long>(f.expected),
                static_cast<unsigned long long>(f.observed));
    std::printf("message of rank %d: %s\n", r, jax_ep::FaultMessage(f, per_process).c_str());
    faulted = 1;
  }
  return faulted;
}

}  // namespace emu_driver
