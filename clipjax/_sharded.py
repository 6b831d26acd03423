"""Clipping inside `shard_map`: the explicit forms, for code that maps over a mesh itself.

Under `jax.jit` the plain `andrea_clip` / `clip_tree` already clip sharded gradients
per shard (see `_partition.py`). These entry points are for code that holds local
shards: `clip_tree_in_shard_map` inside the caller's own `shard_map`, and
`sharded_clip_tree`, which runs the clip in a `shard_map` of its own. Both run
`_shards.clip_shards`: per-device norms, an all-reduce of a few floats per leaf over
the axes each leaf is split on, the same decision everywhere, each device scaling its
own shards. Called outside jit, `sharded_clip_tree` runs as one jitted call, cached
like any jitted function: a shard_map run eagerly is traced and compiled anew at every
call.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from clipjax import _dispatch, _options, _shards
from clipjax._options import ClipResult


# --- which mesh axes each leaf is sharded on -------------------------------------------


def _leaf_specs(specs, tree):
  """One PartitionSpec per leaf of `tree`; `specs` has its structure or a prefix of it."""
  is_spec = lambda x: isinstance(x, PartitionSpec)
  spec_leaves, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
  try:
    subtrees = spec_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError("clipjax: specs must be a PartitionSpec or a pytree of them shaped like "
                     f"the gradients (or like a prefix of them): {e}") from e
  per_leaf = []
  for spec, subtree in zip(spec_leaves, subtrees):
    per_leaf += [spec] * len(jax.tree_util.tree_leaves(subtree))
  return per_leaf


def _mesh_and_specs(mesh, specs, tree, paths, leaves):
  found, known = _shards.known_layout(leaves)
  if specs is None:
    for path, k in zip(paths, known):
      if k is None:
        raise ValueError(f"clipjax: cannot tell how leaf {_options.where(path)} is "
                         "sharded: pass specs=, the PartitionSpecs of the gradients. They are "
                         "read from the leaves only for concrete arrays with a NamedSharding "
                         "or, inside jit, on a mesh whose axes are all Explicit.")
    leaf_specs = [spec for _, spec in known]
  else:
    leaf_specs = _leaf_specs(specs, tree)
  if mesh is None:
    if found is None:
      raise ValueError("clipjax: pass mesh=, the Mesh the gradients are sharded over (their "
                       "shardings name no single mesh)")
    mesh = found
  leaf_axes = [_shards.spec_axes(spec, _options.where(path))
               for spec, path in zip(leaf_specs, paths)]
  for path, axes in zip(paths, leaf_axes):
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"clipjax: the spec for leaf {_options.where(path)} names axes "
                       f"{unknown} that the mesh {tuple(mesh.axis_names)} does not have")
  return mesh, leaf_specs, leaf_axes


def _varying_axes(x):
  """The manual mesh axes over which `x` may differ, as shard_map tracks them (with
  check_vma), or None where this jax does not say."""
  t = jax.typeof(x)
  vma = getattr(t, "vma", None)
  if vma is None:
    vma = getattr(getattr(t, "manual_axis_type", None), "varying", None)
  return None if vma is None else frozenset(vma)


def _check_specs_in_shard_map(paths, leaves, leaf_axes):
  """Each spec names axes of the enclosing mesh and, where shard_map tracks which axes
  a value varies over (check_vma), exactly the axes its leaf varies over: a missing axis
  would leave that leaf's shards out of the norm, an extra one would count them twice."""
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(mesh.axis_names) if not mesh.empty else None
  varying = [_varying_axes(x) for x in leaves]
  tracked = any(v for v in varying if v is not None)  # all empty: check_vma is off
  for path, axes, vma in zip(paths, leaf_axes, varying):
    if names is not None:
      unknown = [a for a in axes if a not in names]
      if unknown:
        raise ValueError(f"clipjax: the spec for leaf {_options.where(path)} names mesh axis "
                         f"{unknown[0]!r}, which the enclosing mesh {names} does not have")
    if tracked and vma is not None and vma != set(axes):
      missing, extra = sorted(vma - set(axes)), sorted(set(axes) - vma)
      what = (f"varies over mesh axes {missing} that its spec does not name, so the norm "
              "would miss the other devices' shards" if missing else
              f"is the same on every device along {extra}, which its spec names, so it "
              "would be counted once per device")
      raise ValueError(f"clipjax: leaf {_options.where(path)} {what}; its spec must name "
                       f"exactly the axes it is split over: {sorted(vma)}")


# --- public entry points ---------------------------------------------------------------


