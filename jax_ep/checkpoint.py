"""Checkpoints of models with MoE layers (Orbax), restorable on a different EP size.

    import jax_ep.checkpoint as ckpt

    ckpt.save("/ckpt/step_1000", model, optimizer)            # optimizer optional
    # later, any mesh (e.g. 8 -> 4 EP ranks): build the model the same way on the new mesh, then
    ckpt.restore("/ckpt/step_1000", model, optimizer)         # in place

What is saved (Orbax ``CompositeCheckpointHandler``, one directory): ``model``, the whole
``nnx.state(model)`` (parameters, each MoE layer's balancing bias, load statistics and expert placement
tables) as a pytree of arrays; ``optimizer``, ``nnx.state(optimizer)`` when one is given; ``jax_ep``, a
JSON record (format version, and per MoE layer its configuration, the EP size it was saved on and its
placement's sizes). Orbax writes each array from its shards (sharded arrays, several processes) and
reads each one straight into the target sharding, so expert weights ``[E, ...]`` saved over 8 EP ranks
come back sharded over the new model's EP axis.

Restoring (``restore``) checks the checkpoint against the model first: every MoE layer's configuration
(``CHECKED_FIELDS``: sizes, top-k and routing, compute dtype) and every array's shape and dtype must
match, else ``CheckpointMismatchError`` names each field or array with both values. The arrays are
read with the shardings of the model built on the new mesh (``NamedSharding(mesh, spec)`` from each
variable's sharding metadata: experts over the EP axis, the rest replicated, the rule of
``examples/models.shard_model``). Expert placements (EPLB) are kept when they fit the new EP size and
re-planned when they do not (``restore``'s ``placement`` argument says how).

Orbax is an optional dependency (``pip install jax_ep[checkpoint]``; Flax already depends on it);
``import jax_ep`` never imports it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import eplb
from jax_ep.errors import CheckpointMismatchError, CheckpointNotFoundError, EPUnsupportedError, EPValueError
from jax_ep.moe import MoE

FORMAT = 1                    # version of the "jax_ep" JSON record
# An MoE layer's variables whose shape or meaning depends on the expert placement (its physical slots).
PLACEMENT_TABLES = ("physical_to_logical", "logical_to_physical", "replica_counts")
SLOT_STATS = ("last_slot_load", "total_slot_load")
PLACEMENT_MODES = ("replan", "drop", "error")


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:   # pragma: no cover - flax depends on orbax-checkpoint today
        raise ImportError("jax_ep.checkpoint needs Orbax (orbax-checkpoint): pip install 'jax_ep[checkpoint]'"
                          ) from e
    return ocp


def _checkpointer(ocp):
    """A synchronous Orbax checkpointer of our three items (named handlers: metadata and partial
    restores need to know them)."""
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        model=ocp.StandardCheckpointHandler(), optimizer=ocp.StandardCheckpointHandler(),
        jax_ep=ocp.JsonCheckpointHandler()))


def _abs_path(path) -> str:
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)   # Orbax wants absolute local paths


# ---------------------------------------------------------------------------------------------------------
# What a checkpoint records about each MoE layer
# ---------------------------------------------------------------------------------------------------------
def _key(path: tuple) -> str:
    return "/".join(str(p) for p in path) or "."


def moe_layers(model) -> dict[str, MoE]:
    """The MoE layers of a model, by their path in the module tree ("blocks/0/moe"; "." for the root)."""
    return {_key(path): m for path, m in nnx.iter_modules(model) if isinstance(m, MoE)}


def _layer_paths(model) -> dict[str, tuple]:
    return {_key(path): tuple(path) for path, m in nnx.iter_modules(model) if isinstance(m, MoE)}


def _ep_size(layer: MoE) -> int | None:
    return layer.mesh_ep_size


def layer_config(layer: MoE) -> dict[str, Any]:
    """The fields ``restore`` compares (``CHECKED_FIELDS``): they fix the parameter shapes and the math."""
    routing = dataclasses.asdict(layer.routing)
    routing.pop("ep_size")       # the layer sets it to its EP size
    routing["topk_groups"] = layer.routing.groups_per_token   # None and num_groups: the same routing
    if not layer.routing.group_limited:
        routing["group_score"] = _FIELD_DEFAULTS["routing.group_score"]   # no limit: no group score
    shared = 0 if layer.shared is None else int(layer.shared.w_gate.shape[1])
    return {"hidden": int(layer.hidden), "ffn_hidden": int(layer.ffn_hidden), "shared_ffn_hidden": shared,
            **{f"routing.{k}": v for k, v in routing.items()},
            "dtype": None if layer.dtype is None else str(layer.dtype)}


CHECKED_FIELDS = ("hidden", "ffn_hidden", "shared_ffn_hidden",
                  "routing.num_experts", "routing.num_topk", "routing.score_func", "routing.normalize_topk",
                  "routing.routed_scaling_factor", "routing.num_groups", "routing.topk_groups",
                  "routing.group_score", "routing.max_ranks_per_token", "routing.max_nodes_per_token",
                  "dtype")
# fields added after checkpoints were written: an older checkpoint has the value they had before them
_FIELD_DEFAULTS = {"routing.group_score": "top2_sum"}


def _layer_record(layer: MoE) -> dict[str, Any]:
    placement = None
    if layer.placement is not None:
        p = layer.placement
        placement = {"num_ranks": int(p.num_ranks), "slots_per_rank": int(p.slots_per_rank),
                     "max_replicas": int(p.logical_to_physical.shape[1])}
    return {"config": layer_config(layer), "ep_size": _ep_size(layer), "axis_name": layer.axis_name,
            "placement": placement,
            "balancing": dataclasses.asdict(layer.balancing)}   # informational: a run option, not checked


# ---------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------
def _refuse_masked(model, what: str) -> None:
    """A rank mask is runtime fault state, never saved: save and restore refuse a layer that has one."""
    masked = [k for k, m in moe_layers(model).items() if m.rank_mask is not None]
    if masked:
        raise EPValueError(f"jax_ep.checkpoint.{what}: MoE layer(s) {masked} have a rank mask (runtime fault "
                           "state, not saved); call layer.clear_rank_mask() first")


def save(path, model, optimizer=None, *, overwrite: bool = False) -> str:
    """Writes ``model`` (and ``optimizer``) to the directory ``path`` with Orbax; returns its absolute path.

    Every process of a multi-process run must call it (Orbax writes each process's shards; process 0
    the metadata). ``overwrite=True`` replaces an existing checkpoint; otherwise an existing ``path`` is
    an error. Returns once the checkpoint is complete on disk.
    """
    _refuse_masked(model, "save")
    ocp = _orbax()
    path = _abs_path(path)
    if not overwrite and "://" not in path and os.path.exists(path):   # Orbax's ValueError named no way out
        raise EPValueError(f"jax_ep.checkpoint.save: {path} already exists; pass overwrite=True to replace "
                           "it")
    record = {"format": FORMAT, "jax_ep_version": _version(), "optimizer": optimizer is not None,
              "moe_layers": {k: _layer_record(m) for k, m in moe_layers(model).items()}}
    items = {"model": ocp.args.StandardSave(_pure(model)), "jax_ep": ocp.args.JsonSave(record)}
    if optimizer is not None:
        items["optimizer"] = ocp.args.StandardSave(_pure(optimizer))
    with _checkpointer(ocp) as checkpointer:
        checkpointer.save(path, ocp.args.Composite(**items), force=overwrite)
    return path


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _pure(node) -> dict:
    """``nnx.state(node)`` as a pure dict, typed PRNG keys (``nnx.Rngs`` state, e.g. of ``nnx.Dropout``)
    as their key data (uint32 [..., 2] for threefry): what Orbax can store; ``restore`` wraps them
    again with the model's key type."""
    return jax.tree.map(lambda v: jax.random.key_data(v) if _is_key(v.dtype) else v,
                        nnx.to_pure_dict(nnx.state(node)))


