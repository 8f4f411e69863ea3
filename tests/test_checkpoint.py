"""jax_ep.checkpoint: a model with MoE layers (parameters, balancing bias, load statistics, expert
placement) and its optimizer saved with Orbax and restored on another EP size (8 -> 4 and 4 -> 8 EP
ranks: meshes over 8 and 4 of this process's 8 CPU devices), expert weights resharded over the new EP
axis, same outputs; placement rules; mismatch errors; Orbax imported lazily.

Outputs on another EP size agree to float32 rounding, not bit for bit: each rank's expert GEMM
(XLA:CPU's ragged_dot) accumulates over its own number of local experts (measured: <= 4 ulps of the
output's largest value); on the same EP size everything is bit-exact.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import parametrize_slow_tail, require_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep.checkpoint as ckpt
from jax_ep import eplb
from jax_ep.balancing import BalancingConfig
from jax_ep.errors import EPValueError
from jax_ep.gating import RouterConfig
from jax_ep.moe import EPOptions, ExpertBias, ExpertLoad, MoE

HIDDEN, FFN, SHARED, EXPERTS, TOPK = 16, 24, 8, 16, 4
EPS32 = float(np.finfo(np.float32).eps)
ULPS = 64     # tolerance across EP sizes, in float32 ulps of the output's largest value


class Net(nnx.Module):
    """A non-MoE layer in front of an MoE layer (shared expert, bias balancing)."""

    def __init__(self, mesh, *, seed=0, hidden=HIDDEN, experts=EXPERTS, topk=TOPK, placement=None, **routing):
        rngs = nnx.Rngs(seed)
        self.proj = nnx.Linear(hidden, hidden, rngs=rngs)
        self.moe = MoE(hidden, FFN, RouterConfig(experts, topk, **routing), rngs=rngs, mesh=mesh,
                       ep=EPOptions(backend="reference"), balancing=BalancingConfig(bias_update_rate=0.05),
                       shared_ffn_hidden=SHARED, placement=placement)

    def __call__(self, x, update_stats=True):
        return self.moe(self.proj(x), update_stats=update_stats)


def make_mesh(n):
    require_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("ep",))


def place(module, mesh):
    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)
    nnx.update(module, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)))


def loss_fn(net, x):
    return jnp.mean(net(x) ** 2)


@nnx.jit
def train_step(net, optimizer, x):
    loss, grads = nnx.value_and_grad(loss_fn)(net, x)
    optimizer.update(net, grads)
    return loss


@nnx.jit
def forward(net, x):
    return net(x, update_stats=False)


@nnx.jit
def observe(net, x):
    """A forward that records the statistics (loads, bias update): a cheaper compile than a step."""
    return net(x)


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little") % 2**31


def tokens(rng, mesh, batch=16, seq=4):
    x = jnp.asarray(rng.standard_normal((batch, seq, HIDDEN)), jnp.float32)
    return jax.device_put(x, NamedSharding(mesh, P("ep")))


def trained(mesh, rng, *, steps=3, placement_slots=None, train=True):
    """A Net and its AdamW optimizer after a few steps (loads, bias, moments all non-trivial); with
    placement_slots, an EPLB placement planned from the loads after the first step. train=False: only
    the statistics move (forwards), the parameters stay the initial ones."""
    net = Net(mesh, seed=int(rng.integers(1 << 30)))
    place(net, mesh)
    optimizer = nnx.Optimizer(net, optax.adamw(1e-2), wrt=nnx.Param)
    place(optimizer, mesh)
    for step in range(steps):
        if train:
            train_step(net, optimizer, tokens(rng, mesh))
        else:
            observe(net, tokens(rng, mesh))
        if step == 0 and placement_slots:
            R = mesh.shape["ep"]
            ckpt._set_placement(net.moe, eplb.plan_placement(np.asarray(net.moe.total_load[...]), R,
                                                             placement_slots))
    return net, optimizer


def blank(mesh, seed=12345):
    """The same architecture on `mesh`, other initial values (what restore must overwrite)."""
    net = Net(mesh, seed=seed)
    place(net, mesh)
    optimizer = nnx.Optimizer(net, optax.adamw(1e-2), wrt=nnx.Param)
    place(optimizer, mesh)
    return net, optimizer


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


def assert_close_ulps(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=ULPS * EPS32 * scale, err_msg=what)


# ---------------------------------------------------------------------------------------------------------
@parametrize_slow_tail("saved_ep,restored_ep", [(8, 4), (4, 8)])
def test_restore_on_other_ep_size(tmp_path, saved_ep, restored_ep):
    """Everything restored bit for bit, resharded; the same outputs; 8 -> 4 also the same next step
    (the same EP size: bit for bit, test_placement_kept_on_same_ep_size_replanned_on_another)."""
    rng = np.random.default_rng(fresh_seed())
    mesh_a, mesh_b = make_mesh(saved_ep), make_mesh(restored_ep)
    net, optimizer = trained(mesh_a, rng)
    path = ckpt.save(tmp_path / "ckpt", net, optimizer)
    record = ckpt.read_record(path)
    assert record["moe_layers"]["moe"]["ep_size"] == saved_ep
    assert record["moe_layers"]["moe"]["placement"] is None

    other, other_opt = blank(mesh_b)
    ckpt.restore(path, other, other_opt)
    # every array bit for bit: parameters, bias, loads, optimizer moments and step
    assert_trees_equal(nnx.state(other), nnx.state(net))
    assert_trees_equal(nnx.state(other_opt), nnx.state(optimizer))
    assert float(np.abs(np.asarray(other.moe.expert_bias[...])).max()) > 0   # trained, not initial
    # expert weights (and their moments) sharded over the new EP axis
    for array in (other.moe.w_gate_up[...], other.moe.w_down[...],
                  other_opt.opt_state[0].mu["moe"]["w_gate_up"][...]):
        assert array.sharding.mesh.shape["ep"] == restored_ep
        assert array.sharding.spec[0] == "ep"
        assert {s.data.shape[0] for s in array.addressable_shards} == {EXPERTS // restored_ep}
    assert other.moe.expert_bias[...].sharding.is_fully_replicated

    # the same function of fresh inputs
    x_a = tokens(rng, mesh_a)
    x_b = jax.device_put(np.asarray(x_a), NamedSharding(mesh_b, P("ep")))
    assert_close_ulps(forward(other, x_b), forward(net, x_a), f"output {saved_ep} -> {restored_ep}")
    if restored_ep < saved_ep:
        # the next training step: the same loss, and the same routing (loads, bias update)
        loss_a, loss_b = train_step(net, optimizer, x_a), train_step(other, other_opt, x_b)
        np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5)
        stats = nnx.Any(ExpertBias, ExpertLoad)
        assert_trees_equal(nnx.state(other.moe, stats), nnx.state(net.moe, stats))


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_placement_kept_on_same_ep_size_replanned_on_another(tmp_path):
    rng = np.random.default_rng(fresh_seed())
    mesh8, mesh4 = make_mesh(8), make_mesh(4)
    net, _ = trained(mesh8, rng, steps=2, placement_slots=3, train=False)   # 8 x 3 slots
    saved_placement = net.moe.placement
    assert saved_placement.num_slots == 24
    path = ckpt.save(tmp_path / "ckpt", net)                          # model only
    assert ckpt.read_record(path)["moe_layers"]["moe"]["placement"] == {
        "num_ranks": 8, "slots_per_rank": 3, "max_replicas": saved_placement.logical_to_physical.shape[1]}
    x8 = tokens(rng, mesh8)
    want = np.asarray(forward(net, x8))

    # same EP size: the placement and the per-slot statistics as saved, outputs bit for bit (the
    # model it is restored into has no placement)
    same, _ = blank(mesh8)
    assert same.moe.placement is None
    ckpt.restore(path, same)
    for name in ("physical_to_logical", "logical_to_physical", "replica_counts"):
        np.testing.assert_array_equal(np.asarray(getattr(same.moe.placement, name)),
                                      np.asarray(getattr(saved_placement, name)))
    assert (same.moe.placement.num_ranks, same.moe.placement.slots_per_rank) == (8, 3)
    assert_trees_equal(nnx.state(same), nnx.state(net))
    np.testing.assert_array_equal(np.asarray(forward(same, x8)), want)

    # 4 ranks: re-planned from the saved total load, 4 x 6 = the same 24 slots; slot statistics restart
    other, _ = blank(mesh4)
    ckpt.restore(path, other)
    total_load = np.asarray(net.moe.total_load[...])
    expected = eplb.plan_placement(total_load, 4, 6)
    got = other.moe.placement
    assert (got.num_ranks, got.slots_per_rank) == (4, 6)
    np.testing.assert_array_equal(np.asarray(got.physical_to_logical), expected.physical_to_logical)
    np.testing.assert_array_equal(np.asarray(got.logical_to_physical), expected.logical_to_physical)
    assert other.moe.last_slot_load[...].shape == (24,)
    assert not np.asarray(other.moe.total_slot_load[...]).any()
    np.testing.assert_array_equal(np.asarray(other.moe.total_load[...]), total_load)
    assert_trees_equal(nnx.state(other, nnx.Param), nnx.state(net, nnx.Param))
    x4 = jax.device_put(np.asarray(x8), NamedSharding(mesh4, P("ep")))
    assert_close_ulps(forward(other, x4), want, "output with the re-planned placement")

    # "drop": no placement (contiguous experts), same function
    dropped, _ = blank(mesh4)
    ckpt.restore(path, dropped, placement="drop")
    assert dropped.moe.placement is None and dropped.moe.last_slot_load[...].shape == (EXPERTS,)
    assert_close_ulps(forward(dropped, x4), want, "output without the placement")

    # "error": refuses, naming both rank counts
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"MoE layer 'moe' has an expert placement for 8 EP ranks, the model's EP axis "
                             r"'ep' has 4"):
        ckpt.restore(path, blank(mesh4)[0], placement="error")
    with pytest.raises(ValueError, match="placement must be one of"):
        ckpt.restore(path, blank(mesh4)[0], placement="keep")


def test_restore_into_abstract_model(tmp_path):
    """A model made with nnx.eval_shape (no memory for its initial values) restores onto the mesh."""
    rng = np.random.default_rng(fresh_seed())
    mesh8, mesh4 = make_mesh(8), make_mesh(4)
    net, _ = trained(mesh8, rng, steps=2, train=False)
    path = ckpt.save(tmp_path / "ckpt", net)
    abstract = nnx.eval_shape(lambda: Net(mesh4, seed=7))
    ckpt.restore(path, abstract, mesh=mesh4)
    assert_trees_equal(nnx.state(abstract), nnx.state(net))
    assert abstract.moe.w_down[...].sharding.spec[0] == "ep"
    x8 = tokens(rng, mesh8)
    x4 = jax.device_put(np.asarray(x8), NamedSharding(mesh4, P("ep")))
    assert_close_ulps(forward(abstract, x4), forward(net, x8), "abstract restore")


def test_restore_into_abstract_model_with_a_placement(tmp_path):
    """An abstract model restores a checkpoint that holds an expert placement, kept (same EP size, the
    abstract layer built with or without one) or re-planned (before 2026-12-05: TypeError, the
    restore read the abstract bias's and placement table's values)."""
    mesh8, mesh4 = make_mesh(8), make_mesh(4)
    saved = eplb.identity_placement(EXPERTS, 8, 3)
    net = Net(mesh8, placement=saved)
    path = ckpt.save(tmp_path / "ckpt", net)
    for mesh, placement, want in ((mesh8, None, (8, 3)), (mesh8, saved, (8, 3)), (mesh4, None, (4, 6))):
        abstract = nnx.eval_shape(lambda m=mesh, p=placement: Net(m, seed=7, placement=p))
        ckpt.restore(path, abstract, mesh=mesh)
        got = abstract.moe.placement
        assert (got.num_ranks, got.slots_per_rank) == want
        assert abstract.moe.last_slot_load[...].shape == (want[0] * want[1],)
        assert_trees_equal(nnx.state(abstract, nnx.Param), nnx.state(net, nnx.Param))
        if want == (8, 3):
            np.testing.assert_array_equal(np.asarray(got.physical_to_logical), saved.physical_to_logical)


def test_a_model_with_rng_state_restores_its_keys(tmp_path):
    """A model that keeps nnx.Rngs state (nnx.Dropout(rngs=...)): its typed PRNG keys are saved as key
    data and restored as keys of the model's type (before 2026-12-05 the restore raised a TypeError
    naming no array)."""
    mesh = make_mesh(4)

    class WithDropout(nnx.Module):
        def __init__(self, seed):
            rngs = nnx.Rngs(seed, dropout=seed + 1)
            self.net = Net(mesh, seed=seed)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    seed = fresh_seed() % 1000
    net = WithDropout(seed)
    net.drop(jnp.ones((4,)))            # the stream moves on: count 1
    path = ckpt.save(tmp_path / "ckpt", net)
    other = WithDropout(seed + 1)
    ckpt.restore(path, other)
    key = other.drop.rngs.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(net.drop.rngs.key[...]))
    assert int(other.drop.rngs.count[...]) == 1
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((8,)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(other.drop(x)), np.asarray(net.drop(x)))
    # a checkpoint written before 2026-12-05 (typed keys as Orbax saves them) restores too
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "_pure", lambda node: nnx.to_pure_dict(nnx.state(node)))
        old = ckpt.save(tmp_path / "old", net)
    again = WithDropout(seed + 2)
    ckpt.restore(old, again)
    np.testing.assert_array_equal(jax.random.key_data(again.drop.rngs.key[...]),
                                  jax.random.key_data(net.drop.rngs.key[...]))


def test_a_refused_placement_leaves_every_layer_as_it_was(tmp_path):
    """A restore that refuses one layer's placement after the arrays were read (a hierarchical layer
    takes none) changes no layer, and the error names the checkpoint's layer and placement='drop'
    (before 2026-12-05 the layers before it already had their new placement)."""

    class Two(nnx.Module):
        def __init__(self, mesh, seed, placement=None, node_axis=None):
            rngs = nnx.Rngs(seed)
            self.a = MoE(HIDDEN, FFN, RouterConfig(EXPERTS, TOPK), rngs=rngs, mesh=mesh,
                         ep=EPOptions(backend="reference"), placement=placement)
            self.b = MoE(HIDDEN, FFN, RouterConfig(EXPERTS, TOPK), rngs=rngs, mesh=mesh,
                         ep=EPOptions(backend="reference"), placement=placement, node_axis=node_axis)

    require_devices(8)
    path = ckpt.save(tmp_path / "ckpt", Two(make_mesh(8), 0, eplb.identity_placement(EXPERTS, 8, 3)))
    mesh2x4 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "ep"))
    other = Two(mesh2x4, 5, node_axis="node")
    before = host(nnx.state(other))
    with pytest.raises(NotImplementedError, match=r"MoE layer 'b' cannot take its restored expert placement: "
                                                  r".*node_axis.*placement='drop'"):
        ckpt.restore(path, other)
    assert other.a.placement is None and other.b.placement is None
    assert_trees_equal(nnx.state(other), before)
    ckpt.restore(path, other, placement="drop")
    assert other.a.placement is None and other.a.last_slot_load[...].shape == (EXPERTS,)


# ---------------------------------------------------------------------------------------------------------
def test_mismatch_errors_name_field_and_values(tmp_path):
    mesh4 = make_mesh(4)
    net = Net(mesh4)
    path = ckpt.save(tmp_path / "ckpt", net)
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"MoE layer 'moe': routing.num_experts is 16 in the checkpoint, 8 in the model"):
        ckpt.restore(path, Net(mesh4, experts=8))
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"MoE layer 'moe': routing.num_topk is 4 in the checkpoint, 2 in the model"):
        ckpt.restore(path, Net(mesh4, topk=2))
    with pytest.raises(ckpt.CheckpointMismatchError) as err:
        ckpt.restore(path, Net(mesh4, hidden=32))
    assert "MoE layer 'moe': hidden is 16 in the checkpoint, 32 in the model" in str(err.value)
    # a non-MoE array: named with both shapes (the MoE fields match here)
    other = Net(mesh4)
    other.proj = nnx.Linear(HIDDEN, HIDDEN, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"model array 'proj/bias' is in the checkpoint, "
                                                           r"not in the model"):
        ckpt.restore(path, other)
    other.proj = nnx.Linear(HIDDEN, HIDDEN, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"model array 'proj/kernel': dtype float32 in the "
                                                           r"checkpoint, bfloat16 in the model"):
        ckpt.restore(path, other)
    with pytest.raises(ckpt.CheckpointMismatchError, match="has no optimizer state"):
        ckpt.restore(path, Net(mesh4), nnx.Optimizer(Net(mesh4), optax.sgd(1.0), wrt=nnx.Param))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ckpt.restore(tmp_path / "missing", Net(mesh4))
    # a failed restore leaves the model as it was
    fresh = Net(mesh4, seed=3)
    before = host(nnx.state(fresh))
    with pytest.raises(ckpt.CheckpointMismatchError):
        ckpt.restore(path, fresh, nnx.Optimizer(fresh, optax.sgd(1.0), wrt=nnx.Param))
    assert_trees_equal(nnx.state(fresh), before)


def test_a_directory_that_is_not_a_jax_ep_checkpoint_is_a_mismatch(tmp_path):
    """An empty directory, a parent directory of a checkpoint (train_moe's DIR instead of DIR/<run>) and
    a plain Orbax checkpoint: CheckpointMismatchError saying so, listing what the directory holds and
    naming a subdirectory that is a jax_ep checkpoint (before 2026-12-05: Orbax's KeyError 'Item
    "jax_ep" was not found', which examples/train_moe.py did not catch)."""
    import orbax.checkpoint as ocp

    mesh4 = make_mesh(4)
    net = Net(mesh4)
    (tmp_path / "empty").mkdir()
    run = ckpt.save(tmp_path / "parent" / "run1", net)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "plain"), {"w": jnp.ones(3)})
    for name, holds in (("empty", "it holds nothing"), ("parent", "it holds ['run1']"),
                        ("plain", "it holds [")):
        path = str(tmp_path / name)
        for args in ((path,), (path, net)):
            with pytest.raises(ckpt.CheckpointMismatchError) as err:
                (ckpt.read_record if len(args) == 1 else ckpt.restore)(*args)
            message = str(err.value)
            assert f"checkpoint {path}: not a jax_ep checkpoint" in message and holds in message, message
            assert (run in message) == (name == "parent"), message
    assert ckpt.read_record(run)["moe_layers"].keys() == {"moe"}
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no checkpoint at"):
        ckpt.read_record(tmp_path / "missing")


