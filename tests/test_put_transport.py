"""KernelConfig.transport and how cuda_backend picks the transport of each op (CPU: the runtime's
answers are simulated). The put kernels themselves run on the kernel emulator
(tests/test_kernel_emulator.py) and on GPUs (tests/gpu/test_put_transport_gpu.py)."""

from __future__ import annotations

import pytest

from jax_ep import KernelConfig, cuda_backend, runtime
from jax_ep.config import EPConfig

RANK_MAJOR = ("dispatch_rank_major", "combine_rank_major", "broadcast_rank_major")
OTHERS = ("dispatch", "combine", "broadcast", "slot_values", "ll_dispatch", "ll_combine")


def transport(op: str, config: EPConfig, ep_size: int = 2) -> int:
    """The transport of ``op``'s call site on an EP group of ``ep_size`` (cuda_backend._transport)."""
    return cuda_backend._transport(op, config, ep_size)


def cfg(transport: str) -> EPConfig:
    return EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                    kernel=KernelConfig(transport=transport))


@pytest.fixture
def job(monkeypatch):
    """Sets the simulated job: job(model, unreachable processes)."""

    def set_job(model: str, unreachable: list[int]):
        monkeypatch.setattr(runtime, "register_targets", lambda: None)
        monkeypatch.setattr(runtime, "process_model", lambda: model)
        monkeypatch.setattr(runtime, "unreachable_processes", lambda: list(unreachable))

    return set_job


def test_transport_values():
    assert KernelConfig().transport == "auto"
    with pytest.raises(ValueError, match="transport must be one of"):
        KernelConfig(transport="rdma")


@pytest.mark.parametrize("op", RANK_MAJOR)
def test_rank_major_ops_take_puts_when_a_process_is_on_another_node(job, op):
    job("process_per_gpu", [2, 3])
    assert transport(op, cfg("auto")) == cuda_backend.TRANSPORT_PUT
    assert transport(op, cfg("load_store")) == cuda_backend.TRANSPORT_LOAD_STORE


@pytest.mark.parametrize("op", RANK_MAJOR)
def test_rank_major_ops_on_one_node(job, op):
    job("process_per_gpu", [])
    assert transport(op, cfg("auto")) == cuda_backend.TRANSPORT_LOAD_STORE
    assert transport(op, cfg("put")) == cuda_backend.TRANSPORT_PUT  # forced: test 3b


@pytest.mark.parametrize("op", RANK_MAJOR)
def test_forced_puts_need_process_model_2(job, op):
    job("local_peers", [])
    text = f"{op} with KernelConfig\\(transport='put'\\) needs process model 2"
    with pytest.raises(NotImplementedError, match=text):
        transport(op, cfg("put"))


@pytest.mark.parametrize("op", OTHERS)
def test_other_ops_over_other_nodes_are_refused_naming_the_op(job, op):
    job("process_per_gpu", [1])
    text = f"jax_ep: {op} reaches its peers by NVLink.*processes \\[1\\]"
    with pytest.raises(NotImplementedError, match=text):
        transport(op, cfg("auto"))
    with pytest.raises(NotImplementedError, match=f"jax_ep: {op} has no NVSHMEM put transport"):
        transport(op, cfg("put"))
    # an EP axis inside a node (hierarchical mesh): the caller says so
    assert transport(op, cfg("load_store")) == cuda_backend.TRANSPORT_LOAD_STORE


def test_put_buffer_size_is_the_put_layout(job):
    ext = pytest.importorskip("jax_ep._C")
    # dispatch_rank_major, R=2, T=4096, H=7168 bf16, K=8: two [R] areas of 16 + T records
    record = 7168 * 2 + 8 * 4 + 8 * 4 + 4
    record += -record % 16
    region = 16 + 4096 * record
    region += -region % 256
    total = ext.put_comm_bytes(2, 4096, 8, 7168 * 2, 0, True)
    assert 2 * 2 * region <= total < 2 * 2 * region + (1 << 20)


@pytest.mark.parametrize("op", RANK_MAJOR)
def test_a_rank_mask_over_puts_is_refused_naming_the_op(job, op):
    """The put kernels exchange with every rank: a mask there is refused, never ignored; over loads /
    stores (or without a mask) the check passes."""
    import jax.numpy as jnp

    mask = jnp.array([1, 0, 1, 1], jnp.int32)
    job("process_per_gpu", [1])
    with pytest.raises(NotImplementedError, match=f"jax_ep: {op} with a rank_mask over the NVSHMEM put"):
        cuda_backend._check_put_mask(op, cfg("auto"), mask)
    cuda_backend._check_put_mask(op, cfg("auto"), None)
    cuda_backend._check_put_mask(op, cfg("load_store"), mask)
    # nor shrink mode (the put kernels trap on a timeout)
    shrink = cfg("auto").replace(shrink=True)
    with pytest.raises(NotImplementedError, match=rf"jax_ep: {op} with EPConfig\(shrink=True\) over"):
        cuda_backend._check_put_mask(op, shrink, None)
    cuda_backend._check_put_mask(op, cfg("load_store").replace(shrink=True), None)