def _version() -> str:
    import jax_ep

    return jax_ep.__version__


def read_record(path) -> dict[str, Any]:
    """The checkpoint's JSON record: format, ``moe_layers`` (config, EP size, placement sizes per layer)."""
    ocp = _orbax()
    path = _abs_path(path)
    if not os.path.isdir(path) and "://" not in path:
        raise CheckpointNotFoundError(f"jax_ep.checkpoint: no checkpoint at {path}")
    with _checkpointer(ocp) as checkpointer:
        try:
            record = checkpointer.restore(path, ocp.args.Composite(jax_ep=ocp.args.JsonRestore()))["jax_ep"]
        except KeyError as e:   # Orbax: 'Item "jax_ep" was not found in the checkpoint. Available items: ...'
            raise CheckpointMismatchError(_not_ours(path, e)) from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointMismatchError(f"checkpoint {path}: not a jax_ep checkpoint of format {FORMAT} "
                                      f"(record: {record!r:.200})")
    return record


def _not_ours(path: str, error: KeyError) -> str:
    """The message for a directory without a jax_ep record: what it holds, and any subdirectory that is a
    jax_ep checkpoint (a parent directory given instead of the run's)."""
    if "://" in path:
        return f"checkpoint {path}: not a jax_ep checkpoint (no 'jax_ep' record; Orbax: {error})"
    items = sorted(os.listdir(path))
    shown = f"{items[:20]}" + (f" and {len(items) - 20} more" if len(items) > 20 else "")   # e.g. step dirs
    shown = shown if items else "nothing"
    message = f"checkpoint {path}: not a jax_ep checkpoint (no 'jax_ep' record; it holds {shown})"
    inner = [os.path.join(path, name) for name in items if os.path.isdir(os.path.join(path, name, "jax_ep"))]
    if inner:
        message += f"; these subdirectories are jax_ep checkpoints: {inner[:5]}"
    return message


