"""The Colab notebooks under notebooks/: each runs end to end on small budgets
(PARAFLAX_NOTEBOOK_SMALL=1) in a kernel of this interpreter, and is committed without outputs."""

import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  monkeypatch.setenv("PARAFLAX_NOTEBOOK_SMALL", "1")
  nb = nbformat.read(path, as_version=4)
  km = _kernel_manager()
  client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT,
                                   resources={"metadata": {"path": str(path.parent)}})
  t0 = time.perf_counter()
  try:
    client.execute()  # raises CellExecutionError (with the cell's traceback) on any error
  finally:
    if km.has_kernel:  # a kernel manager we made is ours to stop
      km.shutdown_kernel(now=True)
  print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
