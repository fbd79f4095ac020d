"""The run control's memory choices by XLA's memory analysis (`training/run/fit.py`): the
candidates go least recompute first, the first that fits is kept, micro-batches follow, only
"auto" fields are chosen, and the CPU (no memory figure) keeps the config as it is."""

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from paraflax.model.run import RunControl
from paraflax.training.run import fit, optim
from paraflax.training.run.dry_run import abstract_batch, fit_to_device, lower_step
from paraflax.training.run.step import init_opt_state, init_params, stack_params
from test_dry_run import micro

GIB = 2**30


def _config(tmp_path: Path, **extra):
  return micro("tiny_ar", tmp_path, **{"data.batch_size": "4", **extra})


def _fake_memory(sizes: dict):
  """memory_of giving `sizes[(remat, whole row?, grad_accum)]` GiB, recording each call (remat
  "full:k": on the first k layers)."""
  calls = []

  def memory_of(c):
    remat = c.run.remat if c.run.remat_layers is None else f"{c.run.remat}:{c.run.remat_layers}"
    key = (remat, c.run.loss_chunk == fit.WHOLE_ROW, c.grad_accum)
    calls.append(key)
    return {"total_bytes": int(sizes.get(key, 99) * GIB)}
  return memory_of, calls


@pytest.mark.fast
def test_least_recompute_first_and_the_first_that_fits_is_kept(tmp_path):
  cfg = _config(tmp_path)
  memory_of, calls = _fake_memory({("none", True, 1): 20, ("none", False, 1): 12,
                                   ("save_matmuls", True, 1): 8})
  got, tried = fit.fitted(cfg, memory_of, capacity=10 * GIB)
  assert calls == [("none", True, 1), ("none", False, 1), ("save_matmuls", True, 1)]
  assert (got.run.remat, got.run.loss_chunk, got.grad_accum) == ("save_matmuls",
                                                                 fit.WHOLE_ROW, 1)
  assert [t["fits"] for t in tried] == [False, False, True]
  assert got.run.attention == cfg.run.attention  # nothing else changes


@pytest.mark.fast
def test_a_compile_refused_for_memory_fits_not_and_other_errors_raise(tmp_path):
  """XLA:TPU refuses to compile a step that cannot fit (RESOURCE_EXHAUSTED): the next
  candidate is tried; any other compile error is the user's to see."""
  cfg = _config(tmp_path)

  def memory_of(c):
    if c.run.loss_chunk == fit.WHOLE_ROW:
      raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    return {"total_bytes": GIB}
  got, tried = fit.fitted(cfg, memory_of, capacity=10 * GIB)
  assert (got.run.remat, got.run.loss_chunk) == ("none", None)
  assert tried[0] == {"remat": "none", "remat_layers": None, "loss_chunk": fit.WHOLE_ROW,
                      "grad_accum": 1, "total_bytes": None, "fits": False}

  def broken(c):
    raise RuntimeError("INTERNAL: Mosaic failed to compile")
  with pytest.raises(RuntimeError, match="Mosaic"):
    fit.fitted(cfg, broken, capacity=10 * GIB)


@pytest.mark.fast
def test_full_remat_on_the_fewest_layers_that_fit_when_no_remat_just_misses(tmp_path):
  """No remat (chunked loss) 10 GiB, full remat 6: with 9 allowed, a quarter of the 4 layers'
  share must go, so remat on 1 layer (no remat's loss chunk) is compiled and kept; where it
  does not fit after all, full remat on every layer is."""
  cfg = _config(tmp_path, **{"model.n_layers": "4"})
  sizes = {("none", False, 1): 10, ("full", True, 1): 6, ("full:1", False, 1): 8.9}
  memory_of, calls = _fake_memory(sizes)
  got, tried = fit.fitted(cfg, memory_of, capacity=10 * GIB)
  assert calls[-2:] == [("full", True, 1), ("full:1", False, 1)]
  assert (got.run.remat, got.run.remat_layers, got.run.loss_chunk) == ("full", 1, None)
  assert tried[-1]["remat_layers"] == 1 and tried[-1]["fits"]
  got, _ = fit.fitted(cfg, _fake_memory({**sizes, ("full:1", False, 1): 9.5})[0],
                      capacity=10 * GIB)
  assert (got.run.remat, got.run.remat_layers, got.run.loss_chunk) == ("full", None,
                                                                       fit.WHOLE_ROW)
  # nothing to estimate from (no remat never compiled): no partial candidate
  memory_of, _ = _fake_memory({("full", True, 1): 6})

  def refused_without_remat(c):
    if c.run.remat == "none":
      raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in HBM")
    return memory_of(c)
  got, tried = fit.fitted(cfg, refused_without_remat, capacity=10 * GIB)
  assert got.run.remat_layers is None and all(t["remat_layers"] is None for t in tried)


