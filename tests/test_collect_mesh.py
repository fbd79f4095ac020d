"""Collection on a mesh (`shares.py`): which rows each process writes, the `--mesh` flag;
(in a subprocess with 8 CPU devices, `collect_mesh_cases.py`) trajectory and teacher stores
collected on (2, 2, 2) and (1, 8, 1) meshes equal the single-device stores; and two processes
(2 CPU devices each) filling one store, each writing its own rows, equal one device."""

from pathlib import Path
from typing import NamedTuple

import pytest
from test_multihost import run_two

from paraflax import cli
from paraflax.parallel.meshes import MeshConfig
from paraflax.training.stores.shares import owned_rows
from conftest import background_job, background_result, run_cases_on_devices

HERE = Path(__file__).resolve().parent


class _Device(NamedTuple):
  process_index: int
  id: int


def _devices(*rows_by_process):
  """{device: index} for devices on processes 0, 1, ... holding the given (lo, hi) rows."""
  rows = [(p, r) for p, rs in enumerate(rows_by_process) for r in rs]
  return {_Device(p, i): (slice(lo, hi), slice(None)) for i, (p, (lo, hi)) in enumerate(rows)}


@pytest.mark.fast
def test_each_row_is_written_by_the_lowest_process_that_computed_it():
  split = _devices([(0, 2), (2, 4)], [(4, 6), (6, 8)])  # batch over 2 processes x 2 devices
  assert owned_rows(split, 8, 0) == [(0, 4)]
  assert owned_rows(split, 8, 1) == [(4, 8)]
  whole = _devices([(0, 8)], [(0, 8)])  # a replicated batch: process 0 writes it
  assert owned_rows(whole, 8, 0) == [(0, 8)] and owned_rows(whole, 8, 1) == []
  crossed = _devices([(2, 4), (6, 8)], [(0, 2), (4, 6), (2, 4)])
  assert owned_rows(crossed, 8, 0) == [(2, 4), (6, 8)]
  assert owned_rows(crossed, 8, 1) == [(0, 2), (4, 6)]


@pytest.mark.fast
def test_the_mesh_flag_takes_what_train_set_mesh_takes():
  parse = cli.build_parser().parse_args
  for value, want in (("1,8,1", MeshConfig(1, 8, 1)), ("(2,2,2)", MeshConfig(2, 2, 2)),
                      ("-1,1,1", MeshConfig(-1, 1, 1))):
    for command in ("collect-trajectories", "teacher-data"):
      assert parse([command, "--workdir", "w", "--out", "o", f"--mesh={value}"]).mesh == want
  assert parse(["teacher-data", "--workdir", "w", "--out", "o"]).mesh is None
  with pytest.raises(SystemExit):
    parse(["teacher-data", "--workdir", "w", "--out", "o", "--mesh", "2,2"])


# (both subprocess runs start early in the background: conftest.background_job)
background_job(__file__, "test_stores_collected_on_eight_devices_equal_one_device",
               lambda tmp: run_cases_on_devices(HERE / "collect_mesh_cases.py"))
background_job(__file__, "test_two_processes_each_write_their_rows_of_one_store",
               lambda tmp: run_two(HERE / "multihost_collect_worker.py", tmp,
                                   env={"PARAFLAX_TEST_OUT": str(tmp / "stores")}))


@pytest.mark.slow
def test_stores_collected_on_eight_devices_equal_one_device(request, tmp_path):
  background_result(request, tmp_path)


@pytest.mark.slow
def test_two_processes_each_write_their_rows_of_one_store(request, tmp_path):
  results = background_result(request, tmp_path)
  assert [r["rows"] for r in results] == [[[0, 4]], [[4, 8]]]  # batch rows split by process
  for r in results:
    assert all(r["checks"].values()), r
  assert {"trajectories", "teacher"} <= set(results[0]["checks"])  # equal to one device
