"""`andrea_clip`: global-norm gradient clipping as an optax transformation.

  norm  = sqrt(sum over every element g of every leaf of g^2)
  g_out = g                        if norm <= max_norm   (bit-for-bit)
          g * (max_norm / norm)    otherwise

The data path is pytree -> flat list of leaves -> one custom call (three
kernels) or its pure-JAX twin -> pytree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from clipjax import _dispatch, _options, _spike, _tree
from clipjax._clip_state import AndreaClipState
from clipjax._spike import ZScoreSpike


def andrea_clip(max_norm, *, impl: str = "auto", mode: str = "global",
                on_nonfinite: str = "propagate", scale: str = "auto",
                spike: ZScoreSpike | None = None, mesh=None,
                specs=None) -> optax.GradientTransformation:
  """Clips updates by their global L2 norm; chain it ahead of the optimizer.

    optax.chain(clipjax.andrea_clip(1.0), optax.adamw(3e-4, weight_decay=0.1))

  With `norm = sqrt(sum_i g_i^2)` over every element of every leaf, updates
  pass unchanged (bit-for-bit) when `norm <= max_norm`; otherwise every leaf is
  multiplied by `max_norm / norm`, after which the global norm is `max_norm`.

  Under `jax.jit` on updates with any sharding (NamedSharding on Auto or
  Explicit mesh axes), each device reduces its own shards, only a few floats
  per leaf are all-reduced, and every update keeps its sharding: nothing is
  gathered, on either implementation.

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
    scale: who multiplies the updates by the clip's factor on the custom-call
      path. "fused" (what "auto" picks here, for up to 1,024 leaves; "kernel"
      above, where compile time grows): the custom call computes the norm
      and the decision, and the multiply is an XLA elementwise op that XLA fuses
      into the optimizer's own pass over the updates, so the clip costs one
      read of the gradients. "kernel": k_grad_scale writes the clipped updates
      in place (the right choice when nothing consumes them in the same jit).
      The updates are bit-identical either way; the pure-JAX path always
      leaves the multiply to XLA.
    spike: a spike policy (`ZScoreSpike(...)`): a step whose global norm is a
      spike by its running statistics clips to the lower of max_norm and the
      spike threshold, and is flagged in the state (`spike`, `spike_count`) for
      `skip_spikes`. All of it runs on the device, with no host sync and no
      conditional; the clip still reads the gradients once, with any `scale`.
      It works with mesh= and specs= as well.
    mesh: only for code that wants the clip in its own `shard_map` over this
      jax.sharding.Mesh (see `sharded_clip_tree`). Not needed for sharded
      updates under `jax.jit`: there the plain transform already clips each
      device's shards in place and all-reduces a few floats per leaf.
    specs: the PartitionSpecs of the updates (a pytree like them, or a
      prefix). With `mesh`, read from the updates when left out (concrete
      arrays, or a mesh with Explicit axes). Without `mesh`, `update` runs
      inside the caller's own shard_map and `specs` are the updates' specs
      there (see `clip_tree_in_shard_map`).

  Returns:
    An optax.GradientTransformation whose state is an AndreaClipState.

  Raises:
    ValueError: an option outside its choices; a Python `max_norm` that is not a finite
      number above 0, or a `max_norm` that is not a real scalar; `scale="kernel"` with
      `impl="jax"`; at `update`, specs that do not fit the updates or the mesh.
    TypeError: a `spike` that is not a `ZScoreSpike`; at `init` or `update`, a leaf that is
      not a floating-point array (the message names it).
    RuntimeError: at `update`, `impl="ffi"` on a platform whose handler this install lacks.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import clipjax
    >>> grads = {"w": jnp.array([3.0, 4.0])}
    >>> clip = clipjax.andrea_clip(1.0)
    >>> updates, state = clip.update(grads, clip.init(grads))
    >>> print(updates["w"], state.global_norm, state.clipped)
    [0.6 0.8] 5.0 True

    Ahead of the optimizer, as in training:

    >>> tx = optax.chain(clipjax.andrea_clip(1.0), optax.sgd(1.0))
    >>> params = {"w": jnp.zeros(2)}
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> print(updates["w"])
    [-0.6 -0.8]
  """
  _options.check_options(max_norm, impl, mode, on_nonfinite, scale)
  if spike is not None and not isinstance(spike, ZScoreSpike):
    raise TypeError(f"clipjax: spike must be a clipjax.ZScoreSpike or None; got {spike!r}")
  # How the tree is clipped as the caller holds it: whole (or sharded under jit), in a
  # shard_map of the clip's own, or inside the caller's.
  held = "whole" if mesh is None and specs is None else "on_shards" if mesh is None else "mesh"

  def init_fn(params):
    _, leaves, _ = _tree.flatten(params)
    return AndreaClipState(jnp.zeros((), _tree.norm_dtype(leaves)), jnp.zeros((), bool),
                           jnp.zeros((), jnp.int32), jnp.zeros((len(leaves),), jnp.float32),
                           *_spike.initial_stats())

  def update_fn(updates, state, params=None):
    del params
    stats = _spike.SpikeStats(*(getattr(state, f) for f in _spike.SpikeStats._fields))
    # The spike policy only lowers the max_norm this step clips to (known from the
    # statistics before the norm: see `_spike.clip_limit`); its verdict follows the norm.
    limit = None if spike is None else functools.partial(_spike.clip_limit, spike, stats)
    result = _dispatch.clip(updates, max_norm, impl=impl, mode=mode, on_nonfinite=on_nonfinite,
                            scale=scale, feeds_consumer=True, held=held, mesh=mesh, specs=specs,
                            limit=limit)
    if spike is not None and result.leaf_norms.shape[0]:  # a tree with leaves
      stats = _spike.step(spike, stats, result.global_norm, result.nonfinite)
    count = state.nonfinite_count + result.nonfinite.astype(jnp.int32)
    leaf_norms = result.leaf_norms.astype(jnp.float32).reshape(state.leaf_norms.shape)
    new_state = AndreaClipState(result.global_norm.astype(state.global_norm.dtype),
                                result.clipped, count, leaf_norms, *stats)
    return result.updates, jax.tree.map(_over, state, new_state)

  return optax.GradientTransformation(init_fn, update_fn)


def _over(old, new):
  """`new`, as a value written over `old`. Every field of the state is read, so none drops
  out of the caller's jit as unused: each donated field pairs with its own output, the
  state keeps its buffers from step to step, and XLA copies nothing and finds every address
  of its command buffers (CUDA graphs) unchanged, with no update. Without it, the write-only
  fields (the norms, `clipped`) get new buffers each step and XLA re-records the whole
  step's graph, a cost of the host's on every step (benchmarks/bench_dispatch.py times the
  host's share of a call by the state it rewrites)."""
  return jnp.where(True, new, old)