def test_saving_onto_an_existing_checkpoint_names_overwrite(tmp_path):
    """An existing path is an EPValueError naming it and overwrite=True (was Orbax's plain ValueError
    'Destination ... already exists', not an EPError; found by a review, 2026-12-05); overwrite=True
    replaces it."""
    net = Net(make_mesh(2))
    path = ckpt.save(tmp_path / "ck", net)
    with pytest.raises(EPValueError, match=f"{path} already exists; pass overwrite=True"):
        ckpt.save(tmp_path / "ck", net)
    assert ckpt.save(tmp_path / "ck", net, overwrite=True) == path
    assert ckpt.read_record(path)["moe_layers"].keys() == {"moe"}


def test_a_mesh_other_than_the_layers_is_refused(tmp_path):
    """restore(mesh=M) with M not the MoE layers' mesh (other axis sizes, or the same sizes on other
    devices): EPValueError naming both, the model left as it was (before 2026-12-05 accepted: the
    weights landed on M, the placement was re-planned for the layer's own EP size and its next call
    failed with JAX's 'incompatible devices'). An equal mesh made anew is the layers' mesh."""
    require_devices(8)
    mesh4 = make_mesh(4)
    path = ckpt.save(tmp_path / "ckpt", Net(make_mesh(8), seed=fresh_seed() % 1000,
                                            placement=eplb.identity_placement(EXPERTS, 8, 3)))
    net = Net(mesh4, seed=3)
    before = host(nnx.state(net))
    other_devices = Mesh(np.array(jax.devices()[4:8]), ("ep",))
    for mesh, match in ((make_mesh(2), r"mesh=\{'ep': 2\} is not MoE layer 'moe''s mesh \{'ep': 4\}"),
                        (other_devices, r"mesh=\{'ep': 4\} on devices \[4, 5, 6, 7\] is not MoE layer "
                                        r"'moe''s mesh \{'ep': 4\} on devices \[0, 1, 2, 3\]")):
        with pytest.raises(EPValueError, match=match):
            ckpt.restore(path, net, mesh=mesh)
        assert_trees_equal(nnx.state(net), before)
        assert net.moe.placement is None
    ckpt.restore(path, net, mesh=Mesh(np.array(jax.devices()[:4]), ("ep",)))
    assert (net.moe.placement.num_ranks, net.moe.placement.slots_per_rank) == (4, 6)
    assert net.moe.w_down[...].sharding.mesh.shape == mesh4.shape
    x = jax.device_put(jnp.ones((8, HIDDEN)), NamedSharding(mesh4, P("ep")))
    assert np.isfinite(np.asarray(forward(net, x))).all()


