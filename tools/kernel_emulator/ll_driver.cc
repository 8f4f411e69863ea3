// Runs jax_ep's low-latency dispatch / combine kernels (cuda/low_latency.cu) on the CPU emulation
// (emu_cuda.h, blocks of a launch concurrently), one process per rank, device memory shared between
// them. Inputs and outputs are raw files in <dir>, written / read by ll_run.py, which compares them
// with jax_ep.reference.
//
//   ll_driver <dir> R T H K E x_kind row_kind reps blocks mode [mismatch]
//
// Repetition i runs with the rank mask mask_<i>.bin (int32 [R]), dispatches with the routing
// idx<rank>.bin and weights tw<rank>.bin, and combines with the handle's weights w<rank>_<i>.bin and
// ranks dest<rank>_<i>.bin (the reference's for that mask). The dispatch's own handle slots are
// written to hw / hdest / hdropped<rank>_<i>.bin (a two-phase send's go to its receive).
// mode 0: each repetition fused ll_dispatch then fused ll_combine; 1: each in two phases (send,
// receive); 2: two repetitions in flight at once (both sends, then both receives, per op);
// 3: three two-phase dispatch sends in a row (must fault: at most two in flight);
// 4: a two-phase dispatch received twice (must fault: stale call token); 5: a two-phase dispatch
// received by a call site of another shape (K - 1; must fault: shape).
// mode 6 / 7: shrink mode with the last rank absent (it never calls): the others run `reps`
// repetitions fused (6) or in two phases (7); the first must time out once on the absent rank and
// mask it, the later ones must not wait (the persistent mask). Then the host clears the persistent
// mask (what Runtime::ClearRankMasks does) and they run one more fused repetition with the absent
// rank in the explicit mask (mask_<reps>.bin). Per rank: masked<r>.bin (the persistent
// RankMaskState after the repetitions), cleared<r>.bin (its mask word after the last one),
// time<r>_<i>.bin (seconds each repetition took, double). Mode 8: as 6, but the last rank runs the
// first fused ll_dispatch with the others and then stops: their first ll_combine is the call that
// times out (its rows for the absent rank's tokens never come back: +0.0).
// Mode 9: fused repetitions, every rank calling, with a rank that dies mid-call (JAX_EP_EMU_DIE =
// rank,launch,flags: emu_driver.h arm_death; a repetition is 2 launches, ll_dispatch then
// ll_combine) and shrink mode when JAX_EP_EMU_SHRINK=1 (timeouts: JAX_EP_EMU_TIMEOUT_S). Per
// rank and repetition also masked<r>_<i>.bin (the persistent RankMaskState after it).
// With `mismatch` (a FingerprintFieldName of cuda/fingerprint.h; mode ignored, no files read)
// every rank runs ONE fused ll_dispatch, the last rank with one field changed (num_ranks + 1,
// num_tokens + 1, hidden + 8, num_topk - 1, num_experts + R, dtype: an fp8 wire instead of bf16,
// op: ll_combine instead of ll_dispatch; op_throughput: the throughput dispatch instead) or its
// call count in the group 5 calls ahead (call_sequence). Every rank must fault; the driver prints
// each record and its message.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/low_latency.h"
#include "tools/kernel_emulator/emu_driver.h"
#include "tools/kernel_emulator/unread_dispatch.h"

using namespace jax_ep;
using namespace emu_driver;

