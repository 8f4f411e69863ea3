"""One order of EP calls in every process (jax_ep.ordering).

Every communicating custom call must be issued in the same order on every process, whatever each
process's XLA schedules (process model 2 compiles one executable per process). The guarantee is a data
dependency from each EP call to the next in the program that XLA receives: these tests lower real
programs through the CUDA backend for the 'cuda' platform (no GPU needed to lower) and check, on the
StableHLO dataflow graph, that the jax_ep custom calls form one chain in program order. Before the
ordering token, the backward of dispatch issued its combine (d x) and its slot_values (d topk_weights)
with no dependency between them: the failure seen on 4 H200s (2026-11-28), where process 3 ran combine
while processes 0-2 ran slot_values.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_cuda_here
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import cuda_backend, ordering, runtime
from jax_ep.config import EPConfig, KernelConfig
from jax_ep.errors import EPUnsupportedError

R, T, H, E, K = 4, 16, 128, 8, 2


_NEEDED = ordering.needed


@pytest.fixture(autouse=True)
def several_processes(monkeypatch):
    """The ordering as several processes get it (in one process the calls carry no effect)."""
    monkeypatch.setattr(ordering, "needed", lambda: True)


def test_one_process_issues_the_calls_without_the_effect(monkeypatch):
    """One process compiles one program for all of its devices (one schedule): no effect, so JAX's
    runtime token (a host wait for the previous step before each launch) stays out of its steps."""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    assert jax.process_count() == 1 and not ordering.needed()
    jaxpr = jax.make_jaxpr(lambda a: _stand_in(a, "one"))(jnp.ones(3))
    assert not jaxpr.effects and ordering.ep_calls(jaxpr) == []
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a: _stand_in(a, "one"))(jnp.ones(3))),
                               np.sin(np.ones(3)) * 2.0, rtol=1e-6)


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Trace the CUDA backend on this CPU machine: what only a GPU process does at trace time (register
    the targets, size the buffers) is skipped; lowering needs neither."""
    lower_cuda_here(monkeypatch, stub_extension=False)
    monkeypatch.setattr(runtime, "unreachable_processes", lambda: [])
    monkeypatch.setattr(runtime, "process_model", lambda: "local_peers")


def _mesh():
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (R * T, H), jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(k[1], (R * T, E)), axis=1)[:, :K].astype(jnp.int32)
    wts = jax.random.uniform(k[2], (R * T, K), jnp.float32)
    w = (jax.random.normal(k[3], (E, H, H)) / H**0.5).astype(jnp.bfloat16)
    return x, idx, wts, w


def _cfg(**kw):
    return EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="cuda", **kw)


def _expert_major_loss(cfg):
    def loss(x, idx, wts, w):
        d = jax_ep.dispatch(x, idx, wts, cfg)
        y = jax_ep.grouped_matmul(d.x, w, d.group_sizes)
        return jnp.sum(jax_ep.combine(y, d.handle, cfg).astype(jnp.float32) ** 2)
    return loss


def _rank_major_loss(cfg):
    def loss(x, idx, wts, w):
        d = jax_ep.dispatch_rank_major(x, idx, wts, cfg)
        y = d.x * w[0, 0, 0]
        return jnp.sum(jax_ep.combine_rank_major(y, d.handle, cfg).astype(jnp.float32) ** 2)
    return loss


def _two_layers(cfg):
    one = _expert_major_loss(cfg)

    def loss(x, idx, wts, w):  # two MoE layers: the second's routing independent of the first's
        d = jax_ep.dispatch(x, idx, wts, cfg)
        y = jax_ep.combine(jax_ep.grouped_matmul(d.x, w, d.group_sizes), d.handle, cfg)
        return one(y.astype(x.dtype), jnp.flip(idx, axis=1), wts, w) + jnp.sum(y.astype(jnp.float32))
    return loss


PROGRAMS = {
    "expert_major": _expert_major_loss,
    "rank_major": _rank_major_loss,
    "two_layers": _two_layers,
}


def _grad_program(loss):
    return jax.shard_map(jax.grad(loss, argnums=(0, 2, 3)), mesh=_mesh(),
                         in_specs=P("ep"), out_specs=P("ep"))


# ---- the StableHLO dataflow graph ---------------------------------------------------------------
def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                inner = inner.operation  # an OpView's .name can be its symbol's name
                yield inner
                yield from _walk(inner)


class Dataflow:
    """Which jax_ep custom calls each one (transitively) depends on, in a lowered module. Precise for
    what these programs contain: func.call (followed per call site; from inside a function, out through
    its one call site), sdy.manual_computation (block
    argument i is operand i, result i is the terminator's operand i), ops whose regions are scalar
    functions (reduce, sort, scatter), branches (case, if: a result depends on the index and on what
    each branch returns); a loop is refused."""

    def __init__(self, module):
        from jax._src.lib.mlir import ir

        self.ir = ir
        self.module = module   # held: its ops die with it (a freed module's ops crashed MLIR's bindings)
        top = module.operation
        self.funcs = {str(f.attributes["sym_name"]).strip('"'): f for f in _walk(top)
                      if f.name == "func.func"}
        self.calls = [o for o in _walk(top) if o.name == "stablehlo.custom_call"
                      and str(o.attributes["call_target_name"]).strip('"').startswith("jax_ep_")]
        # the call sites of each function: a custom call inside one (compute_on's wrapper of a call on
        # an async stream) depends on what its function's single call site passes it
        self.callers = {}
        for o in _walk(top):
            if o.name == "func.call":
                self.callers.setdefault(str(o.attributes["callee"]).lstrip("@").strip('"'), []).append(o)
        self.memo = {}

    def name(self, call) -> str:
        return str(call.attributes["call_target_name"]).strip('"')

    def ancestors(self, call) -> set[int]:
        """Indices (in self.calls) of the EP calls that `call` depends on."""
        return self.value_ancestors(call.operands)

    def value_ancestors(self, values) -> set[int]:
        """Indices (in self.calls) of the EP calls that any of `values` depends on."""
        return self._upstream(values)[0]

    def upstream_ops(self, values) -> list:
        """Every op that any of `values` depends on (their own ops included)."""
        return self._upstream(values)[1]

    def _upstream(self, values):
        found, seen, ops = set(), set(), []
        stack = [(v, ()) for v in values]
        while stack:
            value, sites = stack.pop()
            key = (value, sites)
            if key in seen:
                continue
            seen.add(key)
            if not isinstance(value, self.ir.BlockArgument):
                ops.append(getattr(value.owner, "operation", value.owner))
            stack.extend(self._sources(value, sites, found))
        return found, ops

    def _sources(self, value, sites, found):
        ir = self.ir
        if isinstance(value, ir.BlockArgument):
            parent = value.owner.owner
            parent = getattr(parent, "operation", parent)
            if parent.name == "func.func":
                if sites:
                    return [(sites[-1].operands[value.arg_number], sites[:-1])]
                callers = self.callers.get(str(parent.attributes["sym_name"]).strip('"'), [])
                assert len(callers) <= 1, "a function called from several sites: which one is unknown here"
                return [(callers[0].operands[value.arg_number], ())] if callers else []
            if parent.name == "sdy.manual_computation":
                return [(parent.operands[value.arg_number], sites)]
            raise AssertionError(f"unhandled region owner {parent.name}")
        op = value.owner
        op = getattr(op, "operation", op)
        if op.name == "func.call":
            callee = self.funcs[str(op.attributes["callee"]).lstrip("@").strip('"')]
            ret = list(callee.regions[0].blocks[0].operations)[-1].operation
            return [(ret.operands[value.result_number], sites + (op,))]
        if op.name == "sdy.manual_computation":
            ret = list(op.regions[0].blocks[0].operations)[-1].operation
            return [(ret.operands[value.result_number], sites)]
        if op.name in ("stablehlo.case", "stablehlo.if"):
            # a branch's result: the index and what each branch returns (its ops read values of the
            # enclosing block directly; its regions take no arguments)
            rets = [list(r.blocks[0].operations)[-1].operation for r in op.regions]
            return [(v, sites) for v in op.operands] + [(ret.operands[value.result_number], sites)
                                                        for ret in rets]
        if op.name == "stablehlo.while":
            raise AssertionError(f"unhandled control flow {op.name}")
        # any other op (a reduce's or sort's region is a scalar function of its operands): its results
        # depend on its operands
        for i, call in enumerate(self.calls):
            if call == op:
                found.add(i)
        return [(v, sites) for v in op.operands]