# ---------------------------------------------------------------------------------------------------------
# restore
# ---------------------------------------------------------------------------------------------------------
def restore(path, model, optimizer=None, *, mesh: Mesh | None = None, placement: str = "replan") -> dict:
    """Reads the checkpoint at ``path`` into ``model`` (and ``optimizer``) in place; returns its record.

    Build ``model`` (and ``optimizer``) as for training, on the mesh of this run, which may have another
    EP size than the one saved (or abstractly, with ``nnx.eval_shape``; then pass ``mesh``). Each array
    is read with ``NamedSharding(mesh, spec)``, ``spec`` from the variable's sharding metadata (expert
    weights and their optimizer moments over the EP axis, the rest replicated). ``mesh`` defaults to the
    MoE layers' mesh; with none (layers called inside your own ``shard_map``), each array keeps the
    sharding of the model's current one. A ``mesh`` given where the layers have one must be theirs (same
    devices and axis sizes), else ``EPValueError``.

    Checked before any array is read: the same MoE layers (by path), each with the same configuration
    (``CHECKED_FIELDS``), and every array of the same shape and dtype; otherwise
    ``CheckpointMismatchError`` names every field or array with the checkpoint's and the model's value.
    Run options are not checked (dispatch/combine ``EPOptions``, ``BalancingConfig`` rates, the GEMM
    backend): a restored run may change them.

    Expert placement (EPLB) of each MoE layer, with R the layer's new EP size:

    * saved without a placement: restored without one (expert e on rank e // (E / R)).
    * saved with a placement for R ranks (or the layer has no mesh): restored as saved, with its per-slot
      statistics.
    * saved with a placement for another number of ranks, ``placement="replan"`` (default): a new one is
      planned from the saved ``total_load`` with ``eplb.plan_placement(total_load, R, S)``, ``S =
      ceil(saved slots / R)`` slots per rank (the same slot count when it divides evenly, e.g. 8 x 3 ->
      4 x 6); ``"error"``: ``CheckpointMismatchError``.
    * ``placement="drop"``: no placement, whatever was saved (e.g. into a layer that takes none).

    Where the placement changes, the per-slot statistics (``last_slot_load``, ``total_slot_load``)
    describe the old slots and restart from zero; the per-expert ones (``last_load``, ``total_load``) and
    the bias are restored. Every layer's new placement is made and checked before any layer changes.

    A placement never changes the math (every replica gathers the same logical expert weights), so the
    restored model computes what the saved one did: bit for bit on the same EP size; on another EP size
    to float32 rounding, since each rank's grouped GEMM (XLA's ``ragged_dot``) accumulates over its own
    number of local experts (measured on CPU: at most a few ulps of the output's largest value).
    """
    if placement not in PLACEMENT_MODES:
        raise EPValueError(f"jax_ep.checkpoint.restore: placement must be one of {PLACEMENT_MODES}, "
                           f"got {placement!r}")
    _refuse_masked(model, "restore")
    ocp = _orbax()
    path = _abs_path(path)
    record = read_record(path)
    layers = moe_layers(model)
    _check_layers(path, record["moe_layers"], layers)
    if optimizer is not None and not record.get("optimizer"):
        raise CheckpointMismatchError(f"checkpoint {path}: has no optimizer state, an optimizer was given")
    mesh = _target_mesh(mesh, layers)
    actions = {key: _placement_action(path, key, layer, record["moe_layers"][key]["placement"], placement)
               for key, layer in layers.items()}

    with _checkpointer(ocp) as checkpointer:
        saved_meta = checkpointer.metadata(path).item_metadata
        targets = {"model": _target_tree(path, "model", saved_meta["model"].tree, model, mesh,
                                         _placement_paths(layers))}
        if optimizer is not None:
            targets["optimizer"] = _target_tree(path, "optimizer", saved_meta["optimizer"].tree, optimizer,
                                                mesh, set())
        restored = checkpointer.restore(
            path, ocp.args.Composite(**{k: ocp.args.StandardRestore(t) for k, t in targets.items()}))

    model_state = _wrap_keys(restored["model"], model)
    paths = _layer_paths(model)
    # every layer's new placement made and checked before any layer changes: a refusal leaves the
    # model as it was
    plans = {}
    for key, layer in layers.items():
        node = model_state
        for part in paths[key]:
            node = node[part]
        new = _new_placement(layer, record["moe_layers"][key]["placement"], node, actions[key])
        try:
            layer.check_placement(new)
        except (EPUnsupportedError, EPValueError) as e:
            refused = (f"checkpoint {path}: MoE layer {key!r} cannot take its restored expert placement: {e} "
                       "(restore with placement='drop' to restore the layer without it)")
            if isinstance(e, EPUnsupportedError):
                raise EPUnsupportedError(refused) from e
            raise CheckpointMismatchError(refused) from e
        plans[key] = (node, new)
    for key, layer in layers.items():
        node, new = plans[key]
        _restore_placement(layer, new, node, actions[key], mesh)
    nnx.update(model, model_state)
    if optimizer is not None:
        nnx.update(optimizer, _wrap_keys(restored["optimizer"], optimizer))
    return record


