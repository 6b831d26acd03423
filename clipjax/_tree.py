"""The tree a clip acts on: its leaves (as arrays) with their paths, the names of those
paths, the dtype of its norms, and the `ClipResult` that takes the clipped leaves back."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ClipResult(NamedTuple):
  """What a clip returns: the clipped tree, its norms and what the clip did.

  Norms are float32, or float64 for a tree with float64 leaves.

  Attributes:
    updates: the clipped tree, shaped and sharded as the tree clipped.
    global_norm: scalar, the norm before clipping.
    clipped: bool scalar, whether the tree was scaled (or zeroed).
    nonfinite: bool scalar, whether the norm was NaN or inf (or a traced `max_norm` was
      not a finite number above 0).
    leaf_norms: [number of leaves], each leaf's norm before clipping, in tree-flatten order.

  Examples:
    >>> import jax.numpy as jnp
    >>> import clipjax
    >>> result = clipjax.clip_tree([jnp.array([3.0]), jnp.array([4.0])], 10.0)
    >>> print(result.global_norm, result.clipped, result.nonfinite, result.leaf_norms)
    5.0 False False [3. 4.]
  """
  updates: object
  global_norm: jax.Array
  clipped: jax.Array
  nonfinite: jax.Array
  leaf_norms: jax.Array


def empty_result(tree) -> ClipResult:
  zero = jnp.zeros((), jnp.float32)
  return ClipResult(tree, zero, jnp.zeros((), bool), jnp.zeros((), bool), jnp.zeros((0,)))


def make_result(treedef, out, norms, flags, invalid_max_norm) -> ClipResult:
  """A ClipResult from a clip's (out_leaves, norms f32[n + 1], flags int32[2]); an invalid
  max_norm (see `_dispatch.max_norm_operand`) counts as non-finite."""
  return ClipResult(jax.tree_util.tree_unflatten(treedef, out), norms[0], flags[0] != 0,
                    (flags[1] != 0) | invalid_max_norm, norms[1:])


def where(path) -> str:
  """A leaf's path as users write it, e.g. ['layer']['w']."""
  return jax.tree_util.keystr(path) or "<root>"


def name(path) -> str:
  """A leaf's path as Flax and Orbax name it, e.g. blocks/0/attn/q/kernel."""
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def norm_dtype(leaves):
  """The dtype of the norms and of the arithmetic: float64 for a tree with a float64 or
  complex128 leaf, else float32."""
  wide = any(jnp.dtype(x.dtype) in (jnp.dtype("float64"), jnp.dtype("complex128"))
             for x in leaves)
  return jnp.dtype("float64" if wide else "float32")


def _as_array(leaf):
  """A Python number leaf as a JAX scalar: a float or int as float32, as JAX makes a Python
  float without jax_enable_x64; a subclass that carries a dtype (numpy's float64, say) as
  that dtype where JAX has it, else float32, with no warning. Any other leaf as it is."""
  if not isinstance(leaf, (int, float)) or isinstance(leaf, bool):
    return leaf
  if type(leaf) in (int, float):
    return jnp.asarray(leaf, jnp.float32)
  return jnp.asarray(leaf)


def flatten(tree):
  """Leaves (as arrays) with their paths; rejects leaves that are not floats."""
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, leaf in paths_leaves:
    leaf = _as_array(leaf)
    if not hasattr(leaf, "dtype"):
      raise TypeError(f"clipjax: leaf {where(path)} is a {type(leaf).__name__}, not a "
                      "floating-point array")
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(f"clipjax: leaf {where(path)} has dtype {leaf.dtype}; gradients must be "
                      "floating point (float32, bfloat16, float16, float64). Integer and bool leaves "
                      "cannot be clipped: mask them out (e.g. optax.masked) or drop them.")
    leaves.append(leaf)
  return [p for p, _ in paths_leaves], leaves, treedef
