"""The options every entry point takes, their checks, and the leaves they act on."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "jax", "ffi")
# The custom call's `mode` and `on_nonfinite` attributes are these positions
# (cuda/andrea_clip_math.h: ClipMode, NonFinitePolicy).
MODES = ("global", "per_tensor")
NONFINITE_POLICIES = ("propagate", "zero")
# Who multiplies the leaves by the clip's factor when the custom call computes the norm:
# "kernel" (k_grad_scale, in place), "fused" (an XLA elementwise op that XLA fuses into
# whatever consumes the clipped leaves), or "auto" (see `resolve_scale`).
SCALES = ("auto", "fused", "kernel")


class ClipResult(NamedTuple):
  """What a clip returns: the clipped tree, the norm before clipping, whether it was
  clipped, whether the norm was NaN/inf, and the per-leaf norms (an array, in tree-flatten
  order). Norms are float32, or float64 for a tree with float64 leaves."""
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
  max_norm (see `max_norm_operand`) counts as non-finite."""
  return ClipResult(jax.tree_util.tree_unflatten(treedef, out), norms[0], flags[0] != 0,
                    (flags[1] != 0) | invalid_max_norm, norms[1:])


def check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"clipjax: {name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_max_norm(max_norm):
  """A clear error for a max_norm that is not a real scalar, or (when its value is known
  now) not finite and > 0. A traced value is checked on the device (`max_norm_operand`)."""
  if isinstance(max_norm, (bool, np.bool_)):
    raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}")
  if isinstance(max_norm, jax.core.Tracer):  # e.g. injected by optax.inject_hyperparams
    shape, dtype = max_norm.shape, max_norm.dtype
  else:
    try:
      value = np.asarray(max_norm)
    except Exception as e:  # noqa: BLE001 - report any unconvertible object
      raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}") from e
    shape, dtype = value.shape, value.dtype
  if shape != ():
    raise ValueError(f"clipjax: max_norm must be a scalar; got shape {shape}")
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"clipjax: max_norm must be a real number; got dtype {dtype}")
  if not isinstance(max_norm, jax.core.Tracer):
    number = float(value.astype(np.float64))
    if not (math.isfinite(number) and number > 0):
      raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}")


def max_norm_operand(max_norm, on_nonfinite, dtype=jnp.float32):
  """(max_norm for the clip as a `dtype` scalar, invalid flag), on the device and without
  a host sync.

  A traced max_norm that is NaN or <= 0 must not flip or scale the updates: it is handled
  like a non-finite norm. It becomes 0 under on_nonfinite="zero" (every update is zeroed)
  and NaN under "propagate" (every update is NaN), and the step counts as non-finite.
  """
  max_norm = jnp.asarray(max_norm, dtype).reshape(())
  invalid = ~(max_norm > 0)  # True for NaN
  stand_in = jnp.asarray(0.0 if on_nonfinite == "zero" else jnp.nan, dtype)
  return jnp.where(invalid, stand_in, max_norm), invalid


def check_options(max_norm, impl, mode, on_nonfinite, scale="auto"):
  check_choice("impl", impl, IMPLS)
  check_choice("mode", mode, MODES)
  check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
  check_choice("scale", scale, SCALES)
  if impl == "jax" and scale == "kernel":
    raise ValueError("clipjax: scale='kernel' runs k_grad_scale, a kernel of the custom call; "
                     "impl='jax' always leaves the multiply to XLA. Use impl='auto' or 'ffi', "
                     "or scale='auto'.")
  check_max_norm(max_norm)


# Above this many leaves scale="auto" is "kernel" even ahead of an optimizer: XLA compiles
# the fused multiply into every leaf's fusions, and an AdamW step's compile time grows with
# them on a CPU (docs/design.md, "Who applies the scale").
FUSED_MAX_LEAVES = 1024


def resolve_scale(scale: str, *, impl: str, feeds_consumer: bool, num_leaves: int) -> str:
  """"fused" or "kernel" for scale="auto" (any other value is returned as it is).

  In a transformation whose outputs feed another in the same jit (`andrea_clip` ahead of
  an optimizer), "fused": the multiply joins the optimizer's own elementwise pass, so the
  clip costs one read of the gradients; but "kernel" for a tree of more than
  FUSED_MAX_LEAVES leaves. Where the clipped tree is the result (`clip_tree`), "kernel": it
  writes only when it clips. impl="jax" has no kernel: always "fused".
  """
  if scale != "auto":
    return scale
  if impl == "jax":
    return "fused"
  return "fused" if feeds_consumer and num_leaves <= FUSED_MAX_LEAVES else "kernel"


def where(path) -> str:
  """A leaf's path as users write it, e.g. ['layer']['w']."""
  return jax.tree_util.keystr(path) or "<root>"


def name(path) -> str:
  """A leaf's path as Flax and Orbax name it, e.g. blocks/0/attn/q/kernel."""
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


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