def _lowered(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")


def assert_one_chain(fn, *args, what: str) -> list[str]:
    """The jax_ep custom calls of fn's lowered program: each depends on every one before it in the
    jaxpr's order. Returns their names in that order."""
    expected = ordering.ep_calls(jax.make_jaxpr(fn)(*args))
    flow = Dataflow(_lowered(fn, *args))
    names = [flow.name(c) for c in flow.calls]
    assert len(names) >= 5 and sorted(names) == sorted(expected), (names, expected)
    # a total order: each call depends on every call before it in the jaxpr's order
    order = sorted(range(len(flow.calls)), key=lambda i: len(flow.ancestors(flow.calls[i])))
    for rank, i in enumerate(order):
        ancestors = flow.ancestors(flow.calls[i])
        assert ancestors == set(order[:rank]), (
            f"{what}: EP call {names[i]} depends on {sorted(names[a] for a in ancestors)}, not on "
            f"every earlier call {[names[a] for a in order[:rank]]}: XLA may issue it in another order "
            "on another process")
    assert [names[i] for i in order] == expected
    return expected


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_lowered_ep_calls_form_one_chain_in_program_order(cuda_lowering, program):
    assert_one_chain(_grad_program(PROGRAMS[program](_cfg())), *_inputs(), what=program)


# the layer's side-stream overlaps, by name: their EPOptions
OVERLAPS = {"shared_beside": dict(shared_beside=True),
            "shared_split": dict(shared_beside=True, shared_split=True),
            "weight_grad_beside": dict(weight_grad_beside=True)}


def _cuda_layer(shared_beside: bool = False, kernel: KernelConfig | None = None, **ep):
    """A small bf16 MoE layer on the 'cuda' backend over _mesh() (a shared expert with shared_beside;
    ep: more EPOptions)."""
    from flax import nnx

    from jax_ep import moe
    from jax_ep.gating import RouterConfig

    return moe.MoE(H, 2 * H, RouterConfig(E, K), rngs=nnx.Rngs(0), mesh=_mesh(), axis_name="ep",
                   ep=moe.EPOptions(backend="cuda", kernel=kernel or KernelConfig(),
                                    shared_beside=shared_beside, **ep),
                   param_dtype=jnp.bfloat16, shared_ffn_hidden=H if shared_beside else 0)


def _layer_step(kernel, shared_beside: bool = False, checkpoint=None, **ep):
    """(the MoE layer's training step, its params, its input x). shared_beside: with a shared expert
    beside the last combine (EPOptions.shared_beside); remat: None, else the residual block x + layer(x)
    rematerialised: checkpoint None, else jax.checkpoint with that policy ("no_policy": none)."""
    from flax import nnx

    layer = _cuda_layer(shared_beside, kernel, **ep)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def step(params, x):
        def block(params, x):
            return x + nnx.merge(graphdef, params, rest)(x, update_stats=False)
        if checkpoint is not None:
            block = jax.checkpoint(block, policy=None if checkpoint == "no_policy" else checkpoint)

        def loss(params, x):
            return jnp.mean(block(params, x).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    return step, params, _inputs()[0]


def _layer_step_calls(kernel, shared_beside: bool = False, **ep) -> list[str]:
    """The EP calls of the MoE layer's training step (_layer_step; one chain in program order:
    assert_one_chain)."""
    return assert_one_chain(*_layer_step(kernel, shared_beside, **ep), what="MoE layer step")


def _lowered_calls(fn, *args) -> list[str]:
    """The jax_ep custom calls of fn's lowered program, in the order of its text."""
    flow = Dataflow(_lowered(fn, *args))
    return [flow.name(c) for c in flow.calls]


# combine's backward: the in-place broadcast with the gate weights in the experts (EPOptions.gate_weights
# "auto" on the flat exchange, the default), the fused combine_bwd with them in combine
LAYER_STEP_OPS = ["dispatch", "combine", "broadcast", "combine", "slot_values"]


@pytest.mark.parametrize("gate_weights, backward", [("auto", "broadcast"), ("combine", "combine_bwd")])
def test_the_moe_layer_training_step_issues_its_ep_calls_in_one_order(cuda_lowering, gate_weights, backward):
    assert _layer_step_calls(KernelConfig(), gate_weights=gate_weights) == [
        f"jax_ep_{op}" for op in ("dispatch", "combine", backward, "combine", "slot_values")]


@pytest.mark.parametrize("processes", ["one", "several"])
@pytest.mark.parametrize("wire", [None, "float8_e4m3fn"])
def test_a_rematerialised_layer_runs_dispatch_again_unless_the_exchange_policy_keeps_it(
        cuda_lowering, monkeypatch, processes, wire):
    """The layer in a rematerialised residual block. In one process (no ordering effect) with no policy
    its backward runs dispatch again; jax_ep.remat.policy() keeps dispatch's results (the FP8 wire's
    e4m3 rows and scales: their dequantised copy is rebuilt without an exchange), alone, beside another
    policy or offloaded, so the step issues the plain step's calls (keeping combine's output too changes
    nothing: the block's backward does not read it). With several processes the calls carry the ordered
    effect, whose results JAX always keeps (it never runs an effect twice): the plain calls, in one
    order, with or without a policy; offloading them is refused there (jax cannot lower host offload
    beside ordered effects)."""
    from jax_ep import remat

    several = processes == "several"
    if several:   # one chain in program order
        calls = functools.partial(assert_one_chain, what="rematerialised MoE layer step")
    else:         # no effect: the calls in the lowered program's order
        monkeypatch.setattr(ordering, "needed", _NEEDED)
        calls = _lowered_calls
    plain = [f"jax_ep_{op}" for op in LAYER_STEP_OPS]
    assert calls(*_layer_step(KernelConfig(), checkpoint="no_policy", dispatch_dtype=wire)) == (
        plain if several else plain[:2] + ["jax_ep_dispatch"] + plain[2:])
    offload = remat.policy(save=(), offload=(remat.DISPATCH,))
    offload_beside_dots = remat.policy(save=(), offload=(remat.DISPATCH,),
                                       base=jax.checkpoint_policies.dots_saveable)
    for policy in (remat.policy(), remat.policy(base=jax.checkpoint_policies.dots_saveable),
                   remat.policy(save=remat.NAMES)) + (() if several else (offload, offload_beside_dots)):
        assert calls(*_layer_step(KernelConfig(), checkpoint=policy, dispatch_dtype=wire)) == plain
    if several:   # JAX keeps the effect's results on the device and cannot lower host offload beside it
        for policy in (offload, remat.policy(base=jax.checkpoint_policies.offload_dot_with_no_batch_dims(
                "device", "pinned_host"))):
            with pytest.raises(EPUnsupportedError, match=r"host offload .* needs one process"):
                calls(*_layer_step(KernelConfig(), checkpoint=policy, dispatch_dtype=wire))
    else:         # the kept rows really go to host memory and back
        assert "pinned_host" not in str(_lowered(*_layer_step(KernelConfig(), checkpoint=remat.policy(),
                                                               dispatch_dtype=wire)))
        for policy in (offload, offload_beside_dots):
            assert "pinned_host" in str(_lowered(*_layer_step(KernelConfig(), checkpoint=policy,
                                                               dispatch_dtype=wire)))


@pytest.mark.parametrize("processes", ["one", "several"])
@pytest.mark.parametrize("overlap", ["shared_beside", "shared_split", "weight_grad_beside"])
def test_a_rematerialised_layer_keeps_its_side_stream_calls(cuda_lowering, monkeypatch, processes, overlap):
    """The layer's side-stream overlaps (EPOptions.shared_beside, shared_split, weight_grad_beside) in a
    rematerialised block: they lower (a side call traced without AD inside jax.checkpoint still has a
    derivative: overlap.primal), the side calls and joins are never rerun (ordering.kept_call: a rerun
    would have no join), and with remat.policy() the step issues the plain step's calls; with no policy
    in one process the rerun holds the plain dispatch where it is not a side call."""
    from jax_ep import remat

    several = processes == "several"
    if several:
        calls = functools.partial(assert_one_chain, what="rematerialised MoE layer step")
    else:
        monkeypatch.setattr(ordering, "needed", _NEEDED)
        calls = _lowered_calls
    ep = OVERLAPS[overlap]
    kernel = KernelConfig(side_num_sms=24)
    plain = calls(*_layer_step(kernel, **ep))
    assert any(name.endswith("_side") for name in plain), plain
    assert calls(*_layer_step(kernel, checkpoint=remat.policy(), **ep)) == plain
    rerun = [] if several or overlap == "shared_split" else ["jax_ep_dispatch"]
    assert sorted(calls(*_layer_step(kernel, checkpoint="no_policy", **ep))) == sorted(plain + rerun)


@pytest.mark.parametrize("overlap", ["shared_beside", "shared_split"])
def test_layers_scanned_under_grad_keep_their_side_stream_calls(cuda_lowering, overlap):
    """Two layers as a lax.scan over stacked parameters, differentiated: the scan traces its body before
    AD sees it, and the side calls there still have a derivative (overlap.primal) and lower, once in
    the loop body."""
    from flax import nnx

    layer = _cuda_layer(True, KernelConfig(side_num_sms=24), shared_split=overlap == "shared_split")
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)

    def step(stacked, x):
        def loss(stacked, x):
            def body(x, p):
                return x + nnx.merge(graphdef, p, rest)(x, update_stats=False), None
            return jnp.mean(jax.lax.scan(body, x, stacked)[0].astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(stacked, x)

    joins = 4 if overlap == "shared_split" else 2
    names = ordering.ep_calls(jax.make_jaxpr(step)(stacked, _inputs()[0]))   # in program order
    assert names.count("jax_ep_side_join") == joins, names
    text = str(_lowered(step, stacked, _inputs()[0]))   # (a loop: Dataflow does not follow it)
    assert "stablehlo.while" in text and text.count("stablehlo.custom_call @jax_ep_side_join(") == joins


@pytest.mark.parametrize("wire", [None, "float8_e4m3fn"])
def test_a_rematerialised_layer_reruns_only_the_gemms_whose_outputs_it_does_not_keep(
        cuda_lowering, monkeypatch, wire):
    """The grouped GEMMs (here chlo.ragged_dot: no Hopper kernel on this lowering) of the rematerialised
    layer's step, one process: the plain step has 6 (two forward, two input and two weight gradients).
    Without a policy, or keeping dispatch's results only, the rerun holds both forward GEMMs: the
    gate|up GEMM's output feeds SwiGLU's backward, the down GEMM's is the buffer combine's backward
    writes into (EPOptions.dy_in_place). Keeping remat.GATE_UP too leaves the down GEMM; with
    dy_in_place=False too, none."""
    from jax_ep import remat

    monkeypatch.setattr(ordering, "needed", _NEEDED)

    def gemms(policy, **ep):
        module = _lowered(*_layer_step(KernelConfig(), checkpoint=policy, dispatch_dtype=wire, **ep))
        return sum(o.name == "chlo.ragged_dot" for o in _walk(module.operation))

    kept = remat.policy(save=(remat.DISPATCH, remat.GATE_UP))
    assert [gemms(None), gemms("no_policy"), gemms(remat.policy()), gemms(kept),
            gemms(kept, dy_in_place=False), gemms("no_policy", dy_in_place=False)] == [6, 8, 8, 7, 6, 7]


@pytest.mark.parametrize("program", ["expert_major", "rank_major"])
def test_rematerialised_ops_keep_their_results_by_name(cuda_lowering, monkeypatch, program):
    """dispatch and combine (expert- and rank-major) in a rematerialised loss that reads combine's
    output (one process, no effect): with no policy the backward runs both again; saving
    jax_ep.remat.DISPATCH keeps dispatch (combine runs again); saving both NAMES runs neither again."""
    from jax_ep import remat

    monkeypatch.setattr(ordering, "needed", _NEEDED)
    x, idx, wts, w = _inputs()
    loss = PROGRAMS[program](_cfg())

    def calls(policy):
        inner = loss if policy is None else jax.checkpoint(
            loss, policy=None if policy == "no_policy" else policy)
        # the loss's value too: with jax.grad alone the forward's own run is dead, only its rerun is left
        step = jax.shard_map(jax.value_and_grad(inner, argnums=(0, 2, 3)), mesh=_mesh(), in_specs=P("ep"),
                             out_specs=(P(), P("ep")), check_vma=False)
        return _lowered_calls(step, x, idx, wts, w)

    dispatch, combine = (("jax_ep_dispatch", "jax_ep_combine") if program == "expert_major" else
                         ("jax_ep_dispatch_rank_major", "jax_ep_combine_rank_major"))
    plain = calls(None)
    assert plain.count(dispatch) == 1 and plain.count(combine) >= 1, plain
    again = calls("no_policy")
    assert sorted(again) == sorted(plain + [dispatch, combine]), (again, plain)
    assert sorted(calls(remat.policy())) == sorted(plain + [combine])
    assert sorted(calls(remat.policy(save=remat.NAMES))) == sorted(plain)


@pytest.mark.parametrize("gate_weights, backward", [("auto", "broadcast"), ("combine", "combine_bwd")])
def test_the_shared_expert_beside_combine_puts_combine_and_its_backward_on_the_side_stream(
        cuda_lowering, gate_weights, backward):
    """EPOptions(shared_beside=True): the forward's combine and its backward (the backward's first
    exchange) lower to their side twins, each followed by a join; all in one program order."""
    assert _layer_step_calls(KernelConfig(), shared_beside=True, gate_weights=gate_weights) == [
        f"jax_ep_{op}" for op in ("dispatch", "combine_side", "side_join", f"{backward}_side", "side_join",
                                  "combine", "slot_values")]


def test_the_shared_expert_split_puts_all_four_exchanges_on_the_side_stream(cuda_lowering):
    """EPOptions(shared_split=True): dispatch beside the shared expert's gate|up half, combine beside its
    down GEMM, and in the backward combine's backward and dispatch's backward beside theirs: each of the
    step's four exchanges a side twin followed by a join, in one program order."""
    assert _layer_step_calls(KernelConfig(), shared_beside=True, shared_split=True) == [
        f"jax_ep_{op}" for op in ("dispatch_side", "side_join", "combine_side", "side_join", "broadcast_side",
                                  "side_join", "combine_side", "side_join", "slot_values")]


def test_dispatch_backward_beside_the_weight_gradient_goes_on_the_side_stream(cuda_lowering):
    """EPOptions(weight_grad_beside=True): dispatch's backward (its combine of the rows' gradient) lowers
    to the side twin followed by a join, in one program order with the other calls, and the gate|up
    GEMM's weight gradient is ordered after the side call and before the join."""
    assert _layer_step_calls(KernelConfig(), weight_grad_beside=True) == [
        f"jax_ep_{op}" for op in ("dispatch", "combine", "broadcast", "combine_side", "side_join",
                                  "slot_values")]
    from flax import nnx

    graphdef, params, rest = nnx.split(_cuda_layer(weight_grad_beside=True), nnx.Param, ...)

    def step(params, x):
        return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x, update_stats=False)
                                          .astype(jnp.float32) ** 2))(params)

    module = _lowered(step, params, _inputs()[0])
    flow = Dataflow(module)
    names = [flow.name(c) for c in flow.calls]
    side, join = names.index("jax_ep_combine_side"), names.index("jax_ep_side_join")
    # the GEMMs contracting over the rows: the two weight gradients (the lowering for a GPU without a
    # Hopper kernel here: chlo.ragged_dot), fn's backward traced twice and each dead half dropped
    dots = [o for o in _walk(module.operation) if o.name == "chlo.ragged_dot"]
    weight_grads = [o for o in dots if "lhs_contracting_dimensions = [0]" in str(o)]
    assert len(dots) == 6 and len(weight_grads) == 2, [str(o)[:200] for o in dots]
    before_join = flow.upstream_ops(flow.calls[join].operands)
    beside = [o for o in weight_grads if side in flow.ancestors(o) and o in before_join]
    assert len(beside) == 1, names    # the gate|up GEMM's; the down GEMM's comes before the exchange