def test_group_score_is_checked_where_it_routes(tmp_path):
    """RouterConfig.group_score (added 2026-12-05) is a checked field where a group limit uses it; a record
    written before it existed has the rule of then ("top2_sum")."""
    mesh4 = make_mesh(4)
    groups = dict(num_groups=4, topk_groups=2)
    path = ckpt.save(tmp_path / "ckpt", Net(mesh4, **groups))
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"MoE layer 'moe': routing.group_score is 'top2_sum' in the checkpoint, 'max'"):
        ckpt.restore(path, Net(mesh4, group_score="max", **groups))
    record = ckpt.read_record(path)["moe_layers"]
    del record["moe"]["config"]["routing.group_score"]              # as an older checkpoint's record
    ckpt._check_layers(path, record, ckpt.moe_layers(Net(mesh4, **groups)))
    with pytest.raises(ckpt.CheckpointMismatchError, match="routing.group_score"):
        ckpt._check_layers(path, record, ckpt.moe_layers(Net(mesh4, group_score="max", **groups)))
    # without a group limit no group is scored: the rule does not matter
    path = ckpt.save(tmp_path / "nolimit", Net(mesh4))
    ckpt.restore(path, Net(mesh4, group_score="max"))


def test_restore_refuses_a_layer_that_would_compute_otherwise(tmp_path):
    """Restores that would give another function are errors naming the layer (before 2026-12-05 they
    succeeded): a rank cap (routing by the EP size's layout) on another EP size; no placement where the
    experts do not divide over the EP size (the first call failed in shard_map)."""
    mesh4, mesh8 = make_mesh(4), make_mesh(8)
    path = ckpt.save(tmp_path / "cap", Net(mesh8, max_ranks_per_token=2))
    ckpt.restore(path, Net(mesh8, max_ranks_per_token=2))
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"MoE layer 'moe': its rank / node caps "
                                                           r"\(max_ranks_per_token=2, .* \(8, None\) \(EP "
                                                           r"size, nodes\) in the checkpoint, \(4, None\)"):
        ckpt.restore(path, Net(mesh4, max_ranks_per_token=2))
    # a cap that cuts on neither EP size (8 ranks of 4 or 2) is no cap: the same routing, restored
    path = ckpt.save(tmp_path / "nocap", Net(mesh4, max_ranks_per_token=8))
    ckpt.restore(path, Net(make_mesh(2), max_ranks_per_token=8))
    path = ckpt.save(tmp_path / "twelve", Net(mesh4, experts=12))
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"MoE layer 'moe' would have no expert placement, "
                                                           r"and its num_experts=12 do not divide over the "
                                                           r"model's EP size 8"):
        ckpt.restore(path, Net(mesh8, experts=12, placement=eplb.plan_placement(np.ones(12), 8, 2)))


