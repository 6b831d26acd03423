"""In a donated training step the optimizer state stays where it is: every leaf of the
state (the clip's own included) is written over its own donated buffer, and (without a
spike policy) nothing is copied. A state leaf that got a new buffer each step would change
addresses inside XLA's command buffers (CUDA graphs), which XLA then re-records on the
host at every step. (Older XLAs copy an optimizer's bfloat16 state even in AdamW alone: the
clip adds no copy to those.)
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import clipjax

CHAINS = {
    "plain": lambda impl: optax.chain(clipjax.andrea_clip(1.0, impl=impl), optax.adamw(1e-3)),
    "per_tensor": lambda impl: optax.chain(clipjax.andrea_clip(1.0, impl=impl, mode="per_tensor"),
                                           optax.adamw(1e-3)),
    "kernel": lambda impl: optax.chain(clipjax.andrea_clip(1.0, impl=impl, scale="kernel"),
                                       optax.adamw(1e-3)),
    "spike": lambda impl: optax.chain(
        clipjax.andrea_clip(1.0, impl=impl, spike=clipjax.ZScoreSpike()), optax.adamw(1e-3)),
    "skip_spikes": lambda impl: clipjax.skip_spikes(optax.chain(
        clipjax.andrea_clip(1.0, impl=impl, spike=clipjax.ZScoreSpike()), optax.adamw(1e-3))),
}


def copies(hlo: str) -> list[str]:
  """The copy ops of a compiled module (not a fusion's root)."""
  return re.findall(r"^\s*%\S+ = \S+ copy\(", hlo, re.M)


def compiled_step(tx, params):
  def step(params, opt_state, batch):
    grads = jax.tree.map(lambda p, x: p * x, params, batch)  # made in the step, as a backward pass
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  step = jax.jit(step, donate_argnums=(0, 1))
  return step.lower(params, opt_state, params).compile().as_text(), (params, opt_state)


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_every_state_leaf_is_written_in_place(impl, chain):
  if impl == "jax" and chain == "kernel":
    pytest.skip("scale='kernel' is the custom call's")
  params = {"w": jnp.ones((8, 16)), "b": jnp.ones((16,)), "h": jnp.ones((4,), jnp.bfloat16)}
  hlo, state = compiled_step(CHAINS[chain](impl), params)
  aliased = re.findall(r"\{(\d+)\}: \((\d+), \{\}", hlo.splitlines()[0])
  outputs = len(jax.tree.leaves(state))
  assert len(aliased) == outputs, f"{len(aliased)} of {outputs} outputs write over their input"
  assert all(int(o) == int(i) for o, i in aliased), "an output was paired with another's buffer"
  if chain not in ("spike", "skip_spikes"):  # a spike policy copies two scalars (skip: the state)
    assert len(copies(hlo)) <= len(copies(compiled_step(optax.adamw(1e-3), params)[0])), hlo
