"""Typing of per-rank values inside ``shard_map`` (which manual mesh axes an array varies over).

JAX tracks, per array, the manual axes it varies over. Values a kernel computes per rank (an
``ffi_call`` result, a ``custom_vjp`` cotangent) must carry the right type; these helpers set it and work
across the jax versions we support (the attribute and the cast were renamed)."""

from __future__ import annotations

import jax


def varying_axes(x) -> tuple:
    """The manual mesh axes x varies over inside shard_map (empty outside, or without check_vma)."""
    aval = jax.typeof(x)
    for get in (lambda a: a.vma, lambda a: a.mat.varying):  # attribute name differs across jax versions
        try:
            return tuple(sorted(get(aval)))
        except AttributeError:
            continue
    return ()


def manual_axes() -> tuple:
    """The manual mesh axes of the enclosing shard_map (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(getattr(mesh, "manual_axes", ()) or ())


def vary_over(outputs, axes: tuple):
    """Type `outputs` as varying over `axes` (their transpose sums over those axes); axes that are not
    manual axes of the current mesh are left out (e.g. a ``jax.vmap`` axis name: nothing to type)."""
    manual = manual_axes()
    axes = tuple(a for a in axes if a in manual)
    if not axes:
        return outputs
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(outputs, axes, to="varying")
    return jax.lax.pvary(outputs, axes)


def vary_like(outputs, like):
    """Types rank-local outputs as varying over the same mesh axes as the input they derive from
    (what a pure-JAX computation gets automatically)."""
    return vary_over(outputs, varying_axes(like))


def vary_also(output, axes):
    """Type `output` as varying over each of `axes` it does not vary over already."""
    return vary_over(output, tuple(sorted(set(axes) - set(varying_axes(output)))))


def vary_as(output, *likes):
    """Type `output` (e.g. a Pallas kernel's result, typed invariant) as varying over every axis the
    `likes` vary over that it does not already."""
    axes = set()
    for a in likes:
        axes.update(varying_axes(a))
    return vary_also(output, axes)


def vary_jointly(*arrays):
    """Cast every array to vary over the union of the arrays' axes, as JAX does implicitly for the
    operands of one primitive: the transpose of that cast sums a cotangent over the added axes (e.g. a
    weight replicated over a data axis gets the gradient summed over it)."""
    return tuple(vary_as(a, *arrays) for a in arrays)


def shape_like(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel output's shape typed as varying like `like` (a Pallas call's out_shape must say so inside
    shard_map with check_vma; outside it the type is empty)."""
    mat = getattr(jax.typeof(like), "mat", None)
    if mat is None:  # a jax without manual axis types on avals
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def sum_to(cotangent, like_axes: tuple):
    """A cotangent typed as the primal it belongs to: summed over the axes it varies over that the primal
    (varying over ``like_axes``) does not, as the transpose of the cast that made it varying would."""
    extra = tuple(a for a in varying_axes(cotangent) if a not in like_axes)
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def typed_like(cotangent, primal):
    """A custom_vjp backward's cotangent typed exactly as its primal (or a residual typed like it):
    cast to vary over the primal's axes it lacks, summed over those the primal does not vary over. The
    kernels' and reference's results need not carry the primal's type (e.g. at zero tokens per rank,
    where rows come from zero-size constants, typed invariant)."""
    axes = varying_axes(primal)
    return sum_to(vary_also(cotangent, axes), axes)
