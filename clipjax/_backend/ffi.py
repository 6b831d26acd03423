"""The custom-call implementation of the clip: the clipjax custom calls, as `ffi_call`s and
a primitive of its own.

Naming chain: kernels `k_grad_norm_partial`/`k_grad_norm_final`/`k_grad_scale`
-> handlers `AndreaClipCpu`/`AndreaClipCuda` -> XLA target
`"clipjax_andrea_clip"` -> `clipjax._backend.ffi.clip_call`; and the scale stage alone
(the sharded clip, whose decision follows an all-reduce): `k_scale_table` + `k_grad_scale`
-> `AndreaScaleCpu`/`AndreaScaleCuda` -> `"clipjax_andrea_scale"` ->
`clipjax._backend.ffi.scale_call`.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching, mlir

from clipjax import _decision, _native, _options, _trace_reads

TARGET = "clipjax_andrea_clip"
SCALE_TARGET = "clipjax_andrea_scale"
ACTIONS = {"keep": 0, "multiply": 1, "zero_fill": 2}  # LeafAction in cuda/andrea_clip_math.h
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Leaves per custom call. XLA's compile time grows faster than linearly in the number of
# results a call aliases to its operands (benchmarks/bench_compile.py), so larger trees are
# clipped by several calls (see `clipjax._partitioning.spmd`).
MAX_LEAVES_PER_CALL = 256

def num_chunks(sizes) -> int:
  chunk = _native.layout().CHUNK_ELEMS
  return sum(max(1, -(-int(n) // chunk)) for n in sizes)


# How the norm kernels read an operand, the clip call's `read_as` (ReadAs in
# cuda/andrea_clip_decode.h): as stored (None), or float32 values rounded to a narrow type.
READ_AS = {None: 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}


def clip_call(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_by,
              norm_inputs: _trace_reads.NormInputs):
  """The clip of `leaves` in one custom call.

  `scale_by` says who multiplies the leaves by the clip's factor:
  - "kernel": the call runs all three kernels, and `k_grad_scale` writes the clipped leaves
    over its inputs (aliased), only when it clips;
  - "fused": the call runs the two norm kernels and returns its decision as multipliers;
    the multiply is an XLA elementwise op (`_decision.scale_by_rows`) that XLA fuses into
    whatever consumes the clipped leaves (the optimizer's update inside `optax.chain`);
  - None: the norms only.

  `norm_inputs`: what the norm kernels read, the leaves' values: the leaves as stored
  (`_trace_reads.NormInputs.as_stored`), or cheaper sources of them
  (`_trace_reads.norm_sources`); for "kernel", which writes the leaves and reads them, the
  leaves as stored (`clipjax._dispatch.run` finds sources only for the other forms).

  Returns `(out_leaves or None, norms, flags)`: `norms` is f32[n + 1] (global norm, then
  one per leaf); `flags` is int32[2] (clipped, nonfinite).
  """
  n = len(leaves)
  in_place = scale_by == "kernel"
  reads = norm_inputs
  # Each leaf's elements: a block of columns holds rows * width of them.
  sizes = [a.size if c is None else a.shape[0] * c[1]
           for a, c in zip(reads.arrays, reads.columns)]
  out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves] if in_place else []
  out_types += [
      jax.ShapeDtypeStruct((n + 1,), jnp.float32),
      jax.ShapeDtypeStruct((2,), jnp.int32),
      jax.ShapeDtypeStruct((n, 4), jnp.float32),
      jax.ShapeDtypeStruct((_native.layout().workspace_bytes(num_chunks(sizes), n),), jnp.uint8),
  ]
  aliases = {i + 1: i for i in range(n)} if in_place else {}
  call = jax.ffi.ffi_call(TARGET, out_types, input_output_aliases=aliases,
                          vmap_method="sequential")
  outs = call(jnp.asarray(max_norm, jnp.float32).reshape(()), *reads.arrays,
              mode=np.int64(_options.MODES.index(mode)),
              on_nonfinite=np.int64(_options.NONFINITE_POLICIES.index(on_nonfinite)),
              read_as=np.asarray([READ_AS[r] for r in reads.read_as], np.int64),
              columns=np.asarray([c or (0, 0) for c in reads.columns], np.int64).reshape(2 * n))
  if in_place:
    return list(outs[:n]), outs[n], outs[n + 1]
  norms, flags, multipliers, _ = outs
  if scale_by is None:
    return None, norms, flags
  # The consumers read the four floats the call wrote, with no arithmetic between.
  return (_decision.scale_by_rows(multipliers, leaves, per_leaf=mode == "per_tensor"),
          norms, flags)


def scale_call(scale, shift, keep, zero_fill, leaves):
  """The scale stage alone, on a decision made elsewhere, in one custom call.

  Per leaf i (each argument a scalar, or one value per leaf): zeros where zero_fill[i],
  else the leaf unchanged where keep[i] (nothing is written), else x times the factor
  scale[i] * 2**shift[i] (see `_decision.decide`), in float32 where the factor is a
  normal float32 and else in float64, rounded once. Returns the leaves, aliased to the
  inputs.
  """
  n = len(leaves)
  shape = (n,)
  factors = jnp.stack([jnp.broadcast_to(jnp.asarray(scale, jnp.float32), shape),
                       jnp.broadcast_to(jnp.asarray(shift, jnp.float32), shape)], axis=1)
  actions = jnp.where(jnp.broadcast_to(zero_fill, shape), ACTIONS["zero_fill"],
                      jnp.where(jnp.broadcast_to(keep, shape), ACTIONS["keep"],
                                ACTIONS["multiply"])).astype(jnp.int32)
  out = []
  for first in range(0, n, MAX_LEAVES_PER_CALL):
    part = leaves[first:first + MAX_LEAVES_PER_CALL]
    m = len(part)
    # A call's factors as one dimension (scale, shift, scale, ...), so that their layout is
    # the only one there is: the call constrains none (see `_scale_p`).
    out += _scale_p.bind(factors[first:first + m].reshape(2 * m), actions[first:first + m],
                         *part, workspace_bytes=_native.layout().scale_workspace_bytes(m))[:m]
  return out


# The scale call is a primitive of clipjax's own, not `jax.ffi.ffi_call`, so that it
# constrains no layout. XLA copies every aliased operand of a custom call that constrains
# its layouts before it assigns layouts, and removes the copies only passes later: one copy
# per leaf that each of those passes walks, and a check in the fusion pass that costs
# O(m^2) per copy of a call of m leaves (benchmarks/bench_compile.py). The call needs no layout: its
# kernel is elementwise, so any layout of a leaf is right (its result is the same buffer),
# and its other operands have one dimension.
_scale_p = jax.extend.core.Primitive(SCALE_TARGET)
_scale_p.multiple_results = True


@_scale_p.def_abstract_eval
def _scale_abstract_eval(factors, actions, *leaves, workspace_bytes):
  del factors
  workspace = actions.update(shape=(workspace_bytes,), dtype=jnp.dtype(jnp.uint8),
                             weak_type=False)
  return (*leaves, workspace)


def _scale_lowering(ctx, factors, actions, *leaves, workspace_bytes):
  del workspace_bytes  # in the result's type
  rule = jax.ffi.ffi_lowering(SCALE_TARGET, skip_ffi_layout_processing=True,
                              operand_output_aliases={i + 2: i for i in range(len(leaves))})
  return rule(ctx, factors, actions, *leaves)


def in_sequence(fn, args, axes):
  """`fn(*args)` under `jax.vmap` as the custom calls run there: once per batch element, in
  sequence. `axes` gives each argument's batch axis, or None for an argument that is not
  batched (it is broadcast). Returns fn's outputs, each batched on axis 0."""
  size = next(x.shape[a] for x, a in zip(args, axes) if a is not None)
  args = [jnp.broadcast_to(x, (size, *x.shape)) if a is None else jnp.moveaxis(x, a, 0)
          for x, a in zip(args, axes)]
  return lax.map(lambda xs: fn(*xs), args)


def _scale_batched(args, dims, *, workspace_bytes):
  outs = in_sequence(functools.partial(_scale_p.bind, workspace_bytes=workspace_bytes),
                     args, dims)
  return outs, [0] * len(outs)


@functools.cache
def _scale_jitted(workspace_bytes):
  return jax.jit(lambda *args: _scale_p.bind(*args, workspace_bytes=workspace_bytes))


_scale_p.def_impl(lambda *args, workspace_bytes: _scale_jitted(workspace_bytes)(*args))
mlir.register_lowering(_scale_p, _scale_lowering)
batching.primitive_batchers[_scale_p] = _scale_batched