def test_a_side_call_takes_side_num_sms_and_the_calls_in_series_num_sms(cuda_lowering):
    """KernelConfig(side_num_sms=...): the call on the side stream (dispatch's backward, beside the weight
    gradient) runs that many blocks; every call in series keeps num_sms (slot_values one block)."""
    from flax import nnx

    layer = _cuda_layer(kernel=KernelConfig(num_sms=100, side_num_sms=24), weight_grad_beside=True)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def step(params, x):
        return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x, update_stats=False)
                                          .astype(jnp.float32) ** 2))(params)

    flow = Dataflow(_lowered(step, params, _inputs()[0]))
    blocks = {flow.name(c): re.findall(r"num_sms = (\d+)", str(c)) for c in flow.calls
              if flow.name(c) != "jax_ep_side_join"}
    assert blocks == {"jax_ep_dispatch": ["100"], "jax_ep_combine": ["100"], "jax_ep_broadcast": ["100"],
                      "jax_ep_combine_side": ["24"], "jax_ep_slot_values": ["1"]}, blocks


def test_one_process_orders_side_calls_against_the_calls_around_them(cuda_lowering, monkeypatch):
    """In one process EP calls carry no ordering effect, but a side call runs beside XLA's stream: the
    layer step with the shared expert beside combine lowers each side call after every EP call before
    it, and every EP call after its join (a plain call XLA ran meanwhile would share the buffers)."""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    from flax import nnx

    layer = _cuda_layer(shared_beside=True)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def step(params, x):
        def loss(params, x):   # linear in the output: combine's backward needs nothing of the forward's
            return jnp.sum(nnx.merge(graphdef, params, rest)(x, update_stats=False).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(params, x)

    flow = Dataflow(_lowered(step, params, _inputs()[0]))
    names = [flow.name(c) for c in flow.calls]
    assert names == [f"jax_ep_{op}" for op in ("dispatch", "combine_side", "side_join", "broadcast_side",
                                               "side_join", "combine", "slot_values")], names
    for i, name in enumerate(names):
        before = flow.ancestors(flow.calls[i])
        if name.endswith("_side"):
            assert set(range(i)) <= before, (name, names)
        joins = [j for j in range(i) if names[j] == "jax_ep_side_join"]
        assert set(joins) <= before, (name, names)


def test_one_process_orders_a_side_call_after_every_call_since_the_last_join(cuda_lowering, monkeypatch):
    """Two independent dispatches, then combine (of the first's rows) beside other work, then a third
    dispatch, in one process: the side call depends on both dispatches, not only on the one it reads,
    and the third dispatch on the join."""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    from jax_ep import overlap

    cfg = _cfg()

    def body(x, idx, wts):
        d1 = jax_ep.dispatch(x, idx, wts, cfg)
        d2 = jax_ep.dispatch(x * 2, jnp.flip(idx, axis=1), wts, cfg)
        with overlap.beside(jnp.sin, x.astype(jnp.float32)) as work:
            out = jax_ep.combine(d1.x, d1.handle, cfg)
        d3 = jax_ep.dispatch(x * 3, idx, wts, cfg)
        return out, d2.x, d3.x, work.result

    x, idx, wts, _ = _inputs()
    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    flow = Dataflow(_lowered(fn, x, idx, wts))
    names = [flow.name(c) for c in flow.calls]
    assert names == [f"jax_ep_{op}" for op in ("dispatch", "dispatch", "combine_side", "side_join",
                                               "dispatch")], names
    assert {0, 1} <= flow.ancestors(flow.calls[2]) and 3 in flow.ancestors(flow.calls[4]), names
    assert 0 not in flow.ancestors(flow.calls[1])   # the plain calls themselves stay unordered


def assert_nothing_beside_a_side_call(flow: Dataflow, what: str) -> None:
    """No EP call of the lowered program can run while a side call runs (between the side call and its
    join; on the same buffers): every other call is an ancestor of the side call or depends on its join
    (the first join depending on it)."""
    names = [flow.name(c) for c in flow.calls]
    deps = [flow.ancestors(c) for c in flow.calls]
    for s, name in enumerate(names):
        if not name.endswith("_side"):
            continue
        joins = [j for j, n in enumerate(names) if n == "jax_ep_side_join" and s in deps[j]]
        assert joins, (what, name)
        join = min(joins, key=lambda j: len(deps[j]))
        for c in range(len(names)):
            if c not in (s, join):
                assert c in deps[s] or join in deps[c], (
                    f"{what}: {names[c]} (call {c}) may run beside {name} (call {s}): {names}")


@pytest.mark.parametrize("differentiated", [False, True])
def test_one_process_orders_every_call_after_a_join_and_the_backward_side_call_after_its_plain_calls(
        cuda_lowering, monkeypatch, differentiated):
    """combine beside other work whose results are dropped (only the work's result read), then two
    independent dispatches: both wait for the join (not only the first; XLA may schedule two
    independent calls either way), forward and, differentiated in x only, backward (the backward's side
    call after the plain backward calls before it)."""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    from jax_ep import overlap

    cfg = _cfg()

    def body(x, idx, wts):
        d1 = jax_ep.dispatch(x, idx, wts, cfg)
        with overlap.beside(jnp.sin, x.astype(jnp.float32)) as work:
            jax_ep.combine(d1.x, d1.handle, cfg)            # its results dropped
        d3 = jax_ep.dispatch(x * 3, idx, wts, cfg)
        d4 = jax_ep.dispatch(x * 5, idx, wts, cfg)
        total = sum(jnp.sum(a.astype(jnp.float32)) for a in (d3.x, d4.x, work.result))
        return jax.lax.psum(total, "ep")

    x, idx, wts, _ = _inputs()
    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P())
    if differentiated:
        fn = jax.grad(fn)
    flow = Dataflow(_lowered(fn, x, idx, wts))
    names = [flow.name(c) for c in flow.calls]
    assert names.count("jax_ep_combine_side") == 1 and names.count("jax_ep_dispatch") == 3, names
    assert_nothing_beside_a_side_call(flow, "dispatch beside dropped work")


