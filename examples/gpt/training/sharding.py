"""The device mesh of a run and where each array lives on it (--mesh data=N,fsdp=M).

Two axes, as in JAX's sharded-training examples and nanodo:

  data  batches are split over it (and within it over fsdp: every device has its rows);
  fsdp  parameters and optimizer state are split over it: each matrix on its largest
        dimension that the axis size divides (else the next largest); vectors, scalars
        and matrices below MIN_SHARDED_SIZE elements are replicated.

The default mesh puts every visible device on the data axis (fsdp=1: plain data
parallelism). A leaf's placement depends on its shape only, so the optimizer state
(AdamW's moments have the parameters' shapes) is split exactly like the parameters.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")
MIN_SHARDED_SIZE = 4096  # smaller leaves are replicated: splitting them saves little


class MeshError(ValueError):
  """A --mesh that cannot be built on the visible devices."""


def parse_mesh(spec: str | None, device_count: int) -> dict[str, int]:
  """{"data": N, "fsdp": M} from "data=N,fsdp=M" (either may be left out: the data axis
  takes the devices the other leaves; None or "" puts every device on it)."""
  sizes = {}
  for part in filter(None, (spec or "").replace(" ", "").split(",")):
    name, _, value = part.partition("=")
    if name not in AXES or name in sizes or not value.isdigit() or int(value) < 1:
      raise MeshError(f"--mesh {spec!r}: expected data=N,fsdp=M with N, M >= 1")
    sizes[name] = int(value)
  sizes.setdefault("fsdp", 1)
  sizes.setdefault("data", max(device_count // sizes["fsdp"], 1))
  if sizes["data"] * sizes["fsdp"] != device_count:
    raise MeshError(f"--mesh {spec!r}: data={sizes['data']} x fsdp={sizes['fsdp']} is not "
                    f"the {device_count} visible device(s)")
  return {name: sizes[name] for name in AXES}


def make_mesh(spec: str | None = None, devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh(spec, len(devices))
  return Mesh(np.array(devices).reshape(sizes["data"], sizes["fsdp"]), AXES)


def describe(mesh: Mesh) -> str:
  return ", ".join(f"{name}={size}" for name, size in mesh.shape.items())


def leaf_spec(shape, fsdp_size: int) -> P:
  """The PartitionSpec of a parameter or optimizer-state leaf of this shape."""
  if fsdp_size == 1 or len(shape) < 2 or math.prod(shape) < MIN_SHARDED_SIZE:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):  # largest first
    if shape[dim] % fsdp_size == 0:
      return P(*(["fsdp" if d == dim else None for d in range(len(shape))]))
  return P()


def state_shardings(mesh: Mesh, tree):
  """A NamedSharding for each leaf of `tree` (arrays or shape/dtype structs)."""
  fsdp = mesh.shape["fsdp"]
  return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(np.shape(x), fsdp)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows split over every device: the data axis, and within it the fsdp axis (as
  in FSDP: each device computes on its own rows and gathers the parameters it needs)."""
  return NamedSharding(mesh, P(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def device_bytes(tree) -> list[int]:
  """Bytes of `tree`'s arrays held by each of this process's devices, in
  jax.local_devices() order."""
  held = {d: 0 for d in jax.local_devices()}
  for x in jax.tree.leaves(tree):
    for shard in getattr(x, "addressable_shards", ()):
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return list(held.values())


def memory_in_use(state_tree) -> list[int]:
  """Per device of this process (a process can only read its own devices' memory): the
  allocator's bytes in use where the backend reports it (GPU, TPU), else (CPU) the bytes
  of the training state's shards on it."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  if all(s and "bytes_in_use" in s for s in stats):
    return [int(s["bytes_in_use"]) for s in stats]
  return device_bytes(state_tree)
