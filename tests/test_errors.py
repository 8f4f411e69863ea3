"""Issue 39 items 2-3: one error family under jax_ep.EPError (each class keeps its built-in base), the
wrong inputs that escaped it (combine with another op's handle, MoE sizes the mesh cannot split), and
option types checked once (bools are bools, ints are ints)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import runtime
from jax_ep.gating import RouterConfig
from jax_ep.moe import EPOptions, MoE

CFG = jax_ep.EPConfig(num_experts=8, num_topk=2, hidden=16, max_tokens_per_rank=4, backend="reference")
R = 4


@pytest.mark.parametrize("cls, builtin", [
    (jax_ep.EPValueError, ValueError), (jax_ep.EPTypeError, TypeError), (jax_ep.EPTypeError, ValueError),
    (jax_ep.EPUnsupportedError, NotImplementedError), (jax_ep.EPRuntimeError, RuntimeError),
    (jax_ep.EPTimeoutError, TimeoutError), (jax_ep.DeviceFaultError, RuntimeError),
    (jax_ep.DeviceMemoryError, RuntimeError), (runtime.DeviceMemoryError, RuntimeError),
    (jax_ep.CheckpointMismatchError, ValueError), (jax_ep.CheckpointNotFoundError, FileNotFoundError)])
def test_every_error_class_is_an_ep_error_and_keeps_its_builtin_base(cls, builtin):
    assert issubclass(cls, jax_ep.EPError) and issubclass(cls, builtin)
    with pytest.raises(jax_ep.EPError):
        raise cls("x")


def test_error_classes_are_exported_under_one_name():
    assert jax_ep.DeviceMemoryError is runtime.DeviceMemoryError
    # the extension's class is one of jax_ep.errors' too: either name catches what C++ raises
    # (``except jax_ep.errors.DeviceMemoryError`` missed it before 2026-12-06; found by a review)
    with pytest.raises(jax_ep.errors.DeviceMemoryError, match="no room"):
        raise runtime.DeviceMemoryError("no room")
    assert runtime.DeviceFaultError is jax_ep.DeviceFaultError
    for name in jax_ep.__all__:
        value = getattr(jax_ep, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, jax_ep.EPError), name


# raised on purpose yet not EPErrors: an internal invariant, a module's missing attribute, an optional
# dependency's import, the launcher's command-line parsing and exit
NOT_EP_ERRORS = {"AssertionError", "AttributeError", "ImportError", "SystemExit",
                 "argparse.ArgumentTypeError"}


def test_every_error_the_library_raises_on_purpose_is_an_ep_error():
    """Every ``raise Name(...)`` in jax_ep/ names an EPError class (or a helper returning one, checked
    by its return annotation); before 2026-12-05 overlap.beside raised a TypeError and a ValueError and the
    checkpoint a FileNotFoundError outside the family."""
    import ast
    import pathlib

    ep_errors = {cls.__name__ for cls in jax_ep.errors.ERRORS}
    trees = {path: ast.parse(path.read_text())
             for path in sorted(pathlib.Path(jax_ep.__file__).parent.rglob("*.py"))}
    returns = {f.name: ast.unparse(f.returns) for tree in trees.values() for f in ast.walk(tree)
               if isinstance(f, ast.FunctionDef) and f.returns is not None}
    wrong = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = ast.unparse(exc).removeprefix("errors.")
            if isinstance(node.exc, ast.Name) and not node.exc.id[0].isupper():
                continue                                  # re-raising a caught exception (a variable)
            if name in returns:                           # a helper that builds the error
                name = returns[name]
            if not all(part.strip() in ep_errors | NOT_EP_ERRORS for part in name.split("|")):
                wrong.append(f"{path.name}:{node.lineno} raises {ast.unparse(exc)}")
    assert not wrong, wrong


def _mesh(n=R):
    return Mesh(np.array(jax.devices()[:n]), ("ep",))


def _sharded(body, *args):
    spec = (P("ep"),) * len(args)
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=spec, out_specs=P("ep")))(*args)


def _inputs(tokens=4 * R):
    x = np.ones((tokens, 16), np.float32)
    w = np.full((tokens, 2), 0.5, np.float32)
    idx = np.tile(np.array([[0, 5]], np.int32), (tokens, 1))
    return x, idx, w


@pytest.mark.parametrize("change", ["x_1d", "x_int", "idx_int64", "idx_shape", "w_f16", "cfg_dict"])
def test_dispatch_wrong_inputs_raise_ep_errors(change):
    x, idx, w = _inputs()
    cfg = CFG
    if change == "x_1d":
        x = x[:, 0]
    elif change == "x_int":
        x = x.astype(np.int32)
    elif change == "idx_int64":
        idx = idx.astype(np.int16)
    elif change == "idx_shape":
        idx = idx[:, :1]
    elif change == "w_f16":
        w = w.astype(np.float16)
    else:
        cfg = {"num_experts": 8}
    with pytest.raises(jax_ep.EPError):
        _sharded(lambda a, b, c: jax_ep.dispatch(a, b, c, cfg).x, x, idx, w)


def test_wrong_types_are_ep_type_errors_naming_the_argument():
    """Found by a review (2026-12-05): these raised EPValueError, AttributeError or ZeroDivisionError, or
    took the wrong value silently (explain on -2 GPUs, ops="dispatch" read letter by letter)."""
    cases = [
        (lambda: jax_ep.EPConfig(**{**CFG.__dict__, "checked": np.True_}),
         r"EPConfig.checked must be a bool, got np.True_ \(numpy.bool\)"),
        (lambda: jax_ep.explain(CFG, 2.0), r"explain: ep_size must be a positive int, got 2.0 \(float\)"),
        (lambda: jax_ep.explain(CFG, True), r"explain: ep_size must be a positive int, got True"),
        (lambda: jax_ep.explain(CFG, 2, ops="dispatch"), r"ops must be a sequence of op names, got the str"),
        (lambda: _sharded(lambda *_: jax_ep.ll_dispatch_recv(None, CFG).x, *_inputs()),
         r"ll_dispatch_recv: expected the LLDispatchPending"),
        (lambda: jax_ep.dispatch_hierarchical(*_inputs(), CFG, ("node",)),
         r"dispatch_hierarchical: node_axis must be a non-empty str, got \('node',\) \(tuple\)"),
        (lambda: jax_ep.dispatch_hierarchical(*_inputs(), {"num_experts": 8}, "node"),
         r"dispatch_hierarchical: cfg must be a jax_ep.EPConfig, got dict"),
        (lambda: jax_ep.grouped_matmul(jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32),
                                       zero_tail=0), r"zero_tail must be a bool, got 0 \(int\)"),
    ]
    for call, message in cases:
        with pytest.raises(jax_ep.EPTypeError, match=message):
            call()
    with pytest.raises(jax_ep.EPValueError, match=r"explain: ep_size must be a positive int, got -2"):
        jax_ep.explain(CFG, -2)


def test_a_malformed_device_wait_timeout_is_an_ep_value_error_naming_the_variable(monkeypatch):
    """JAX_EP_TIMEOUT_S is checked before the extension's set-up (which raised a bare ValueError from
    C++, 2026-12-05), with the extension's rule: seconds in (0, 1e6]."""
    for good in ("10", "2.5", ".5", "1e3", "+4", " 10", "0x10"):   # as strtod reads them
        monkeypatch.setenv("JAX_EP_TIMEOUT_S", good)
        runtime.check_timeout_env()
    for bad in ("ten", "0", "-1", "1e7", "nan", "inf", "1_0", "10 ", "0x"):
        monkeypatch.setenv("JAX_EP_TIMEOUT_S", bad)
        with pytest.raises(jax_ep.EPValueError, match=rf"JAX_EP_TIMEOUT_S must be a positive number of "
                                                       rf"seconds \(at most 1e6\), got '{bad}'"):
            runtime.check_timeout_env()


