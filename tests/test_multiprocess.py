"""andrea_clip across processes: JAX's multi-controller model, 2 processes x 4 CPU devices.

The test launches this file twice as a program (`python tests/test_multiprocess.py ID
PORT OUT`), as two processes of one run joined by `jax.distributed.initialize` (their
collectives go over gloo, JAX's CPU default). Each process builds the same gradient tree
as global arrays on a mesh of all 8 devices, data=2 x fsdp=4 and fsdp=8, and clips it
with every impl through `andrea_clip` in a donated, jitted chain with AdamW,
`clip_tree` under jit, and `sharded_clip_tree` under jit and outside it. Per process:

- the global norm and every leaf norm are those of float64 NumPy (rtol 1e-6);
- the clipped leaves keep their shardings;
- the compiled clip moves no gradient-sized array between devices (no collective
  larger than a few floats per leaf).

The test then checks that both processes found the very same norms, bit for bit.
"""

import json
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

PROCESSES, DEVICES_PER_PROCESS = 2, 4
MESHES = {"data=2,fsdp=4": ((2, 4), ("data", "fsdp")), "fsdp=8": ((8,), ("fsdp",))}
TIMEOUT_S = 600


def gradients() -> dict:
  """The same float32 tree on every process; rows of different sizes, so each shard
  holds a different norm."""
  rng = np.random.default_rng(7)
  shapes = {"embed": (64, 48), "w_up": (48, 192), "w_down": (192, 48), "bias": (48,),
            "scalar": ()}
  return {name: (rng.standard_normal(shape) * np.linspace(0.1, 3.0, math.prod(shape) or 1)
                 .reshape(shape)).astype(np.float32) for name, shape in shapes.items()}


def specs_for(axes: tuple[str, ...]) -> dict:
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  fsdp = "fsdp"
  both = axes if len(axes) > 1 else fsdp
  return {"embed": P(both, None), "w_up": P(None, fsdp), "w_down": P(fsdp, None),
          "bias": P(), "scalar": P()}


def worker(process_id: int, port: int, out: str) -> None:
  """One process of the run: every check above; writes OUT/process-ID.json."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.initialize(f"localhost:{port}", PROCESSES, process_id,
                             heartbeat_timeout_seconds=30)
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top

  import clipjax  # pylint: disable=g-import-not-at-top
  from conftest import compiled_collectives  # pylint: disable=g-import-not-at-top

  host = gradients()
  want_leaf = {k: float(np.sqrt(np.sum(v.astype(np.float64)**2))) for k, v in host.items()}
  want = math.sqrt(sum(n * n for n in want_leaf.values()))
  largest_small = 4 * (len(host) + 1)  # a collective of a few floats per leaf
  failures, norms = [], {}

  def check(ok, what):
    if not ok:
      failures.append(what)

  for mesh_name, (shape, axes) in MESHES.items():
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    specs = specs_for(axes)
    place = lambda tree: {k: jax.make_array_from_callback(
        v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i]) for k, v in tree.items()}
    for impl in ("jax", "ffi", "auto"):
      where = f"{mesh_name} impl={impl}"
      results = {}
      tx = optax.chain(clipjax.andrea_clip(1.0, impl=impl), optax.adamw(1e-3))
      params = place({k: np.zeros_like(v) for k, v in host.items()})
      state = jax.jit(tx.init)(params)
      step = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(0, 1))
      grads = place(host)
      hlo = step.lower(grads, state, params).compile().as_text()
      updates, state = step(grads, state, params)
      clip = clipjax.clip_state(state)
      results["andrea_clip"] = (clip.global_norm, clip.leaf_norms, updates)
      biggest = max((size for _, size in compiled_collectives(hlo)), default=0)
      check(biggest <= largest_small, f"{where}: andrea_clip step has a collective of "
            f"{biggest} elements")
      r = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl=impl))(place(host))
      results["clip_tree"] = (r.global_norm, r.leaf_norms, r.updates)
      r = jax.jit(lambda t: clipjax.sharded_clip_tree(t, 1.0, mesh=mesh, specs=specs,
                                                      impl=impl))(place(host))
      results["sharded_clip_tree in jit"] = (r.global_norm, r.leaf_norms, r.updates)
      for call in range(2):  # outside jit: the second call is the cached program
        r = clipjax.sharded_clip_tree(place(host), 1.0, impl=impl)
      results["sharded_clip_tree"] = (r.global_norm, r.leaf_norms, r.updates)
      for form, (global_norm, leaf_norms, clipped) in results.items():
        got = float(global_norm)
        check(abs(got - want) <= 1e-6 * want, f"{where} {form}: norm {got} != {want}")
        for name, n in zip(sorted(host), np.asarray(leaf_norms)):
          check(abs(n - want_leaf[name]) <= 1e-6 * want_leaf[name] + 1e-30,
                f"{where} {form}: leaf {name} norm {n} != {want_leaf[name]}")
        for k, x in clipped.items():
          check(x.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), x.ndim),
                f"{where} {form}: leaf {k} came back as {x.sharding}, not {specs[k]}")
        norms[f"{where} {form}"] = [got.hex()] + [float(n).hex() for n in np.asarray(leaf_norms)]
  with open(os.path.join(out, f"process-{process_id}.json"), "w") as f:
    json.dump({"failures": failures, "norms": norms}, f)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_of_four_devices_clip_as_one(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") +
      f" --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}").strip())
  port = free_port()
  procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path)],
                            env=env, cwd=os.path.dirname(__file__), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for i in range(PROCESSES)]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for p in procs:
      p.kill()
  for i, (p, output) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i}:\n{output[-6000:]}"
  results = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(PROCESSES)]
  for i, r in enumerate(results):
    assert not r["failures"], f"process {i}: " + "\n".join(r["failures"])
  assert len(results[0]["norms"]) == len(MESHES) * 3 * 4
  assert results[0]["norms"] == results[1]["norms"]  # bit for bit on every process


if __name__ == "__main__":
  worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
