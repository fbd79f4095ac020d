"""The Colab notebooks under notebooks/: each runs end to end on small budgets
(PARAFLAX_NOTEBOOK_SMALL=1) in a kernel of this interpreter, and is committed without outputs."""

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if __name__ != "__main__":  # (run as a script: one notebook, no test setup)
  from conftest import ENVIRON, background_job, background_result

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell


def _kernel_manager():
  """A kernel manager that starts ipykernel with this interpreter (the venv), whatever
  kernelspecs the machine has installed."""
  from jupyter_client import KernelManager
  from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

  class ThisPython(KernelSpecManager):
    def get_kernel_spec(self, kernel_name):
      return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                              "{connection_file}"], display_name="Python 3", language="python")

  return KernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())


@pytest.mark.fast
def test_there_are_notebooks_and_they_carry_no_outputs():
  nbformat = pytest.importorskip("nbformat")
  assert {"01", "02", "03", "04", "05"} <= {p.name[:2] for p in NOTEBOOKS}
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
      if cell.cell_type == "code":
        assert not cell.outputs and cell.execution_count is None, (
            f"{path.name} cell {i} has outputs: clear them before committing")


def execute(path: Path) -> float:
  """Run the notebook at `path` on small budgets in a fresh kernel of this interpreter; raises
  CellExecutionError (with the cell's traceback) on any error; returns the seconds taken."""
  import nbclient
  import nbformat
  os.environ["PARAFLAX_NOTEBOOK_SMALL"] = "1"  # (this process is a subprocess of the test)
  nb = nbformat.read(path, as_version=4)
  km = _kernel_manager()
  client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT,
                                   resources={"metadata": {"path": str(path.parent)}})
  t0 = time.perf_counter()
  try:
    client.execute()
  finally:
    if km.has_kernel:  # a kernel manager we made is ours to stop
      km.shutdown_kernel(now=True)
  return time.perf_counter() - t0


def _execute_in_a_subprocess(path: Path, tmp: Path) -> str:
  proc = subprocess.run([sys.executable, __file__, str(path)], env=ENVIRON, capture_output=True,
                        text=True, timeout=CELL_TIMEOUT * 10)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
  return proc.stdout.strip().splitlines()[-1]


# (each notebook runs in a subprocess started early in the background: conftest.background_job)
for _path in NOTEBOOKS if __name__ != "__main__" else []:
  background_job(__file__, f"test_notebook_runs_end_to_end[{_path.stem}]",
                 functools.partial(_execute_in_a_subprocess, _path))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path, request, tmp_path):
  pytest.importorskip("nbformat")
  pytest.importorskip("nbclient")
  print(background_result(request, tmp_path))


if __name__ == "__main__":
  notebook = Path(sys.argv[1])
  print(f"{notebook.name}: {execute(notebook):.1f} s")