@pytest.mark.parametrize("field, change, expected", [
    ("row_weights", lambda a: a[:3], r"handle.row_weights must be float32 \[capacity\], got float32\(3,\)"),
    ("row_weights", lambda a: a.astype(jnp.bfloat16), r"handle.row_weights must be float32 \[capacity\]"),
    ("src_index", lambda a: a.astype(jnp.float32), r"src_index must be int32 \[capacity\], got float32"),
    ("token_rows", lambda a: a.astype(jnp.int8), r"handle.token_rows must be int32 \[4 x 4, 2\]"),
    ("token_rows", lambda a: a[:, :1], r"handle.token_rows must be int32 \[4 x 4, 2\] .* got int32\(16, 1\)"),
    ("is_token_in_rank", lambda a: a[:, :2], r"handle.is_token_in_rank must be bool \[tokens, 4\]"),
])
def test_combine_checks_the_handles_fields(field, change, expected):
    """A handle with a field of another shape or dtype (``handle._replace(row_weights=...)`` is how a
    user feeds their own weights) is an error naming the field; before 2026-12-05 the reference read a
    short row_weights as zeros (a wrong output, no error) and the CUDA handler failed at run time."""
    def body(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, CFG)
        handle = d.handle._replace(**{field: change(getattr(d.handle, field))})
        return jax_ep.combine(d.x, handle, CFG)

    with pytest.raises(jax_ep.EPValueError, match=expected):
        _sharded(body, *_inputs())


