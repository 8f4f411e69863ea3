// Runs jax_ep's dispatch / combine / broadcast / combine_bwd / slot_values kernels and their
// rank-major forms (dispatch_rank_major, combine_rank_major, broadcast_rank_major) on the CPU
// emulation
// (emu_cuda.h): one process per rank, device memory shared between them. Inputs and outputs are
// raw little-endian files in <dir> (written/read by run.py, which compares with
// jax_ep.reference).
//
//   driver <dir> R T H K E C align x_kind row_kind y_kind num_blocks send_warps reps [mismatch]
//
// With `mismatch` (a FingerprintFieldName of cuda/fingerprint.h, or "behind"), no files are read:
// every rank runs ONE call, the last rank with one field changed (num_ranks + 1, hidden + 8,
// num_tokens + 1, num_topk - 1, num_experts + R, capacity + align, expert_alignment * 2, dtype:
// rows of float32 instead of bfloat16 from float32 x, op: combine instead of dispatch), or its
// call count in the group ahead (call_sequence: 5 calls, behind: 1 call); with `transport` every
// rank runs dispatch_rank_major, rank 0 over NVSHMEM puts (cuda/remote_rank_major.cu, through the
// shim include/nvshmem*.h: every buffer and DeviceState is a symmetric object), the others over
// loads / stores (process model 2, where each process picks its KernelConfig.transport). Every
// rank must fault (the kernels trap); the driver prints each fault record and its message
// (xla_ffi/fault_message.cc).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/broadcast.h"
#include "cuda/combine.h"
#include "cuda/dispatch.h"
#include "cuda/ep_layout.h"
#include "cuda/group.h"
#include "cuda/remote_rank_major.h"
#include "cuda/slot_values.h"
#include "tools/kernel_emulator/emu_driver.h"
#include "tools/kernel_emulator/include/nvshmem.h"
#include "tools/kernel_emulator/unread_dispatch.h"

using namespace jax_ep;
using namespace emu_driver;

