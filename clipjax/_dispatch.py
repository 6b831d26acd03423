"""Which implementation runs a clip, and on what: the one place that picks.

`impl="auto"` is decided when lowering (`lax.platform_dependent`): the custom call on
CUDA, pure JAX elsewhere (CPU, TPU). Under `jax.jit` on sharded leaves the custom call
is partitioned per shard (`clipjax._partitioning.spmd`), and so is the pure-JAX clip on
GPUs; on other platforms XLA partitions the pure-JAX clip like any per-leaf reduction.
None of them gathers a leaf. The tree runs as the caller holds it (`run`), in a
`shard_map` of the clip's own (`run_in_shard_map`), or on the shards inside the caller's
(`run_on_shards`); each calls the implementations through `clipjax._backend`, and each
gives the clip the pure-JAX clip's derivative (`differentiable`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from clipjax import _backend, _native, _options, _trace_reads, _tree
from clipjax._partitioning import per_shard, specs as _specs, spmd


def clip(tree, max_norm, *, impl, mode, on_nonfinite, scale, feeds_consumer, held="whole",
         mesh=None, specs=None, limit=None):
  """The ClipResult of every entry point, on options that the entry point has checked
  (`_options.check_options`): the tree's leaves (`leaves_of`), the clip's operand
  (`max_norm_operand`), who scales (`_options.resolve_scale`), and the clip of the tree as
  the caller holds it (`held`): "whole" (or sharded under jit: `run`), "mesh" (in a
  `shard_map` of the clip's own over `mesh`: `run_in_shard_map`) or "on_shards" (inside
  the caller's `shard_map`: `run_on_shards`). `limit`, where given, maps the max_norm
  operand to the one this step clips to."""
  paths, leaves, treedef = leaves_of(tree, impl)
  if not leaves:
    return _tree.empty_result(tree)
  operand, invalid = max_norm_operand(max_norm, on_nonfinite, _tree.norm_dtype(leaves))
  operand = operand if limit is None else limit(operand)
  kwargs = dict(impl=impl, mode=mode, on_nonfinite=on_nonfinite,
                scale_by=_options.resolve_scale(scale, impl=impl, feeds_consumer=feeds_consumer,
                                                num_leaves=len(leaves)))
  if held == "mesh":
    out, norms, flags = run_in_shard_map(operand, leaves, paths, tree, mesh=mesh, specs=specs,
                                         **kwargs)
  elif held == "on_shards":
    out, norms, flags = run_on_shards(operand, leaves, paths, tree, specs=specs, **kwargs)
  else:
    out, norms, flags = run(operand, leaves, **kwargs)
  return _tree.make_result(treedef, out, norms, flags, invalid)


def leaves_of(tree, impl):
  """The tree's (paths, leaves, treedef), checked that impl="ffi" can run them."""
  paths, leaves, treedef = _tree.flatten(tree)
  if leaves and impl == "ffi":
    check_ffi(paths, leaves)
  return paths, leaves, treedef


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


def default_platform() -> str:
  """The lowering platform of the default backend ("gpu" resolved to cuda/rocm)."""
  platform = jax.default_backend()
  if platform == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    platform = "rocm" if "rocm" in version else "cuda"
  return platform


def check_ffi(paths, leaves):
  """impl="ffi" needs a handler for this platform and leaves of a supported dtype."""
  platform = default_platform()
  if not _native.has_handler(platform):
    raise RuntimeError(_native.missing_handler_message(platform))
  for path, x in zip(paths, leaves):
    if jnp.dtype(x.dtype) not in _backend.FFI_DTYPES:
      raise TypeError(f"clipjax: impl='ffi' supports float32, bfloat16 and float16 leaves; "
                      f"leaf {_tree.where(path)} is {x.dtype}. Use impl='jax' or 'auto'.")


def auto_has_custom_call(leaves) -> bool:
  """impl="auto": whether the clip of `leaves` holds the custom call's CUDA branch (a usable
  CUDA handler, leaves of its dtypes). Warns once per process where a CUDA GPU would run
  the pure-JAX path for want of a usable handler (`_native.cuda_usable`)."""
  supported = all(jnp.dtype(x.dtype) in _backend.FFI_DTYPES for x in leaves)
  return supported and _native.cuda_usable()


def shard_impl(impl, leaves) -> str:
  """impl for code that already runs per device (inside shard_map), decided when tracing.

  There the two branches of a lowering-time choice would have to agree on the mesh axes
  their outputs vary over, and the custom call's outputs carry none.
  """
  if impl != "auto":
    return impl
  use_ffi = default_platform() == "cuda" and auto_has_custom_call(leaves)
  return "ffi" if use_ffi else "jax"


def run(max_norm, leaves, *, impl, mode, on_nonfinite, scale_by):
  """The clip of `leaves` by `impl`, as the caller holds them (whole, or sharded under jit):
  `(out_leaves or None, norms f32[n + 1], flags int32[2])`.

  `scale_by`: "kernel", "fused" or None (the norms only), as `_backend.clip` takes it; the
  pure-JAX path always leaves the multiply to XLA. Which code runs is decided when
  lowering, per platform (`_backend.per_platform`): the custom call on CUDA for
  impl="auto" where it can run; where the pure-JAX clip sums by rows, that clip per shard
  (`spmd.clip_by_rows`: each device stacks its own leaves' row sums), or leaf by leaf
  where the leaves' layout is not known before partitioning; elsewhere the pure-JAX clip
  leaf by leaf, which XLA's partitioner splits like any reduction.

  On a single device the custom call's norms read a leaf that this jit converted to or
  from float32 in its cheaper source, and a merged matmul's gradient in the merged output
  (`_trace_reads.norm_sources`). Those arrays travel beside the leaves, and the derivative
  takes no account of them: they hold the leaves' values.
  """
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  custom_call = impl == "ffi" or (impl == "auto" and auto_has_custom_call(leaves))
  # `spmd.partitioned_clip` hands them to the norms where nothing is partitioned.
  reads = (custom_call and scale_by != "kernel" and _trace_reads.norm_sources(leaves)) or None
  n = len(leaves)
  tangent = tangent_of(_pure_jax_by_leaf(**kwargs))
  return differentiable(
      lambda max_norm, xs: _run(max_norm, xs[:n], impl=impl, custom_call=custom_call,
                                norm_inputs=reads and reads._replace(arrays=list(xs[n:])),
                                **kwargs),
      max_norm, [*leaves, *(reads.arrays if reads else ())],
      lambda primals, tangents: tangent((primals[0], primals[1][:n]),
                                        (tangents[0], tangents[1][:n])))


def _run(max_norm, leaves, *, impl, custom_call, mode, on_nonfinite, scale_by, norm_inputs):
  """`run`'s clip, with `custom_call` (whether it holds the custom call) and what the custom
  call's norms read in place of the leaves (`_trace_reads.NormInputs`, or None)."""
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  # Each form takes (max_norm, *leaves, *norm_inputs) and returns the flat outputs.
  n = len(leaves)
  args = (max_norm, *leaves, *(norm_inputs.arrays if norm_inputs else ()))

  def the_custom_call(max_norm, *xs):
    return _backend.flat_outputs(*spmd.partitioned_clip(
        max_norm, list(xs[:n]), impl="ffi",
        norm_inputs=norm_inputs and norm_inputs._replace(arrays=list(xs[n:])), **kwargs))

  if impl == "ffi":
    outs = the_custom_call(*args)
  else:
    pure_jax = _pure_jax_by_leaf(**kwargs)

    def leaf_by_leaf(max_norm, *xs):
      return _backend.flat_outputs(*pure_jax(max_norm, xs[:n]))

    rows = spmd.clip_by_rows(leaves, **kwargs)
    by_rows = (lambda max_norm, *xs: rows(max_norm, *xs[:n])) if rows else leaf_by_leaf
    outs = _backend.per_platform(by_rows, leaf_by_leaf, *args,
                                 **({"cuda": the_custom_call} if custom_call else {}))
  out = list(outs[:-2]) if scale_by else None
  return out, outs[-2], outs[-1]


def _pure_jax_by_leaf(**kwargs):
  """The pure-JAX clip leaf by leaf, as a function of (max_norm, leaves): the clip whose
  derivative every path takes (`tangent_of`)."""
  return functools.partial(_backend.clip, "jax", by_rows=False, **kwargs)


def run_in_shard_map(max_norm, leaves, paths, tree, *, mesh, specs, impl, mode, on_nonfinite,
                     scale_by):
  """`run`'s contract, in a `shard_map` of the clip's own."""
  mesh, leaf_specs, leaf_axes = _specs.mesh_and_specs(mesh, specs, tree, paths, leaves)
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  clip_fn = functools.partial(per_shard.clip_in_shard_map, mesh=mesh, leaf_specs=leaf_specs,
                              leaf_axes=leaf_axes, impl=shard_impl(impl, leaves), **kwargs)
  return differentiable(clip_fn, max_norm, leaves,
                        tangent_of(_pure_jax_by_leaf(**kwargs)))


def run_on_shards(max_norm, leaves, paths, tree, *, specs, impl, mode, on_nonfinite, scale_by):
  """`run`'s contract, on local shards inside the caller's `shard_map`."""
  leaf_axes = [_specs.spec_axes(spec, _tree.where(path))
               for spec, path in zip(_specs.specs_per_leaf(specs, tree), paths)]
  _specs.check_in_shard_map(paths, leaves, leaf_axes)
  impl = shard_impl(impl, leaves)
  clip_fn = functools.partial(per_shard.clip_shards, leaf_axes=leaf_axes, impl=impl, mode=mode,
                              on_nonfinite=on_nonfinite, scale_by=scale_by)
  if impl == "jax":  # the pure-JAX clip of the shards is differentiable as it is
    return clip_fn(max_norm, leaves)
  return differentiable(clip_fn, max_norm, leaves,
                        no_tangent(_NO_DERIVATIVE_HERE))


_NO_DERIVATIVE_HERE = (
    "clipjax: inside your own shard_map the custom call has no derivative: pass impl='jax' "
    "to clip_tree_in_shard_map to differentiate through it, or clip the whole tree outside "
    "the shard_map (clip_tree, andrea_clip), whose derivative every path provides.")


# The clip's derivative. The custom call has none of its own, nor has `custom_partitioning`:
# every clip of whole leaves, by either implementation, takes the pure-JAX clip's, leaf by
# leaf (whose norms carry their own derivative, `clipjax._backend.pure_jax.norms`), which XLA
# partitions like any reduction. It is what `jax.grad` or `jax.jvp` through a clip, or
# through an optimizer chain that holds one, uses on every platform.


def differentiable(clip_fn, max_norm, leaves, tangent_fn):
  """clip_fn(max_norm, leaves), its derivative given by tangent_fn(primals, tangents)."""
  @jax.custom_jvp
  def with_derivative(max_norm, leaves):
    return clip_fn(max_norm, leaves)

  @with_derivative.defjvp
  def jvp(primals, tangents):
    primals = jax.tree.map(jnp.asarray, primals)  # JAX passes a Python number leaf as it is
    return clip_fn(*primals), tangent_fn(primals, tangents)

  return with_derivative(max_norm, list(leaves))


def tangent_of(pure_clip):
  """The tangent_fn of a clip of whole leaves, by any path: that of `pure_clip`, the pure-JAX
  clip leaf by leaf, as a function of (max_norm, leaves)."""
  return lambda primals, tangents: jax.jvp(pure_clip, primals, tangents)[1]


def no_tangent(why: str):
  """The tangent_fn of a clip that cannot be differentiated: raises TypeError(why)."""
  def tangent(primals, tangents):
    raise TypeError(why)

  return tangent
