"""The clip's two implementations behind one interface, for the code that picks one
(`clipjax._dispatch`) and the code that partitions it (`clipjax._partitioning`): impl
"ffi" is the custom call (`ffi.py`: three kernels, on CUDA or the CPU), impl "jax" is pure
JAX (`pure_jax.py`: what CPUs and TPUs run). One question, `clip`: the clip of leaves
where it runs, whole (their norms, the decision, the leaves, in one pass) or by a `Split`
(the norms in several calls, combined, as the sharded clip's all-reduce combines them,
then the decision, `clipjax._decision.from_norms`, and the leaves multiplied by it).

A clip returns what the custom call returns: `(out_leaves or None, norms, flags)`, with
norms f32[n + 1] (the global norm, then one per leaf; float64 on the pure-JAX path for a
tree with float64 leaves) and flags int32[2] (clipped, nonfinite).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

from clipjax import _decision, _trace_reads
from clipjax._backend import ffi, pure_jax

# Leaves per custom call: a larger tree's norms take several calls.
MAX_LEAVES_PER_CALL = ffi.MAX_LEAVES_PER_CALL
# The leaf dtypes that the custom call takes.
FFI_DTYPES = ffi.SUPPORTED_DTYPES
# A custom call under `jax.vmap`: once per batch element, in sequence.
in_sequence = ffi.in_sequence
# Each platform's form of a clip, decided when lowering: the pure-JAX clip's sums by rows
# on the platforms where it finishes them so (`pure_jax.ROW_SUM_PLATFORMS`).
per_platform = pure_jax.per_platform


class Split(NamedTuple):
  """How a clip takes its norms in parts (`clipjax._partitioning.per_shard.split`):
  - `calls`: the leaf indices of each norm call (at most MAX_LEAVES_PER_CALL each);
  - `combine`: the calls' norms (each f[m + 1]: the call's, then one per leaf) to the whole
    tree's (global root, global exponent, leaf roots, leaf exponents), as
    `clipjax._decision.from_norms` takes them."""
  calls: list
  combine: Callable


def clip(impl, max_norm, leaves, *, mode: str, on_nonfinite: str, scale_by, norm_inputs=None,
         by_rows: bool | None = None, split: Split | None = None):
  """The clip of `leaves` by `impl`, each leaf whole where this runs (on one device, or one
  device's shards inside a partitioned or mapped clip).

  `scale_by`: "kernel" (impl="ffi": k_grad_scale writes the leaves in place), "fused" (an
  XLA multiply that XLA fuses into the leaves' consumers) or None (the norms only).
  The custom call's norms read `norm_inputs` (`clipjax._trace_reads.NormInputs`) where
  given: only it reads a source rounded, or a block of its columns. impl="jax" finishes its
  sums by rows or leaf by leaf as `by_rows` says, or, for None, in each platform's form
  (`per_platform`).

  `split`: None for one pass over all the leaves (impl="ffi": at most MAX_LEAVES_PER_CALL
  of them); else the norms by `split.calls`, combined by `split.combine`, then the
  decision, and the leaves multiplied as it says, by XLA's elementwise ops (which XLA fuses
  into their consumers), or for impl="ffi" with scale_by="kernel" by the custom call's
  scale stage (k_grad_scale, in place).
  """
  reads = norm_inputs
  if reads is None:
    reads = _trace_reads.NormInputs.as_stored(leaves)
  if split is not None:
    parts = [reads.pick(indices) for indices in split.calls]
    # Each call takes a max_norm operand, which its norms do not depend on: any valid one.
    kwargs = dict(mode="global", on_nonfinite="propagate")
    call_norms = []
    for part in parts:
      if impl == "ffi":
        _, norms, _ = ffi.clip_call(jnp.ones((), jnp.float32), part.arrays, scale_by=None,
                                    norm_inputs=part, **kwargs)
      else:
        _, norms, _ = pure_jax.clip_leaves(jnp.ones((), jnp.float32), part.arrays,
                                           scale_leaves=False, by_rows=by_rows, **kwargs)
      call_norms.append(norms)
    global_root, global_exp, leaf_roots, leaf_exps = split.combine(call_norms)
    decision, all_norms, flags = _decision.from_norms(
        max_norm, global_root, global_exp, leaf_roots, leaf_exps, mode=mode,
        on_nonfinite=on_nonfinite)
    if scale_by is None:
      return None, all_norms, flags
    if impl != "ffi" or scale_by != "kernel":
      return _decision.scale_all(*decision, leaves), all_norms, flags
    return ffi.scale_call(*decision, leaves), all_norms, flags
  if impl == "ffi":
    return ffi.clip_call(max_norm, leaves, mode=mode, on_nonfinite=on_nonfinite,
                         scale_by=scale_by, norm_inputs=reads)
  return pure_jax.clip_leaves(max_norm, list(leaves), mode=mode, on_nonfinite=on_nonfinite,
                              scale_leaves=scale_by is not None, by_rows=by_rows)


def flat_outputs(out, all_norms, flags) -> tuple:
  """A clip's (out_leaves or None, norms, flags) as one flat tuple of arrays."""
  return (*(out or []), all_norms, flags)
