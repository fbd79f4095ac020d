"""Workdir and store locations through `etils.epath`: a `gs://` location becomes the right
tensorstore kvstore spec, orbax directory and (absent) lock without touching the network; the
same checkpoint and store code runs on local paths given as `str` and as `epath.Path`."""

import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from paraflax.paths import as_path, is_remote, kvstore, resolve_path
from paraflax.training.stores import store
from paraflax.training.workdirs.checkpoint import Checkpoints, checkpoint_dir
from paraflax.training.workdirs.checksums import ChecksumWarning
from paraflax.training.workdirs.lock import DirLock, RemoteLockWarning
from conftest import StubTokenizer


@pytest.mark.fast
def test_a_gs_location_maps_to_a_gcs_kvstore_an_orbax_directory_and_no_lock():
  assert is_remote("gs://bucket/run") and not is_remote("/tmp/run")
  assert kvstore("gs://bucket/runs/traj/tokens") == {
      "driver": "gcs", "bucket": "bucket", "path": "runs/traj/tokens"}
  assert kvstore(epath.Path("gs://bucket/runs") / "teacher" / "answers") == {
      "driver": "gcs", "bucket": "bucket", "path": "runs/teacher/answers"}
  with pytest.raises(ValueError, match="local disks or gs:// only"):
    kvstore("s3://bucket/x")
  assert os.fspath(checkpoint_dir("gs://bucket/run/")) == "gs://bucket/run/checkpoints"
  assert os.fspath(as_path("gs://bucket/run") / "config.json") == "gs://bucket/run/config.json"
  assert resolve_path("gs://bucket/model/") == "gs://bucket/model"
  with pytest.warns(RemoteLockWarning, match="no locks"), DirLock("gs://bucket/run"):
    pass


@pytest.mark.fast
def test_local_locations_are_absolute_file_kvstores(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert kvstore("s/rows") == {"driver": "file", "path": str(tmp_path / "s" / "rows")}
  assert as_path("~/x") == epath.Path(os.path.expanduser("~/x"))
  assert checkpoint_dir(epath.Path("run")) == tmp_path / "run" / "checkpoints"


@pytest.mark.parametrize("kind", [str, epath.Path])
def test_checkpoints_and_stores_run_on_str_and_epath_locations(tmp_path, kind):
  ckpt = Checkpoints(kind(tmp_path / "run"))
  ckpt.save(3, {"w": jnp.arange(4.0)}, {"m": jnp.ones(2)}, {"position": 3})
  with warnings.catch_warnings():
    warnings.simplefilter("error", ChecksumWarning)  # the manifest was written and verifies
    step, (params, _, data) = ckpt.restore_latest({"w": jnp.zeros(4)}, {"m": jnp.zeros(2)})
  ckpt.close()
  assert (step, data) == (3, {"position": 3})
  np.testing.assert_array_equal(params["w"], np.arange(4.0))

  out, meta = epath.Path(tmp_path / "store"), {"examples": 3, "batch_size": 2}  # as collectors
  shapes = {"rows": ((3, 2), (2, 2))}
  arrays, done = store.open_store(out, meta, shapes, StubTokenizer(), what="test store")
  store.fill(out, arrays, meta, done, lambda i, lo, hi: {"rows": np.full((hi - lo, 2), i,
                                                                         np.int32)},
             desc="test", progress=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ChecksumWarning)
    _, got = store.read_store(kind(out), shapes, what="test store", command="make-it")
  np.testing.assert_array_equal(got["rows"][:, 0], [0, 0, 1])
