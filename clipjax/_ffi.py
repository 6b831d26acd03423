"""The clipjax custom calls: native modules, registration, ffi_call.

Naming chain: kernels `k_grad_norm_partial`/`k_grad_norm_final`/`k_grad_scale`
-> handlers `AndreaClipCpu`/`AndreaClipCuda` -> XLA target
`"clipjax_andrea_clip"` -> `clipjax._ffi.clip_call`; and the scale stage alone
(the sharded clip, whose decision follows an all-reduce): `k_scale_table` + `k_grad_scale`
-> `AndreaScaleCpu`/`AndreaScaleCuda` -> `"clipjax_andrea_scale"` ->
`clipjax._ffi.scale_call`.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from clipjax import _jax_impl, _options

TARGET = "clipjax_andrea_clip"
SCALE_TARGET = "clipjax_andrea_scale"
ACTIONS = {"keep": 0, "multiply": 1, "zero_fill": 2}  # LeafAction in cuda/andrea_clip_math.h
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Leaves per custom call. XLA's compile time grows faster than linearly in the number of
# results a call aliases to its operands (at 4,000 leaves, 79 s on a CPU; 2.3 s as calls
# of 250), so larger trees are clipped by several calls (see `_partition._whole_call`).
MAX_LEAVES_PER_CALL = 256

_native: dict[str, object] = {}  # "cpu"/"cuda" -> the loaded native module
_load_errors: dict[str, str] = {}

# (lowering platform, native module): each module hands JAX one handler per target.
for _platform, _module in (("cpu", "_clipjax_cpu"), ("cuda", "_clipjax_cuda")):
  try:
    _native[_platform] = importlib.import_module(f"clipjax.{_module}")
  except ImportError as e:  # an install without that extension (no nvcc, no CUDA runtime)
    _load_errors[_platform] = str(e)
    continue
  for _target, _capsule in _native[_platform].registrations().items():
    jax.ffi.register_ffi_target(_target, _capsule, platform=_platform.upper()
                                if _platform == "cuda" else _platform)

def platforms() -> tuple[str, ...]:
  """Lowering platforms that have a handler for the custom call."""
  return tuple(sorted(_native))


def has_handler(platform: str) -> bool:
  return platform.lower() in _native


def missing_handler_message(platform: str) -> str:
  have = ", ".join(platforms()) or "none"
  why = _load_errors.get(platform.lower())
  msg = (f"clipjax: impl='ffi' needs a custom-call handler for platform '{platform}', "
         f"but handlers are registered only for: {have}. Use impl='jax' or impl='auto'.")
  if why:
    msg += f" (loading the {platform} handler failed: {why})"
  return msg


def _layout():
  """A loaded native module, for the sizes of a call's results (every module has them)."""
  if not _native:
    raise RuntimeError("clipjax: no native extension is importable: " +
                       "; ".join(f"{p}: {e}" for p, e in sorted(_load_errors.items())))
  return next(iter(_native.values()))


