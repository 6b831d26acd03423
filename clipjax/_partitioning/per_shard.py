"""The clip as one device sees it: its own shards in, its clipped shards out.

Every sharded clip ends here: the partitioned clip that the plain `andrea_clip` becomes
under `jax.jit` on sharded gradients (`spmd.py`), in a `shard_map` over the
leaves' types where those are sharded by Explicit mesh axes, and the explicit
`shard_map` forms (`clipjax.sharded_clip_tree`, `clipjax.clip_tree_in_shard_map`).
Leaves are grouped by the set of mesh axes they are sharded on, one norm pass per group;
a group's shard norms are combined over exactly its axes (a replicated leaf is whole on
every device, so it is not summed again); then every device takes the same decision and
scales its own shards:

  whole norm  = sqrt(psum over the group's axes of shard norm^2)
                (for each leaf, and for all the group's shards together)
  global norm = the same over the group norms, each kept as root * 2**exponent

The squares are summed at three scales at once, as the pure-JAX path sums a leaf's
elements (`clipjax._decision.whole_norms`), so none overflows or underflows, and
a norm above the float range keeps its scale (root * 2**exponent) though it reads as inf.
Only a few floats per leaf cross devices: one psum per set of axes, of three floats per
leaf and per norm call in the set (a call takes at most `_backend.MAX_LEAVES_PER_CALL` leaves).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from clipjax import _backend, _decision


def split(leaf_axes) -> _backend.Split:
  """How `_backend.clip` takes the norms of leaves split over `leaf_axes` (per leaf, the
  mesh axes it is split over): the leaves grouped by their set of axes, a group in calls of
  at most `_backend.MAX_LEAVES_PER_CALL` leaves, and the calls' norms combined over each
  group's axes (`_combine`)."""
  by_axes: dict[frozenset, list[int]] = {}
  for i, axes in enumerate(leaf_axes):
    by_axes.setdefault(frozenset(axes), []).append(i)
  step = _backend.MAX_LEAVES_PER_CALL
  groups = [(members, leaf_axes[members[0]]) for members in by_axes.values()]
  calls = [members[k:k + step] for members, _ in groups for k in range(0, len(members), step)]
  return _backend.Split(calls, functools.partial(_combine, groups, step))


def _combine(groups, step, call_norms):
  """The whole tree's (global root, global exponent, leaf roots, leaf exponents) from the
  norm calls' outputs (`split`), in the leaves' order."""
  # Every call's norms = [norm of this device's shards in the call, then one per leaf],
  # laid end to end per set of axes: one frexp or all-reduce per set, and a few slices per
  # set, not per call or per leaf (each a kernel of its own, which XLA:CPU compiles apart:
  # benchmarks/bench_compile.py).
  call_roots, call_exps, leaf_roots, leaf_exps = [], [], [], []
  first = 0
  for members, axes in groups:
    num_calls = -(-len(members) // step)
    roots, exps = _decision.whole_norms(jnp.concatenate(call_norms[first:first + num_calls]),
                                        axes)
    first += num_calls
    for x, calls, leaves in ((roots, call_roots, leaf_roots), (exps, call_exps, leaf_exps)):
      of_calls, of_leaves = _split_calls(x, len(members), step)
      calls.append(of_calls)
      leaves.append(of_leaves)
  root, exp = _decision.norm_of_norms(jnp.concatenate(call_roots), jnp.concatenate(call_exps))
  leaf_roots, leaf_exps = jnp.concatenate(leaf_roots), jnp.concatenate(leaf_exps)
  order = [i for members, _ in groups for i in members]
  if order != sorted(order):
    inverse = np.argsort(order)
    leaf_roots, leaf_exps = leaf_roots[inverse], leaf_exps[inverse]
  return root, exp, leaf_roots, leaf_exps


def clip_shards(max_norm, shards, leaf_axes, *, impl: str, mode: str, on_nonfinite: str,
                scale_by, norm_inputs=None, by_rows=None):
  """The clip of the whole tree, run on this device's shards (inside shard_map or a
  partitioned custom call, where the mesh axes are bound).

  Args:
    max_norm: scalar (float32, or float64 for float64 leaves), the same on every device.
    shards: this device's shard of every leaf.
    leaf_axes: per leaf, the mesh axes it is split over.
    impl: "ffi" (custom calls) or "jax".
    scale_by: "kernel" (one scale call, `k_grad_scale`, for impl="ffi"), "fused" (XLA
      elementwise ops) or None (the norms only); see `_backend.clip`.
    norm_inputs: what the norms are taken of (`_trace_reads.NormInputs`), where it differs from
      `shards` (a shard with padding, masked to zero; a leaf's cheaper source, for
      impl="ffi"); the scale always applies to `shards`.
    by_rows: for impl="jax", how each device finishes its sums, as
      `_backend.clip` takes it (None: decided when lowering, by platform).

  Returns:
    (out_shards or None, norms f32[n + 1], flags int32[2]), as the custom call does;
    all but the shards are the same on every device.
  """
  return _backend.clip(impl, max_norm, shards, mode=mode, on_nonfinite=on_nonfinite,
                       scale_by=scale_by, norm_inputs=norm_inputs, by_rows=by_rows,
                       split=split(leaf_axes))


def _split_calls(x, num_leaves, step):
  """(one value per call, one per leaf) from the norm calls' outputs laid end to end: calls
  of `step` leaves, the last of what is left, each [call's value, then its leaves']. Static
  slices and reshapes only: a gather would need its indices as a constant, which the
  function that `custom_partitioning` traces may not hold."""
  full = num_leaves // step
  whole = x[:full * (step + 1)].reshape(full, step + 1)
  rest = x[full * (step + 1):]  # the last call's, if it is short: empty or 1 + its leaves
  return (jnp.concatenate([whole[:, 0], rest[:1]]),
          jnp.concatenate([whole[:, 1:].reshape(-1), rest[1:]]))


def _shard_map(fn, mesh, in_specs, out_specs):
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  from jax.experimental.shard_map import shard_map  # older jax
  return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def clip_in_shard_map(max_norm, leaves, mesh, leaf_specs, leaf_axes, *, impl: str, mode: str,
                      on_nonfinite: str, scale_by, by_rows=None):
  """`clip_shards` in a `shard_map` over `mesh`, each leaf laid out as its spec in
  `leaf_specs` says (`leaf_axes`: the axes each names); the clipped leaves come out laid
  out as they came, the norms and flags replicated.

  Returns (out_leaves or None, norms, flags) as `clip_shards` does.
  """
  def clip_on_device(max_norm, *shards):
    out, norms, flags = clip_shards(max_norm, list(shards), leaf_axes, impl=impl, mode=mode,
                                    on_nonfinite=on_nonfinite, scale_by=scale_by,
                                    by_rows=by_rows)
    return (out, norms, flags) if scale_by else (norms, flags)

  replicated = PartitionSpec()
  out_specs = (list(leaf_specs),) * bool(scale_by) + (replicated, replicated)
  outs = _shard_map(clip_on_device, mesh, in_specs=(replicated, *leaf_specs),
                    out_specs=out_specs)(max_norm, *leaves)
  return tuple(outs) if scale_by else (None, *outs)