def _wrap_keys(tree: dict, node) -> dict:
    """The restored ``tree`` with the key data of ``node``'s typed PRNG keys wrapped in their key type."""
    keys = {_key(p): v.dtype for p, v in _flatten(nnx.to_pure_dict(nnx.state(node))).items()
            if _is_key(v.dtype)}

    def wrap(path, value):
        if isinstance(value, dict):
            return {k: wrap((*path, k), v) for k, v in value.items()}
        dtype = keys.get(_key(path))
        # a checkpoint written before 2026-12-05 holds typed keys as Orbax saves them: restored as keys
        if dtype is None or _is_key(value.dtype):
            return value
        return jax.random.wrap_key_data(value, dtype=dtype)

    return wrap((), tree) if keys else tree


def _check_layers(path: str, saved: dict, layers: dict[str, MoE]) -> None:
    problems = []
    for key in sorted(set(saved) - set(layers)):
        problems.append(f"MoE layer {key!r} is in the checkpoint, not in the model")
    for key in sorted(set(layers) - set(saved)):
        problems.append(f"MoE layer {key!r} is in the model, not in the checkpoint")
    for key in sorted(set(saved) & set(layers)):
        have, want = saved[key]["config"], layer_config(layers[key])
        for field in CHECKED_FIELDS:
            saved_value = have.get(field, _FIELD_DEFAULTS.get(field))
            if saved_value != want.get(field):
                problems.append(f"MoE layer {key!r}: {field} is {saved_value!r} in the checkpoint, "
                                f"{want.get(field)!r} in the model")
        # the rank and node caps limit routing by the contiguous layout of the EP size and its nodes:
        # where they cut, another layout routes differently (not the saved function)
        routing, saved_size, ep_size = layers[key].routing, saved[key].get("ep_size"), _ep_size(layers[key])
        capped = routing.max_ranks_per_token is not None or routing.max_nodes_per_token is not None
        if capped and None not in (saved_size, ep_size):
            was = _capped_layout(routing, saved_size, have.get("routing.ranks_per_node"))
            now = _capped_layout(routing, ep_size, routing.ranks_per_node)
            if was != now:
                caps = (f"max_ranks_per_token={routing.max_ranks_per_token}, "
                        f"max_nodes_per_token={routing.max_nodes_per_token}")
                problems.append(f"MoE layer {key!r}: its rank / node caps ({caps}) route by the EP layout, "
                                f"{was} (EP size, nodes) in the checkpoint, {now} in the model: the restored "
                                "layer would route differently")
    _raise_problems(path, "model", problems)