namespace {

// One rank's sizes (the last rank's differ in a mismatch case).
struct Sizes {
  int R, T, H, K, E, C, align, x_kind, row_kind;
};

// The sizes the last rank runs with in mismatch case `field` (others: unchanged).
Sizes changed(Sizes s, const std::string& field) {
  if (field == "num_ranks") s.R += 1;  // it waits for a rank that is not there, then reports
  if (field == "hidden") s.H += 8;
  if (field == "num_tokens") s.T += 1;
  if (field == "num_topk") s.K -= 1;
  if (field == "num_experts") s.E += s.R;
  if (field == "capacity") s.C += s.align;
  if (field == "expert_alignment") s.align *= 2;
  if (field == "dtype") s.row_kind = kRowF32;
  return s;
}

CommLayout dispatch_layout_of(const Sizes& s) {
  const int num_scales = s.row_kind == kRowFP8 ? s.H / 128 : 0;
  return make_comm_layout(s.R, s.T, s.K, s.E, dispatch_row_bytes(s.H, s.row_kind), num_scales * 4);
}

// The put layout of dispatch_rank_major for the sizes (cuda/remote_rank_major.h).
PutLayout put_layout_of(const Sizes& s) {
  const int num_scales = s.row_kind == kRowFP8 ? s.H / 128 : 0;
  return make_put_layout(s.R, s.T, s.K, dispatch_row_bytes(s.H, s.row_kind), num_scales * 4, true);
}

// What the one call of a mismatch case is.
enum class MismatchCall { kDispatch, kCombine, kRankMajor, kRankMajorPut };

// The one call of a mismatch case on `rank` (inputs zero: the call must trap before using them).
void run_mismatch(DeviceState* state, int rank, const Sizes& s, MismatchCall call, int blocks,
                  int send_warps, uint64_t call_offset, bool pull) {
  const int R = s.R;
  const int32_t rank_value = rank, group_value = 0;
  const int axis_slot = 1;
  state->sync.group_epoch[axis_slot][0] += call_offset;  // calls this rank ran alone before
  if (call == MismatchCall::kRankMajorPut) {
    std::vector<char> x(size_t(s.T) * s.H * 4 + 16), idx(size_t(s.T) * s.K * 4 + 16),
        w(size_t(s.T) * s.K * 4 + 16);
    RankMajorOutputs rm(R, s.T, s.H, s.K, s.E, s.row_kind, kRowBF16);
    PutLaunch p{};
    p.state = state;
    p.layout = put_layout_of(s);
    p.rank = &rank_value;
    p.group = &group_value;
    p.num_ranks = R;
    p.num_tokens = s.T;
    p.num_topk = s.K;
    p.num_experts = s.E;
    p.hidden = s.H;
    p.axis_slot = axis_slot;
    p.num_blocks = blocks;
    p.x_kind = s.x_kind;
    p.row_kind = s.row_kind;
    rm.put_dispatch(p, x, idx, w);
    return;
  }
  if (call == MismatchCall::kCombine) {
    // sized for the call; it must trap before it reads or writes them
    std::vector<char> rows(size_t(s.C) * s.H * 4 + 16), row_weights(size_t(s.C) * 4 + 16),
        token_rows(size_t(R) * s.T * s.K * 4 + 16), in_rank(size_t(s.T) * R + 16),
        out(size_t(s.T) * s.H * 4 + 16);
    GroupLaunch g{};
    g.state = state;
    g.layout = make_comm_layout(R, s.T, s.K, 0, static_cast<uint64_t>(s.H) * 2, 0);
    g.rank = &rank_value;
    g.group = &group_value;
    g.num_ranks = R;
    g.num_tokens = s.T;
    g.num_topk = s.K;
    g.axis_slot = axis_slot;
    g.num_blocks = blocks;
    g.send_warps = send_warps;
    check(launch_combine(g, rows.data(), reinterpret_cast<const float*>(row_weights.data()),
                         reinterpret_cast<const int32_t*>(token_rows.data()),
                         reinterpret_cast<const bool*>(in_rank.data()), s.H, kRowBF16, false,
                         out.data(), nullptr),
          "combine");
    return;
  }
  DispatchLaunch d{};
  d.state = state;
  d.layout = dispatch_layout_of(s);
  d.rank = &rank_value;
  d.group = &group_value;
  d.num_tokens = s.T;
  d.num_topk = s.K;
  d.num_experts = s.E;
  d.num_ranks = R;
  d.hidden = s.H;
  d.capacity = s.C;
  d.alignment = s.align;
  d.x_kind = s.x_kind;
  d.row_kind = s.row_kind;
  d.num_blocks = blocks;
  d.send_warps = send_warps;
  d.axis_slot = axis_slot;
  d.use_tma = true;
  d.pull = pull;
  if (call == MismatchCall::kRankMajor) {
    d.rank_major = true;
    d.capacity = R * s.T;
    d.alignment = 1;
  }
  check(launch_unread_dispatch(d), "dispatch");
}

}  // namespace