@pytest.mark.parametrize("handle, expected", [
    ("rank_major", r"combine: handle must be the Handle of dispatch.*RankMajorHandle.*combine_rank_major"),
    ("tuple", r"combine: handle must be the Handle of dispatch.*got tuple"),
    ("dispatched", r"got Dispatched \(pass its \.handle")])
def test_combine_with_another_ops_handle_names_it(handle, expected):
    """Before: AttributeError ('tuple' object has no attribute 'src_index', ...)."""
    def body(x, idx, w):
        if handle == "rank_major":
            d = jax_ep.dispatch_rank_major(x, idx, w, CFG)
            return jax_ep.combine(d.x, d.handle, CFG)
        d = jax_ep.dispatch(x, idx, w, CFG)
        return jax_ep.combine(d.x, tuple(d.handle) if handle == "tuple" else d, CFG)

    with pytest.raises(jax_ep.EPTypeError, match=expected):
        _sharded(body, *_inputs())


@pytest.mark.parametrize("kw, error, field", [
    ({"checked": "no"}, jax_ep.EPTypeError, "EPConfig.checked"),
    ({"checked": 1}, jax_ep.EPTypeError, "EPConfig.checked"),
    ({"shrink": None}, jax_ep.EPTypeError, "EPConfig.shrink"),
    ({"num_experts": 8.0}, jax_ep.EPTypeError, "EPConfig.num_experts"),
    ({"hidden": "16"}, jax_ep.EPTypeError, "EPConfig.hidden"),
    ({"max_tokens_per_rank": True}, jax_ep.EPTypeError, "EPConfig.max_tokens_per_rank"),
    ({"capacity": 2.5}, jax_ep.EPTypeError, "EPConfig.capacity"),
    ({"capacity": 0}, jax_ep.EPValueError, "EPConfig.capacity"),
    ({"axis_name": 3}, jax_ep.EPTypeError, "EPConfig.axis_name"),
    ({"backend": "nccl"}, jax_ep.EPValueError, "EPConfig.backend"),
    ({"dispatch_dtype": "float16"}, jax_ep.EPValueError, "EPConfig.dispatch_dtype"),
    ({"kernel": {"num_sms": 8}}, jax_ep.EPTypeError, "EPConfig.kernel"),
    ({"num_topk": 9}, jax_ep.EPValueError, "EPConfig.num_topk")])
def test_ep_config_bad_values_and_types(kw, error, field):
    """Before: EPConfig(checked='no') was accepted (and turned checking on); floats passed as ints."""
    base = dict(num_experts=8, num_topk=2, hidden=16, max_tokens_per_rank=4) | kw
    with pytest.raises(error, match=field) as info:
        jax_ep.EPConfig(**base)
    assert repr(next(iter(kw.values())))[:12] in str(info.value)
    assert isinstance(info.value, ValueError)  # existing `except ValueError` keeps catching them


@pytest.mark.parametrize("kw, error, field", [
    ({"num_sms": 8.0}, jax_ep.EPTypeError, "KernelConfig.num_sms"),
    ({"num_sms": 0}, jax_ep.EPValueError, "KernelConfig.num_sms"),
    ({"dispatch_send_warps": "6"}, jax_ep.EPTypeError, "KernelConfig.dispatch_send_warps"),
    ({"bulk_copy": 1}, jax_ep.EPTypeError, "KernelConfig.bulk_copy"),
    ({"dispatch_pull": "yes"}, jax_ep.EPTypeError, "KernelConfig.dispatch_pull"),
    ({"async_stream": True}, jax_ep.EPTypeError, "KernelConfig.async_stream"),
    ({"transport": "nvlink"}, jax_ep.EPValueError, "KernelConfig.transport")])
def test_kernel_config_bad_values_and_types(kw, error, field):
    with pytest.raises(error, match=field):
        jax_ep.KernelConfig(**kw)