def test_stacked_layers_restore_with_their_statistics(tmp_path):
    """MoE layers stacked with nnx.vmap (a scanned model): the per-slot statistics keep their layer axis
    (before 2026-12-05 restore replaced them by zeros [E] and the model no longer ran); a placement on
    stacked layers is refused."""
    mesh = make_mesh(4)

    def stacked(seed, placement=None):
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(key):
            return MoE(HIDDEN, FFN, RouterConfig(EXPERTS, TOPK), rngs=nnx.Rngs(key), mesh=mesh,
                       ep=EPOptions(backend="reference"), placement=placement)
        return make(jax.random.split(jax.random.key(seed), 2))

    @nnx.jit
    def run(layers, x):
        return nnx.scan(lambda layer, x: x + layer(x, update_stats=False), in_axes=(0, nnx.Carry),
                        out_axes=nnx.Carry)(layers, x)

    rng = np.random.default_rng(fresh_seed())
    saved = stacked(0)
    x = tokens(rng, mesh)
    want = run(saved, x)
    path = ckpt.save(tmp_path / "stacked", saved)
    restored = stacked(7)
    ckpt.restore(path, restored)
    assert restored.total_slot_load[...].shape == (2, EXPERTS)
    np.testing.assert_array_equal(np.asarray(run(restored, x)), np.asarray(want))
    path = ckpt.save(tmp_path / "placed", stacked(0, eplb.identity_placement(EXPERTS, 4)))
    with pytest.raises(NotImplementedError, match="is stacked .* and has an expert placement"):
        ckpt.restore(path, stacked(7, eplb.identity_placement(EXPERTS, 4)))
    # placement="drop": nothing of the placement to restore (refused too before 2026-12-05)
    dropped = stacked(7)
    ckpt.restore(path, dropped, placement="drop")
    assert dropped.placement is None and dropped.total_slot_load[...].shape == (2, EXPERTS)


def test_orbax_is_optional(monkeypatch):
    """import jax_ep (and its MoE layer) does not import Orbax; without it the checkpoint functions say
    what to install."""
    code = ("import sys, jax_ep, jax_ep.moe, jax_ep.checkpoint; "
            "print(sorted(m for m in sys.modules if m.startswith('orbax.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(ImportError, match=r"pip install 'jax_ep\[checkpoint\]'"):
        ckpt.save("/tmp/unused", Net(None))
