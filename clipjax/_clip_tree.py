"""The clip as a function of a tree: `clip_tree` and `global_norm` on the tree as the caller
holds it (whole, or sharded under `jax.jit`, where each device clips its own shards), and
the explicit `shard_map` forms, for code that maps over a mesh itself:
`clip_tree_in_shard_map` inside the caller's own `shard_map`, and `sharded_clip_tree`,
which runs the clip in a `shard_map` of its own. Called outside jit, `sharded_clip_tree`
runs as one jitted call, cached like any jitted function: a shard_map run eagerly is
traced and compiled anew at every call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from clipjax import _dispatch, _options, _tree
from clipjax._partitioning import specs as _specs
from clipjax._tree import ClipResult


def clip_tree(tree, max_norm, *, impl: str = "auto", mode: str = "global",
              on_nonfinite: str = "propagate", scale: str = "auto") -> ClipResult:
  """Clips a pytree of gradients by its global norm (or per leaf).

  None leaves and optax.MaskedNode are skipped and kept as they are. A tree with a float64
  leaf (with jax_enable_x64) is clipped in float64, norms included; else in float32.
  Under `jax.jit` on sharded leaves, each device clips its own shards.

  Args:
    tree: the gradients, a pytree of floating-point arrays.
    max_norm: the largest global norm let through: a Python float (finite, > 0) or a JAX
      scalar.
    impl, mode, on_nonfinite: as for `andrea_clip`.
    scale: as for `andrea_clip`, but "auto" is "kernel" here: the clipped tree is the
      result, and k_grad_scale writes it only when it clips.

  Returns:
    A ClipResult: the clipped tree, the norm before clipping, whether it was clipped,
    whether the norm was NaN/inf, and the per-leaf norms.

  Raises:
    ValueError: an option outside its choices; a Python `max_norm` that is not a finite
      number above 0, or a `max_norm` that is not a real scalar; `scale="kernel"` with
      `impl="jax"`.
    TypeError: a leaf that is not a floating-point array (the message names it), or, with
      `impl="ffi"`, a dtype the custom call does not take.
    RuntimeError: `impl="ffi"` on a platform whose handler this install lacks.

  Examples:
    >>> import jax.numpy as jnp
    >>> import clipjax
    >>> result = clipjax.clip_tree({"w": jnp.array([3.0, 4.0])}, 1.0)
    >>> print(result.updates["w"], result.global_norm, result.clipped)
    [0.6 0.8] 5.0 True
    >>> tree = [jnp.array([3.0, 4.0]), jnp.array([0.5])]
    >>> print(clipjax.clip_tree(tree, 1.0, mode="per_tensor").updates)
    [Array([0.6, 0.8], dtype=float32), Array([0.5], dtype=float32)]
  """
  _options.check_options(max_norm, impl, mode, on_nonfinite, scale)
  return _dispatch.clip(tree, max_norm, impl=impl, mode=mode,
                        on_nonfinite=on_nonfinite, scale=scale, feeds_consumer=False)


def global_norm(tree, *, impl: str = "auto") -> jax.Array:
  """The global L2 norm of every element of every leaf of a pytree.

  Squares are accumulated without overflow or underflow for any input (float64
  in the custom call; rescaling in JAX).

  Args:
    tree: a pytree of floating-point arrays (None leaves and optax.MaskedNode skipped).
    impl: as for `andrea_clip`.

  Returns:
    A scalar: float32, or float64 for a tree with a float64 leaf; 0 for a tree with no
    leaves.

  Raises:
    ValueError: `impl` outside its choices.
    TypeError: a leaf or dtype refused as by `clip_tree`.
    RuntimeError: as for `clip_tree`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import clipjax
    >>> print(clipjax.global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
    5.0
    >>> print(clipjax.global_norm([jnp.array([3e20, 4e20])]))  # squares beyond float32
    5e+20
  """
  _options.check_options(1.0, impl, "global", "propagate")  # any valid max_norm
  _, leaves, _ = _dispatch.leaves_of(tree, impl)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  max_norm, _ = _dispatch.max_norm_operand(1.0, "propagate", _tree.norm_dtype(leaves))
  _, norms, _ = _dispatch.run(max_norm, leaves, impl=impl, mode="global",
                              on_nonfinite="propagate", scale_by=None)
  return norms[0]


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

  Raises:
    ValueError: an option or `max_norm` refused as by `clip_tree`; no mesh given or found;
      a spec that does not fit its leaf or the mesh, or a leaf whose spec cannot be read
      (each message names the leaf).
    TypeError: a spec that is not a PartitionSpec, or a leaf that is not a floating-point
      array (the message names it).

  Examples:
    The mesh and the specs read from gradients placed with a NamedSharding:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import clipjax
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    >>> grads = {"w": jax.device_put(jnp.array([3.0, 4.0]), data)}
    >>> result = clipjax.sharded_clip_tree(grads, 1.0)
    >>> print(result.updates["w"], result.global_norm)
    [0.6 0.8] 5.0
  """
  options = dict(impl=impl, mode=mode, on_nonfinite=on_nonfinite, scale=scale)
  paths, leaves, treedef = _tree.flatten(tree)
  _options.check_options(max_norm, impl, mode, on_nonfinite, scale)
  if leaves and not any(isinstance(x, jax.core.Tracer) for x in [max_norm, *leaves]):
    mesh, leaf_specs, _ = _specs.mesh_and_specs(mesh, specs, tree, paths, leaves)
    return _sharded_clip_jitted(tree, max_norm, mesh=mesh, treedef=treedef,
                                leaf_specs=tuple(leaf_specs), **options)
  return _dispatch.clip(tree, max_norm, feeds_consumer=False, held="mesh", mesh=mesh,
                        specs=specs, **options)


@functools.partial(jax.jit, static_argnames=("mesh", "treedef", "leaf_specs", "impl", "mode",
                                             "on_nonfinite", "scale"))
def _sharded_clip_jitted(tree, max_norm, *, mesh, treedef, leaf_specs, impl, mode,
                         on_nonfinite, scale):
  """sharded_clip_tree outside jit: the mesh and the specs (one per leaf, as hashable
  static arguments) are known, so the jit cache keys on them and the tree's shapes."""
  specs = jax.tree_util.tree_unflatten(treedef, leaf_specs)
  return _dispatch.clip(tree, max_norm, held="mesh", mesh=mesh, specs=specs, impl=impl,
                        mode=mode, on_nonfinite=on_nonfinite, scale=scale,
                        feeds_consumer=False)


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

  Raises:
    ValueError: `specs` left out; a spec that does not fit its leaf; an option or
      `max_norm` refused as by `clip_tree`.
    TypeError: a spec that is not a PartitionSpec, or a leaf that is not a floating-point
      array (the message names it).

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> import clipjax
    >>> mesh = Mesh(jax.devices()[:1], ("data",))
    >>> def clip(grads):
    ...   return clipjax.clip_tree_in_shard_map(grads, 1.0, specs=P("data")).updates
    >>> clipped = jax.shard_map(clip, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> print(clipped(jnp.array([3.0, 4.0])))
    [0.6 0.8]
  """
  if specs is None:
    raise ValueError("clipjax: inside shard_map, pass specs=, the PartitionSpecs of the "
                     "gradients (the in_specs given to shard_map for them)")
  _options.check_options(max_norm, impl, mode, on_nonfinite, scale)
  return _dispatch.clip(tree, max_norm, held="on_shards", specs=specs,
                        impl=impl, mode=mode, on_nonfinite=on_nonfinite, scale=scale,
                        feeds_consumer=False)