namespace {

// One rank's sizes (the last rank's differ in a mismatch case).
struct Sizes {
  int R, T, H, K, E, row_kind;
};

Sizes changed(Sizes s, const std::string& field) {
  if (field == "num_ranks") s.R += 1;  // it waits for a rank that is not there, then reports
  if (field == "num_tokens") s.T += 1;
  if (field == "hidden") s.H += 8;
  if (field == "num_topk") s.K -= 1;
  if (field == "num_experts") s.E += s.R;
  if (field == "dtype") s.row_kind = kRowFP8;
  return s;
}

LLLayout layout_of(const Sizes& s) {
  const bool fp8 = s.row_kind == kRowFP8;
  return make_ll_layout(s.R, s.T, s.K, s.E, s.H, uint64_t(s.H) * (fp8 ? 1 : 2),
                        fp8 ? uint64_t(s.H / 128) * 4 : 0);
}

// The one fused call of a mismatch case on `rank` (inputs zero: it must trap before using them).
// The throughput dispatch of the same sizes (capacity: the worst case), on the same axis slot.
void run_throughput_dispatch(DeviceState* state, const int32_t* rank, const int32_t* group,
                             const Sizes& s, int axis_slot) {
  DispatchLaunch d{};
  d.state = state;
  d.layout = make_comm_layout(s.R, s.T, s.K, s.E, dispatch_row_bytes(s.H, kRowBF16), 0);
  d.rank = rank;
  d.group = group;
  d.num_tokens = s.T;
  d.num_topk = s.K;
  d.num_experts = s.E;
  d.num_ranks = s.R;
  d.hidden = s.H;
  d.capacity = s.R * s.T * s.K;
  d.alignment = 1;
  d.x_kind = kRowBF16;
  d.row_kind = kRowBF16;
  d.num_blocks = 1;
  d.send_warps = 4;
  d.axis_slot = axis_slot;
  d.use_tma = false;
  check(launch_unread_dispatch(d), "dispatch");
}

void run_mismatch(DeviceState* state, int rank, const Sizes& s, bool combine, bool throughput,
                  int blocks, uint64_t call_offset) {
  const int32_t rank_value = rank, group_value = 0;
  const int axis_slot = 2;
  state->sync.group_epoch[axis_slot][0] += call_offset;  // calls this rank ran alone before
  if (throughput) {
    emu::concurrent_blocks = false;
    run_throughput_dispatch(state, &rank_value, &group_value, s, axis_slot);
    return;
  }
  const size_t slots = size_t(s.E) * s.T;  // E_local * R * T
  std::vector<char> x(size_t(s.T) * s.H * 2 + 16), idx(size_t(s.T) * s.K * 4 + 16),
      w(size_t(s.T) * s.K * 4 + 16), rows(slots * s.H * 2 + 16),
      scales(slots * (s.H / 128 + 1) * 4 + 16), counts(size_t(s.E) * 4 + 16),
      src(slots * 4 + 16), out(size_t(s.T) * s.H * 2 + 16), active(size_t(s.R) * 4 + 16),
      dest(size_t(s.T) * s.K * 4 + 16), handle_w(size_t(s.T) * s.K * 4 + 16), dropped(16);
  LLCommon c{};
  c.state = state;
  c.rank = &rank_value;
  c.group = &group_value;
  c.mode = kLLFused;
  c.num_ranks = s.R;
  c.num_tokens = s.T;
  c.num_topk = s.K;
  c.num_experts = s.E;
  c.hidden = s.H;
  c.axis_slot = axis_slot;
  c.num_blocks = blocks;
  if (combine) {
    LLCombineLaunch p{};
    p.c = c;
    p.c.L = make_ll_layout(s.R, s.T, s.K, s.E, s.H, uint64_t(s.H) * 2, 0);
    p.y = rows.data();
    p.src_slot = reinterpret_cast<const int32_t*>(src.data());
    p.topk_weights = reinterpret_cast<const float*>(w.data());
    p.dest_rank = reinterpret_cast<const int32_t*>(dest.data());
    p.out = out.data();
    check(launch_ll_combine(p, nullptr), "ll_combine");
    return;
  }
  LLDispatchLaunch p{};
  p.c = c;
  p.c.L = layout_of(s);
  p.x = x.data();
  p.topk_idx = reinterpret_cast<const int32_t*>(idx.data());
  p.rows = rows.data();
  p.scales = reinterpret_cast<float*>(scales.data());
  p.counts = reinterpret_cast<int32_t*>(counts.data());
  p.src_slot = reinterpret_cast<int32_t*>(src.data());
  p.active = reinterpret_cast<int32_t*>(active.data());
  p.topk_weights = reinterpret_cast<const float*>(w.data());
  p.weights = reinterpret_cast<float*>(handle_w.data());
  p.dest_rank = reinterpret_cast<int32_t*>(dest.data());
  p.num_dropped = reinterpret_cast<int32_t*>(dropped.data());
  p.x_kind = kRowBF16;
  p.row_kind = s.row_kind;
  check(launch_ll_dispatch(p, nullptr), "ll_dispatch");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 12 && argc != 13) {
    std::fprintf(stderr, "usage: ll_driver dir R T H K E x_kind row_kind reps blocks mode "
                         "[mismatch]\n");
    return 1;
  }
  const std::string mismatch = argc == 13 ? argv[12] : "";
  dir = argv[1];
  const int R = std::atoi(argv[2]), T = std::atoi(argv[3]), H = std::atoi(argv[4]),
            K = std::atoi(argv[5]), E = std::atoi(argv[6]), x_kind = std::atoi(argv[7]),
            row_kind = std::atoi(argv[8]), reps = std::atoi(argv[9]), blocks = std::atoi(argv[10]),
            mode = std::atoi(argv[11]);
  emu::concurrent_blocks = true;
  const bool fp8 = row_kind == kRowFP8;
  const int num_scales = fp8 ? H / 128 : 0;
  const int local = E / R;
  const int x_bytes = x_kind == kRowF32 ? 4 : 2;
  const int row_bytes = fp8 ? 1 : 2;
  const LLLayout dispatch_layout =
      make_ll_layout(R, T, K, E, H, uint64_t(H) * row_bytes, uint64_t(num_scales) * 4);
  const LLLayout combine_layout = make_ll_layout(R, T, K, E, H, uint64_t(H) * 2, 0);
  const Sizes sizes{R, T, H, K, E, row_kind};
  const Sizes last_sizes = changed(sizes, mismatch);
  const double bound_s = timeout_s(
      !mismatch.empty() ? 5 : mode >= 6 && mode <= 8 ? 4 : mode >= 3 && mode != 9 ? 20 : 300);
  const Devices devices = make_devices(
      R,
      std::max({dispatch_layout.base.total, combine_layout.base.total,
                layout_of(last_sizes).base.total,
                make_comm_layout(R, T, K, E, dispatch_row_bytes(H, kRowBF16), 0).total}),
      bound_s, /*peers=*/true);
  const std::vector<DeviceState*>& states = devices.states;