def _total(*arrays):
    return jax.lax.psum(sum(jnp.sum(a.astype(jnp.float32)) for a in arrays), "ep")


@pytest.mark.parametrize("case", ["two_blocks", "unrelated_grad", "stopped_before"])
def test_one_process_runs_no_ep_call_beside_a_side_call_in_differentiated_programs(
        cuda_lowering, monkeypatch, case):
    """Counterexamples of a review (2026-12-04), one process, differentiated: two independent blocks (the
    second block's backward keeps the first's join), a block whose inputs carry no tangent (grad in an
    unrelated argument: AD stages the block's custom_vjp into a jaxpr of its own), and a dispatch of
    stopped gradients before a block: no EP call can run between a side call and its join. (Not after
    the block: the backward is traced apart from the forward, and a forward call it does not depend on
    is not ordered against its side call; overlap's module doc says which calls are not.)"""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    from jax_ep import overlap

    cfg = _cfg()
    sg = jax.lax.stop_gradient

    def body(a, x, idx, wts):
        d1 = jax_ep.dispatch(x, idx, wts, cfg)
        d0 = jax_ep.dispatch(sg(x) * 2, idx, sg(wts), cfg) if case == "stopped_before" else None
        with overlap.beside(jnp.sin, x.astype(jnp.float32)) as w1:
            c1 = jax_ep.combine(d1.x, d1.handle, cfg)
        parts = [c1, w1.result] + ([d0.x] if d0 is not None else [])
        if case == "two_blocks":
            d2 = jax_ep.dispatch(x * 2, idx, wts, cfg)
            with overlap.beside(jnp.cos, x.astype(jnp.float32)) as w2:
                parts += [jax_ep.combine(d2.x, d2.handle, cfg), w2.result]
        if case == "unrelated_grad":
            parts += [jax_ep.dispatch(x * a, idx, wts, cfg).x, jax_ep.dispatch(x * 5, idx, wts, cfg).x]
        return _total(*parts)

    x, idx, wts, _ = _inputs()
    fn = jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P("ep"), P("ep"), P("ep")), out_specs=P())
    fn = jax.value_and_grad(fn, argnums=0 if case == "unrelated_grad" else 1)
    flow = Dataflow(_lowered(fn, jnp.ones((), jnp.bfloat16), x, idx, wts))
    assert_nothing_beside_a_side_call(flow, case)


