"""--mesh: the example on 1, 2 and 8 CPU devices computes the same losses.

This process checks the mesh flag and the leaf specs, then runs this file again in
subprocesses on forced CPU devices (conftest.run_file_on_cpu_devices), in this order:

  on 1: train the tiny reference;
  on 8: train with every device on the data axis, and on data=2,fsdp=4 (stopped after
        step STOP, saved); check the compiled step's all-gathers;
  on 2: train with every device on the data axis; resume the 8-device run on
        data=1,fsdp=2;
  on 1: resume the 8-device run.

Every run's losses equal the reference's to float32 reduction-order tolerance.
"""

import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt import config, flags
from gpt.reports import metrics
from gpt.training import loop, sharding, train_step
from examples.tests.conftest import devices_here, run_file_on_cpu_devices

STEPS, STOP = 50, 25
# float32 sums in another order (batch rows and shards split differently). The runs use
# peak lr 1e-3: at the tiny preset's 3e-3, batches of 8 rows bring loss spikes that blow
# rounding differences up to 0.2% by step 30. At 1e-3 they stayed below 2e-7 on some
# corpora and reached 2e-5 on others.
RTOL = 1e-4
SHARED_ENV = "CLIPJAX_EXAMPLE_MESH_DIR"  # the reference losses and the 8-device run
STAGE_ENV = "CLIPJAX_EXAMPLE_MESH_STAGE"  # which one-device run: reference or resume

in_parent = pytest.mark.skipif(devices_here() is not None, reason="runs in the parent process")


def on(count, stage=None):
  here = devices_here() == count and (stage is None or os.environ.get(STAGE_ENV) == stage)
  return pytest.mark.skipif(not here, reason=f"runs on {count} CPU devices {stage or ''}")


def _cfg(tiny, out_dir, **overrides):
  return tiny(out_dir, steps=STEPS, batch_size=8, peak_lr=1e-3, seed=1, **overrides)


def _losses(records):
  return [r["loss"] for r in metrics.step_records(records)]


def _shared() -> pathlib.Path:
  return pathlib.Path(os.environ[SHARED_ENV])


def _reference():
  return json.loads((_shared() / "reference.json").read_text())


def _resume_copy(tiny, out_dir, mesh=None):
  """Resumes (a copy of) the run saved on 8 devices after step STOP; its losses."""
  saved = _shared() / "saved-on-8"
  if not saved.is_dir():
    pytest.skip("the 8-device run saved nothing")
  shutil.copytree(saved, out_dir)
  records = loop.train(_cfg(tiny, out_dir, resume=True, mesh=mesh))
  assert metrics.step_records(records)[STOP]["step"] == STOP + 1
  return _losses(records)


# --- Here, on one device ----------------------------------------------------------


@in_parent
def test_parse_mesh():
  assert sharding.parse_mesh(None, 8) == {"data": 8, "fsdp": 1}
  assert sharding.parse_mesh("fsdp=4", 8) == {"data": 2, "fsdp": 4}
  assert sharding.parse_mesh("data=2,fsdp=4", 8) == {"data": 2, "fsdp": 4}
  for bad in ("data=3", "data=2,fsdp=2", "model=8", "data=0,fsdp=8", "data=x"):
    with pytest.raises(sharding.MeshError):
      sharding.parse_mesh(bad, 8)


@in_parent
def test_leaf_spec():
  P = jax.sharding.PartitionSpec
  assert sharding.leaf_spec((128, 512), 4) == P(None, "fsdp")  # the largest dimension
  assert sharding.leaf_spec((96, 130), 4) == P("fsdp", None)  # else the next
  assert sharding.leaf_spec((33, 129), 4) == P()  # neither divides
  assert sharding.leaf_spec((512,), 4) == P()  # vectors, scalars: replicated
  assert sharding.leaf_spec((16, 16), 4) == P()  # small matrices: replicated
  assert sharding.leaf_spec((128, 512), 1) == P()


@in_parent
def test_mesh_flag_errors(tiny, tmp_path):
  with pytest.raises(sharding.MeshError, match="visible device"):
    loop.train(_cfg(tiny, tmp_path, mesh=f"data={jax.device_count() + 1}"))
  assert flags.parse_args(["--mesh", "data=1,fsdp=1"])[1].mesh == "data=1,fsdp=1"


@pytest.fixture(scope="module")
def shared(tmp_path_factory, cache_dir):
  """The directory the subprocesses share, and the tokenizer cache."""
  directory = tmp_path_factory.mktemp("mesh")
  return {SHARED_ENV: str(directory), "CLIPJAX_EXAMPLE_CACHE": cache_dir}


