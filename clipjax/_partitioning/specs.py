"""Which mesh axes each leaf is split over: read from the leaves' shardings where they are
known before lowering, or from the PartitionSpecs a caller gives, and checked against the
mesh (and, inside `shard_map`, against the axes each leaf varies over)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from clipjax import _tree


def spec_axes(spec, where: str) -> tuple:
  """The mesh axes named by `spec` (the PartitionSpec of leaf `where`), each once."""
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


def known_layout(leaves):
  """(mesh, known): `known` holds each leaf's (mesh, spec) where its sharding is known
  before lowering (`_known_sharding`) and None elsewhere; `mesh` is the one mesh those
  name, or None where they name none or several."""
  known = [_known_sharding(x) for x in leaves]
  meshes = {k[0] for k in known if k is not None}
  return (meshes.pop() if len(meshes) == 1 else None), known


def specs_per_leaf(specs, tree):
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


def mesh_and_specs(mesh, specs, tree, paths, leaves):
  found, known = known_layout(leaves)
  if specs is None:
    for path, k in zip(paths, known):
      if k is None:
        raise ValueError(f"clipjax: cannot tell how leaf {_tree.where(path)} is "
                         "sharded: pass specs=, the PartitionSpecs of the gradients. They are "
                         "read from the leaves only for concrete arrays with a NamedSharding "
                         "or, inside jit, on a mesh whose axes are all Explicit.")
    leaf_specs = [spec for _, spec in known]
  else:
    leaf_specs = specs_per_leaf(specs, tree)
  if mesh is None:
    if found is None:
      raise ValueError("clipjax: pass mesh=, the Mesh the gradients are sharded over (their "
                       "shardings name no single mesh)")
    mesh = found
  leaf_axes = [spec_axes(spec, _tree.where(path))
               for spec, path in zip(leaf_specs, paths)]
  for path, axes in zip(paths, leaf_axes):
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"clipjax: the spec for leaf {_tree.where(path)} names axes "
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


def check_in_shard_map(paths, leaves, leaf_axes):
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
        raise ValueError(f"clipjax: the spec for leaf {_tree.where(path)} names mesh axis "
                         f"{unknown[0]!r}, which the enclosing mesh {names} does not have")
    if tracked and vma is not None and vma != set(axes):
      missing, extra = sorted(vma - set(axes)), sorted(set(axes) - vma)
      what = (f"varies over mesh axes {missing} that its spec does not name, so the norm "
              "would miss the other devices' shards" if missing else
              f"is the same on every device along {extra}, which its spec names, so it "
              "would be counted once per device")
      raise ValueError(f"clipjax: leaf {_tree.where(path)} {what}; its spec must name "
                       f"exactly the axes it is split over: {sorted(vma)}")
