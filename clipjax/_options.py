"""The options every entry point takes and their checks: impl, mode, on_nonfinite, scale
(and who multiplies when it is "auto"), and max_norm."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "jax", "ffi")
# The custom call's `mode` and `on_nonfinite` attributes are these positions
# (cuda/andrea_clip_math.h: ClipMode, NonFinitePolicy).
MODES = ("global", "per_tensor")
NONFINITE_POLICIES = ("propagate", "zero")
# Who multiplies the leaves by the clip's factor when the custom call computes the norm:
# "kernel" (k_grad_scale, in place), "fused" (an XLA elementwise op that XLA fuses into
# whatever consumes the clipped leaves), or "auto" (see `resolve_scale`).
SCALES = ("auto", "fused", "kernel")


def check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"clipjax: {name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_max_norm(max_norm):
  """A clear error for a max_norm that is not a real scalar, or (when its value is known
  now) not finite and > 0. A traced value is checked on the device
  (`clipjax._dispatch.max_norm_operand`)."""
  if isinstance(max_norm, (bool, np.bool_)):
    raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}")
  if isinstance(max_norm, jax.core.Tracer):  # e.g. injected by optax.inject_hyperparams
    shape, dtype = max_norm.shape, max_norm.dtype
  else:
    try:
      value = np.asarray(max_norm)
    except Exception as e:  # noqa: BLE001 - report any unconvertible object
      raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}") from e
    shape, dtype = value.shape, value.dtype
  if shape != ():
    raise ValueError(f"clipjax: max_norm must be a scalar; got shape {shape}")
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"clipjax: max_norm must be a real number; got dtype {dtype}")
  if not isinstance(max_norm, jax.core.Tracer):
    number = float(value.astype(np.float64))
    if not (math.isfinite(number) and number > 0):
      raise ValueError(f"clipjax: max_norm must be a finite number > 0; got {max_norm!r}")


def check_options(max_norm, impl, mode, on_nonfinite, scale="auto"):
  check_choice("impl", impl, IMPLS)
  check_choice("mode", mode, MODES)
  check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
  check_choice("scale", scale, SCALES)
  if impl == "jax" and scale == "kernel":
    raise ValueError("clipjax: scale='kernel' runs k_grad_scale, a kernel of the custom call; "
                     "impl='jax' always leaves the multiply to XLA. Use impl='auto' or 'ffi', "
                     "or scale='auto'.")
  check_max_norm(max_norm)


# Above this many leaves scale="auto" is "kernel" even ahead of an optimizer: XLA compiles
# the fused multiply into every leaf's fusions, and an AdamW step's compile time grows with
# them on a CPU (docs/design.md, "Who applies the scale").
FUSED_MAX_LEAVES = 1024


def resolve_scale(scale: str, *, impl: str, feeds_consumer: bool, num_leaves: int) -> str:
  """"fused" or "kernel" for scale="auto" (any other value is returned as it is).

  In a transformation whose outputs feed another in the same jit (`andrea_clip` ahead of
  an optimizer), "fused": the multiply joins the optimizer's own elementwise pass, so the
  clip costs one read of the gradients; but "kernel" for a tree of more than
  FUSED_MAX_LEAVES leaves. Where the clipped tree is the result (`clip_tree`), "kernel": it
  writes only when it clips. impl="jax" has no kernel: always "fused".
  """
  if scale != "auto":
    return scale
  if impl == "jax":
    return "fused"
  return "fused" if feeds_consumer and num_leaves <= FUSED_MAX_LEAVES else "kernel"