@pytest.mark.parametrize("kw, error, field", [
    ({"checked": "no"}, jax_ep.EPTypeError, "EPOptions.checked"),
    ({"capacity": 64.0}, jax_ep.EPTypeError, "EPOptions.capacity"),
    ({"expert_alignment": 0}, jax_ep.EPValueError, "EPOptions.expert_alignment"),
    ({"kernel": {"num_sms": 8}}, jax_ep.EPTypeError, "EPOptions.kernel"),
    ({"backend": "nccl"}, jax_ep.EPValueError, "EPOptions.backend")])
def test_ep_options_bad_values_and_types(kw, error, field):
    with pytest.raises(error, match=field):
        EPOptions(**kw)


def test_configs_take_numpy_ints_as_python_ints():
    """Before: config's int check was isinstance(value, int): EPOptions(capacity=np.int64(64)) and
    MoE(hidden=np.int64(16)) were refused as not positive ints (RouterConfig took them). Stored as Python
    ints: the same config, hash and jit cache entry as the Python ints give."""
    from jax_ep.config import check_option

    rng = np.random.default_rng()
    e, k, h, t = (int(v) for v in rng.integers(2, 9, size=4) * (8, 1, 16, 4))
    ints = (np.int64, np.int32, np.uint16)
    cfg = jax_ep.EPConfig(ints[0](e), ints[1](k), ints[2](h), np.int8(t), capacity=np.int64(2 * t),
                          expert_alignment=np.uint8(2), kernel=jax_ep.KernelConfig(num_sms=np.int64(8),
                                                                                    async_stream=np.int16(1)))
    plain = jax_ep.EPConfig(e, k, h, t, capacity=2 * t, expert_alignment=2,
                            kernel=jax_ep.KernelConfig(num_sms=8, async_stream=1))
    assert cfg == plain and hash(cfg) == hash(plain)
    for obj in (cfg, cfg.kernel):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            assert not isinstance(value, np.generic), (field.name, value)
    options = EPOptions(capacity=np.int64(64), expert_alignment=np.int32(4), chunks=np.int64(2))
    assert options == EPOptions(capacity=64, expert_alignment=4, chunks=2)
    assert (type(options.capacity), type(options.expert_alignment), type(options.chunks)) == (int, int, int)
    traces = []
    f = jax.jit(lambda x, cfg: traces.append(cfg) or x + cfg.hidden, static_argnums=1)
    f(jnp.ones(2), plain), f(jnp.ones(2), cfg)
    assert len(traces) == 1
    assert type(check_option("f:", "timeout_s", np.float32(2.5), "seconds")) is float
    assert type(check_option("f:", "timeout_s", np.int64(3), "seconds")) is int
    # still refused: NumPy bools and floats where an int is meant
    for value in (np.True_, np.float64(8.0)):
        with pytest.raises(jax_ep.EPTypeError, match=r"EPConfig\.num_experts must be a positive int"):
            jax_ep.EPConfig(value, 2, 16, 4)
    with pytest.raises(jax_ep.EPTypeError, match=r"timeout_s must be a positive number of seconds"):
        check_option("f:", "timeout_s", np.False_, "seconds")


def test_moe_takes_numpy_sizes():
    """MoE(hidden=np.int64(16)) raised "MoE: hidden must be a positive int, got np.int64(16)"; now the
    same layer as the Python ints make (its sizes Python ints), the same output."""
    seed = int(np.random.randint(1 << 30))
    routing = RouterConfig(num_experts=8, num_topk=2)
    ep = EPOptions(backend="reference")
    mesh = _mesh()
    numpy_sizes = MoE(np.int64(16), np.int32(8), routing, rngs=nnx.Rngs(seed), mesh=mesh, ep=ep,
                      shared_ffn_hidden=np.int64(8), gemm_num_sms=np.int64(4))
    plain = MoE(16, 8, routing, rngs=nnx.Rngs(seed), mesh=mesh, ep=ep, shared_ffn_hidden=8, gemm_num_sms=4)
    sizes = (numpy_sizes.hidden, numpy_sizes.ffn_hidden, numpy_sizes.gemm_num_sms)
    assert tuple(map(type, sizes)) == (int,) * 3
    x = jax.random.normal(jax.random.key(seed), (8 * R, 16))
    run = nnx.jit(lambda layer, x: layer(x))
    np.testing.assert_array_equal(np.asarray(run(numpy_sizes, x)), np.asarray(run(plain, x)))


