"""What the clip's norm kernels read in place of the leaves, found in JAX's trace.

A custom call reads its operands from memory, so XLA writes out for it any array that the
optimizer's update alone would have computed as it read it. `norm_sources` finds, for the
leaves traced in the same jit as the clip, arrays that hold the same values and cost less
to read, or nothing to write: a narrow source (a float32 leaf widened from it), a float32
source that XLA keeps in memory anyway (a narrow leaf rounded from it), and the output of
a matmul that XLA merges with its siblings (a block of its columns).

It reads JAX's trace through attributes that JAX does not promise to keep: each traced
value's equation (`parent`: its `primitive`, `params`, `in_tracers`, `outvars`), its trace
(`_trace`) and variable (`val`), and the jaxprs of nested jits. The results never depend on
it, only what the kernels read:

- `CLIPJAX_TRACE_READS=0` in the environment turns it off: the norms read every leaf as
  stored. Read when a clip is traced.
- Where the running JAX's trace does not expose those attributes (`_trace_is_readable`,
  a probe run once per process), the norms read every leaf as stored, and clipjax says so
  once, in a warning that names the JAX version.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# The environment variable that turns the reads off (`enabled`).
SWITCH = "CLIPJAX_TRACE_READS"
_warned = False  # whether `_warn_unreadable` has warned in this process
_NARROW_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Equations whose float32 result XLA writes to memory whatever reads it (a reduction, a
# matmul, a scatter): reading it costs the norms no array of its own.
_IN_MEMORY = frozenset({"reduce_sum", "reduce_max", "reduce_min", "dot_general", "scatter-add",
                        "scatter_add", "scatter"})
# XLA's GPU compiler merges matmuls that share an operand (its DotMerger pass) when one of
# them reads and writes at most this many MiB, unless XLA_FLAGS sets another limit.
_DOT_MERGER_FLAG = "xla_gpu_dot_merger_threshold_mb"
_DOT_MERGER_DEFAULT_MB = 32


class NormInputs(NamedTuple):
  """What the norm kernels read in place of the leaves (`norm_sources`). Per leaf:
  - `arrays`: an array of the leaf's shape, or, where `columns` gives (first, width), a
    two-dimensional array whose columns [first, first + width) are the leaf;
  - `read_as`: None (read as stored) or the narrow type that the array's float32 values
    are rounded to before they are squared;
  - `columns`: None (the whole array) or (first, width)."""
  arrays: list
  read_as: tuple
  columns: tuple

  @staticmethod
  def as_stored(arrays) -> "NormInputs":
    return NormInputs(list(arrays), (None,) * len(arrays), (None,) * len(arrays))

  def pick(self, indices) -> "NormInputs":
    return NormInputs([self.arrays[i] for i in indices], tuple(self.read_as[i] for i in indices),
                      tuple(self.columns[i] for i in indices))


def _producer(x, primitive: str):
  """The equation that made `x` in JAX's trace, where it is `primitive` and its operands are
  of x's own trace; else None."""
  eqn = getattr(x, "parent", None)
  if getattr(getattr(eqn, "primitive", None), "name", None) != primitive:
    return None
  trace = getattr(x, "_trace", False)
  if any(getattr(t, "_trace", None) is not trace for t in getattr(eqn, "in_tracers", ())):
    return None
  return eqn


def _made_by(x, primitive: str):
  """The one operand of the equation that made `x`, where `_producer` finds it; else None."""
  eqn = _producer(x, primitive)
  return eqn.in_tracers[0] if eqn is not None and len(eqn.in_tracers) == 1 else None


def _unreshaped(x):
  while (y := _made_by(x, "reshape")) is not None:
    x = y
  return x


def _converted_from(x):
  """The array that `x` (after any reshapes) was converted from in the same trace, or None."""
  return _made_by(_unreshaped(x), "convert_element_type")


def _in_memory(x) -> bool:
  """Whether XLA has `x` in memory whatever reads it: an argument of the jit, or the result
  of an `_IN_MEMORY` equation, looked for inside nested jits (JAX wraps some, as the
  scatter-add that differentiates an indexing)."""
  eqn = getattr(x, "parent", None)
  if eqn is None:
    return True
  var = getattr(x, "val", None)  # the trace's variable (JAX versions without it: None)
  while eqn.primitive.name in ("jit", "pjit"):
    inner = getattr(eqn.params.get("jaxpr"), "jaxpr", None)
    k = next((k for k, v in enumerate(getattr(eqn, "outvars", ())) if v is var), None)
    if inner is None or k is None:
      return False
    var = inner.outvars[k]
    eqn = next((e for e in inner.eqns if any(v is var for v in e.outvars)), None)
    if eqn is None:  # one of the inner jit's inputs, passed through
      return False
  return eqn.primitive.name in _IN_MEMORY


def enabled() -> bool:
  """Whether the trace reads are on: unless CLIPJAX_TRACE_READS=0, and where this JAX's
  trace exposes what they read (else a warning, once per process)."""
  if os.environ.get(SWITCH, "1") == "0":
    return False
  if _trace_is_readable():
    return True
  _warn_unreadable()
  return False


def _probe(x):
  """Whether the reads below find what they look for in a trace made for the purpose: a
  conversion of a nested jit's reduction, and a dense layer's weight gradient."""
  total = jax.jit(lambda v: jnp.sum(v, axis=0))(x)
  narrow = total.astype(jnp.bfloat16)
  weight = lax.dot_general(x, x, (((0,), (0,)), ((), ()))).T
  found = _weight_gradient(weight)
  return (_converted_from(narrow) is total and _in_memory(total) and found is not None
          and found[0] is x)