  const int failed = run_ranks(R, [&](int rank) {
    if (!mismatch.empty()) {
      const bool last = rank == R - 1;
      run_mismatch(states[rank], rank, last ? last_sizes : sizes, last && mismatch == "op",
                   last && mismatch == "op_throughput", blocks,
                   last && mismatch == "call_sequence" ? 5 : 0);
      return;  // the call should have trapped
    }
    const char* shrink_env = std::getenv("JAX_EP_EMU_SHRINK");
    const bool shrink =
        (mode >= 6 && mode <= 8) || (mode == 9 && shrink_env != nullptr && shrink_env[0] == '1');
    if (mode == 9) arm_death(rank, devices.buffers, devices.buffer_bytes);
    if (shrink && rank == R - 1 && mode >= 6 && mode <= 7) return;  // absent: never calls
    const int runs = mode >= 6 && mode <= 8 ? reps + 1 : reps;  // one more after the clear
    const std::string s = std::to_string(rank);
    const int32_t rank_value = rank, group_value = 0;
    auto x = read_file("x" + s + ".bin", size_t(T) * H * x_bytes);
    auto idx = read_file("idx" + s + ".bin", size_t(T) * K * 4);
    auto topk_w = read_file("tw" + s + ".bin", size_t(T) * K * 4);
    auto y = read_file("y" + s + ".bin", size_t(local) * R * T * H * 2);
    const size_t slots = size_t(local) * R * T;
    struct Rep {
      std::vector<char> rows, scales, counts, src, out, active;
      std::vector<char> mask, w, dest;  // inputs of the repetition (the reference's handle)
      std::vector<char> hw, hdest, hdropped;  // the dispatch's handle slots
      std::vector<char> sw, sdest, sdropped;  // a two-phase send's, for its receive
      uint32_t dispatch_token[4], combine_token[4];
    };
    std::vector<Rep> out(runs);
    for (int rep = 0; rep < runs; ++rep) {
      Rep& o = out[rep];
      const std::string tag = s + "_" + std::to_string(rep);
      o.mask = read_file("mask_" + std::to_string(rep) + ".bin", size_t(R) * 4);
      o.w = read_file("w" + tag + ".bin", size_t(T) * K * 4);
      o.dest = read_file("dest" + tag + ".bin", size_t(T) * K * 4);
      o.active = poisoned(size_t(R) * 4);
      o.rows = poisoned(slots * H * row_bytes);
      o.scales = poisoned(slots * std::max(num_scales, 1) * 4);
      o.counts = poisoned(size_t(local) * R * 4);
      o.src = poisoned(slots * 4);
      o.out = poisoned(size_t(T) * H * 2);
      o.hw = poisoned(size_t(T) * K * 4);
      o.hdest = poisoned(size_t(T) * K * 4);
      o.hdropped = poisoned(4);
      o.sw = poisoned(size_t(T) * K * 4);
      o.sdest = poisoned(size_t(T) * K * 4);
      o.sdropped = poisoned(4);
    }
    LLCommon common{};
    common.state = states[rank];
    common.rank = &rank_value;
    common.group = &group_value;
    common.num_ranks = R;
    common.num_tokens = T;
    common.num_topk = K;
    common.num_experts = E;
    common.hidden = H;
    common.axis_slot = 2;
    common.num_blocks = blocks;
    common.shrink = shrink ? 1 : 0;
    auto dispatch = [&](Rep& o, int m, uint32_t* token, int topk_less = 0) {
      LLDispatchLaunch d{};
      d.c = common;
      d.c.num_topk -= topk_less;
      d.c.L = dispatch_layout;
      d.c.mode = m;
      d.c.token = token;
      d.x = x.data();
      d.topk_idx = reinterpret_cast<const int32_t*>(idx.data());
      d.rows = o.rows.data();
      d.scales = fp8 ? reinterpret_cast<float*>(o.scales.data()) : nullptr;
      d.counts = reinterpret_cast<int32_t*>(o.counts.data());
      d.src_slot = reinterpret_cast<int32_t*>(o.src.data());
      d.active = reinterpret_cast<int32_t*>(o.active.data());
      d.topk_weights = reinterpret_cast<const float*>(topk_w.data());
      const bool send = m == kLLSend;
      d.weights = reinterpret_cast<float*>((send ? o.sw : o.hw).data());
      d.dest_rank = reinterpret_cast<int32_t*>((send ? o.sdest : o.hdest).data());
      d.num_dropped = reinterpret_cast<int32_t*>((send ? o.sdropped : o.hdropped).data());
      d.sent_weights = reinterpret_cast<const float*>(o.sw.data());
      d.sent_dest = reinterpret_cast<const int32_t*>(o.sdest.data());
      d.sent_dropped = reinterpret_cast<const int32_t*>(o.sdropped.data());
      d.c.rank_mask = reinterpret_cast<const int32_t*>(o.mask.data());
      d.x_kind = x_kind;
      d.row_kind = row_kind;
      check(launch_ll_dispatch(d, nullptr), "ll_dispatch");
    };
    auto combine = [&](Rep& o, int m, uint32_t* token) {
      LLCombineLaunch c{};
      c.c = common;
      c.c.L = combine_layout;
      c.c.mode = m;
      c.c.token = token;
      c.y = y.data();
      c.src_slot = reinterpret_cast<const int32_t*>(o.src.data());
      c.topk_weights = reinterpret_cast<const float*>(o.w.data());
      c.dest_rank = reinterpret_cast<const int32_t*>(o.dest.data());
      c.c.rank_mask = reinterpret_cast<const int32_t*>(o.mask.data());
      c.out = o.out.data();
      check(launch_ll_combine(c, nullptr), "ll_combine");
    };
    // one repetition: both ops fused, or each in two phases (send, then receive)
    auto run_rep = [&](Rep& o, bool two_phase) {
      if (two_phase) {
        dispatch(o, kLLSend, o.dispatch_token);
        dispatch(o, kLLRecv, o.dispatch_token);
        combine(o, kLLSend, o.combine_token);
        combine(o, kLLRecv, o.combine_token);
      } else {
        dispatch(o, kLLFused, nullptr);
        combine(o, kLLFused, nullptr);
      }
    };
    if (mode == 3) {  // a third send while two are in flight
      for (int i = 0; i < 3; ++i) dispatch(out[0], kLLSend, out[0].dispatch_token);
    } else if (mode == 4) {  // the same call token received twice
      dispatch(out[0], kLLSend, out[0].dispatch_token);
      dispatch(out[0], kLLRecv, out[0].dispatch_token);
      dispatch(out[0], kLLRecv, out[0].dispatch_token);
    } else if (mode == 5) {  // received by a call site of another shape
      dispatch(out[0], kLLSend, out[0].dispatch_token);
      dispatch(out[0], kLLRecv, out[0].dispatch_token, 1);
    } else if (mode == 2) {
      for (int base = 0; base < reps; base += 2) {
        const int n = std::min(2, reps - base);
        for (int i = 0; i < n; ++i) dispatch(out[base + i], kLLSend, out[base + i].dispatch_token);
        for (int i = 0; i < n; ++i) dispatch(out[base + i], kLLRecv, out[base + i].dispatch_token);
        for (int i = 0; i < n; ++i) combine(out[base + i], kLLSend, out[base + i].combine_token);
        for (int i = 0; i < n; ++i) combine(out[base + i], kLLRecv, out[base + i].combine_token);
      }
    } else if (mode == 9) {  // fused repetitions; the dying rank's process ends in one of them
      for (int i = 0; i < reps; ++i) {
        dispatch(out[i], kLLFused, nullptr);
        combine(out[i], kLLFused, nullptr);
        write_file("masked" + s + "_" + std::to_string(i) + ".bin",
                   &states[rank]->sync.rank_masks[2][0], sizeof(SyncCounters::RankMaskState));
      }
    } else if (shrink && rank == R - 1) {  // mode 8: one dispatch with the others, then absent
      dispatch(out[0], kLLFused, nullptr);
      return;  // writes no outputs
    } else if (shrink) {
      SyncCounters::RankMaskState& persistent = states[rank]->sync.rank_masks[2][0];
      auto timed = [&](int i, auto body) {
        const auto start = std::chrono::steady_clock::now();
        body(out[i]);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        write_file("time" + s + "_" + std::to_string(i) + ".bin", &seconds, sizeof(seconds));
      };
      for (int i = 0; i < reps; ++i) timed(i, [&](Rep& o) { run_rep(o, mode == 7); });
      write_file("masked" + s + ".bin", &persistent, sizeof(persistent));
      std::memset(&persistent, 0, sizeof(persistent));  // the host's clear (no kernel running)
      timed(reps, [&](Rep& o) { run_rep(o, false); });
      write_file("cleared" + s + ".bin", &persistent.masked, sizeof(persistent.masked));
    } else {
      for (Rep& o : out) run_rep(o, mode == 1);
    }
    for (int rep = 0; rep < runs; ++rep) {
      const std::string tag = s + "_" + std::to_string(rep);
      const Rep& o = out[rep];
      write_file("rows" + tag + ".bin", o.rows.data(), slots * H * row_bytes);
      if (fp8) write_file("scales" + tag + ".bin", o.scales.data(), slots * num_scales * 4);
      write_file("counts" + tag + ".bin", o.counts.data(), size_t(local) * R * 4);
      write_file("src" + tag + ".bin", o.src.data(), slots * 4);
      write_file("out" + tag + ".bin", o.out.data(), size_t(T) * H * 2);
      write_file("active" + tag + ".bin", o.active.data(), size_t(R) * 4);
      write_file("hw" + tag + ".bin", o.hw.data(), size_t(T) * K * 4);
      write_file("hdest" + tag + ".bin", o.hdest.data(), size_t(T) * K * 4);
      write_file("hdropped" + tag + ".bin", o.hdropped.data(), 4);
    }
  });
  return report_faults(devices, /*per_process=*/false) | failed;
}