def test_an_ep_call_inside_the_work_beside_a_side_call_is_refused(cuda_lowering):
    """fn of a block runs while the block's exchange is on the side stream: an EP call there would use
    the same buffers at once, and is refused where it is traced."""
    from jax_ep import overlap
    from jax_ep.errors import EPUnsupportedError

    cfg = _cfg()

    def body(x, idx, wts):
        d1 = jax_ep.dispatch(x, idx, wts, cfg)
        with overlap.beside(lambda y: jax_ep.dispatch(y, idx, wts, cfg).x, x * 2) as work:
            out = jax_ep.combine(d1.x, d1.handle, cfg)
        return out, work.result

    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(EPUnsupportedError, match="inside the work of jax_ep.overlap.beside"):
        _lowered(fn, *_inputs()[:3])


@pytest.mark.parametrize("checkpoint", [None, "policy", "no_policy"])
@pytest.mark.parametrize("overlap", ["shared_beside", "shared_split", "weight_grad_beside"])
def test_one_process_runs_no_ep_call_beside_a_layer_side_call(cuda_lowering, monkeypatch, overlap,
                                                              checkpoint):
    """The layer's training step with each side-stream overlap, plain and rematerialised, in one
    process: no EP call can run between a side call and its join."""
    from jax_ep import remat

    monkeypatch.setattr(ordering, "needed", _NEEDED)
    policy = {None: None, "policy": remat.policy(), "no_policy": "no_policy"}[checkpoint]
    flow = Dataflow(_lowered(*_layer_step(KernelConfig(side_num_sms=24), checkpoint=policy,
                                          **OVERLAPS[overlap])))
    assert any(flow.name(c).endswith("_side") for c in flow.calls)
    assert_nothing_beside_a_side_call(flow, f"{overlap}, checkpoint {checkpoint}")


def _layers_loss(layers, linear: bool = False, wrap=None):
    """(loss, params): the layers (one each, or one layer listed twice) on two independent micro-batches
    of _inputs()' tokens in one step, their losses summed: each call's shard_map is a trace of its own.
    linear: each loss the output's sum (the backward then reads none of the forward's results); wrap:
    applied to each call (params, tokens) -> output."""
    from flax import nnx

    splits = [nnx.split(m, nnx.Param, ...) for m in layers]

    def loss(params, x):
        total = 0.0
        for (graphdef, _, rest), p, half in zip(splits, params, jnp.split(x, 2), strict=True):
            def call(p, h, graphdef=graphdef, rest=rest):
                return nnx.merge(graphdef, p, rest)(h, update_stats=False)
            out = (call if wrap is None else wrap(call))(p, jnp.concatenate([half, half])).astype(jnp.float32)
            total = total + (jnp.sum(out) if linear else jnp.mean(out ** 2))
        return total

    return loss, [s[1] for s in splits]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("overlap", ["shared_beside", "shared_split", "weight_grad_beside"])
