"""examples/minimal.py: the drop-in on its own trains, and the clip state it reads back
is the clip's."""

import jax
import minimal
import numpy as np
from flax import nnx


def test_the_minimal_example_clips_the_first_steps_then_passes(capsys):
  records = minimal.train()
  printed = capsys.readouterr().out.splitlines()

  # Step 1's global norm is the norm of the first gradients, computed here in float64.
  graphdef, params = nnx.split(minimal.MLP(nnx.Rngs(0)), nnx.Param)
  grad_fn = jax.jit(jax.grad(minimal.loss_fn), static_argnums=1)
  grads = grad_fn(params, graphdef, *minimal.make_batch(jax.random.key(0)))
  want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(records[0]["global_norm"], want, rtol=1e-6)

  norms = np.array([r["global_norm"] for r in records])
  clipped = np.array([r["clipped"] for r in records])
  np.testing.assert_array_equal(clipped, norms > minimal.MAX_NORM)
  first_passed = int(np.argmin(clipped))
  assert 0 < first_passed < len(records) - 10, norms  # clips at first, then stops
  assert not clipped[first_passed:].any(), norms
  assert records[-1]["loss"] < records[0]["loss"] / 20

  assert printed[0].startswith("step   1  loss") and printed[0].endswith("clipped")
  assert printed[-2].startswith("step  40  loss") and printed[-2].endswith("passed")
  assert printed[-1] == f"{clipped.sum()} of 40 steps clipped to max_norm 1.0"