int main(int argc, char** argv) {
  const bool use_tma = std::getenv("JAX_EP_TMA") == nullptr || std::getenv("JAX_EP_TMA")[0] != '0';
  // the pull form of the dispatches and broadcasts (DispatchLaunch::pull, GroupLaunch::pull) on every rank
  const bool pull = std::getenv("JAX_EP_EMU_PULL") != nullptr && std::getenv("JAX_EP_EMU_PULL")[0] == '1';
  if (argc != 15 && argc != 16) {
    std::fprintf(stderr, "usage: driver dir R T H K E C align x_kind row_kind y_kind blocks "
                         "send_warps reps [mismatch]\n");
    return 1;
  }
  const std::string mismatch = argc == 16 ? argv[15] : "";
  dir = argv[1];
  const int R = std::atoi(argv[2]), T = std::atoi(argv[3]), H = std::atoi(argv[4]),
            K = std::atoi(argv[5]), E = std::atoi(argv[6]), C = std::atoi(argv[7]),
            align = std::atoi(argv[8]), x_kind = std::atoi(argv[9]),
            row_kind = std::atoi(argv[10]), y_kind = std::atoi(argv[11]),
            blocks = std::atoi(argv[12]), send_warps = std::atoi(argv[13]),
            reps = std::atoi(argv[14]);
  const bool fp8 = row_kind == kRowFP8;
  const int num_scales = fp8 ? H / 128 : 0;
  const CommLayout dispatch_layout =
      make_comm_layout(R, T, K, E, dispatch_row_bytes(H, row_kind), num_scales * 4);
  const CommLayout data_layout =
      make_comm_layout(R, T, K, 0, static_cast<uint64_t>(H) * kind_bytes(y_kind), 0);
  const CommLayout values_layout = make_comm_layout(R, T, K, 0, 0, 0);
  // combine_rank_major / broadcast_rank_major: one row per (token, rank), K = 1
  const CommLayout rm_layout =
      make_comm_layout(R, T, 1, 0, static_cast<uint64_t>(H) * kind_bytes(y_kind), 0);
  const Sizes sizes{R, T, H, K, E, C, align, x_kind, row_kind};
  const Sizes last_sizes = changed(sizes, mismatch);
  const Devices devices = make_devices(
      R, std::max({dispatch_layout.total, data_layout.total, dispatch_layout_of(last_sizes).total,
                   put_layout_of(sizes).total}),
      timeout_s(mismatch.empty() ? 300 : 5), /*peers=*/true);
  const std::vector<DeviceState*>& states = devices.states;
  // the put transport (mismatch `transport`): every rank's buffer and DeviceState are symmetric
  // objects of the NVSHMEM shim; the loads / stores of the other ops use the same memory
  emu_nvshmem::n_pes = R;
  for (int r = 0; r < R; ++r) {
    emu_nvshmem::register_object(0, r, devices.buffers[r], devices.buffer_bytes);
    emu_nvshmem::register_object(1, r, states[r], sizeof(DeviceState));
    states[r]->tables.symmetric_buffer = devices.buffers[r];
  }

  // Rank masking (run.py's masked cases): JAX_EP_EMU_MASK = one 0/1 per rank, passed to every op
  // (expert- and rank-major);
  // JAX_EP_EMU_MASK_ODD = the mask of the odd repetitions (default: the same);
  // JAX_EP_EMU_ABSENT = ranks whose process never runs an op (a dead or non-calling masked peer).
  const auto mask_of = [R](const char* name) {
    std::vector<int32_t> flags;
    if (const char* m = std::getenv(name); m != nullptr) {
      for (const char* c = m; *c != '\0'; ++c) {
        if (*c == '0' || *c == '1') flags.push_back(*c - '0');
      }
    }
    if (!flags.empty() && static_cast<int>(flags.size()) != R) {
      std::fprintf(stderr, "%s needs %d entries\n", name, R);
      std::exit(1);
    }
    return flags;
  };
  const std::vector<int32_t> rank_mask = mask_of("JAX_EP_EMU_MASK");
  std::vector<int32_t> rank_mask_odd = mask_of("JAX_EP_EMU_MASK_ODD");
  if (rank_mask_odd.empty()) rank_mask_odd = rank_mask;
  std::string absent;
  if (const char* a = std::getenv("JAX_EP_EMU_ABSENT"); a != nullptr) absent = a;
  const bool masked = !rank_mask.empty();
  // JAX_EP_EMU_UNMASKED_DISPATCH=1: both dispatches run without the mask, the ops through their
  // handles with it (combine's mask after an unmasked dispatch: rows of sources it does not link)
  const char* unmasked_env = std::getenv("JAX_EP_EMU_UNMASKED_DISPATCH");
  const bool unmasked_dispatch = unmasked_env != nullptr && unmasked_env[0] == '1';
  // JAX_EP_EMU_PERSISTENT = one 0/1 per rank, 0 = in the persistent mask of the group (what a
  // shrink-mode call leaves), set on every running rank at the start of each repetition, or with
  // JAX_EP_EMU_PERSISTENT_AT=dispatch right after its expert-major dispatch (cleared at the start).
  const std::vector<int32_t> persistent = mask_of("JAX_EP_EMU_PERSISTENT");
  uint32_t persistent_bits = 0;
  for (int r = 0; r < static_cast<int>(persistent.size()); ++r) {
    if (persistent[r] == 0) persistent_bits |= 1u << r;
  }
  const char* persistent_at = std::getenv("JAX_EP_EMU_PERSISTENT_AT");
  const bool persistent_after_dispatch =
      persistent_at != nullptr && std::string(persistent_at) == "dispatch";
  // Faults (the shrink and dying-rank cases): JAX_EP_EMU_SHRINK=1 runs every op in shrink mode;
  // JAX_EP_EMU_STOP=rank,n: that rank's process stops calling after n repetitions;
  // JAX_EP_EMU_DIE: it dies mid-call (arm_death; a repetition's launches are notify (with prep),
  // [pending,] main[, fixup] of dispatch (the bracketed ones in shrink mode), then the other ops').
  // Per rank and repetition: masked<r>_<i>.bin (the
  // persistent RankMaskState after it), time<r>_<i>.bin (seconds its dispatch took, double).
  const char* shrink_env = std::getenv("JAX_EP_EMU_SHRINK");
  const int shrink = shrink_env != nullptr && shrink_env[0] == '1' ? 1 : 0;
  long stop_rank = -1, stop_reps = 0;
  if (const char* v = std::getenv("JAX_EP_EMU_STOP");
      v == nullptr || std::sscanf(v, "%ld,%ld", &stop_rank, &stop_reps) != 2) {
    stop_rank = -1;
  }

  const int failed = run_ranks(R, [&](int rank) {
    emu_nvshmem::my_pe = rank;
    if (absent.find(std::to_string(rank)) != std::string::npos) return;  // never runs an op
    if (!mismatch.empty()) {
      const bool last = rank == R - 1;
      uint64_t ahead = 0;
      if (last && mismatch == "call_sequence") ahead = 5;
      if (last && mismatch == "behind") ahead = 1;
      MismatchCall call = last && mismatch == "op" ? MismatchCall::kCombine : MismatchCall::kDispatch;
      if (mismatch == "transport") {
        call = rank == 0 ? MismatchCall::kRankMajorPut : MismatchCall::kRankMajor;
      }
      // pull: rank 0's dispatch pulls its rows, rank 1's pushes them (fingerprint field transport)
      run_mismatch(states[rank], rank, last ? last_sizes : sizes, call, blocks, send_warps, ahead,
                   mismatch == "pull" && rank == 0);
      return;  // the call should have trapped
    }
    arm_death(rank, devices.buffers, devices.buffer_bytes);
    const std::string s = std::to_string(rank);
    const int32_t rank_value = rank, group_value = 0;
    auto x = read_file("x" + s + ".bin", size_t(T) * H * kind_bytes(x_kind));
    auto idx = read_file("idx" + s + ".bin", size_t(T) * K * 4);
    auto w = read_file("w" + s + ".bin", size_t(T) * K * 4);
    auto y = read_file("y" + s + ".bin", size_t(C) * H * kind_bytes(y_kind));
    auto g = read_file("g" + s + ".bin", size_t(T) * H * kind_bytes(y_kind));
    auto v = read_file("v" + s + ".bin", size_t(C) * 4);
    const size_t RT = size_t(R) * T;  // rank-major rows
    auto yr = read_file("yr" + s + ".bin", RT * H * kind_bytes(y_kind));
    SyncCounters::RankMaskState& rank_masks = states[rank]->sync.rank_masks[1][0];
    for (int rep = 0; rep < reps; ++rep) {
      if (rank == stop_rank && rep == stop_reps) break;  // stops calling
      const std::string tag = s + "_" + std::to_string(rep);
      if (!persistent.empty()) {
        std::memset(&rank_masks, 0, sizeof(rank_masks));  // the host's clear (no kernel running)
        if (!persistent_after_dispatch) rank_masks.masked = persistent_bits;
      }
      auto rows = poisoned(size_t(C) * H * kind_bytes(row_kind));
      auto scales = poisoned(size_t(C) * std::max(num_scales, 1) * 4);
      auto group_sizes = poisoned(size_t(E / R) * 4);
      auto expert_counts = poisoned(size_t(E / R) * 4);
      auto row_weights = poisoned(size_t(C) * 4);
      auto num_dropped = poisoned(4);
      auto active = poisoned(size_t(R) * 4);
      auto src_index = poisoned(size_t(C) * 4);
      auto token_rows = poisoned(size_t(R) * T * K * 4);
      auto in_rank = poisoned(size_t(T) * R);
      DispatchLaunch d{};
      d.state = states[rank];
      d.layout = dispatch_layout;
      d.x = x.data();
      d.topk_idx = reinterpret_cast<const int32_t*>(idx.data());
      d.topk_weights = reinterpret_cast<const float*>(w.data());
      d.rank = &rank_value;
      d.group = &group_value;
      const int32_t* mask_now =
          !masked ? nullptr : rep % 2 == 1 ? rank_mask_odd.data() : rank_mask.data();
      d.rank_mask = unmasked_dispatch ? nullptr : mask_now;
      d.rows = rows.data();
      d.scales = fp8 ? reinterpret_cast<float*>(scales.data()) : nullptr;
      d.group_sizes = reinterpret_cast<int32_t*>(group_sizes.data());
      d.expert_counts = reinterpret_cast<int32_t*>(expert_counts.data());
      d.row_weights = reinterpret_cast<float*>(row_weights.data());
      d.num_dropped = reinterpret_cast<int32_t*>(num_dropped.data());
      d.active = reinterpret_cast<int32_t*>(active.data());
      d.src_index = reinterpret_cast<int32_t*>(src_index.data());
      d.token_rows = reinterpret_cast<int32_t*>(token_rows.data());
      d.is_token_in_rank = reinterpret_cast<bool*>(in_rank.data());
      d.num_tokens = T;
      d.num_topk = K;
      d.num_experts = E;
      d.num_ranks = R;
      d.hidden = H;
      d.capacity = C;
      d.alignment = align;
      d.x_kind = x_kind;
      d.row_kind = row_kind;
      d.num_blocks = blocks;
      d.send_warps = send_warps;
      d.axis_slot = 1;
      d.use_tma = use_tma;
      d.pull = pull;
      d.shrink = shrink;
      const auto start = std::chrono::steady_clock::now();
      check(launch_dispatch(d, nullptr), "dispatch");
      const double seconds =  // (how long the dispatch took: whether it waited for a timeout)
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      write_file("time" + tag + ".bin", &seconds, sizeof(seconds));
      if (!persistent.empty()) rank_masks.masked = persistent_bits;
      write_file("rows" + tag + ".bin", rows.data(), size_t(C) * H * kind_bytes(row_kind));
      if (fp8) write_file("scales" + tag + ".bin", scales.data(), size_t(C) * num_scales * 4);
      write_file("group_sizes" + tag + ".bin", group_sizes.data(), size_t(E / R) * 4);
      write_file("expert_counts" + tag + ".bin", expert_counts.data(), size_t(E / R) * 4);
      write_file("row_weights" + tag + ".bin", row_weights.data(), size_t(C) * 4);
      write_file("num_dropped" + tag + ".bin", num_dropped.data(), 4);
      write_file("rank_mask" + tag + ".bin", active.data(), size_t(R) * 4);
      write_file("src_index" + tag + ".bin", src_index.data(), size_t(C) * 4);
      write_file("token_rows" + tag + ".bin", token_rows.data(), size_t(R) * T * K * 4);
      write_file("in_rank" + tag + ".bin", in_rank.data(), size_t(T) * R);

      GroupLaunch gl{};
      gl.state = states[rank];
      gl.layout = data_layout;
      gl.rank = &rank_value;
      gl.group = &group_value;
      gl.rank_mask = mask_now;
      gl.num_ranks = R;
      gl.num_tokens = T;
      gl.num_topk = K;
      gl.axis_slot = 1;
      gl.num_blocks = blocks;
      gl.send_warps = send_warps;
      gl.shrink = shrink;
      const size_t out_bytes = size_t(T) * H * kind_bytes(y_kind);
      auto comb_w = poisoned(out_bytes);
      check(launch_combine(gl, y.data(), d.row_weights, d.token_rows, d.is_token_in_rank, H,
                           y_kind, false, comb_w.data(), nullptr),
            "combine");
      write_file("comb_w" + tag + ".bin", comb_w.data(), out_bytes);
      auto comb_u = poisoned(out_bytes);
      check(launch_combine(gl, y.data(), nullptr, d.token_rows, d.is_token_in_rank, H, y_kind,
                           false, comb_u.data(), nullptr),
            "combine unweighted");
      write_file("comb_u" + tag + ".bin", comb_u.data(), out_bytes);
      const size_t bcast_bytes = size_t(C) * H * kind_bytes(y_kind);
      auto bcast = poisoned(bcast_bytes);
      GroupLaunch gb = gl;  // broadcast pulls with the dispatches (pull); the other ops have no pull form
      gb.pull = pull;
      check(launch_broadcast(gb, g.data(), d.token_rows, d.is_token_in_rank, d.src_index, C, H,
                             y_kind, use_tma, false, false, bcast.data(), nullptr),
            "broadcast");
      write_file("bcast" + tag + ".bin", bcast.data(), bcast_bytes);
      // the same in y's buffer (keep_empty_rows: over a copy of y, whose rows with no token stay NaN)
      std::vector<char> bcast_in_y(y.begin(), y.end());
      check(launch_broadcast(gb, g.data(), d.token_rows, d.is_token_in_rank, d.src_index, C, H,
                             y_kind, use_tma, false, true, bcast_in_y.data(), nullptr),
            "broadcast in y's buffer");
      write_file("bcast_in_y" + tag + ".bin", bcast_in_y.data(), bcast_bytes);
      // combine_bwd of g and y through the same handle (y's empty rows hold NaN: never read), then
      // in y's buffer (empty_rows_from_y: d y over a copy of y, whose rows with no token stay NaN)
      for (const bool in_y : {false, true}) {
        std::vector<char> bwd_dy = in_y ? std::vector<char>(y.begin(), y.end()) : poisoned(bcast_bytes);
        auto bwd_drw = poisoned(size_t(C) * 4);
        check(launch_combine_bwd(gl, g.data(), in_y ? bwd_dy.data() : y.data(), d.row_weights,
                                 d.token_rows, d.is_token_in_rank, d.src_index, C, H, y_kind, use_tma,
                                 bwd_dy.data(), reinterpret_cast<float*>(bwd_drw.data()), nullptr),
              in_y ? "combine_bwd in y's buffer" : "combine_bwd");
        const std::string suffix = (in_y ? "_in_y" : "") + tag;
        write_file("bwd_dy" + suffix + ".bin", bwd_dy.data(), bcast_bytes);
        write_file("bwd_drw" + suffix + ".bin", bwd_drw.data(), size_t(C) * 4);
      }
      GroupLaunch gv = gl;
      gv.layout = values_layout;
      auto slotv = poisoned(size_t(T) * K * 4);
      check(launch_slot_values(gv, reinterpret_cast<const float*>(v.data()), d.token_rows,
                               reinterpret_cast<float*>(slotv.data()), nullptr),
            "slot_values");
      write_file("slotv" + tag + ".bin", slotv.data(), size_t(T) * K * 4);

      // rank-major: dispatch_rank_major, then combine_rank_major / broadcast_rank_major through
      // its handle (the slot -> row table first, as the FFI handlers do); the same rank mask
      RankMajorOutputs rm(R, T, H, K, E, row_kind, y_kind);
      DispatchLaunch m = d;
      m.rows = rm.rows.data();
      m.scales = rm.scales_or_null();
      m.group_sizes = nullptr;
      m.row_weights = nullptr;
      m.num_dropped = nullptr;
      m.active = nullptr;
      m.token_rows = nullptr;
      m.expert_counts = rm.i32(rm.per_expert);
      m.src_index = rm.i32(rm.src);
      m.is_token_in_rank = rm.in_rank_data();
      m.row_ids = rm.i32(rm.ids);
      m.row_topk_weights = rm.f32(rm.w);
      m.tokens_per_rank = rm.i32(rm.per_rank);
      m.capacity = R * T;
      m.alignment = 1;
      m.rank_major = true;
      check(launch_dispatch(m, nullptr), "dispatch_rank_major");

      auto slot_rows = poisoned(RT * 4);
      int32_t* table = reinterpret_cast<int32_t*>(slot_rows.data());
      check(launch_rank_major_rows(m.src_index, static_cast<int32_t>(RT), blocks, table, nullptr),
            "rank_major_rows");
      GroupLaunch gr = gl;
      gr.layout = rm_layout;
      gr.num_topk = 1;
      check(launch_combine(gr, yr.data(), nullptr, table, m.is_token_in_rank, H, y_kind, true,
                           rm.comb.data(), nullptr),
            "combine_rank_major");
      gr.pull = pull;
      check(launch_broadcast(gr, g.data(), table, m.is_token_in_rank, m.src_index,
                             static_cast<int32_t>(RT), H, y_kind, use_tma, true, false,
                             rm.bcast.data(), nullptr),
            "broadcast_rank_major");
      rm.write(tag);
      write_file("masked" + tag + ".bin", &rank_masks, sizeof(rank_masks));
    }
  });
  return report_faults(devices, /*per_process=*/false) | failed;
}