def test_one_process_runs_no_ep_call_of_another_layer_call_beside_a_side_call(
        cuda_lowering, monkeypatch, overlap, grad):
    """One layer with a side-stream overlap on two micro-batches in one step (gradient accumulation
    by summed losses): each call is a shard_map of its own, where the other's calls are not seen; the
    layer orders its call as one region at its caller's level (overlap.region), forward and backward.
    Before 2026-12-05 the second call's dispatch could run beside the first's side call."""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    layer = _cuda_layer(kernel=KernelConfig(side_num_sms=24), **OVERLAPS[overlap])
    loss, params = _layers_loss([layer, layer])
    flow = Dataflow(_lowered(jax.value_and_grad(loss) if grad else loss, params, _inputs()[0]))
    sides = any(flow.name(c).endswith("_side") for c in flow.calls)
    assert sides == (grad or overlap != "weight_grad_beside")   # weight_grad_beside: in the backward only
    assert_nothing_beside_a_side_call(flow, f"{overlap}, grad {grad}")


@pytest.mark.parametrize("side_first", [False, True])
def test_one_process_orders_a_plain_layer_against_a_layer_with_side_calls(cuda_lowering, monkeypatch,
                                                                         side_first):
    """A layer without overlaps and one with the shared expert split beside its exchanges, on two
    micro-batches in one differentiated step, in either order: no EP call of the plain layer can run
    beside a side call of the other, forward or backward (each backward traced after the other's)."""
    monkeypatch.setattr(ordering, "needed", _NEEDED)
    side = _cuda_layer(True, KernelConfig(side_num_sms=24), shared_split=True)
    plain = _cuda_layer(False, KernelConfig())
    loss, params = _layers_loss([side, plain] if side_first else [plain, side])
    flow = Dataflow(_lowered(jax.value_and_grad(loss), params, _inputs()[0]))
    assert_nothing_beside_a_side_call(flow, f"side first {side_first}")


