"""Shared helpers: float64 references and random gradient trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def f64_norm(tree) -> float:
  """Reference global norm in float64 (NumPy), chunked to bound memory."""
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    flat = np.asarray(jnp.asarray(leaf).astype(jnp.float32)).reshape(-1)
    for start in range(0, flat.size, 1 << 24):
      part = flat[start:start + (1 << 24)].astype(np.float64)
      total += float(np.dot(part, part))
  return float(np.sqrt(total))


def random_tree(key, shapes, dtype=jnp.float32, scale=1.0):
  keys = jax.random.split(key, len(shapes))
  return {f"p{i}": (scale * jax.random.normal(k, s, jnp.float32)).astype(dtype)
          for i, (k, s) in enumerate(zip(keys, shapes))}


def has_cuda() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


@pytest.fixture(params=["jax", "ffi"])
def impl(request):
  """Both implementations that run on this machine's default platform."""
  return request.param
