"""The clip made partitionable: under `jax.jit` on sharded leaves, XLA's SPMD partitioner
(Shardy or GSPMD) runs it on each device's shards instead of gathering them.

`partitioned_clip` wraps the whole clip in `jax.experimental.custom_partitioning`: the
custom call (impl="ffi"), or, on GPUs, the pure-JAX clip by rows (impl="jax"), which
stacks the leaves' row sums (`clipjax._backend.pure_jax.norms`): partitioned here,
each device stacks its own, where XLA's partitioning of the stack would move them between
devices.

- the sharding rule gives every dimension of every leaf its own factor, passed through
  from operand to result, so each clipped leaf keeps its operand's sharding; the norms
  and flags need replication;
- `_partition` accepts the operands as the partitioner laid them out (nothing is
  resharded) and lowers, per device, either the whole clip (every leaf whole on every
  device) or `per_shard.clip_shards` (norms of the local shards, an all-reduce of a few
  floats per leaf over the axes each leaf is split on, then the scale);
- with a single device (`_nothing_to_partition`) the whole call is traced directly.

Leaves split by their types (Explicit mesh axes) must keep to them op by op: there the
pure-JAX clip by rows runs in a `shard_map` over the types' specs instead (`clip_by_rows`).

A dimension that its mesh axes do not divide is padded by the partitioner; its padding
is masked to zero before the norm (one extra pass over that shard only).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from clipjax import _backend, _trace_reads
from clipjax._partitioning import per_shard, specs


def _whole_call(impl, mode, on_nonfinite, scale_by, ranks, max_norm, leaves):
  """The clip of whole leaves (a tuple), as `custom_partitioning` calls it: `_whole_clip`.

  The leaves travel as one tuple, here and through `_batchable`, rather than as one
  argument each: JAX handles each positional argument of a custom_partitioning call
  against every other (quadratic in their number: benchmarks/bench_compile.py)."""
  del ranks  # static: only the sharding rule reads it
  return _whole_clip(max_norm, list(leaves), impl=impl, mode=mode, on_nonfinite=on_nonfinite,
                     scale_by=scale_by)


def _whole_clip(max_norm, leaves, *, impl, mode, on_nonfinite, scale_by, norm_inputs=None):
  """The clip of whole leaves, flat. impl="ffi": one custom call, or for a tree of more than
  `_backend.MAX_LEAVES_PER_CALL` leaves, norm calls and scale calls of that many leaves each
  with the decision between them (`per_shard.split` with no mesh axes), the norms of
  `norm_inputs` where given (`_trace_reads.norm_sources`). impl="jax": the pure-JAX clip by
  rows, which is partitioned here only where it finishes its sums by rows (see
  `clipjax._dispatch.run`)."""
  split = None
  if impl == "ffi" and len(leaves) > _backend.MAX_LEAVES_PER_CALL:
    split = per_shard.split([()] * len(leaves))
  return _backend.flat_outputs(*_backend.clip(
      impl, max_norm, leaves, mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by,
      norm_inputs=norm_inputs, by_rows=True, split=split))


def _sharding_rule(impl, mode, on_nonfinite, scale_by, ranks, mesh, operand_types,
                   result_types):
  """Shardy's rule: a pass-through factor per leaf dimension; norms and flags replicated."""
  del impl, mode, on_nonfinite, mesh, operand_types, result_types
  counter = iter(range(sum(ranks)))
  leaves = [" ".join(f"d{next(counter)}" for _ in range(rank)) for rank in ranks]
  results = (leaves if scale_by else []) + ["norms", "flags"]
  rule = ", ".join([""] + leaves) + " -> " + ", ".join(results)
  return rule, {"need_replication_factors": ("norms", "flags")}


def _leaf_shardings(mesh, leaf_shapes):
  """Each leaf's NamedSharding as the partitioner chose it (replicated if it is not one)."""
  out = []
  for shape in leaf_shapes:
    sharding = shape.sharding
    if not isinstance(sharding, NamedSharding):
      sharding = NamedSharding(mesh, PartitionSpec())
    out.append(sharding)
  return out