ROUTING = RouterConfig(num_experts=8, num_topk=2)


@pytest.mark.parametrize("kw, error, field", [
    ({"decode": "no"}, jax_ep.EPTypeError, "MoE: decode"),
    ({"hidden": 16.0}, jax_ep.EPTypeError, "MoE: hidden"),
    ({"ffn_hidden": 0}, jax_ep.EPValueError, "MoE: ffn_hidden"),
    ({"shared_ffn_hidden": -1}, jax_ep.EPValueError, "MoE: shared_ffn_hidden"),
    ({"gemm": "cublas"}, jax_ep.EPValueError, "MoE: gemm"),
    ({"axis_name": 0}, jax_ep.EPTypeError, "MoE: axis_name"),
    ({"ep": {"backend": "reference"}}, jax_ep.EPTypeError, "MoE: ep must be"),
    # before: numpy's TypeError, jax.random's "must be a float dtype", an AttributeError, and an int
    # compute dtype accepted (its first call blamed x)
    ({"dtype": "fp32"}, jax_ep.EPTypeError, r"MoE: dtype must be a floating dtype .*got 'fp32'"),
    ({"dtype": jnp.int32}, jax_ep.EPValueError, "MoE: dtype must be a floating dtype, got int32"),
    ({"param_dtype": jnp.int32}, jax_ep.EPValueError, "MoE: param_dtype must be a floating dtype, got int32"),
    ({"param_dtype": "fp32"}, jax_ep.EPTypeError, "MoE: param_dtype must be a floating dtype"),
    ({"rngs": 0}, jax_ep.EPTypeError, r"MoE: rngs must be a flax.nnx.Rngs, got 0 \(int\)")])
def test_moe_bad_arguments(kw, error, field):
    args = dict(hidden=16, ffn_hidden=8, routing=ROUTING, rngs=nnx.Rngs(0)) | kw
    with pytest.raises(error, match=field):
        MoE(**args)


@pytest.mark.parametrize("decode", ["False", 0, 1, np.True_])
def test_moe_view_refuses_a_decode_that_is_not_a_bool(decode):
    """Before: set_view took bool(decode), so nnx.view(layer, decode="False") switched the layer to the
    decode path (MoE(decode="False") and layer(x, decode="False") refuse it)."""
    layer = MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), ep=EPOptions(backend="reference"))
    with pytest.raises(jax_ep.EPTypeError, match=rf"MoE: decode must be None or a bool, got {decode!r}"):
        nnx.view(layer, decode=decode)
    assert layer.decode is False
    assert nnx.view(layer, decode=True).decode is True


def test_moe_built_with_a_mesh_inside_a_shard_map_says_to_build_it_without():
    """MoE(mesh=...) built inside a shard_map body raised JAX's "pspec ... contains a manual axes" (a
    layer called there says to build it with mesh=None; found by a review, 2026-12-05)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))

    def body(x):
        MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), mesh=mesh, ep=EPOptions(backend="reference"))
        return x

    with pytest.raises(jax_ep.EPValueError, match=r"MoE: built with mesh= inside a shard_map over \('ep',\)"
                       r".*build it with mesh=None"):
        jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(jnp.ones((2, 4)))


@pytest.mark.parametrize("gemm_dtype", ["bfloat16", "float8_e5m2", "fp8"])
def test_expert_block_names_a_gemm_dtype_it_does_not_take(gemm_dtype):
    """Before 2026-12-05 any gemm_dtype but None ran both GEMMs in FP8 (e4m3) silently."""
    from jax_ep.moe import expert_block

    rows, w1, w2 = jnp.ones((8, 128)), jnp.ones((2, 128, 256)), jnp.ones((2, 128, 128))
    with pytest.raises(jax_ep.EPValueError, match=f"expert_block: gemm_dtype must be one of .*{gemm_dtype}"):
        expert_block(rows, w1, w2, jnp.array([4, 4], jnp.int32), gemm_dtype=gemm_dtype)


def test_moe_experts_that_do_not_divide_over_the_mesh_name_num_experts():
    """Before: JAX's IndivisibleError, not naming num_experts."""
    with pytest.raises(jax_ep.EPValueError, match=r"routing\.num_experts=6 is not divisible by the EP size"):
        MoE(16, 8, RouterConfig(num_experts=6, num_topk=2), rngs=nnx.Rngs(0), mesh=_mesh(),
            ep=EPOptions(backend="reference"))