def _capped_layout(routing, ep_size: int, ranks_per_node) -> tuple:
    """What the rank and node caps route by (gating.RouterConfig.rank_limited / node_limited): the EP size
    where the rank cap cuts, the node count where the node cap does (None where a cap is no cap)."""
    try:
        r = dataclasses.replace(routing, ep_size=ep_size, ranks_per_node=ranks_per_node)
    except EPValueError:
        return ("invalid", ep_size, ranks_per_node)
    return (r.ep_size if r.rank_limited else None, r.num_nodes if r.node_limited else None)


def _raise_problems(path: str, what: str, problems: list[str]) -> None:
    if problems:
        lines = "\n  ".join(problems)
        raise CheckpointMismatchError(f"checkpoint {path} does not fit the {what}:\n  {lines}")


def _describe_mesh(mesh: Mesh, other: Mesh) -> str:
    """The mesh's axis sizes; its devices too where the axis sizes do not tell it from ``other``."""
    sizes = dict(mesh.shape)
    return f"{sizes} on devices {mesh.device_ids.tolist()}" if mesh.shape == other.shape else str(sizes)


def _target_mesh(mesh: Mesh | None, layers: dict[str, MoE]) -> Mesh | None:
    # a layer keeps its own mesh (and its placement is planned for that EP size): arrays read onto
    # another mesh would leave it with weights on other devices, failing at its next call
    for key, layer in layers.items():
        if mesh is not None and layer.mesh is not None and mesh is not layer.mesh:   # JAX interns meshes
            raise EPValueError(f"jax_ep.checkpoint.restore: mesh={_describe_mesh(mesh, layer.mesh)} is not "
                               f"MoE layer {key!r}'s mesh {_describe_mesh(layer.mesh, mesh)}: pass the "
                               "layers' mesh (or none), or build the model on the mesh to restore onto")
    if mesh is not None:
        return mesh
    meshes = {id(m.mesh): m.mesh for m in layers.values() if m.mesh is not None}
    if len(meshes) > 1:
        raise EPValueError("jax_ep.checkpoint.restore: the MoE layers have different meshes "
                           f"{[dict(m.shape) for m in meshes.values()]}: restore reads every array onto one "
                           "mesh")
    return next(iter(meshes.values()), None)


def _placement_paths(layers: dict[str, MoE]) -> set[str]:
    """Paths (as _key strings) of the placement-dependent variables of every MoE layer."""
    out = set()
    for key in layers:
        prefix = "" if key == "." else key + "/"
        out.update(prefix + name for name in (*PLACEMENT_TABLES, *SLOT_STATS))
    return out


def _flatten(tree, prefix=()) -> dict[tuple, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, k)))
        return out
    return {prefix: tree}


