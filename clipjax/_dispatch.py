"""Which implementation runs a clip: the custom call or its pure-JAX twin.

`impl="auto"` is decided when lowering (`lax.platform_dependent`): the custom call on
CUDA, pure JAX elsewhere (CPU, TPU). Under `jax.jit` on sharded leaves the custom call
is partitioned per shard (`_partition.py`), and so is the pure-JAX twin on GPUs; on
other platforms XLA partitions the pure-JAX twin like any per-leaf reduction. None of
them gathers a leaf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _ffi, _jax_impl, _jax_norms, _native, _options, _partition, _sources


def default_platform() -> str:
  """The lowering platform of the default backend ("gpu" resolved to cuda/rocm)."""
  platform = jax.default_backend()
  if platform == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    platform = "rocm" if "rocm" in version else "cuda"
  return platform


def ffi_supports(leaves) -> bool:
  return all(jnp.dtype(x.dtype) in _ffi.SUPPORTED_DTYPES for x in leaves)


def check_ffi(paths, leaves):
  """impl="ffi" needs a handler for this platform and leaves of a supported dtype."""
  platform = default_platform()
  if not _native.has_handler(platform):
    raise RuntimeError(_native.missing_handler_message(platform))
  for path, x in zip(paths, leaves):
    if jnp.dtype(x.dtype) not in _ffi.SUPPORTED_DTYPES:
      raise TypeError(f"clipjax: impl='ffi' supports float32, bfloat16 and float16 leaves; "
                      f"leaf {_options.where(path)} is {x.dtype}. Use impl='jax' or 'auto'.")


class Prepared(NamedTuple):
  paths: list
  leaves: list
  treedef: object
  max_norm: jax.Array  # the clip's operand: a scalar of the norms' dtype
  invalid_max_norm: jax.Array


def prepare(tree, max_norm, impl, mode, on_nonfinite, scale="auto") -> Prepared | None:
  """What every clip entry point does first: checks the options, flattens the tree, checks
  that impl="ffi" can run it, and turns max_norm into the clip's operand. None for a tree
  without leaves."""
  _options.check_options(max_norm, impl, mode, on_nonfinite, scale)
  paths, leaves, treedef = _options.flatten(tree)
  if not leaves:
    return None
  if impl == "ffi":
    check_ffi(paths, leaves)
  operand, invalid = _options.max_norm_operand(max_norm, on_nonfinite,
                                               _jax_norms.norm_dtype(leaves))
  return Prepared(paths, leaves, treedef, operand, invalid)


def shard_impl(impl, leaves) -> str:
  """impl for code that already runs per device (inside shard_map), decided when tracing.

  There the two branches of a lowering-time choice would have to agree on the mesh axes
  their outputs vary over, and the custom call's outputs carry none.
  """
  if impl != "auto":
    return impl
  use_ffi = default_platform() == "cuda" and auto_has_custom_call(leaves)
  return "ffi" if use_ffi else "jax"


def auto_has_custom_call(leaves) -> bool:
  """impl="auto": whether the clip of `leaves` holds the custom call's CUDA branch (a usable
  CUDA handler, leaves of its dtypes). Warns once per process where a CUDA GPU would run
  the pure-JAX path for want of a usable handler (`_native.cuda_usable`)."""
  return ffi_supports(leaves) and _native.cuda_usable()


def run(max_norm, leaves, *, impl, mode, on_nonfinite, scale_by):
  """The clip of `leaves` by `impl`: `(out_leaves or None, norms f32[n + 1], flags int32[2])`.

  `scale_by`: "kernel", "fused" or None (the norms only), as `_ffi.clip_call` takes it; the
  pure-JAX path always leaves the multiply to XLA. Which code runs is decided when
  lowering, per platform (`_jax_impl.per_platform`): the custom call on CUDA for
  impl="auto" where it can run; where the pure-JAX clip sums by rows, that clip per shard
  (`_partition.clip_by_rows`: each device stacks its own leaves' row sums), or leaf by leaf
  where the leaves' layout is not known before partitioning; elsewhere the pure-JAX clip
  leaf by leaf, which XLA's partitioner splits like any reduction.

  On a single device the custom call's norms read a leaf that this jit converted to or
  from float32 in its cheaper source, and a merged matmul's gradient in the merged output
  (`_sources.norm_sources`). Those arrays travel beside the leaves, and the derivative
  takes no account of them: they hold the leaves' values.
  """
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  tangent = pure_jax_tangent(**kwargs)
  custom_call = _has_custom_call(impl, leaves)
  # `_partition.partitioned_clip` hands them to the norms where nothing is partitioned.
  reads = (custom_call and scale_by != "kernel" and _sources.norm_sources(leaves)) or None
  n = len(leaves)
  return differentiable(
      lambda max_norm, xs: _run(max_norm, xs[:n], impl=impl, custom_call=custom_call,
                                norm_inputs=reads and reads._replace(arrays=list(xs[n:])),
                                **kwargs),
      max_norm, [*leaves, *(reads.arrays if reads else ())],
      lambda primals, tangents: tangent((primals[0], primals[1][:n]),
                                        (tangents[0], tangents[1][:n])))


def _has_custom_call(impl, leaves) -> bool:
  """Whether the clip of `leaves` by `impl` holds the custom call (on CUDA, for "auto")."""
  return impl == "ffi" or (impl == "auto" and auto_has_custom_call(leaves))


def differentiable(clip_fn, max_norm, leaves, tangent_fn):
  """clip_fn(max_norm, leaves), its derivative given by tangent_fn(primals, tangents): the
  custom call has none of its own, nor has `custom_partitioning`."""
  @jax.custom_jvp
  def clip(max_norm, leaves):
    return clip_fn(max_norm, leaves)

  @clip.defjvp
  def clip_jvp(primals, tangents):
    primals = jax.tree.map(jnp.asarray, primals)  # JAX passes a Python number leaf as it is
    return clip_fn(*primals), tangent_fn(primals, tangents)

  return clip(max_norm, list(leaves))


def pure_jax_tangent(*, mode, on_nonfinite, scale_by):
  """The tangent_fn of a clip of whole leaves, by any path: the pure-JAX clip's leaf by
  leaf (`_partition.pure_jax_clip`, whose norms carry their own derivative,
  `_jax_norms.norms`), which XLA partitions like any reduction. What `jax.grad` or `jax.jvp`
  through a clip, or an optimizer chain that holds one, uses on every platform."""
  def pure(max_norm, leaves):
    *out, norms, flags = _partition.pure_jax_clip(
        max_norm, leaves, by_rows=False, mode=mode, on_nonfinite=on_nonfinite,
        scale_by=scale_by)
    return (out if scale_by else None), norms, flags

  return lambda primals, tangents: jax.jvp(pure, primals, tangents)[1]


def no_tangent(why: str):
  """The tangent_fn of a clip that cannot be differentiated: raises TypeError(why)."""
  def tangent(primals, tangents):
    raise TypeError(why)

  return tangent


def _run(max_norm, leaves, *, impl, custom_call, mode, on_nonfinite, scale_by, norm_inputs):
  """`run`'s clip, with `custom_call` (`_has_custom_call`) and what the custom call's norms
  read in place of the leaves (`_sources.NormInputs`, or None)."""
  kwargs = dict(mode=mode, on_nonfinite=on_nonfinite, scale_by=scale_by)
  if impl == "ffi":
    return _partition.partitioned_clip(max_norm, leaves, impl="ffi", norm_inputs=norm_inputs,
                                       **kwargs)
  # Each platform's function takes (max_norm, *leaves, *norm_inputs).
  n = len(leaves)

  def leaf_by_leaf(max_norm, *xs):
    return _partition.pure_jax_clip(max_norm, xs[:n], by_rows=False, **kwargs)

  def on_cuda(max_norm, *xs):
    return _partition.flat_outputs(*_partition.partitioned_clip(
        max_norm, list(xs[:n]), impl="ffi",
        norm_inputs=norm_inputs and norm_inputs._replace(arrays=list(xs[n:])), **kwargs))

  rows = _partition.clip_by_rows(leaves, **kwargs)
  by_rows = (lambda max_norm, *xs: rows(max_norm, *xs[:n])) if rows else leaf_by_leaf
  outs = _jax_impl.per_platform(by_rows, leaf_by_leaf, max_norm, *leaves,
                                *(norm_inputs.arrays if norm_inputs else ()),
                                **({"cuda": on_cuda} if custom_call else {}))
  out = list(outs[:-2]) if scale_by else None
  return out, outs[-2], outs[-1]


def run_whole(p: Prepared, tree, *, impl, mode, on_nonfinite, scale_by):
  """`run` on a prepared tree as the caller holds it (whole, or sharded under jit): the
  form that `run_in_shard_map` and `run_on_shards` (`_sharded.py`) take too."""
  del tree  # p holds its leaves
  return run(p.max_norm, p.leaves, impl=impl, mode=mode, on_nonfinite=on_nonfinite,
             scale_by=scale_by)


def clip(run_prepared, tree, max_norm, *, impl, mode, on_nonfinite, scale, feeds_consumer):
  """The ClipResult of every entry point: prepare the tree, pick who scales
  (`_options.resolve_scale`), and clip it by `run_prepared` (`run_whole`, or a sharded
  form)."""
  p = prepare(tree, max_norm, impl, mode, on_nonfinite, scale)
  if p is None:
    return _options.empty_result(tree)
  scale_by = _options.resolve_scale(scale, impl=impl, feeds_consumer=feeds_consumer,
                                    num_leaves=len(p.leaves))
  out, norms, flags = run_prepared(p, tree, impl=impl, mode=mode, on_nonfinite=on_nonfinite,
                                   scale_by=scale_by)
  return _options.make_result(p.treedef, out, norms, flags, p.invalid_max_norm)
