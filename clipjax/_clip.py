"""`andrea_clip`: global-norm gradient clipping as an optax transformation.

  norm  = sqrt(sum over every element g of every leaf of g^2)
  g_out = g                        if norm <= max_norm   (bit-for-bit)
          g * (max_norm / norm)    otherwise

The data path is pytree -> flat list of leaves -> one custom call (three
kernels) or its pure-JAX twin -> pytree.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipjax import _ffi, _jax_impl

IMPLS = ("auto", "jax", "ffi")


class AndreaClipState(NamedTuple):
  """State of `andrea_clip`, rewritten by every update.

  Attributes:
    global_norm: float32 scalar, the global norm of the latest updates before
      clipping (so a training loop can log it without computing it again).
    clipped: bool scalar, whether the latest updates were scaled (or zeroed).
    nonfinite_count: int32 scalar, how many updates so far had a NaN/inf norm.
    leaf_norms: with mode="per_tensor", a pytree like the updates holding each
      leaf's float32 norm before clipping; None with mode="global".
  """
  global_norm: jax.Array
  clipped: jax.Array
  nonfinite_count: jax.Array
  leaf_norms: Any


class ClipResult(NamedTuple):
  updates: Any
  global_norm: jax.Array
  clipped: jax.Array
  nonfinite: jax.Array
  leaf_norms: list


def _check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"clipjax: {name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check_max_norm(max_norm):
  if isinstance(max_norm, jax.core.Tracer):
    return  # e.g. injected by optax.inject_hyperparams: checked by the caller
  if isinstance(max_norm, (bool, np.bool_)):
    raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}")
  try:
    value = np.asarray(max_norm)
  except Exception as e:  # noqa: BLE001 - report any unconvertible object
    raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}") from e
  if value.shape != () or not np.issubdtype(value.dtype, np.number):
    raise ValueError(f"clipjax: max_norm must be a scalar number; got {max_norm!r}")
  if not (math.isfinite(float(value)) and float(value) > 0):
    raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}")


def _check_options(max_norm, impl, mode, on_nonfinite):
  _check_choice("impl", impl, IMPLS)
  _check_choice("mode", mode, tuple(_ffi.MODES))
  _check_choice("on_nonfinite", on_nonfinite, tuple(_ffi.NONFINITE_POLICIES))
  _check_max_norm(max_norm)


def _flatten(tree):
  """Leaves (as arrays) with their paths; rejects leaves that are not floats."""
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, leaf in paths_leaves:
    where = jax.tree_util.keystr(path) or "<root>"
    if not hasattr(leaf, "dtype"):
      if isinstance(leaf, (float, int)) and not isinstance(leaf, bool):
        leaf = jnp.asarray(leaf, jnp.float32)
      else:
        raise TypeError(f"clipjax: leaf {where} is a {type(leaf).__name__}, not an array")
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(f"clipjax: leaf {where} has dtype {leaf.dtype}; gradients must be "
                      "floating point (float32, bfloat16, float16). Integer and bool leaves "
                      "cannot be clipped: mask them out (e.g. optax.masked) or drop them.")
    leaves.append(leaf)
  return [p for p, _ in paths_leaves], leaves, treedef


def _ffi_supports(leaves):
  return all(jnp.dtype(x.dtype) in _ffi.SUPPORTED_DTYPES for x in leaves)


def _default_platform() -> str:
  """The lowering platform of the default backend ("gpu" resolved to cuda/rocm)."""
  platform = jax.default_backend()
  if platform == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    platform = "rocm" if "rocm" in version else "cuda"
  return platform


def _check_ffi(paths, leaves):
  platform = _default_platform()
  if not _ffi.has_handler(platform):
    raise RuntimeError(_ffi.missing_handler_message(platform))
  for path, x in zip(paths, leaves):
    if jnp.dtype(x.dtype) not in _ffi.SUPPORTED_DTYPES:
      raise TypeError(f"clipjax: impl='ffi' supports float32, bfloat16 and float16 leaves; "
                      f"leaf {jax.tree_util.keystr(path)} is {x.dtype}. Use impl='jax' or 'auto'.")


def _run(max_norm, leaves, *, impl, mode, on_nonfinite, scale_leaves):
  """Dispatches to the custom call or the pure-JAX twin (see module doc)."""
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_leaves=scale_leaves)
  if impl == "jax":
    return _jax_impl.andrea_clip(max_norm, leaves, **kwargs)
  if impl == "ffi":
    return _ffi.andrea_clip(max_norm, leaves, **kwargs)
  # impl == "auto": decided when lowering: CUDA -> custom call, else pure JAX.
  if not (_ffi.has_handler("cuda") and _ffi_supports(leaves)):
    return _jax_impl.andrea_clip(max_norm, leaves, **kwargs)
  if not scale_leaves:
    pick = lambda fn: (lambda *xs: fn(xs[0], list(xs[1:]), **kwargs)[1:])
    norms, flags = jax.lax.platform_dependent(
        max_norm, *leaves, cuda=pick(_ffi.andrea_clip), default=pick(_jax_impl.andrea_clip))
    return None, norms, flags
  pick = lambda fn: (lambda *xs: fn(xs[0], list(xs[1:]), **kwargs))
  out, norms, flags = jax.lax.platform_dependent(
      max_norm, *leaves, cuda=pick(_ffi.andrea_clip), default=pick(_jax_impl.andrea_clip))
  return list(out), norms, flags


def clip_tree(tree, max_norm, *, impl: str = "auto", mode: str = "global",
              on_nonfinite: str = "propagate") -> ClipResult:
  """Clips a pytree of gradients by its global norm (or per leaf).

  Returns a ClipResult: the clipped tree, the float32 norm before clipping,
  whether it was clipped, whether the norm was NaN/inf, and per-leaf norms.
  None leaves and optax.MaskedNode are skipped and kept as they are.
  """
  _check_options(max_norm, impl, mode, on_nonfinite)
  paths, leaves, treedef = _flatten(tree)
  if not leaves:
    zero = jnp.zeros((), jnp.float32)
    return ClipResult(tree, zero, jnp.zeros((), bool), jnp.zeros((), bool), [])
  if impl == "ffi":
    _check_ffi(paths, leaves)
  max_norm = jnp.asarray(max_norm, jnp.float32).reshape(())
  out, norms, flags = _run(max_norm, leaves, impl=impl, mode=mode, on_nonfinite=on_nonfinite,
                           scale_leaves=True)
  return ClipResult(jax.tree_util.tree_unflatten(treedef, out), norms[0], flags[0] != 0,
                    flags[1] != 0, [norms[1 + i] for i in range(len(leaves))])


def global_norm(tree, *, impl: str = "auto") -> jax.Array:
  """The float32 global L2 norm of every element of every leaf of `tree`.

  Squares are accumulated without overflow or underflow for any float32,
  bfloat16 or float16 input (float64 in the custom call; rescaling in JAX).
  """
  _check_choice("impl", impl, IMPLS)
  paths, leaves, _ = _flatten(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  if impl == "ffi":
    _check_ffi(paths, leaves)
  _, norms, _ = _run(jnp.ones((), jnp.float32), leaves, impl=impl, mode="global",
                     on_nonfinite="propagate", scale_leaves=False)
  return norms[0]


def andrea_clip(max_norm, *, impl: str = "auto", mode: str = "global",
                on_nonfinite: str = "propagate", mesh=None,
                specs=None) -> optax.GradientTransformation:
  """Clips updates by their global L2 norm; chain it ahead of the optimizer.

    optax.chain(clipjax.andrea_clip(1.0), optax.adamw(3e-4, weight_decay=0.1))

  With `norm = sqrt(sum_i g_i^2)` over every element of every leaf, updates
  pass unchanged (bit-for-bit) when `norm <= max_norm`; otherwise every leaf is
  multiplied by `max_norm / norm`, after which the global norm is `max_norm`.

  Args:
    max_norm: the largest global norm let through; a Python float (finite,
      > 0) or a JAX scalar. It is an operand of the custom call, so
      `optax.inject_hyperparams` can change it without recompiling.
    impl: "auto" (CUDA custom call on NVIDIA GPUs, pure JAX elsewhere, decided
      when lowering), "ffi" (the custom call on the current platform: CPU or
      CUDA) or "jax" (pure JAX; the fallback for CPU and TPU).
    mode: "global" (one norm for all leaves) or "per_tensor" (each leaf clipped
      by its own norm; the state then holds the per-leaf norms).
    on_nonfinite: "propagate" (like optax: a NaN norm makes every update NaN,
      an inf norm zeroes the finite ones) or "zero" (a NaN/inf norm writes exact
      zeros to every leaf, so AdamW's moments never see it; the step is counted
      in `nonfinite_count`).
    mesh: for updates sharded over this jax.sharding.Mesh: the clip runs in
      `shard_map` over it, each device on its own shards, and only per-leaf
      sums of squares cross devices (see `sharded_clip_tree`).
    specs: the PartitionSpecs of the updates (a pytree like them, or a
      prefix). With `mesh`, read from the updates when left out (concrete
      arrays, or a mesh with Explicit axes). Without `mesh`, `update` runs
      inside the caller's own shard_map and `specs` are the updates' specs
      there (see `clip_tree_in_shard_map`).

  Returns:
    An optax.GradientTransformation whose state is an AndreaClipState.
  """
  _check_options(max_norm, impl, mode, on_nonfinite)
  per_tensor = mode == "per_tensor"
  clip = clip_tree
  if mesh is not None or specs is not None:
    from clipjax import _sharded  # imports this module, so not at the top
    clip = (functools.partial(_sharded.sharded_clip_tree, mesh=mesh, specs=specs)
            if mesh is not None else
            functools.partial(_sharded.clip_tree_in_shard_map, specs=specs))

  def init_fn(params):
    leaf_norms = (jax.tree.map(lambda _: jnp.zeros((), jnp.float32), params)
                  if per_tensor else None)
    return AndreaClipState(jnp.zeros((), jnp.float32), jnp.zeros((), bool),
                           jnp.zeros((), jnp.int32), leaf_norms)

  def update_fn(updates, state, params=None):
    del params
    result = clip(updates, max_norm, impl=impl, mode=mode, on_nonfinite=on_nonfinite)
    leaf_norms = None
    if per_tensor:
      treedef = jax.tree_util.tree_structure(updates)
      leaf_norms = jax.tree_util.tree_unflatten(treedef, result.leaf_norms)
    count = state.nonfinite_count + result.nonfinite.astype(jnp.int32)
    return result.updates, AndreaClipState(result.global_norm, result.clipped, count,
                                           leaf_norms)

  return optax.GradientTransformation(init_fn, update_fn)


def clip_state(opt_state) -> AndreaClipState:
  """The first AndreaClipState inside a (nested) optimizer state."""
  found = []

  def visit(node):
    if isinstance(node, AndreaClipState):
      found.append(node)
      return True
    return False

  jax.tree_util.tree_flatten(opt_state, is_leaf=visit)
  if not found:
    raise ValueError("clipjax: no AndreaClipState in this optimizer state; is andrea_clip in the chain?")
  return found[0]