def num_chunks(sizes) -> int:
  chunk = _layout().CHUNK_ELEMS
  return sum(max(1, -(-int(n) // chunk)) for n in sizes)


def clip_call(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_by):
  """The clip of `leaves` in one custom call.

  `scale_by` says who multiplies the leaves by the clip's factor:
  - "kernel": the call runs all three kernels, and `k_grad_scale` writes the clipped leaves
    over its inputs (aliased), only when it clips;
  - "fused": the call runs the two norm kernels and returns its decision; the multiply is
    an XLA elementwise op (`_jax_impl.scale_all`) that XLA fuses into whatever consumes
    the clipped leaves (the optimizer's update inside `optax.chain`);
  - None: the norms only.

  Returns `(out_leaves or None, norms, flags)`: `norms` is f32[n + 1] (global norm, then
  one per leaf); `flags` is int32[2] (clipped, nonfinite).
  """
  n = len(leaves)
  sizes = [int(np.prod(x.shape)) for x in leaves]
  chunks = num_chunks(sizes)
  in_place = scale_by == "kernel"
  out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves] if in_place else []
  out_types += [
      jax.ShapeDtypeStruct((n + 1,), jnp.float32),
      jax.ShapeDtypeStruct((2,), jnp.int32),
      jax.ShapeDtypeStruct((_layout().workspace_bytes(chunks, n),), jnp.uint8),
  ]
  aliases = {i + 1: i for i in range(n)} if in_place else {}
  call = jax.ffi.ffi_call(TARGET, out_types, input_output_aliases=aliases,
                          vmap_method="sequential")
  outs = call(jnp.asarray(max_norm, jnp.float32).reshape(()), *leaves,
              mode=np.int64(_options.MODES.index(mode)),
              on_nonfinite=np.int64(_options.NONFINITE_POLICIES.index(on_nonfinite)))
  if in_place:
    return list(outs[:n]), outs[n], outs[n + 1]
  norms, flags, workspace = outs
  if scale_by is None:
    return None, norms, flags
  if mode == "per_tensor":
    decision = _decision(workspace, chunks, n, n)
  else:  # one decision for every leaf: scalars
    decision = [d[0] for d in _decision(workspace, chunks, n, 1)]
  return _jax_impl.scale_all(*decision, leaves), norms, flags


def _decision(workspace, chunks, n, count):
  """The first `count` entries of the decision table of a call of `n` leaves (a LeafScale
  per leaf, cuda/andrea_clip_math.h: a float64 factor and a LeafAction) as
  `_jax_impl.decide` states a decision: (scale, shift, keep, zero_fill), one value each.

  The factor is read from its bits, with no float64 arithmetic (none is needed without
  jax_enable_x64): it carries float32's 24 significant bits (see `DecideScale`), so it is
  exactly scale * 2**shift with scale a float32, normal, and shift 0 wherever the factor is
  a normal float32.
  """
  first = _layout().leaf_scale_offset(chunks, n)
  table = lax.bitcast_convert_type(
      workspace[first:first + 16 * count].reshape(count, 4, 4), jnp.uint32)
  low, high, action = table[:, 0], table[:, 1], table[:, 2].astype(jnp.int32)
  exponent = ((high >> 20) & 0x7FF).astype(jnp.int32)  # float64's biased exponent
  fraction = ((high & 0xFFFFF) << 3) | (low >> 29)  # float32's 23 fraction bits
  biased = exponent - 1023 + 127  # as float32's
  normal = biased >= 1
  # Below float32's normal range: scale is the factor's mantissa in [0.5, 1) and shift
  # the rest of its exponent, applied after the multiply in exact steps.
  bits = (jnp.where(normal, biased, 126).astype(jnp.uint32) << 23) | fraction
  scale = lax.bitcast_convert_type(bits, jnp.float32)
  scale = jnp.where(exponent == 0, 0.0, jnp.where(exponent == 0x7FF, jnp.nan, scale))
  shift = jnp.where(normal | (exponent == 0), 0, biased - 126)
  return (scale, shift, action == ACTIONS["keep"], action == ACTIONS["zero_fill"])


def scale_call(scale, shift, keep, zero_fill, leaves):
  """The scale stage alone, on a decision made elsewhere, in one custom call.

  Per leaf i (each argument a scalar, or one value per leaf): zeros where zero_fill[i],
  else the leaf unchanged where keep[i] (nothing is written), else x times the factor
  scale[i] * 2**shift[i] (see `_jax_impl.decide`), in float32 where the factor is a
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
    out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in part]
    out_types.append(jax.ShapeDtypeStruct((_layout().scale_workspace_bytes(m),), jnp.uint8))
    call = jax.ffi.ffi_call(SCALE_TARGET, out_types,
                            input_output_aliases={i + 2: i for i in range(m)},
                            vmap_method="sequential")
    out += call(factors[first:first + m], actions[first:first + m], *part)[:m]
  return out