@functools.cache
def _trace_is_readable() -> bool:
  """Whether this JAX's trace exposes the attributes that the reads below take (`_probe`)."""
  seen = []
  jax.make_jaxpr(lambda x: seen.append(_probe(x)))(jax.ShapeDtypeStruct((4, 4), jnp.float32))
  return bool(seen and seen[0])


def _warn_unreadable():
  global _warned
  if not _warned:
    _warned = True
    warnings.warn(
        f"clipjax: the trace of this JAX (jax {jax.__version__}) does not expose what clipjax "
        "reads in it to find cheaper sources for the custom call's norms; they read every "
        f"leaf as stored (the same results; the clip may be slower). {SWITCH}=0 turns the "
        "reads off without this warning.", RuntimeWarning, stacklevel=3)


def norm_sources(leaves) -> NormInputs | None:
  """What the norm kernels may read in place of `leaves`, or None where they read the
  leaves: always where the reads are off (`enabled`). Only a leaf traced in the same jit as
  the equations that made it is known by them (JAX's trace records them): under `vmap` or
  `grad` the call reads the leaf.

  Two arrays have a cheaper source, with the same values:
  - widened: a float32 leaf converted from a bfloat16 or float16 array (the gradients of
    float32 parameters in a model with bfloat16 compute). The norms read the narrow
    array, 2 bytes an element; the widening is exact.
  - narrowed: a bfloat16 or float16 leaf (or the narrow array of a widened one) converted
    from a float32 array that XLA has in memory anyway (a reduction's, a matmul's or a
    scatter's result, or an argument of the jit: in a bfloat16 model, the LayerNorms'
    gradients, summed in float32). The norms read the float32 array and round
    each value as the conversion does: no kernel of its own for each conversion.
  Reshapes between a leaf and its source are looked through. Then the weight gradients
  of matmuls that share an input are read as blocks of columns of one array
  (`_merged_matmuls`).
  """
  if not enabled():
    return None
  arrays, read_as = [], []
  for x in leaves:
    source, rounded_to = x, None
    narrow = _converted_from(x)
    if (jnp.dtype(x.dtype) == jnp.float32 and narrow is not None
        and jnp.dtype(narrow.dtype) in _NARROW_FLOATS):
      source = narrow
    wide = _converted_from(source)
    if (jnp.dtype(source.dtype) in _NARROW_FLOATS and wide is not None
        and jnp.dtype(wide.dtype) == jnp.float32):
      if _in_memory(_unreshaped(wide)):
        source, rounded_to = wide, jnp.dtype(source.dtype)
    arrays.append(source if source is x else source.reshape(x.shape))
    read_as.append(rounded_to)
  columns = [None] * len(arrays)
  for members in _merged_matmuls(arrays, read_as):
    merged = jnp.concatenate([arrays[i] for i in members], axis=1)
    first = 0
    for i in members:
      columns[i] = (first, arrays[i].shape[1])
      first += arrays[i].shape[1]
      arrays[i] = merged
  if all(a is x for a, x in zip(arrays, leaves)):
    return None
  return NormInputs(arrays, tuple(read_as), tuple(columns))


def dot_merger_limit() -> int:
  """The bytes a matmul may read and write for XLA's GPU compiler to merge it with the
  others that share an operand: `--xla_gpu_dot_merger_threshold_mb` in XLA_FLAGS (the last
  one given), else XLA's default, in MiB."""
  given = re.findall(rf"--{_DOT_MERGER_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return int(given[-1] if given else _DOT_MERGER_DEFAULT_MB) << 20


def _weight_gradient(x):
  """(shared, other, dot equation) where `x` is transpose(dot_general(other, shared)) with
  permutation (1, 0), the dot without batch dimensions (how JAX differentiates a dense
  layer's weight: `other` is the output's gradient, `shared` the layer's input); else None."""
  transpose = _producer(x, "transpose")
  if x.ndim != 2 or transpose is None or tuple(transpose.params["permutation"]) != (1, 0):
    return None
  dot = _producer(transpose.in_tracers[0], "dot_general")
  if dot is None or any(dot.params["dimension_numbers"][1]):
    return None
  other, shared = dot.in_tracers
  return shared, other, dot


def _merged_matmuls(arrays, read_as):
  """Groups of leaf indices (two or more each) whose arrays are weight gradients that XLA's
  GPU compiler computes as one matmul: `_weight_gradient`s of one `shared` operand, with the
  same dimension numbers, the same shape and type of `other`, and the same rows; each within
  `dot_merger_limit` (XLA merges a pair where one of them is). XLA then writes each leaf as
  a copy of a block of the merged matmul's columns; the norms read that block in place.

  A leaf's rows must be whole 16-byte vectors, as the norm kernel reads a block of columns
  fastest. Leaves read rounded (`read_as`) keep their source."""
  limit = dot_merger_limit()
  groups: dict = {}
  for i, (a, rounded) in enumerate(zip(arrays, read_as)):
    found = rounded is None and _weight_gradient(a)
    if not found or (a.shape[1] * a.dtype.itemsize) % 16:
      continue
    shared, other, dot = found
    size = sum(t.size * t.dtype.itemsize for t in (shared, other)) + a.size * a.dtype.itemsize
    if size > limit:
      continue
    key = (id(shared), str(dot.params["dimension_numbers"]), other.shape, str(other.dtype),
           str(a.dtype), a.shape[0])
    groups.setdefault(key, []).append(i)
  return [members for members in groups.values() if len(members) > 1]