@pytest.mark.parametrize("case", ["linear_same_layer", "linear_then_plain", "has_aux", "outside_the_grad"])
@pytest.mark.parametrize("overlap", ["shared_beside", "weight_grad_beside"])
def test_one_process_orders_calls_the_backward_does_not_read(cuda_lowering, monkeypatch, overlap, case):
    """Forward calls the backward does not read (a linear loss; the second call's output only as aux; a
    call outside the grad in the same jit) are ordered at the trace that stages them, where the backward
    is traced: the forward's AD trace is not a level of its own (overlap._level; before 2026-12-05 each
    of these let an EP call run beside a side call in one process)."""
    from flax import nnx

    monkeypatch.setattr(ordering, "needed", _NEEDED)
    layer = _cuda_layer(kernel=KernelConfig(side_num_sms=24), **OVERLAPS[overlap])
    x = _inputs()[0]
    if case in ("linear_same_layer", "linear_then_plain"):
        layers = [layer, layer] if case == "linear_same_layer" else [layer, _cuda_layer()]
        loss, params = _layers_loss(layers, linear=True)
        fn, args = jax.value_and_grad(loss), (params, x)
    else:
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        plain_graphdef, plain_params, plain_rest = nnx.split(_cuda_layer(), nnx.Param, ...)

        def loss(p, a, b):
            y = nnx.merge(graphdef, p, rest)(a, update_stats=False)
            aux = nnx.merge(graphdef, p, rest)(b, update_stats=False) if case == "has_aux" else None
            return jnp.mean(y.astype(jnp.float32) ** 2), aux

        def step(p, q, x):
            a, b = (jnp.concatenate([h, h]) for h in jnp.split(x, 2))
            outside = None   # a plain layer's call before the grad, in the same jit
            if case == "outside_the_grad":
                outside = nnx.merge(plain_graphdef, q, plain_rest)(b, update_stats=False)
            (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(p, a, b)
            return value, aux, grads, outside

        fn, args = step, (params, plain_params, x)
    flow = Dataflow(_lowered(fn, *args))
    assert any(flow.name(c).endswith("_side") for c in flow.calls)
    assert_nothing_beside_a_side_call(flow, f"{overlap}, {case}")


@pytest.mark.parametrize("overlap", ["shared_beside", "weight_grad_beside"])
def test_one_process_orders_checkpointed_layer_calls_wrapped_in_a_region(cuda_lowering, monkeypatch, overlap):
    """Each call under jax.checkpoint of its own is a trace of its own, which the layer's region cannot
    leave; wrapped in overlap.region (docs/api.md) the checkpointed calls are ordered too."""
    from jax_ep import overlap as ov
    from jax_ep import remat

    monkeypatch.setattr(ordering, "needed", _NEEDED)
    layer = _cuda_layer(kernel=KernelConfig(side_num_sms=24), **OVERLAPS[overlap])

    def wrap(call):
        return lambda p, h: ov.region(jax.checkpoint(call, policy=remat.policy()), p, h, side=True)

    loss, params = _layers_loss([layer, layer], wrap=wrap)
    flow = Dataflow(_lowered(jax.value_and_grad(loss), params, _inputs()[0]))
    assert_nothing_beside_a_side_call(flow, overlap)


def test_a_call_whose_results_are_dropped_leaves_the_list():
    """A call none of whose results is referenced any more is dropped from its trace's list at the next
    record (it is dropped from the program too: no order needed), so the list of a long program does not
    grow with such calls."""
    from jax_ep import overlap

    cfg = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    x, idx, wts, _ = _inputs()
    lengths = []

    def body(x, idx, wts):
        kept = jax_ep.dispatch(x, idx, wts, cfg)
        for _ in range(4):
            jax_ep.dispatch(x, idx, wts, cfg)       # results dropped at once
            lengths.append(len(overlap._since[jax._src.core.trace_ctx.trace][1]))
        return kept.x

    jax.make_jaxpr(jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep")))(x, idx, wts)
    assert lengths == [2, 2, 2, 2], lengths


def test_the_shared_expert_beside_the_decode_dispatch_sends_on_the_side_stream(cuda_lowering):
    """EPOptions(shared_beside=True) on the decode path: ll_dispatch in its two phases, the send on the
    side stream with the shared expert beside it, then the receive after the join."""
    from flax import nnx

    layer = _cuda_layer(shared_beside=True)
    graphdef, state = nnx.split(layer)
    step = lambda state, x: nnx.merge(graphdef, state)(x, decode=True)   # noqa: E731
    flow = Dataflow(_lowered(step, state, _inputs()[0]))
    names = [flow.name(c) for c in flow.calls]
    assert names == [f"jax_ep_{op}" for op in ("ll_dispatch_send_side", "side_join", "ll_dispatch_recv",
                                               "ll_combine")], names
    for i in range(1, len(names)):
        assert i - 1 in flow.ancestors(flow.calls[i]), names


def test_ep_calls_on_an_async_stream_take_the_targets_kept_out_of_command_buffers(cuda_lowering):
    """KernelConfig(async_stream=1): every EP call of the layer step lowers to its op's "_uncaptured"
    target (XLA puts an async region into a CUDA graph only when every call in it may be captured,
    and inside one the region runs in series: xla_ffi/handler_util.h), still in one program order
    (traced out of compute_on's wrapper function)."""
    assert _layer_step_calls(KernelConfig(async_stream=1)) == [f"jax_ep_{op}_uncaptured"
                                                               for op in LAYER_STEP_OPS]


def test_the_backward_of_dispatch_issues_its_two_calls_in_one_order(cuda_lowering):
    """The case seen on 4 GPUs: combine (d x) and slot_values (d topk_weights), both in dispatch's
    backward, neither using the other's result."""
    fn = _grad_program(_expert_major_loss(_cfg()))
    flow = Dataflow(_lowered(fn, *_inputs()))
    names = [flow.name(c) for c in flow.calls]
    slot = names.index("jax_ep_slot_values")
    last_combine = max(i for i, n in enumerate(names) if n == "jax_ep_combine")
    assert (last_combine in flow.ancestors(flow.calls[slot])
            or slot in flow.ancestors(flow.calls[last_combine]))


def test_every_ep_custom_call_is_inside_an_ordered_call(cuda_lowering):
    fn = _grad_program(_two_layers(_cfg()))
    jaxpr = jax.make_jaxpr(fn)(*_inputs())
    bare = []

    def walk(j, inside):
        for eqn in getattr(j, "jaxpr", j).eqns:
            target = eqn.params.get("target_name", "")
            if eqn.primitive.name == "ffi_call" and target.startswith("jax_ep_") and not inside:
                if target != "jax_ep_dispatch_layout":  # local: it does not communicate
                    bare.append(target)
            for sub in _subjaxprs(eqn.params):
                walk(sub, inside or eqn.primitive is ordering.ep_call_p)

    walk(jaxpr, False)
    assert not bare, f"EP custom calls outside jax_ep.ordering: {bare}"
    assert ordering.EP_ORDER in jaxpr.effects


def _subjaxprs(params):
    from jax._src import core

    return core.jaxprs_in_params(params)


# ---- the mechanism on CPU, executed -------------------------------------------------------------
def _stand_in(x, name):
    return ordering.ordered_call(lambda a: jnp.sin(a) * 2.0, x, name=name)


def test_ordered_call_computes_what_its_function_computes_under_every_transformation():
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    x = jax.random.normal(jax.random.key(1), (R * 3, 5))

    @jax.custom_vjp
    def op(v):
        return _stand_in(v, "f")

    def bwd(v, g):  # two independent ordered calls, as dispatch's backward has
        cos = ordering.ordered_call(lambda a: jnp.cos(a) * 2.0, v, name="a")
        gg = ordering.ordered_call(lambda a: a * 1.0, g, name="b")
        return (cos * gg,)

    op.defvjp(lambda v: (_stand_in(v, "f"), v), bwd)

    def step(v):
        def body(c, _):
            return jax.checkpoint(lambda u: op(op(u) * 3.0))(c), None
        y, _ = jax.lax.scan(body, v, None, length=2)
        y = jax.lax.cond(jnp.sum(y) > 0, lambda u: op(u), lambda u: u, y)
        return jnp.sum(y ** 2)

    def plain(v):
        def body(c, _):
            return jnp.sin(jnp.sin(c) * 2.0 * 3.0) * 2.0, None
        y, _ = jax.lax.scan(body, v, None, length=2)
        y = jnp.where(jnp.sum(y) > 0, jnp.sin(y) * 2.0, y)
        return jnp.sum(y ** 2)

    got = jax.jit(jax.shard_map(jax.value_and_grad(step), mesh=mesh, in_specs=P("ep"),
                                out_specs=(P(), P("ep")), check_vma=False))(x)
    want = jax.jit(jax.shard_map(jax.value_and_grad(plain), mesh=mesh, in_specs=P("ep"),
                                 out_specs=(P(), P("ep")), check_vma=False))(x)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(jax.vmap(lambda v: _stand_in(v, "v"))(x)),
                               np.asarray(jnp.sin(x) * 2.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(_stand_in(x, "eager")), np.asarray(jnp.sin(x) * 2.0), rtol=1e-6)


def test_differentiating_an_ordered_call_directly_names_it():
    with pytest.raises(NotImplementedError, match="jax_ep_thing"):
        jax.grad(lambda v: jnp.sum(_stand_in(v, "jax_ep_thing")))(jnp.ones(3))


def test_an_ep_call_whose_results_are_unused_is_removed(cuda_lowering):
    """Gradients of the gate and expert weights, not of x (the layer benchmark's case): the combine that
    brings d x back in dispatch's backward is unused, so it is not in the program (and XLA can drop
    the expert GEMM feeding it); the same removal in every process (it happens on the jaxpr)."""
    loss = _expert_major_loss(_cfg())
    fn = jax.shard_map(jax.grad(loss, argnums=(2, 3)), mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    flow = Dataflow(_lowered(fn, *_inputs()))
    names = [flow.name(c) for c in flow.calls]
    assert names == ["jax_ep_dispatch", "jax_ep_combine", "jax_ep_combine_bwd", "jax_ep_slot_values"], names


def test_an_ahead_of_time_compiled_function_runs_more_than_once():
    """jit(f).lower().compile(): jax 0.10-0.11's AOT fast path drops the ordered effect's runtime token
    from the second call on (EPIssueEffect keeps it off; seen failing on 2x H200 in remote_smoke)."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    f = jax.jit(jax.shard_map(lambda a: _stand_in(a, "aot"), mesh=mesh, in_specs=P("ep"),
                              out_specs=P("ep")))
    x = jax.random.normal(jax.random.key(2), (R * 2, 3))
    compiled = f.lower(x).compile()
    for _ in range(3):
        np.testing.assert_allclose(np.asarray(compiled(x)), np.asarray(jnp.sin(x) * 2.0), rtol=1e-6)


def test_an_ep_call_beside_work_goes_on_the_side_stream_between_the_work_and_the_join(cuda_lowering):
    """jax_ep.overlap.beside: dispatch lowers to its side twin; the work (a layout call here, an EP
    custom call the dataflow can follow) depends on it, so no schedule starts the work first; the join
    depends on both, and every result of dispatch and of the work depends on the join, so nothing
    reads them before XLA's stream waited for the side stream."""
    from jax_ep import overlap

    cfg = _cfg()
    beside = {}

    def body(x, idx, wts):
        with overlap.beside(lambda i: cuda_backend.layout_of(i, E, R), jnp.flip(idx, axis=1)) as work:
            d = jax_ep.dispatch(x, idx, wts, cfg)
        beside["overlapped"] = work.overlapped
        return d.x, d.group_sizes, work.result.num_tokens_per_rank

    x, idx, wts, _ = _inputs()
    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    module = _lowered(fn, x, idx, wts)
    flow = Dataflow(module)
    names = [flow.name(c) for c in flow.calls]
    assert beside["overlapped"] is True
    assert "jax_ep_dispatch" not in names and names.count("jax_ep_dispatch_side") == 1, names
    side, join = names.index("jax_ep_dispatch_side"), names.index("jax_ep_side_join")
    work = [i for i, n in enumerate(names)
            if n == "jax_ep_dispatch_layout" and side in flow.ancestors(flow.calls[i])]
    assert len(work) == 1, names                    # the work's layout, after the side call
    assert {side, work[0]} <= flow.ancestors(flow.calls[join])
    # a side effect keeps XLA from replacing the zero-sized token and dropping the join
    assert "has_side_effect = true" in str(flow.calls[join]), flow.calls[join]
    # every result of the program (dispatch's and the work's) comes after the join
    main = [f for f in flow.funcs.values() if str(f.attributes["sym_name"]).strip('"') == "main"][0]
    ret = list(main.regions[0].blocks[0].operations)[-1].operation
    for value in ret.operands:
        assert join in flow.value_ancestors([value]), names


def _beside_loss(cfg, side: bool):
    """A loss with dispatch inside a block beside a small dense chain on m (or the same without the
    block): both the exchange and the chain differentiated."""
    from jax_ep import overlap

    def chain(a, m):
        return jnp.tanh(a @ m) @ m

    def loss(x, wts, m, idx):
        a = x.astype(jnp.float32)
        if side:
            with overlap.beside(chain, a, m) as work:
                d = jax_ep.dispatch(x, idx, wts, cfg)
            result = work.result
        else:
            d, result = jax_ep.dispatch(x, idx, wts, cfg), chain(a, m)
        rows = d.x.astype(jnp.float32) * jnp.arange(1, d.x.shape[0] + 1, dtype=jnp.float32)[:, None]
        return jnp.sum(rows ** 2) + jnp.sum(jnp.cos(d.handle.row_weights)) + jnp.sum(jnp.sin(result))
    return loss


def test_a_differentiated_call_beside_work_overlaps_both_directions(cuda_lowering):
    """Differentiated inside the block, dispatch and the block's work are one custom_vjp: the forward
    lowers dispatch's side twin with the work between it and a join, the backward dispatch's backward
    (combine) on the side stream with the work's backward between it and a second join. Each side
    call comes after the EP call before it in program order (one process orders nothing else)."""
    cfg = _cfg()
    x, idx, wts, _ = _inputs()
    m = jax.random.normal(jax.random.key(7), (H, H), jnp.float32) / H

    def body(x, wts, m, idx):
        return jax.grad(_beside_loss(cfg, True), argnums=(0, 1, 2))(x, wts, m, idx)

    fn = jax.shard_map(body, mesh=_mesh(), in_specs=(P("ep"), P("ep"), P(), P("ep")),
                       out_specs=(P("ep"), P("ep"), P()), check_vma=False)
    flow = Dataflow(_lowered(fn, x, wts, m, idx))
    names = [flow.name(c) for c in flow.calls]
    sides = [i for i, n in enumerate(names) if n.endswith("_side")]
    joins = [i for i, n in enumerate(names) if n == "jax_ep_side_join"]
    assert [names[i] for i in sides] == ["jax_ep_dispatch_side", "jax_ep_combine_side"], names
    assert len(joins) == 2 and "jax_ep_dispatch" not in names and "jax_ep_combine" not in names, names
    for side, join in zip(sides, joins, strict=True):
        assert side in flow.ancestors(flow.calls[join]), names
    # the backward's side call after the forward's join; every other EP call ordered with them
    assert joins[0] in flow.ancestors(flow.calls[sides[1]]), names
    for i, name in enumerate(names):
        if i not in sides and i not in joins:
            related = flow.ancestors(flow.calls[i]) | {j for j, c in enumerate(flow.calls)
                                                       if i in flow.ancestors(c)}
            assert set(sides) <= related, (name, names)


def test_a_differentiated_call_beside_work_gives_the_plain_gradients():
    """The block's custom_vjp computes the same values and gradients as the program without the block
    (the reference backend: the work runs at the end of each of its blocks)."""
    cfg = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    x, idx, wts, _ = _inputs(3)
    m = jax.random.normal(jax.random.key(8), (H, H), jnp.float32) / H

    def run(side):
        def body(x, wts, m, idx):
            return jax.value_and_grad(_beside_loss(cfg, side), argnums=(0, 1, 2))(x, wts, m, idx)
        return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("ep"), P("ep"), P(), P("ep")),
                                     out_specs=(P(), (P("ep"), P("ep"), P())), check_vma=False))(
            x, wts, m, idx)

    got, want = run(True), run(False)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.abs(np.asarray(w, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_beside_leaves_calls_of_other_traces_alone(cuda_lowering):
    """A call traced at another level than the block (inside a jit of its own) does not take the
    work: it lowers to the plain target and fn runs after the block."""
    from jax_ep import overlap

    cfg = _cfg()
    x, idx, wts, _ = _inputs()
    flags = {}

    def nested_body(x, idx, wts):
        with overlap.beside(jnp.flip, idx) as work:
            rows = jax.jit(lambda *a: jax_ep.dispatch(*a, cfg).x)(x, idx, wts)
        flags["overlapped"] = work.overlapped
        return rows, work.result

    fn = jax.shard_map(nested_body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    flow = Dataflow(_lowered(fn, x, idx, wts))
    names = [flow.name(c) for c in flow.calls]
    assert flags["overlapped"] is False and "jax_ep_dispatch" in names and "jax_ep_side_join" not in names


def test_beside_runs_the_work_after_the_block_where_no_call_takes_it():
    """The reference backend has no side stream: fn runs at the block's end, same result, and
    work.overlapped says so; blocks do not nest."""
    from jax_ep import overlap

    a = jnp.arange(6.0)
    with overlap.beside(lambda v: v * 2, a) as work:
        assert work.result is None
    assert not work.overlapped and np.array_equal(work.result, a * 2)
    with pytest.raises(ValueError, match="do not nest"), overlap.beside(jnp.sum, a):
        with overlap.beside(jnp.sum, a):
            pass
    with pytest.raises(TypeError, match="fn must be callable"), overlap.beside(3):
        pass


@pytest.mark.parametrize("options", [dict(shared_beside=True), dict(weight_grad_beside=True),
                                     dict(shared_beside=True, shared_split=True)])
def test_side_joins_return_a_token_with_elements(cuda_lowering, options):
    """Every jax_ep_side_join of the layer step returns a token of at least one element: readers of a
    side call's results are ordered after the join only through it, and XLA replaces a zero-element
    value by a constant, which orders nothing (one H200, 2026-12-02: with an int32[0] token XLA's
    stream read the side dispatch's group sizes before the join; tests/gpu checks the compiled
    schedule, gpu_helpers.assert_side_results_read_after_join)."""
    from flax import nnx

    graphdef, params, rest = nnx.split(_cuda_layer(**options), nnx.Param, ...)

    def step(params, x):
        return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x, update_stats=False)
                                          .astype(jnp.float32) ** 2))(params)

    flow = Dataflow(_lowered(step, params, _inputs()[0]))
    joins = [c for c in flow.calls if flow.name(c) == "jax_ep_side_join"]
    assert joins, [flow.name(c) for c in flow.calls]
    for join in joins:
        (result,) = join.results
        assert result.type.rank == 1 and result.type.shape[0] >= 1, str(result.type)
