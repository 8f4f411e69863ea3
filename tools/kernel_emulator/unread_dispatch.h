// The throughput dispatch of the emulator's config-fingerprint cases (driver.cc, ll_driver.cc),
// expert- or rank-major (d.rank_major): it runs on zero inputs and must trap in its group discovery
// (a peer runs another call), so nobody reads its outputs. One place that points a DispatchLaunch
// at buffers large enough for any row kind.
#pragma once

#include <cstddef>
#include <vector>

#include "cuda/dispatch.h"

namespace jax_ep {

// `d` carries the state, layout, rank/group pointers, sizes, kinds and knobs; its inputs and outputs
// are set here. The emulated launch has finished when it returns (the buffers die with this call).
inline cudaError_t launch_unread_dispatch(DispatchLaunch d) {
  const size_t T = d.num_tokens, K = d.num_topk, E = d.num_experts, R = d.num_ranks, H = d.hidden,
               C = d.capacity;
  std::vector<char> x(T * H * 4 + 16), idx(T * K * 4 + 16), w(T * K * 4 + 16), rows(C * H * 4 + 16),
      scales(C * (H / 128 + 1) * 4 + 16), sizes(E * 4 + 16), counts(E * 4 + 16),
      row_weights(C * 4 + 16), dropped(16), src_index(C * 4 + 16), token_rows(R * T * K * 4 + 16),
      in_rank(T * R + 16), row_ids(C * K * 4 + 16), row_w(C * K * 4 + 16), per_rank(R * 4 + 16);
  d.x = x.data();
  d.topk_idx = reinterpret_cast<const int32_t*>(idx.data());
  d.topk_weights = reinterpret_cast<const float*>(w.data());
  d.rows = rows.data();
  d.scales = d.row_kind == kRowFP8 ? reinterpret_cast<float*>(scales.data()) : nullptr;
  d.group_sizes = reinterpret_cast<int32_t*>(sizes.data());
  d.expert_counts = reinterpret_cast<int32_t*>(counts.data());
  d.row_weights = reinterpret_cast<float*>(row_weights.data());
  d.num_dropped = reinterpret_cast<int32_t*>(dropped.data());
  d.src_index = reinterpret_cast<int32_t*>(src_index.data());
  d.token_rows = reinterpret_cast<int32_t*>(token_rows.data());
  d.is_token_in_rank = reinterpret_cast<bool*>(in_rank.data());
  if (d.rank_major) {  // C = R * T rows; no expert-major outputs
    d.group_sizes = nullptr;
    d.row_weights = nullptr;
    d.num_dropped = nullptr;
    d.token_rows = nullptr;
    d.row_ids = reinterpret_cast<int32_t*>(row_ids.data());
    d.row_topk_weights = reinterpret_cast<float*>(row_w.data());
    d.tokens_per_rank = reinterpret_cast<int32_t*>(per_rank.data());
  }
  return launch_dispatch(d, nullptr);
}

}  // namespace jax_ep