# The runs on several devices: a sweep of device counts, in the slow set.
@pytest.mark.slow
@in_parent
def test_reference_on_1_cpu_device(shared):
  run_file_on_cpu_devices(__file__, 1, {**shared, STAGE_ENV: "reference"})


@pytest.mark.slow
@in_parent
def test_on_8_cpu_devices(shared):
  run_file_on_cpu_devices(__file__, 8, shared)


@pytest.mark.slow
@in_parent
def test_on_2_cpu_devices(shared):
  run_file_on_cpu_devices(__file__, 2, shared)


@pytest.mark.slow
@in_parent
def test_resume_on_1_cpu_device(shared):
  run_file_on_cpu_devices(__file__, 1, {**shared, STAGE_ENV: "resume"})


# --- In the subprocesses ----------------------------------------------------------


@pytest.fixture
def tiny_here(tiny):
  """tiny with the parent's tokenizer cache (each corpus tokenized once)."""
  cache = os.environ.get("CLIPJAX_EXAMPLE_CACHE")
  return lambda out_dir, **kw: tiny(out_dir, **({"cache_dir": cache} if cache else {}), **kw)


@on(1, "reference")
def test_1_device_reference(tiny_here):
  losses = _losses(loop.train(_cfg(tiny_here, _shared() / "reference")))
  (_shared() / "reference.json").write_text(json.dumps(losses))


@on(1, "resume")
def test_1_device_resumes_the_8_device_run(tiny_here, tmp_path):
  np.testing.assert_allclose(_resume_copy(tiny_here, tmp_path / "run"), _reference(),
                             rtol=RTOL)


@on(8)
def test_8_devices_match_one(tiny_here, tmp_path):
  reference = _reference()
  records = loop.train(_cfg(tiny_here, tmp_path / "data8"))
  assert len(metrics.step_records(records)[0]["device_memory_bytes"]) == 8
  np.testing.assert_allclose(_losses(records), reference, rtol=RTOL)
  saved = _shared() / "saved-on-8"
  fsdp = loop.train(_cfg(tiny_here, saved, mesh="data=2,fsdp=4", stop_after_step=STOP))
  np.testing.assert_allclose(_losses(fsdp), reference[:STOP], rtol=RTOL)


@on(2)
def test_2_devices_match_one(tiny_here, tmp_path):
  reference = _reference()
  np.testing.assert_allclose(_losses(loop.train(_cfg(tiny_here, tmp_path / "data2"))),
                             reference, rtol=RTOL)
  np.testing.assert_allclose(_resume_copy(tiny_here, tmp_path / "fsdp2", "data=1,fsdp=2"),
                             reference, rtol=RTOL)


def _all_gathers(tiny, tmp_path, mesh_spec, max_norm):
  """The result shapes of the all-gathers in the compiled step, and the parameters."""
  cfg = config.resolve(_cfg(tiny, tmp_path, max_norm=max_norm))
  mesh = sharding.make_mesh(mesh_spec)
  graphdef, params = loop.init_model(cfg, mesh)
  tx = train_step.make_optimizer(cfg)
  opt_state = loop.init_opt_state(tx, params, mesh)
  step = train_step.make_train_step(graphdef, tx, cfg, 3, mesh, params, opt_state)
  rows = sharding.batch_sharding(mesh)
  batch = (jax.ShapeDtypeStruct((cfg.batch_size, cfg.context_length + 1), jnp.int32,
                                sharding=rows),
           jax.ShapeDtypeStruct((cfg.batch_size,), jnp.int32, sharding=rows))
  hlo = step.lower(params, opt_state, *batch, jnp.int32(1)).compile().as_text()
  shapes = [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(", hlo)]
  return sorted(shapes), jax.tree.leaves(params)


@on(8)
def test_step_gathers_only_parameters(tiny_here, tmp_path):
  """With the fsdp axis: the clip adds no all-gather (the step without it compiles to
  the same ones), nothing larger than a parameter is gathered, and at most one gather
  per sharded parameter has its shape (the forward pass's)."""
  with_clip, params = _all_gathers(tiny_here, tmp_path, "data=2,fsdp=4", 1.0)
  without_clip, _ = _all_gathers(tiny_here, tmp_path, "data=2,fsdp=4", 0.0)
  assert with_clip == without_clip
  largest = max(p.size for p in params)
  assert all(np.prod(s) <= largest for s in with_clip), with_clip
  sharded = [p.shape for p in params if p.sharding.spec != jax.sharding.PartitionSpec()]
  assert sharded
  for shape in set(sharded):
    assert with_clip.count(shape) <= sharded.count(shape), (shape, with_clip)
  # Every device on the data axis: the parameters are replicated, none is gathered.
  data_only, params = _all_gathers(tiny_here, tmp_path, None, 1.0)
  assert not {tuple(p.shape) for p in params} & set(data_only), data_only