def test_moe_experts_that_do_not_divide_inside_own_shard_map():
    layer = MoE(16, 8, RouterConfig(num_experts=6, num_topk=2), rngs=nnx.Rngs(0),
                ep=EPOptions(backend="reference"))
    mesh = _mesh()
    f = jax.shard_map(lambda x: layer(x), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(jax_ep.EPValueError, match=r"num_experts=6 is not divisible by the EP size 4"):
        f(jnp.ones((8, 16)))


@pytest.mark.parametrize("batch_axes, match", [
    (("dp",), r"batch_axes=\('dp',\) names \['dp'\], not axes of the mesh"),
    (("data",), r"batch_axes=\('data',\) must include the EP axes \['ep'\]"),
    ("ep", r"batch_axes must be a tuple of mesh axis names, got 'ep'")])
def test_moe_batch_axes_are_checked_where_the_layer_is_built(batch_axes, match):
    """Before 2026-12-05: a KeyError at the first call, or JAX's shard_map error."""
    mesh = Mesh(np.array(jax.devices()[:2 * R]).reshape(2, R), ("data", "ep"))
    error = jax_ep.EPTypeError if isinstance(batch_axes, str) else jax_ep.EPValueError
    with pytest.raises(error, match=match):
        MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), mesh=mesh, batch_axes=batch_axes,
            ep=EPOptions(backend="reference"))


@pytest.mark.parametrize("batch_axes, extra, error, match", [
    (("data",), {}, jax_ep.EPValueError, r"batch_axes=\('data',\) must include the EP axes \['ep'\]"),
    (("ep",), {"node_axis": "node"}, jax_ep.EPValueError,
     r"batch_axes=\('ep',\) must include the EP axes \['node'\]"),
    ("data", {}, jax_ep.EPTypeError, r"batch_axes must be a tuple of mesh axis names, got 'data'"),
    (("data", 0), {}, jax_ep.EPTypeError, r"batch_axes must be a tuple of mesh axis names")])
def test_moe_batch_axes_are_checked_without_a_mesh(batch_axes, extra, error, match):
    """Before: with mesh=None batch_axes went unchecked. ("data",) inside a data x ep shard_map made the
    loads, the bias update and the aux loss count one EP rank's tokens (last_load summed to 16 of 64);
    "data" was stored as ('d', 'a', 't', 'a') and the first call raised JAX's "unbound axis name: d"."""
    with pytest.raises(error, match=match):
        MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), batch_axes=batch_axes, ep=EPOptions(backend="reference"),
            **extra)


def test_moe_batch_axes_without_a_mesh_count_every_token():
    """The accepted form (a list too, stored as a tuple): the loads of all tokens of a data x ep shard_map."""
    layer = MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), batch_axes=["data", "ep"],
                ep=EPOptions(backend="reference"))
    assert layer.batch_axes == ("data", "ep")
    mesh = Mesh(np.array(jax.devices()[:2 * R]).reshape(2, R), ("data", "ep"))
    graphdef, state = nnx.split(layer)
    specs = jax.tree.map(lambda _: P(), state)
    for name in ("w_gate_up", "w_down"):
        specs[name] = jax.tree.map(lambda _: P("ep"), state[name])

    def body(x, state):
        per_rank = nnx.merge(graphdef, state)
        per_rank(x)
        return per_rank.last_load[...]

    tokens = 8 * 2 * R
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (tokens, 16))
    load = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("data", "ep")), specs), out_specs=P(),
                                 check_vma=False))(x, state)
    assert int(load.sum()) == tokens * ROUTING.num_topk


def test_moe_without_a_mesh_outside_a_shard_map_over_its_axis_names_it():
    """Before 2026-12-05: JAX's NameError (unbound axis name)."""
    layer = MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), axis_name="expert", ep=EPOptions(backend="reference"))
    f = jax.shard_map(lambda x: layer(x), mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(jax_ep.EPValueError, match=r"MoE: axis_name='expert' is not bound here"):
        f(jnp.ones((8, 16)))


@pytest.mark.parametrize("decode", [False, True])
def test_moe_integer_tokens_are_refused_by_the_layer(decode):
    """Before 2026-12-05: dispatch's error (an op the user did not call), or JAX's TypeError on decode."""
    layer = MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), mesh=_mesh(), ep=EPOptions(backend="reference"))
    with pytest.raises(jax_ep.EPValueError, match="MoE: x must be floating point, got int32"):
        layer(jnp.ones((8, 16), jnp.int32), decode=decode)


