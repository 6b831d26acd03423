"""The clip as one device sees it: its own shards in, its clipped shards out.

Every sharded clip ends here: the partitioned clip that the plain `andrea_clip` becomes
under `jax.jit` on sharded gradients (`_partition.py`), in a `shard_map` over the
leaves' types where those are sharded by Explicit mesh axes, and the explicit
`shard_map` forms (`_sharded.py`). Leaves are grouped by the set of mesh axes they are
sharded on, one norm pass per group; a group's shard norms are combined over exactly its
axes (a replicated leaf is whole on every device, so it is not summed again); then every
device takes the same decision and scales its own shards:

  whole norm  = sqrt(psum over the group's axes of shard norm^2)
                (for each leaf, and for all the group's shards together)
  global norm = the same over the group norms, each kept as root * 2**exponent

The squares are summed at three scales at once, as the pure-JAX path sums a leaf's
elements (`_jax_norms.scaled_squares`, `pick_norm`), so none overflows or underflows, and
a norm above the float range keeps its scale (root * 2**exponent) though it reads as inf.
Only a few floats per leaf cross devices: one psum per set of axes, of three floats per
leaf and per norm call in the set (a call takes at most `_ffi.MAX_LEAVES_PER_CALL` leaves).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from clipjax import _ffi, _jax_impl, _jax_norms, _sources


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


def _whole_leaf_norms(shard_norms, axes):
  """Whole norms from this device's shard norms, elementwise, as (root, exponent) with
  norm = root * 2**exponent and the root in [0.5, 1), so that a whole norm above the
  float range is kept. NaN and inf carry through into the root.

  `shard_norms` are norms of shards of leaves sharded on `axes`; one all-reduce.
  """
  if not axes:
    return jnp.frexp(shard_norms)
  root, exponent = _jax_norms.pick_norm(*lax.psum(_jax_norms.scaled_squares(shard_norms), axes))
  mantissa, shift = jnp.frexp(root)
  return mantissa, exponent + shift


def _norm_of_norms(roots, exps):
  """(root, exponent) of the norm of the norms root_i * 2**exps_i."""
  top = jnp.max(jnp.where(jnp.isfinite(roots) & (roots > 0), exps, jnp.iinfo(jnp.int32).min))
  top = jnp.where(top == jnp.iinfo(jnp.int32).min, 0, top)
  aligned = roots * _jax_norms.pow2(exps - top, roots.dtype)
  return jnp.sqrt(jnp.sum(jnp.square(aligned))), top


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
      elementwise ops) or None (the norms only); see `_ffi.clip_call`.
    norm_inputs: what the norms are taken of (`_sources.NormInputs`), where it differs from
      `shards` (a shard with padding, masked to zero; a leaf's cheaper source, for
      impl="ffi"); the scale always applies to `shards`.
    by_rows: for impl="jax", how each device finishes its sums, as
      `_jax_impl.clip_leaves` takes it (None: decided when lowering, by platform).

  Returns:
    (out_shards or None, norms f32[n + 1], flags int32[2]), as the custom call does;
    all but the shards are the same on every device.
  """
  if norm_inputs is None:
    norm_inputs = _sources.NormInputs.as_stored(shards)
  by_axes: dict[frozenset, list[int]] = {}
  for i, axes in enumerate(leaf_axes):
    by_axes.setdefault(frozenset(axes), []).append(i)
  # Every call's norms = [norm of this device's shards in the call, then one per leaf],
  # laid end to end per set of axes: one frexp or all-reduce per set, and a few slices per
  # set, not per call or per leaf (each a kernel of its own, which XLA:CPU compiles apart:
  # benchmarks/bench_compile.py).
  step = _ffi.MAX_LEAVES_PER_CALL
  call_roots, call_exps, leaf_roots, leaf_exps = [], [], [], []
  for members in by_axes.values():
    norms = [_norms(impl, max_norm, norm_inputs.pick(members[k:k + step]), mode, by_rows)[1]
             for k in range(0, len(members), step)]
    roots, exps = _whole_leaf_norms(jnp.concatenate(norms), leaf_axes[members[0]])
    for x, calls, leaves in ((roots, call_roots, leaf_roots), (exps, call_exps, leaf_exps)):
      of_calls, of_leaves = _split_calls(x, len(members), step)
      calls.append(of_calls)
      leaves.append(of_leaves)
  root, exp = _norm_of_norms(jnp.concatenate(call_roots), jnp.concatenate(call_exps))
  leaf_roots, leaf_exps = jnp.concatenate(leaf_roots), jnp.concatenate(leaf_exps)
  order = [i for members in by_axes.values() for i in members]
  if order != sorted(order):
    inverse = np.argsort(order)
    leaf_roots, leaf_exps = leaf_roots[inverse], leaf_exps[inverse]
  # "kernel": one custom call scales every shard (k_grad_scale); else XLA's elementwise
  # ops, which it fuses into their consumers.
  scale_fn = _ffi.scale_call if impl == "ffi" and scale_by == "kernel" else None
  return _jax_impl.decide_and_scale(max_norm, shards, root, exp, leaf_roots,
                                    leaf_exps, mode=mode, on_nonfinite=on_nonfinite,
                                    scale_leaves=scale_by is not None, scale_fn=scale_fn)


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


def _norms(impl, max_norm, reads, mode, by_rows):
  """(None, norms, flags) by `impl` of what `reads` (`_sources.NormInputs`) gives: the norms
  alone. Only the custom call reads a source rounded (`_sources.norm_sources`)."""
  if impl == "ffi":
    return _ffi.clip_call(max_norm, reads.arrays, mode=mode, on_nonfinite="propagate",
                          scale_by=None, norm_inputs=reads)
  return _jax_impl.clip_leaves(max_norm, reads.arrays, mode=mode, on_nonfinite="propagate",
                               scale_leaves=False, by_rows=by_rows)


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