def sharded_clip_tree(tree, max_norm, *, mesh=None, specs=None, impl: str = "auto",
                      mode: str = "global", on_nonfinite: str = "propagate",
                      scale: str = "auto") -> ClipResult:
  """`clip_tree` for gradients sharded over a mesh: each device clips its own shards.

  The clip runs inside `shard_map` over `mesh`: every device computes the norms
  of its shards, the per-leaf sums of squares are combined with a psum over the
  mesh axes each leaf is sharded on, and every device scales its shards by the
  same factor. Nothing gradient-sized moves between devices. The result is the
  clip of the whole tree (as `clip_tree` on one device), sharded as it came.

  Args:
    tree: the gradients; under jit, sharded as `specs` say (a leaf laid out
      otherwise is resharded by XLA before the clip).
    max_norm, impl, mode, on_nonfinite, scale: as for `clip_tree`.
    mesh: the jax.sharding.Mesh the gradients are sharded over. Left out, it
      is read from the leaves (see `specs`).
    specs: a PartitionSpec per leaf: a pytree of them shaped like `tree`, or a
      prefix of it (one `P()` for a replicated tree). Left out, each leaf's spec
      is read from the leaf: a concrete array with a NamedSharding, or, inside
      jit, an array on a mesh whose axes are all Explicit.

  Returns:
    A ClipResult; the norms and flags are the same on every device.
  """
  options = dict(impl=impl, mode=mode, on_nonfinite=on_nonfinite, scale=scale)
  paths, leaves, treedef = _options.flatten(tree)
  if leaves and not any(isinstance(x, jax.core.Tracer) for x in [max_norm, *leaves]):
    _options.check_options(max_norm, impl, mode, on_nonfinite, scale)
    mesh, leaf_specs, _ = _mesh_and_specs(mesh, specs, tree, paths, leaves)
    return _sharded_clip_jitted(tree, max_norm, mesh=mesh, treedef=treedef,
                                leaf_specs=tuple(leaf_specs), **options)
  return _dispatch.clip(functools.partial(run_in_shard_map, mesh=mesh, specs=specs), tree,
                        max_norm, feeds_consumer=False, **options)


@functools.partial(jax.jit, static_argnames=("mesh", "treedef", "leaf_specs", "impl", "mode",
                                             "on_nonfinite", "scale"))
def _sharded_clip_jitted(tree, max_norm, *, mesh, treedef, leaf_specs, impl, mode,
                         on_nonfinite, scale):
  """sharded_clip_tree outside jit: the mesh and the specs (one per leaf, as hashable
  static arguments) are known, so the jit cache keys on them and the tree's shapes."""
  specs = jax.tree_util.tree_unflatten(treedef, leaf_specs)
  return _dispatch.clip(functools.partial(run_in_shard_map, mesh=mesh, specs=specs), tree,
                        max_norm, impl=impl, mode=mode, on_nonfinite=on_nonfinite,
                        scale=scale, feeds_consumer=False)


def run_in_shard_map(p, tree, *, mesh, specs, impl, mode, on_nonfinite, scale_by):
  """`_dispatch.run_whole`'s contract, in a `shard_map` of the clip's own."""
  mesh, leaf_specs, leaf_axes = _mesh_and_specs(mesh, specs, tree, p.paths, p.leaves)
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  clip = functools.partial(_shards.clip_in_shard_map, mesh=mesh, leaf_specs=leaf_specs,
                           leaf_axes=leaf_axes, impl=_dispatch.shard_impl(impl, p.leaves),
                           **kwargs)
  return _dispatch.differentiable(clip, p.max_norm, p.leaves,
                                  _dispatch.pure_jax_tangent(**kwargs))


def clip_tree_in_shard_map(tree, max_norm, *, specs, impl: str = "auto", mode: str = "global",
                           on_nonfinite: str = "propagate", scale: str = "auto") -> ClipResult:
  """`clip_tree` called inside the caller's own `shard_map` on local shards.

  Args:
    tree: this device's shards of the gradients.
    max_norm, impl, mode, on_nonfinite, scale: as for `clip_tree`.
    specs: the PartitionSpecs the gradients have in the enclosing shard_map
      (its in_specs for them): a pytree shaped like `tree`, or a prefix of it.
      Only the mesh axes they name matter: a leaf is summed over those axes,
      so a spec must name every axis the leaf is split over, and no other.

  Returns:
    A ClipResult holding this device's clipped shards; the norms and flags
    are the same on every device.
  """
  if specs is None:
    raise ValueError("clipjax: inside shard_map, pass specs=, the PartitionSpecs of the "
                     "gradients (the in_specs given to shard_map for them)")
  return _dispatch.clip(functools.partial(run_on_shards, specs=specs), tree, max_norm,
                        impl=impl, mode=mode, on_nonfinite=on_nonfinite, scale=scale,
                        feeds_consumer=False)


def run_on_shards(p, tree, *, specs, impl, mode, on_nonfinite, scale_by):
  """`_dispatch.run_whole`'s contract, on local shards inside the caller's `shard_map`."""
  leaf_axes = [_shards.spec_axes(spec, _options.where(path))
               for spec, path in zip(_leaf_specs(specs, tree), p.paths)]
  _check_specs_in_shard_map(p.paths, p.leaves, leaf_axes)
  impl = _dispatch.shard_impl(impl, p.leaves)
  clip = functools.partial(_shards.clip_shards, leaf_axes=leaf_axes, impl=impl, mode=mode,
                           on_nonfinite=on_nonfinite, scale_by=scale_by)
  if impl == "jax":  # the pure-JAX clip of the shards is differentiable as it is
    return clip(p.max_norm, p.leaves)
  return _dispatch.differentiable(clip, p.max_norm, p.leaves,
                                  _dispatch.no_tangent(_NO_DERIVATIVE_HERE))


_NO_DERIVATIVE_HERE = (
    "clipjax: inside your own shard_map the custom call has no derivative: pass impl='jax' "
    "to clip_tree_in_shard_map to differentiate through it, or clip the whole tree outside "
    "the shard_map (clip_tree, andrea_clip), whose derivative every path provides.")
