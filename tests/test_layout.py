"""jax_ep.get_dispatch_layout against the NumPy model on 1, 2, 4 and 8 virtual devices."""

from __future__ import annotations

import functools

import numpy as np
import numpy_model as nm
import pytest
from helpers import make_cfg, per_rank, random_routing, to_numpy

import jax_ep

E, K, T = 16, 4, 10


@functools.cache
def layout_fn(ep_size, cfg):
    return per_rank(lambda idx: jax_ep.get_dispatch_layout(idx, cfg), ep_size)


def check_layout(ep_size, idx, cfg):
    lay = to_numpy(layout_fn(ep_size, cfg)(idx))
    assert isinstance(lay, jax_ep.Layout)
    assert lay.num_tokens_per_rank.shape == (ep_size, ep_size)
    assert lay.num_tokens_per_expert.shape == (ep_size, cfg.num_experts)
    assert lay.is_token_in_rank.shape == (ep_size, idx.shape[1], ep_size)
    assert lay.num_tokens_per_rank.dtype == np.int32 and lay.num_tokens_per_expert.dtype == np.int32
    assert lay.is_token_in_rank.dtype == np.bool_
    for r in range(ep_size):
        want = nm.layout(idx[r], cfg.num_experts, ep_size)
        np.testing.assert_array_equal(lay.num_tokens_per_rank[r], want.num_tokens_per_rank, f"rank {r}")
        np.testing.assert_array_equal(lay.num_tokens_per_expert[r], want.num_tokens_per_expert, f"rank {r}")
        np.testing.assert_array_equal(lay.is_token_in_rank[r], want.is_token_in_rank, f"rank {r}")
    return lay


@pytest.mark.parametrize("ep_size", [1, 2, 4, 8])
def test_layout_random(ep_size):
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=8, max_tokens_per_rank=T)
    rng = np.random.default_rng(200 + ep_size)
    for _ in range(4):
        idx = random_routing(rng, ep_size, T, K, E, p_unused=0.2, p_out_of_range=0.15, p_repeat=0.3)
        lay = check_layout(ep_size, idx, cfg)
        # a token is counted once per rank however many of that rank's experts it picked
        assert (lay.num_tokens_per_rank <= T).all()
        assert (lay.num_tokens_per_rank.sum(axis=1) <= lay.num_tokens_per_expert.sum(axis=1)).all()


@pytest.mark.parametrize("ep_size", [2, 8])
def test_layout_edge_cases(ep_size):
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=8, max_tokens_per_rank=T)
    local = E // ep_size
    idx = np.full((ep_size, T, K), -1, np.int32)
    idx[:, 0] = [0, 0, 0, 0]                         # one expert four times: counted once
    idx[:, 1] = [E, -2, E + 5, -(2**31)]             # nothing valid
    idx[:, 2] = [E - 1, 1, E, E - 1]                 # repeat after an out-of-range id
    idx[:, 3] = [0, 1, 2, 3] if local >= 4 else [0, local, 2 * local, 3 * local]  # one rank / 4 ranks
    lay = check_layout(ep_size, idx, cfg)
    per_expert = lay.num_tokens_per_expert[0]
    assert per_expert[0] == 2 and per_expert[E - 1] == 1 and per_expert[1] == 1 + (local >= 4)
    assert not lay.is_token_in_rank[0, 1].any()
    np.testing.assert_array_equal(lay.is_token_in_rank[0, 0], np.arange(ep_size) == 0)


def test_layout_matches_dispatch_handle():
    """The layout's token->rank map is the one dispatch records in its handle."""
    ep_size = 4
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=8, max_tokens_per_rank=T)
    rng = np.random.default_rng(250)
    idx = random_routing(rng, ep_size, T, K, E)
    x = rng.standard_normal((ep_size, T, 8)).astype(np.float32) + 3.0
    w = rng.random((ep_size, T, K)).astype(np.float32)

    def f(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        lay = jax_ep.get_dispatch_layout(idx, cfg)
        return d.handle.is_token_in_rank, lay, d.group_sizes

    in_rank, lay, group_sizes = to_numpy(per_rank(f, ep_size)(x, idx, w))
    np.testing.assert_array_equal(in_rank, lay.is_token_in_rank)
    # rows an expert receives == tokens (all ranks) that picked it
    np.testing.assert_array_equal(group_sizes.reshape(-1), lay.num_tokens_per_expert.sum(axis=0))