@pytest.mark.fast
def test_micro_batches_when_no_candidate_fits_and_one_line_when_nothing_does(tmp_path):
  cfg = _config(tmp_path)
  memory_of, calls = _fake_memory({("full", False, 2): 9})
  got, _ = fit.fitted(cfg, memory_of, capacity=10 * GIB)
  assert (got.run.remat, got.run.loss_chunk, got.grad_accum) == ("full", None, 2)
  assert len(calls) == 6 + 6  # every candidate at 1 micro-batch, then at 2
  with pytest.raises(ValueError, match=r"does not fit 90% of 10.0 GiB per device even with "
                                       r"remat 'full' and 4 micro-batches of 1 rows") as e:
    fit.fitted(cfg, _fake_memory({})[0], capacity=10 * GIB)
  assert "\n" not in str(e.value)
  fixed = _config(tmp_path, **{"run.remat": "save_matmuls"})  # the remat it was held to
  with pytest.raises(ValueError, match=r"even with remat 'save_matmuls' and 4 micro-batches"):
    fit.fitted(fixed, _fake_memory({})[0], capacity=10 * GIB)


@pytest.mark.fast
def test_only_auto_fields_are_chosen_and_the_cpu_keeps_the_config(tmp_path):
  cfg = _config(tmp_path, **{"run.remat": "full"})
  memory_of, calls = _fake_memory({("full", False, 1): 1})
  got, _ = fit.fitted(cfg, memory_of, capacity=10 * GIB)
  assert calls == [("full", True, 1), ("full", False, 1)] and got.run.remat == "full"
  fixed = dataclasses.replace(cfg, run=RunControl(remat="none", loss_chunk=8))
  assert fit.fitted(fixed, memory_of, capacity=1) == (fixed, [])  # nothing auto: no compile
  assert fit.fitted(cfg, memory_of, capacity=None) == (cfg, [])  # no memory figure (CPU)
  assert fit.device_memory() is None  # this suite's CPU backend reports none


def test_the_fitted_step_compiles_with_real_memory_and_runs_on_real_arrays(tmp_path):
  """Against a capacity the micro step fits: the first candidate, one compile, and that
  executable takes the arrays a run feeds it (perf train reuses it)."""
  cfg, tried, compiled = fit_to_device(_config(tmp_path), capacity=GIB)
  assert [(t["remat"], t["loss_chunk"]) for t in tried] == [("none", fit.WHOLE_ROW)]
  assert tried[0]["total_bytes"] > 0
  _, params = init_params(cfg.model, 0, run=cfg.run)
  params = stack_params(params)  # as `train` keeps them
  opt_state = init_opt_state(optim.optimizer(cfg.optim, cfg.schedule_steps), params)
  batch = {k: np.zeros(v.shape, v.dtype) for k, v in abstract_batch(cfg).items()}
  _, _, metrics = compiled(params, opt_state, batch, jax.random.key(0))
  assert np.isfinite(float(metrics["loss"]))
  with pytest.raises(ValueError, match="does not fit"):
    fit_to_device(_config(tmp_path), capacity=1024)


@pytest.mark.fast
def test_the_step_returned_is_the_kept_candidates_not_the_last_compiled(tmp_path, monkeypatch):
  """A candidate compiled after the kept one (remat on fewer layers that did not fit) is not
  the executable returned with the kept config."""
  base = _config(tmp_path)
  later = dataclasses.replace(base, run=dataclasses.replace(base.run, remat="full"))

  def fitted(cfg, memory_of, capacity):
    memory_of(cfg)
    memory_of(later)
    return cfg, []
  monkeypatch.setattr(fit, "fitted", fitted)
  cfg, _, compiled = fit_to_device(base, capacity=GIB)
  assert cfg == base
  text = lambda c: _program(lower_step(c, None)[0].compile().as_text())
  assert _program(compiled.as_text()) == text(base) != text(later)


def _program(hlo: str) -> str:
  """The instructions of an HLO text, without their source locations (`metadata=`, and the
  file and stack-frame tables, numbered in the order the process first traced each frame)."""
  return re.sub(r', metadata=\{[^}]*\}|^(\d+ .*|FileNames|FunctionNames|FileLocations|'
                r'StackFrames)\n', "", hlo, flags=re.M)