def pulled(transport: str = "auto") -> EPConfig:
    return EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                    kernel=KernelConfig(transport=transport, dispatch_pull=True))


@pytest.mark.parametrize("model", ["local_peers", "process_per_gpu"])
def test_dispatch_pull_is_the_dispatches_pull_transport(job, model):
    """KernelConfig.dispatch_pull: the dispatches (expert- and rank-major) take the pull form
    (EPAttrs::transport kTransportPull) in either process model; every other op keeps loads / stores."""
    assert KernelConfig().dispatch_pull is None   # auto: the table's choice (below)
    job(model, [])
    for op in ("dispatch", "dispatch_rank_major"):
        assert transport(op, pulled()) == cuda_backend.TRANSPORT_PULL
    for op in ("combine", "broadcast", "combine_bwd", "slot_values", "combine_rank_major", "ll_dispatch"):
        assert transport(op, pulled()) == cuda_backend.TRANSPORT_LOAD_STORE


def test_dispatch_pull_over_puts_or_with_shrink_is_refused(job):
    """Pulling needs load / store addresses: a rank-major dispatch that resolves to NVSHMEM puts (another
    node, or transport='put') is refused naming the op; shrink mode is refused when the config is made
    (a receiver the sender gave up on could read its staging after the sender's next call rewrote it)."""
    job("process_per_gpu", [1])
    with pytest.raises(NotImplementedError, match="dispatch_rank_major with KernelConfig\\(dispatch_pull"):
        transport("dispatch_rank_major", pulled("auto"))
    # transport='put' with a pull knob, and shrink with 'put', are refused when the config is made (found
    # by a review, 2026-12-05: they were accepted, and explain said the kernels would run them)
    with pytest.raises(NotImplementedError, match="transport='put'\\) with dispatch_pull=True"):
        pulled("put")
    with pytest.raises(NotImplementedError, match="shrink=True\\) with KernelConfig\\(transport='put'\\)"):
        pulled("auto").replace(kernel=KernelConfig(transport="put"), shrink=True)
    with pytest.raises(NotImplementedError, match="shrink=True\\) with KernelConfig\\(dispatch_pull=True\\)"):
        pulled().replace(shrink=True)
    attrs = cuda_backend._attrs("dispatch", pulled("load_store"), 4, 1, 16, hidden=128, row_bytes=256,
                                capacity=64, num_experts=8)
    assert int(attrs["transport"]) == cuda_backend.TRANSPORT_PULL


def test_broadcast_pull_is_the_broadcasts_pull_transport(job):
    """KernelConfig.broadcast_pull: broadcast and broadcast_rank_major pull; combine_bwd (the broadcast
    kernel that computes) keeps loads / stores, and so does dispatch without dispatch_pull; with both
    knobs every rank of a call resolves the same. Shrink mode refuses it too."""
    job("local_peers", [])
    cfg = EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                   kernel=KernelConfig(broadcast_pull=True))
    for op in ("broadcast", "broadcast_rank_major"):
        assert transport(op, cfg) == cuda_backend.TRANSPORT_PULL
    for op in ("combine_bwd", "dispatch", "combine"):
        assert transport(op, cfg) == cuda_backend.TRANSPORT_LOAD_STORE
    with pytest.raises(NotImplementedError, match="KernelConfig\\(broadcast_pull=True\\) is not built"):
        cfg.replace(shrink=True)
    job("process_per_gpu", [1])
    with pytest.raises(NotImplementedError, match="broadcast_rank_major with KernelConfig\\(broadcast_pull"):
        transport("broadcast_rank_major", cfg)


