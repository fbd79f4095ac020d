"""Stores collected on a mesh equal the single-device store, on 8 forced CPU devices.

Not collected by default: `test_collect_mesh.py` runs this file in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before JAX starts). One process owns
every row here, but the rows, barriers and process-0 writes go through `shares.py`, the path
each process of a multi-host run takes.
"""

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paraflax.decoding.generate import TRACES
from paraflax.parallel import sharding
from paraflax.training.stores import store, teacher, trajectories
from paraflax.training.stores.shares import Share
from conftest import StubTokenizer, compiled_micro_model

MESHES = [(2, 2, 2), (1, 8, 1)]
TRAJ = trajectories.CollectConfig(block_size=4, num_blocks=2, examples=20, min_prompt_len=3,
                                  max_prompt_len=10, batch_size=8)
TEACH = teacher.TeacherConfig(examples=20, answer_len=6, min_prompt_len=2, max_prompt_len=10,
                              batch_size=8)  # 3 batches, the last one padded
TOKENS = np.random.default_rng(0).integers(0, 48, 400).astype(np.int32)


def test_eight_devices():
  assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


@pytest.fixture(scope="module")
def model():
  return compiled_micro_model(n_layers=1)


@pytest.fixture(scope="module")
def refs(model, tmp_path_factory):
  """The single-device stores."""
  d = tmp_path_factory.mktemp("one_device")
  return (trajectories.load(trajectories.collect(model, StubTokenizer(), TOKENS, d / "t", TRAJ,
                                                 progress=False)),
          teacher.load(teacher.collect(model, StubTokenizer(), TOKENS, d / "a", TEACH,
                                       progress=False)))


def _equal(got, ref, names):
  assert got.meta == ref.meta
  for name in names:
    np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)


@pytest.mark.parametrize("shape", MESHES)
def test_trajectory_store_on_a_mesh_equals_one_device(shape, model, refs, tmp_path):
  before = trajectories.jacobi_trajectories._cache_size()
  out = trajectories.collect(model, StubTokenizer(), TOKENS, tmp_path / "t", TRAJ,
                             progress=False, mesh=shape)
  assert trajectories.jacobi_trajectories._cache_size() == before + 1  # once for 3 batches
  _equal(trajectories.load(out), refs[0], trajectories.ARRAYS)


@pytest.mark.parametrize("shape", MESHES)
def test_teacher_store_on_a_mesh_equals_one_device(shape, model, refs, tmp_path):
  before = sum(TRACES.values())
  out = teacher.collect(model, StubTokenizer(), TOKENS, tmp_path / "a", TEACH, progress=False,
                        mesh=shape)
  assert sum(TRACES.values()) == before + 1  # once for 3 batches
  _equal(teacher.load(out), refs[1], teacher.ARRAYS)


def test_a_store_cut_short_on_one_mesh_resumes_on_another(model, refs, tmp_path):
  out = teacher.collect(model, StubTokenizer(), TOKENS, tmp_path / "a", TEACH, progress=False,
                        mesh=MESHES[0])
  # as if killed after batch 0, with batch 1 half written: the resume rewrites batches 1..2
  (out / store.PROGRESS).write_text(json.dumps({"batches": 1}))
  answers = store.open_array(out, "answers")
  answers[8:12].write(np.zeros((4, TEACH.answer_len), np.int32)).result()
  teacher.collect(model, StubTokenizer(), TOKENS, out, TEACH, progress=False, mesh=MESHES[1])
  _equal(teacher.load(out), refs[1], teacher.ARRAYS)


def test_the_model_is_sharded_by_the_rules_and_prompts_over_the_batch_axes(model):
  share = Share(sharding.resolve_mesh((2, 2, 2)), 8)
  wq = share.place(model).layers[0].attn.wq[...]  # [embed, heads, head_dim]
  assert wq.sharding.spec == P("fsdp", "tensor", None)
  prompts, lens = share.batch(np.zeros((8, 10), np.int32), np.ones((8,), np.int32))
  assert prompts.sharding.spec == P(("data", "fsdp"), None)
  assert lens.sharding.spec == P(("data", "fsdp"))
  assert share.rows(8) == [(0, 8)] and share.rows(4) == [(0, 4)]  # one process: every row