def test_moe_aux_loss_sequences_split_over_shards_name_the_shape():
    """The sequence-wise aux loss needs whole sequences per token shard: [B, S, H] whose sequences span
    shards is refused naming x's shape (before 2026-12-05: sequence_aux_loss's error about its own
    arguments); whole sequences per shard run."""
    from jax_ep.balancing import BalancingConfig

    layer = MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), mesh=_mesh(), ep=EPOptions(backend="reference"),
                balancing=BalancingConfig(aux_loss_alpha=0.01))
    x = jax.random.normal(jax.random.key(0), (R, 4, 16))
    # jitted: an eager call compiles each op of the layer on its own (18 s on CI's CPUs)
    assert nnx.jit(lambda m, x: m(x))(layer, x).shape == x.shape and float(layer.aux_loss) > 0
    with pytest.raises(jax_ep.EPValueError, match=r"x of shape \(2, 8, 16\) puts 4 tokens on each of 4 token "
                                                  r"shards, not whole sequences of 8"):
        layer(x.reshape(2, 8, 16))


@pytest.mark.slow
def test_moe_tokens_that_do_not_split_over_the_mesh_name_the_count():
    """Before: a shard_map error naming '<lambda>'."""
    layer = MoE(16, 8, ROUTING, rngs=nnx.Rngs(0), mesh=_mesh(), ep=EPOptions(backend="reference"))
    with pytest.raises(jax_ep.EPValueError, match=r"x has 3 tokens .* 4 devices of the batch axes"):
        layer(jnp.ones((3, 16)))
    assert layer(jnp.ones((4, 16))).shape == (4, 16)


_UNCAUGHT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax_ep
from jax.sharding import Mesh, PartitionSpec as P
cfg = jax_ep.EPConfig(num_experts=8, num_topk=2, hidden=16, max_tokens_per_rank=4, checked=True,
                      backend="reference")
mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
f = jax.jit(jax.shard_map(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, mesh=mesh,
                          in_specs=(P("ep"),) * 3, out_specs=P("ep")))
idx = np.tile(np.array([[0, 5]], np.int32), (8, 1))
idx[1, 1] = 99
np.asarray(f(np.ones((8, 16), np.float32), idx, np.ones((8, 2), np.float32)))
"""


def test_checked_failure_outside_run_checked_is_one_traceback_without_atexit_noise():
    """Outside run_checked JAX still wraps the callback's EPValueError in a JaxRuntimeError (it cannot be
    avoided), but the traceback ends with jax_ep's message and nothing follows it at exit (before: two
    'Exception ignored in atexit callback' tracebacks, each repeating the error)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(jax_ep.__file__)),
                                                    env.get("PYTHONPATH")] if p)
    proc = subprocess.run([sys.executable, "-c", _UNCAUGHT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    err = proc.stderr
    assert "Exception ignored in atexit" not in err, err[-3000:]
    assert err.count("first bad value 99") == 1, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith(
        "EPValueError: jax_ep.dispatch: topk_idx has 1 ids outside [-1, 8)"), err[-3000:]


@pytest.mark.parametrize("call, message", [
    (lambda x: jax_ep.overlap.chain(jnp.sin, x, jnp.add, ()),
     r"overlap.chain: op_args must be a tuple \(or list\) of arguments, got jaxlib.*ArrayImpl"),
    (lambda x: jax_ep.overlap.chain(3, (x,), jnp.add, ()), "overlap.chain: op must be callable, got int"),
    (lambda x: jax_ep.overlap.chain(jnp.sin, (x,), "add", ()), "overlap.chain: fn must be callable, got str"),
    (lambda x: jax_ep.overlap.region(jnp.sin, x, side="yes"),
     r"overlap.region: side must be a bool, got 'yes'"),
    (lambda x: jax_ep.overlap.region(None, x, side=False),
     "overlap.region: fn must be callable, got NoneType"),
])
def test_overlap_chain_and_region_check_their_arguments(call, message):
    """Before 2026-12-05: an array for op_args split into rows (a bare TypeError far away), side="yes"
    was taken as True."""
    with pytest.raises(jax_ep.EPTypeError, match=message):
        call(jnp.ones((3, 2)))
