"""Clipping gradients sharded over a device mesh, without gathering them.

A custom call handed a sharded array is all-gathered and run whole on every
device. Here each device runs the norm pass (custom call or pure JAX) on its
own shards only, inside `shard_map`. Leaves are grouped by the set of mesh
axes they are sharded on, one norm pass per group; a group's shard norms are
combined over exactly its axes (a replicated leaf is whole on every device, so
it is not summed again); then every device takes the same decision and scales
its own shards:

  whole norm  = m * sqrt(psum over the group's axes of (shard norm / m)^2),
                m = pmax over those axes of the finite shard norms
                (for each leaf, and for all the group's shards together)
  global norm = the same over the group norms, each kept as root * 2**exponent

Dividing by m and aligning the exponents keeps every square inside float32, and
a norm above the float32 range keeps its scale (root * 2**exponent) though it
reads as inf. Only a few floats per leaf cross devices: one pmax and one psum per
group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from clipjax import _jax_impl
from clipjax import _ffi
from clipjax._clip import (ClipResult, _check_ffi, _check_options, _default_platform,
                           _ffi_supports, _flatten, _run)

_F32 = jnp.float32


def _empty_result(tree):
  zero = jnp.zeros((), _F32)
  return ClipResult(tree, zero, jnp.zeros((), bool), jnp.zeros((), bool), [])


# --- which mesh axes each leaf is sharded on -------------------------------------------


def _spec_axes(spec, path):
  """The mesh axes named by `spec`, in order, each once."""
  where = jax.tree_util.keystr(path) or "<root>"
  if not isinstance(spec, PartitionSpec):
    raise TypeError(f"clipjax: the spec for leaf {where} is a {type(spec).__name__}, not a "
                    "PartitionSpec (for a NamedSharding s, pass s.spec)")
  axes = []
  for entry in spec:
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if name is PartitionSpec.UNCONSTRAINED:
        raise ValueError(f"clipjax: the spec for leaf {where} is unconstrained; name the mesh "
                         "axes the leaf is sharded on")
      if name is not None and name not in axes:
        axes.append(name)
  return tuple(axes)


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


def _known_sharding(leaf):
  """(mesh, spec) of a leaf whose sharding is known before lowering, else None.

  A concrete array carries its NamedSharding. Inside jit the type holds the
  sharding only on a mesh whose axes are all Explicit; on Auto axes it says
  nothing about how XLA will lay the array out.
  """
  if not isinstance(leaf, jax.core.Tracer):
    sharding = getattr(leaf, "sharding", None)
    return (sharding.mesh, sharding.spec) if isinstance(sharding, NamedSharding) else None
  typeof = getattr(jax, "typeof", None)
  sharding = getattr(typeof(leaf), "sharding", None) if typeof else None
  if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
    return None
  explicit = jax.sharding.AxisType.Explicit
  if any(t != explicit for t in sharding.mesh.axis_types):
    return None
  return sharding.mesh, sharding.spec


def _mesh_and_specs(mesh, specs, tree, paths, leaves):
  known = [_known_sharding(x) for x in leaves]
  if specs is None:
    for path, k in zip(paths, known):
      if k is None:
        raise ValueError(f"clipjax: cannot tell how leaf {jax.tree_util.keystr(path)} is "
                         "sharded: pass specs=, the PartitionSpecs of the gradients. They are "
                         "read from the leaves only for concrete arrays with a NamedSharding "
                         "or, inside jit, on a mesh whose axes are all Explicit.")
    leaf_specs = [spec for _, spec in known]
  else:
    leaf_specs = _leaf_specs(specs, tree)
  if mesh is None:
    meshes = {k[0] for k in known if k is not None}
    if len(meshes) != 1:
      raise ValueError("clipjax: pass mesh=, the Mesh the gradients are sharded over "
                       f"(their shardings name {len(meshes)} meshes)")
    mesh = meshes.pop()
  leaf_axes = [_spec_axes(spec, path) for spec, path in zip(leaf_specs, paths)]
  for path, axes in zip(paths, leaf_axes):
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"clipjax: the spec for leaf {jax.tree_util.keystr(path)} names axes "
                       f"{unknown} that the mesh {tuple(mesh.axis_names)} does not have")
  return mesh, leaf_specs, leaf_axes


# --- the clip on one device's shards ---------------------------------------------------


def _whole_leaf_norms(shard_norms, axes):
  """Whole norms from this device's shard norms, elementwise, as (root, exponent) with
  norm = root * 2**exponent, so that a whole norm above the float32 range is kept (a
  root stays near 1). NaN and inf carry through into the root.

  `shard_norms` are norms of shards of leaves sharded on `axes`. (Inside
  shard_map the custom call's results are typed as equal on every device; the
  collectives still combine each device's own values.)
  """
  if not axes:
    return jnp.frexp(shard_norms)
  top = lax.pmax(jnp.where(jnp.isfinite(shard_norms), shard_norms, _F32(0)), axes)
  top = jnp.where(top > 0, top, _F32(1))
  mantissa, exponent = jnp.frexp(top)
  return mantissa * jnp.sqrt(lax.psum(jnp.square(shard_norms / top), axes)), exponent


def _norm_of_norms(roots, exps):
  """(root, exponent) of the norm of the norms root_i * 2**exps_i."""
  top = jnp.max(jnp.where(jnp.isfinite(roots) & (roots > 0), exps, jnp.iinfo(jnp.int32).min))
  top = jnp.where(top == jnp.iinfo(jnp.int32).min, 0, top)
  aligned = roots * _jax_impl._pow2(exps - top)
  return jnp.sqrt(jnp.sum(jnp.square(aligned))), top


def _clip_shards(max_norm, shards, leaf_axes, *, impl, mode, on_nonfinite):
  """The clip as one device sees it: its shards in, its clipped shards out.

  Returns (out_shards, global_norm, clipped, nonfinite, leaf_norms[n]); all
  but the shards are the same on every device.
  """
  if impl == "auto":
    # Inside shard_map the two branches of a lowering-time choice must agree on which
    # mesh axes their outputs vary over, and the custom call's outputs carry none; so
    # "auto" is resolved here, from the platform that runs the shards.
    use_ffi = (_default_platform() == "cuda" and _ffi.has_handler("cuda")
               and _ffi_supports(shards))
    impl = "ffi" if use_ffi else "jax"
  groups: dict[frozenset, list[int]] = {}
  for i, axes in enumerate(leaf_axes):
    groups.setdefault(frozenset(axes), []).append(i)
  group_roots, group_exps = [], []
  leaf_roots, leaf_exps = [None] * len(shards), [None] * len(shards)
  for members in groups.values():
    # norms = [norm of this device's shards in the group, then per leaf]. The
    # group norm is safe from overflow and underflow in either mode; the
    # per-leaf norms are (on the pure-JAX path) only with mode="per_tensor".
    _, norms, _ = _run(max_norm, [shards[i] for i in members], impl=impl, mode=mode,
                       on_nonfinite="propagate", scale_leaves=False)
    roots, exps = _whole_leaf_norms(norms, leaf_axes[members[0]])
    group_roots.append(roots[0])
    group_exps.append(exps[0])
    for j, i in enumerate(members):
      leaf_roots[i], leaf_exps[i] = roots[1 + j], exps[1 + j]
  leaf_roots, leaf_exps = jnp.stack(leaf_roots), jnp.stack(leaf_exps)
  root, exp = _norm_of_norms(jnp.stack(group_roots), jnp.stack(group_exps))
  # Norms above the float32 range read as inf, but their (root, exponent) still give the
  # scale; only a NaN or inf root means non-finite gradients.
  global_norm = _jax_impl._unscale(root, exp)
  leaf_norms = _jax_impl._unscale(leaf_roots, leaf_exps)

  zero = on_nonfinite == "zero"
  all_finite = jnp.isfinite(root)
  if mode == "per_tensor":
    scale, keep, zero_fill, pre = _jax_impl.decide(leaf_norms, max_norm, zero, all_finite,
                                                   leaf_roots, leaf_exps)
    clipped = jnp.any(~keep)
  else:
    scale, keep, zero_fill, pre = _jax_impl.decide(global_norm, max_norm, zero, all_finite,
                                                   root, exp)
    clipped = ~keep
  if impl == "ffi" and shards:
    # One custom call scales every shard (k_grad_scale), where XLA would run one
    # fusion per leaf.
    out = _ffi.andrea_scale(scale, pre, keep, zero_fill, shards)
  elif mode == "per_tensor":
    out = [_jax_impl.scale_leaf(x, scale[i], keep[i], zero_fill, pre[i])
           for i, x in enumerate(shards)]
  else:
    out = [_jax_impl.scale_leaf(x, scale, keep, zero_fill, pre) for x in shards]
  return out, global_norm, clipped, ~all_finite, leaf_norms


def _shard_map(fn, mesh, in_specs, out_specs):
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  from jax.experimental.shard_map import shard_map  # older jax
  return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# --- public entry points ---------------------------------------------------------------


def sharded_clip_tree(tree, max_norm, *, mesh=None, specs=None, impl: str = "auto",
                      mode: str = "global", on_nonfinite: str = "propagate") -> ClipResult:
  """`clip_tree` for gradients sharded over a mesh: each device clips its own shards.

  The clip runs inside `shard_map` over `mesh`: every device computes the norms
  of its shards, the per-leaf sums of squares are combined with a psum over the
  mesh axes each leaf is sharded on, and every device scales its shards by the
  same factor. Nothing gradient-sized moves between devices. The result is the
  clip of the whole tree (as `clip_tree` on one device), sharded as it came.

  Args:
    tree: the gradients; under jit, sharded as `specs` say (a leaf laid out
      otherwise is resharded by XLA before the clip).
    max_norm, impl, mode, on_nonfinite: as for `clip_tree`.
    mesh: the jax.sharding.Mesh the gradients are sharded over. Left out, it
      is read from the leaves (see `specs`).
    specs: a PartitionSpec per leaf: a pytree of them shaped like `tree`, or a
      prefix of it (one `P()` for a replicated tree). Left out, each leaf's spec
      is read from the leaf: a concrete array with a NamedSharding, or, inside
      jit, an array on a mesh whose axes are all Explicit.

  Returns:
    A ClipResult; the norms and flags are the same on every device.
  """
  _check_options(max_norm, impl, mode, on_nonfinite)
  paths, leaves, treedef = _flatten(tree)
  if not leaves:
    return _empty_result(tree)
  if impl == "ffi":
    _check_ffi(paths, leaves)
  mesh, leaf_specs, leaf_axes = _mesh_and_specs(mesh, specs, tree, paths, leaves)
  max_norm = jnp.asarray(max_norm, _F32).reshape(())

  def clip_on_device(max_norm, *shards):
    return _clip_shards(max_norm, list(shards), leaf_axes, impl=impl, mode=mode,
                        on_nonfinite=on_nonfinite)

  replicated = PartitionSpec()
  clip = _shard_map(clip_on_device, mesh, in_specs=(replicated, *leaf_specs),
                    out_specs=(list(leaf_specs),) + (replicated,) * 4)
  out, global_norm, clipped, nonfinite, leaf_norms = clip(max_norm, *leaves)
  return ClipResult(jax.tree_util.tree_unflatten(treedef, out), global_norm, clipped,
                    nonfinite, [leaf_norms[i] for i in range(len(leaves))])


def clip_tree_in_shard_map(tree, max_norm, *, specs, impl: str = "auto", mode: str = "global",
                           on_nonfinite: str = "propagate") -> ClipResult:
  """`clip_tree` called inside the caller's own `shard_map` on local shards.

  Args:
    tree: this device's shards of the gradients.
    max_norm, impl, mode, on_nonfinite: as for `clip_tree`.
    specs: the PartitionSpecs the gradients have in the enclosing shard_map
      (its in_specs for them): a pytree shaped like `tree`, or a prefix of it.
      Only the mesh axes they name matter: a leaf is summed over those axes,
      so a spec must name every axis the leaf is split over, and no other.

  Returns:
    A ClipResult holding this device's clipped shards; the norms and flags
    are the same on every device.
  """
  _check_options(max_norm, impl, mode, on_nonfinite)
  if specs is None:
    raise ValueError("clipjax: inside shard_map, pass specs=, the PartitionSpecs of the "
                     "gradients (the in_specs given to shard_map for them)")
  paths, leaves, treedef = _flatten(tree)
  if not leaves:
    return _empty_result(tree)
  if impl == "ffi":
    _check_ffi(paths, leaves)
  leaf_axes = [_spec_axes(spec, path) for spec, path in zip(_leaf_specs(specs, tree), paths)]
  max_norm = jnp.asarray(max_norm, _F32).reshape(())
  out, global_norm, clipped, nonfinite, leaf_norms = _clip_shards(
      max_norm, leaves, leaf_axes, impl=impl, mode=mode, on_nonfinite=on_nonfinite)
  return ClipResult(jax.tree_util.tree_unflatten(treedef, out), global_norm, clipped,
                    nonfinite, [leaf_norms[i] for i in range(len(leaves))])
