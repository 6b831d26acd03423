"""The clip's two implementations behind one interface, for the code that picks one
(`clipjax._dispatch`) and the code that partitions it (`clipjax._partitioning`): impl
"ffi" is the custom call (`ffi.py`: three kernels, on CUDA or the CPU), impl "jax" is pure
JAX (`pure_jax.py`: what CPUs and TPUs run). Each answers three questions:

- `clip`: the clip of leaves whole where it runs: their norms, the decision, the leaves;
- `norms`: the norms alone, of what a `clipjax._trace_reads.NormInputs` gives;
- `decide_and_scale`: the clip's decision from norms taken elsewhere (the sharded clip's,
  after its all-reduce: `clipjax._decision.from_norms`), and the leaves multiplied by it.

A clip returns what the custom call returns: `(out_leaves or None, norms, flags)`, with
norms f32[n + 1] (the global norm, then one per leaf; float64 on the pure-JAX path for a
tree with float64 leaves) and flags int32[2] (clipped, nonfinite).
"""

from __future__ import annotations

import jax.numpy as jnp

from clipjax import _decision
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


def clip(impl, max_norm, leaves, *, mode: str, on_nonfinite: str, scale_by, norm_inputs=None,
         by_rows: bool | None = None):
  """The clip of `leaves` by `impl`, each leaf whole where this runs (on one device, or one
  device's shards inside a partitioned or mapped clip).

  `scale_by`: "kernel" (impl="ffi": k_grad_scale writes the leaves in place), "fused" (an
  XLA multiply that XLA fuses into the leaves' consumers) or None (the norms only).
  impl="ffi" takes at most MAX_LEAVES_PER_CALL leaves, its norms those of `norm_inputs`
  where given (`clipjax._trace_reads.norm_sources`). impl="jax" finishes its sums by rows or
  leaf by leaf as `by_rows` says, or, for None, in each platform's form (`per_platform`).
  """
  if impl == "ffi":
    return ffi.clip_call(max_norm, leaves, mode=mode, on_nonfinite=on_nonfinite,
                         scale_by=scale_by, norm_inputs=norm_inputs)
  return pure_jax.clip_leaves(max_norm, list(leaves), mode=mode, on_nonfinite=on_nonfinite,
                              scale_leaves=scale_by is not None, by_rows=by_rows)


def norms(impl, reads, *, by_rows: bool | None = None):
  """The norms alone, f32[n + 1], of what `reads` (`clipjax._trace_reads.NormInputs`) gives:
  only the custom call reads a source rounded, or a block of its columns. (Each clip takes
  a max_norm operand, which the norms do not depend on: any valid one.)"""
  max_norm = jnp.ones((), jnp.float32)
  if impl == "ffi":
    _, all_norms, _ = ffi.clip_call(max_norm, reads.arrays, mode="global",
                                    on_nonfinite="propagate", scale_by=None, norm_inputs=reads)
  else:
    _, all_norms, _ = pure_jax.clip_leaves(max_norm, reads.arrays, mode="global",
                                           on_nonfinite="propagate", scale_leaves=False,
                                           by_rows=by_rows)
  return all_norms


def decide_and_scale(impl, max_norm, leaves, global_root, global_exp, leaf_roots, leaf_exps, *,
                     mode: str, on_nonfinite: str, scale_by):
  """The clip of `leaves` by norms taken elsewhere, as (root, exponent) pairs: the decision
  (`_decision.from_norms`), then the leaves multiplied as it says, by XLA's elementwise ops
  (which XLA fuses into their consumers), or for impl="ffi" with scale_by="kernel" by the
  custom call's scale stage (k_grad_scale, in place). Returns what `clip` returns."""
  decision, all_norms, flags = _decision.from_norms(
      max_norm, global_root, global_exp, leaf_roots, leaf_exps, mode=mode,
      on_nonfinite=on_nonfinite)
  if scale_by is None:
    return None, all_norms, flags
  if impl != "ffi" or scale_by != "kernel":
    return _decision.scale_all(*decision, leaves), all_norms, flags
  return ffi.scale_call(*decision, leaves), all_norms, flags


def flat_outputs(out, all_norms, flags) -> tuple:
  """A clip's (out_leaves or None, norms, flags) as one flat tuple of arrays."""
  return (*(out or []), all_norms, flags)