def _infer_shardings(impl, mode, on_nonfinite, scale_by, ranks, mesh, arg_shapes,
                     result_shape):
  """GSPMD's rule (the partitioner before Shardy): as `_sharding_rule` says."""
  del impl, mode, on_nonfinite, ranks, result_shape
  replicated = NamedSharding(mesh, PartitionSpec())
  leaves = _leaf_shardings(mesh, arg_shapes[1]) if scale_by else []
  return (*leaves, replicated, replicated)


def _dim_axes(spec, rank):
  """Per dimension, the mesh axes it is split over (a tuple)."""
  entries = tuple(spec) + (None,) * (rank - len(spec))
  return [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in entries]


def _padding_mask(shard, global_shape, spec, mesh):
  """`shard` with the partitioner's padding zeroed, or None if it has none."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  valid = None
  for dim, axes in enumerate(_dim_axes(spec, len(global_shape))):
    parts = math.prod(sizes[a] for a in axes)
    if not axes or global_shape[dim] % parts == 0:
      continue
    start = lax.axis_index(axes) * shard.shape[dim]
    index = lax.broadcasted_iota(jnp.int32, shard.shape, dim) + start
    in_range = index < global_shape[dim]
    valid = in_range if valid is None else valid & in_range
  return None if valid is None else jnp.where(valid, shard, jnp.zeros_like(shard))


def _partition(impl, mode, on_nonfinite, scale_by, ranks, mesh, arg_shapes, result_shape):
  del ranks, result_shape
  replicated = NamedSharding(mesh, PartitionSpec())
  leaf_shapes = arg_shapes[1]
  shardings = _leaf_shardings(mesh, leaf_shapes)
  leaf_axes = [specs.spec_axes(s.spec, f"#{i}") for i, s in enumerate(shardings)]
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  leaf_axes = [tuple(a for a in axes if sizes[a] > 1) for axes in leaf_axes]

  def lower_fn(max_norm, shards):
    if not any(leaf_axes):
      return _whole_call(impl, mode, on_nonfinite, scale_by, (), max_norm, shards)
    masked = [_padding_mask(x, s.shape, sh.spec, mesh)
              for x, s, sh in zip(shards, leaf_shapes, shardings)]
    norm_inputs = _trace_reads.NormInputs.as_stored(
        [x if m is None else m for x, m in zip(shards, masked)])
    return _backend.flat_outputs(*per_shard.clip_shards(
        max_norm, list(shards), leaf_axes, impl=impl, mode=mode, on_nonfinite=on_nonfinite,
        scale_by=scale_by, norm_inputs=norm_inputs, by_rows=True))

  results = (*(shardings if scale_by else []), replicated, replicated)
  return mesh, lower_fn, results, (replicated, tuple(shardings))


_clip = custom_partitioning(_whole_call, static_argnums=(0, 1, 2, 3, 4))
_clip.def_partition(partition=_partition, infer_sharding_from_operands=_infer_shardings,
                    sharding_rule=_sharding_rule)


@functools.cache
def _batchable(impl, mode, on_nonfinite, scale_by, ranks):
  """The partitioned call under `jax.vmap` (the partitioner has no batching rule): the
  custom call once per batch element, in sequence; the pure-JAX clip batched by XLA, leaf
  by leaf (its row sums, batched, would be stacked across devices)."""

  @jax.custom_batching.custom_vmap
  def call(max_norm, leaves):
    return _clip(impl, mode, on_nonfinite, scale_by, ranks, max_norm, leaves)

  @call.def_vmap
  def _(axis_size, in_batched, max_norm, leaves):
    del axis_size
    args, treedef = jax.tree.flatten((max_norm, leaves))
    axes = [0 if batched else None for batched in jax.tree.leaves(tuple(in_batched))]
    unflat = lambda *xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
    if impl == "jax":
      # Batched by XLA, not in sequence: leaf by leaf, which XLA's partitioner splits.
      outs = jax.vmap(lambda *xs: _backend.flat_outputs(*_backend.clip(
          "jax", *unflat(*xs), by_rows=False, mode=mode, on_nonfinite=on_nonfinite,
          scale_by=scale_by)), in_axes=axes)(*args)
    else:
      outs = _backend.in_sequence(lambda *xs: call(*unflat(*xs)), args, axes)
    return outs, (True,) * len(outs)

  return call


def _nothing_to_partition() -> bool:
  """Whether JAX sees a single device, with no mesh of more devices set: then no jit can
  split a leaf, and the partitioner would only inline the whole call."""
  mesh_size = math.prod(jax.sharding.get_abstract_mesh().axis_sizes)
  return jax.device_count() == 1 and mesh_size <= 1


def _split_by_type(leaves) -> bool:
  """Whether a leaf's type says it is split over a mesh axis (an Explicit axis): then each
  op on it must keep to its type's sharding, and the pure-JAX clip's row sums of leaves
  split in different ways cannot be stacked, whoever partitions the clip."""
  for x in leaves:
    sharding = jax.typeof(x).sharding
    explicit = set(getattr(sharding.mesh, "explicit_axes", ()))
    if explicit & set(jax.tree.leaves(tuple(sharding.spec))):
      return True
  return False


def clip_by_rows(leaves, *, mode: str, on_nonfinite: str, scale_by):
  """The pure-JAX clip by rows of `leaves` as they are laid out, per shard, as a function of
  (max_norm, *leaves) -> flat outputs; None where it cannot run so.

  - Leaves that their types do not split: `partitioned_clip`, which the partitioner runs on
    each device's shards.
  - Leaves split by their types, on one mesh whose axes are all Explicit: the clip in a
    `shard_map` over the types' specs (`per_shard.clip_in_shard_map`), each device stacking
    its own row sums.
  - None for leaves split by their types on a mesh that has Auto axes too, whose layout on
    those axes only the partitioner knows: the caller sums each leaf whole.
  """
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  if not _split_by_type(leaves):
    return lambda max_norm, *xs: _backend.flat_outputs(*partitioned_clip(max_norm, list(xs),
                                                                impl="jax", **kwargs))
  mesh, known = specs.known_layout(leaves)
  if mesh is None or None in known:
    return None
  leaf_specs = [spec for _, spec in known]
  leaf_axes = [specs.spec_axes(spec, f"#{i}") for i, spec in enumerate(leaf_specs)]
  return lambda max_norm, *xs: _backend.flat_outputs(*per_shard.clip_in_shard_map(
      max_norm, list(xs), mesh, leaf_specs, leaf_axes, impl="jax", by_rows=True, **kwargs))


def partitioned_clip(max_norm, leaves, *, impl: str, mode: str, on_nonfinite: str, scale_by,
                     norm_inputs=None):
  """The clip by `impl` ("ffi" or "jax"), partitioned per shard under jit (the contract of
  `_backend.clip`).

  On a single device the whole call is traced as it is, without `custom_partitioning` and
  `custom_vmap`, whose per-leaf work costs time and memory on many leaves
  (benchmarks/bench_compile.py); the custom calls
  then batch under `jax.vmap` by themselves, one call per batch element. Only there do
  the norms read `norm_inputs` (`_trace_reads.norm_sources`) where given."""
  if _nothing_to_partition():
    outs = _whole_clip(max_norm, list(leaves), impl=impl, mode=mode,
                       on_nonfinite=on_nonfinite, scale_by=scale_by, norm_inputs=norm_inputs)
  else:
    ranks = tuple(x.ndim for x in leaves)
    outs = _batchable(impl, mode, on_nonfinite, scale_by, ranks)(max_norm, tuple(leaves))
  if scale_by:
    return list(outs[:-2]), outs[-2], outs[-1]
  return None, outs[0], outs[1]