def test_pull_left_to_auto_takes_what_the_table_measured(job, monkeypatch):
    """KernelConfig.dispatch_pull / broadcast_pull None (default): the pull form where the auto table
    measured it at least as fast for the call (tokens per rank, EP size, the blocks the kernels get),
    over loads / stores only: over puts and with shrink mode the rows are pushed, not refused. What
    the table is asked is what explain() says."""
    from jax_ep import auto_table, backends

    asked = []

    def table_says(knob, tokens, ep_size, blocks):
        asked.append((knob, tokens, ep_size, blocks))
        return ep_size >= 4

    monkeypatch.setattr(auto_table, "pull_faster", table_says)
    job("process_per_gpu", [])
    auto = EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                    kernel=KernelConfig(num_sms=20))
    for op in ("dispatch", "dispatch_rank_major", "broadcast", "broadcast_rank_major"):
        assert transport(op, auto, 4) == cuda_backend.TRANSPORT_PULL
        assert transport(op, auto, 2) == cuda_backend.TRANSPORT_LOAD_STORE
    assert asked[0] == ("dispatch_pull", 16, 4, 20) and asked[4] == ("broadcast_pull", 16, 4, 20)
    for op in ("combine", "combine_bwd", "slot_values", "combine_rank_major"):
        assert transport(op, auto, 4) == cuda_backend.TRANSPORT_LOAD_STORE
    assert transport("dispatch", auto.replace(shrink=True), 4) == cuda_backend.TRANSPORT_LOAD_STORE
    pushed = auto.replace(kernel=KernelConfig(num_sms=20, dispatch_pull=False))
    assert transport("dispatch", pushed, 4) == cuda_backend.TRANSPORT_LOAD_STORE
    assert transport("broadcast", pushed, 4) == cuda_backend.TRANSPORT_PULL
    job("process_per_gpu", [1])   # another node: puts, and no pulling there
    assert transport("dispatch_rank_major", auto, 4) == cuda_backend.TRANSPORT_PUT
    form = backends.get("cuda").form
    why = form("dispatch", auto, 4)
    assert why.startswith("rows pulled by the receivers where the call reaches its peers by NVLink")
    assert "dispatch_pull=None" in why and why.endswith("over NVSHMEM puts pushed)")
    assert "16 tokens per rank on 4 GPUs with 20 blocks" in why
    assert form("dispatch", auto, 2).startswith("rows pushed by the senders")
    assert form("combine", auto, 4) is None
    assert "KernelConfig.dispatch_pull=False" in form("dispatch", pushed, 4)
    assert form("dispatch", pulled(), 4).endswith("over NVSHMEM puts refused)")


def test_pull_left_to_auto_asks_at_the_blocks_the_call_gets(job, monkeypatch):
    """Inside jax_ep.overlap.beside's block a call goes on the side stream with side_num_sms blocks:
    the auto table is asked at that count there, at num_sms's elsewhere (every rank traces the same
    program, so every rank asks the same)."""
    from jax_ep import auto_table, overlap

    asked = []
    monkeypatch.setattr(auto_table, "pull_faster", lambda knob, tokens, ep, blocks: asked.append(blocks))
    monkeypatch.setattr(runtime, "has_variant", lambda op, variant: variant == "side")
    job("local_peers", [])
    side = EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                    kernel=KernelConfig(num_sms=40, side_num_sms=12))
    cuda_backend._attrs("dispatch", side, 4, 1, 16, hidden=128, row_bytes=256, capacity=64, num_experts=8)
    with overlap.beside(lambda: None):
        cuda_backend._attrs("dispatch", side, 4, 1, 16, hidden=128, row_bytes=256, capacity=64, num_experts=8)
    assert asked == [40, 12]


def test_a_masked_call_pushes_its_rows(job, monkeypatch):
    """A call with a rank_mask pushes its rows (KernelConfig.*_pull None: whatever the table says;
    True: refused naming the op): a rank masked in this call is not waited for at its start, yet may
    still be pulling the previous call's rows from the staging the pulled form rewrites. The
    hierarchical ops push in both stages (a stage's barrier does not wait for the other stage's group)
    and refuse an explicit pull."""
    from jax_ep import auto_table, hierarchical

    monkeypatch.setattr(auto_table, "pull_faster", lambda *a: True)
    job("local_peers", [])
    auto = EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16)
    for op in ("dispatch", "dispatch_rank_major", "broadcast", "broadcast_rank_major"):
        assert cuda_backend._transport(op, auto, 4) == cuda_backend.TRANSPORT_PULL
        assert cuda_backend._transport(op, auto, 4, masked=True) == cuda_backend.TRANSPORT_LOAD_STORE
    with pytest.raises(NotImplementedError, match=r"dispatch with a rank_mask and KernelConfig\(dispatch_"):
        cuda_backend._transport("dispatch", pulled("load_store"), 4, masked=True)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "local"))
    staged = jax.shard_map(lambda: hierarchical.stage_configs(pulled("load_store").replace(axis_name="local"),
                                                              "node", "dispatch") and jnp.zeros(()),
                           mesh=mesh, in_specs=(), out_specs=P())
    with pytest.raises(NotImplementedError, match=r"KernelConfig\(dispatch_pull=True\) with the hierarch"):
        jax.make_jaxpr(staged)()