def _target_tree(path: str, item: str, saved_tree: dict, node, mesh: Mesh | None, flexible: set[str]) -> dict:
    """The abstract tree to restore ``item`` into: each saved array as a ShapeDtypeStruct with the
    sharding the model wants. ``flexible`` paths (placement tables, slot statistics) may differ in shape
    or be absent from the model: they are read replicated, as saved, and settled afterwards."""
    state = nnx.state(node)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    mine = {_key(p): v for p, v in _flatten(nnx.to_pure_dict(state)).items()}
    my_specs = {_key(p): v for p, v in _flatten(specs).items()}
    saved = {_key(p): (p, v) for p, v in _flatten(saved_tree).items()}
    replicated = (NamedSharding(mesh, P()) if mesh is not None
                  else jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    problems, target = [], {}
    for key in sorted(set(mine) - set(saved) - flexible):
        problems.append(f"{item} array {key!r} is in the model, not in the checkpoint")
    for key, (saved_path, meta) in sorted(saved.items()):
        shape, dtype = tuple(meta.shape), jnp.dtype(meta.dtype)
        if key in flexible:
            leaf = jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
        elif key not in mine:
            problems.append(f"{item} array {key!r} is in the checkpoint, not in the model")
            continue
        else:
            want = mine[key]
            stored = jax.eval_shape(jax.random.key_data, want) if _is_key(want.dtype) else want  # as saved
            want_shape, want_dtype = tuple(stored.shape), jnp.dtype(stored.dtype)
            if shape != want_shape:
                problems.append(f"{item} array {key!r}: shape {shape} in the checkpoint, {want_shape} in "
                                "the model")
            if dtype != want_dtype:
                problems.append(f"{item} array {key!r}: dtype {dtype} in the checkpoint, {want_dtype} in "
                                "the model")
            if mesh is not None:
                sharding = NamedSharding(mesh, my_specs.get(key) or P())
            else:
                sharding = getattr(want, "sharding", None) or replicated
            leaf = jax.ShapeDtypeStruct(want_shape, want_dtype, sharding=sharding)
        _set_in(target, saved_path, leaf)
    _raise_problems(path, item, problems)
    # the model's own keys (ints of nnx.List paths), not the metadata's strings
    return _rekey(target, nnx.to_pure_dict(state))


def _set_in(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _rekey(saved: dict, like) -> dict:
    """Metadata keys are strings; use the model's keys (e.g. int list indices) where they match."""
    if not isinstance(saved, dict):
        return saved
    by_str = {str(k): k for k in like} if isinstance(like, dict) else {}
    return {by_str.get(str(k), k): _rekey(v, like.get(by_str.get(str(k), k)) if isinstance(like, dict)
                                          else None) for k, v in saved.items()}


def _set_placement(layer: MoE, placement: eplb.Placement | None) -> None:
    layer.set_placement(placement)


def _placement_action(path: str, key: str, layer: MoE, saved: dict | None, mode: str) -> str:
    """What happens to a layer's placement: "none" (saved without one), "keep", "replan" or "drop"."""
    ep_size = _ep_size(layer)
    if saved is not None and mode != "drop" and len(layer.expert_bias.shape) > 1:   # (.shape: abstract too)
        raise EPUnsupportedError(f"checkpoint {path}: MoE layer {key!r} is stacked (nnx.vmap) and has an "
                                 "expert placement: restoring placements of stacked layers is not built")
    if saved is None:
        action = "none"
    elif mode == "drop":
        action = "drop"
    elif ep_size is None or saved["num_ranks"] == ep_size:
        return "keep"
    elif mode == "error":
        raise CheckpointMismatchError(
            f"checkpoint {path}: MoE layer {key!r} has an expert placement for {saved['num_ranks']} EP "
            f"ranks, the model's EP axis {layer.axis_name!r} has {ep_size} (restore with placement="
            "'replan' or 'drop')")
    else:
        action = mode
    if action in ("none", "drop") and ep_size is not None and layer.num_experts % ep_size:
        raise CheckpointMismatchError(
            f"checkpoint {path}: MoE layer {key!r} would have no expert placement, and its "
            f"num_experts={layer.num_experts} do not divide over the model's EP size {ep_size}"
            + (" (restore with placement='replan')" if saved is not None else
               " (saved without a placement: restore on an EP size dividing num_experts)"))
    return action


def _new_placement(layer: MoE, saved: dict | None, node: dict, action: str) -> eplb.Placement | None:
    """The layer's placement after the restore (``action``), from its restored state ``node``."""
    if action in ("none", "drop"):
        return None
    if action == "keep":
        return eplb.Placement(
            np.asarray(node["physical_to_logical"]), np.asarray(node["replica_counts"]),
            np.asarray(node["logical_to_physical"]), saved["num_ranks"], saved["slots_per_rank"])
    # replan: as many slots as saved (or the next multiple of the new EP size)
    ep_size = _ep_size(layer)
    slots = saved["num_ranks"] * saved["slots_per_rank"]
    total_load = np.asarray(node["total_load"], np.float64)
    return eplb.plan_placement(total_load, ep_size, math.ceil(slots / ep_size))


def _restore_placement(layer: MoE, placement: eplb.Placement | None, node: dict, action: str,
                       mesh: Mesh | None) -> None:
    """Sets the layer's placement (made by ``_new_placement``) and leaves in ``node`` (its restored
    state) what its placement tables and per-slot statistics become."""
    for name in PLACEMENT_TABLES:
        node.pop(name, None)
    stats = {name: node.pop(name) for name in SLOT_STATS}
    _set_placement(layer, placement)
    for name in PLACEMENT_TABLES:     # set_placement made them (replicated over the mesh)
        variable = getattr(layer, name)
        if variable is not None:
            node[name] = variable[...]
    # per-slot statistics describe the saved slots: kept with them, else they restart from zero
    keep_slots = action in ("none", "keep")
    for name in SLOT_STATS:
        value = stats[name]   # [..., slots]: stacked layers (nnx.vmap) lead with their layer axis
        if not keep_slots or value.shape[-1] != layer.num_slots:
            value = jnp.zeros((*value.shape[:-1], layer.num_slots), value.dtype)
        node[name] = value if mesh is None else jax.device_put(value, NamedSharding(mesh, P()))
