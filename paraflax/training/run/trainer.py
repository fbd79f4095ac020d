"""The training loop: one jitted pure step, periodic validation, resumable checkpoints.

`train(cfg, workdir)` writes into `workdir` (see `workdirs/workdir.py`):
    config.json     the TrainConfig (`TrainConfig.from_dict` reads it back)
    run_control.json  the run control as resolved (on an accelerator, the memory choices
                      fitted by `fit.py`, the candidates tried), the platform and device
    tokenizer.json  the tokenizer the data was encoded with
    metrics.jsonl   one object per logged step and per validation (see `metrics.py`); a
                    step's carries tokens_per_s, tflops_per_device and mfu (`flops.py`)
    loss.png        training and validation loss against step
    checkpoints/    params + optimizer state + data-iterator state per saved step, saved
                    asynchronously (see `workdirs/checkpoint.py`): `train` returns once the
                    last is committed
    paraflax.lock   held by the run writing here: a second one is refused (`workdirs/lock.py`)
    profile/        with `profile_steps`, a jax.profiler trace of those steps (`profile.py`)
and resumes from the newest intact checkpoint there when one exists (a corrupt newer one is
set aside with a warning; a params-only one is refused: see `Checkpoints.restore`). Step `s`
(0-based) consumes the s-th batch of the iterator and the key `fold_in(train_key, s)`, so a
resumed run repeats an uninterrupted one exactly (no RNG state is saved).

The loop knows no method: the config's registered `Objective` gives the loss and the batch
fields it reads (the trainer adds `"step"` when it is one of them), its registered
`DataSource` the batches, the tokenizer and how far its rows reach.

With `cfg.mesh` set, params and optimizer state live sharded on that mesh (by the logical
axis rules of `sharding.py`; `MeshConfig.axis_rules` names its axes), each batch is split
over its data axes, and the same pure `train_step` runs under `jax.jit` shardings;
checkpoints are saved sharded and restore onto whatever mesh the resuming run uses. On
several hosts (`paraflax.parallel.distributed`) every process runs `train` with the same
config; only process 0 writes logs, config and plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time

import jax
import numpy as np
from etils import epath
from tqdm.auto import tqdm

from paraflax import destination
from paraflax.data.source import TrainData
from paraflax.devices import peak_flops
from paraflax.json_io import write_json
from paraflax.parallel import sharding
from paraflax.paths import as_path, is_remote
from paraflax.training.config.train import (
  TrainConfig,
  apply_overrides,
  load_config,
  with_resolved_paths,
)
from paraflax.training.objectives.protocol import STEP, objective
from paraflax.training.run import flops, interrupt, optim
from paraflax.training.run.dry_run import fit_to_device
from paraflax.training.run.metrics import METRICS, MetricsLog, batch_fingerprint, plot_losses
from paraflax.training.run.profile import PROFILE_DIR, StepTrace
from paraflax.training.run.step import (  # noqa: F401
  eval_step,
  evaluate,
  init_opt_state,
  init_params,
  jit_train_step,
  keys,
  mean_loss,
  stack_params,
  train_step,
)
from paraflax.training.workdirs import lock
from paraflax.training.workdirs.checkpoint import Checkpoints
from paraflax.training.workdirs.workdir import (
  CONFIG,
  RUN_CONTROL,
  TOKENIZER,
  check_init_from,
  check_workdir,
  initial_params,
  with_method_tokens,
)


class _Meter:
  """Tokens and steps per second of training time (compilation, validation, saving
  excluded)."""

  def __init__(self):
    self.tokens, self.steps, self.seconds = 0, 0, 0.0
    self.total_tokens, self.total_steps, self.total_s = 0, 0, 0.0
    self._t = 0.0

  def start(self):
    self._t = time.perf_counter()

  def stop(self):
    self.seconds += time.perf_counter() - self._t

  @contextlib.contextmanager
  def paused(self):
    self.stop()
    yield
    self.start()

  def rate(self) -> tuple[float, float]:
    """(tokens/s, steps/s) since the last call (call after a device sync)."""
    self.stop()
    seconds = max(self.seconds, 1e-9)
    rates = self.tokens / seconds, self.steps / seconds
    self.total_tokens += self.tokens
    self.total_steps += self.steps
    self.total_s += self.seconds
    self.tokens, self.steps, self.seconds = 0, 0, 0.0
    self.start()
    return rates


def _bar_speed(speed: dict) -> dict:
  """The progress bar's TFLOP/s per device and MFU, where known."""
  fields = (("tflops", "tflops_per_device", "{:.3g}"), ("mfu", "mfu", "{:.1%}"))
  return {name: fmt.format(speed[key]) for name, key, fmt in fields if speed[key] is not None}


def open_data(cfg: TrainConfig, progress: bool = True) -> TrainData:
  """The run's data source opened with `cfg.data`; refuses rows reaching positions the model
  has not got."""
  data = cfg.source.open(cfg.data, progress=progress)
  if data.max_position > cfg.model.max_seq_len:
    raise ValueError(f"{data.rows} rows reach position {data.max_position}, above the model's "
                     f"max_seq_len {cfg.model.max_seq_len}")
  return data


def train(cfg: TrainConfig, workdir: str | os.PathLike, *, progress: bool = True,
          max_steps: int | None = None, profile_steps: tuple[int, int] | None = None) -> dict:
  """Train (or resume) to `cfg.steps` (or `max_steps`, same schedule); return a summary dict.
  `profile_steps` (A, B): trace steps A..B-1 into `<workdir>/profile` (`profile.py`).

  Summary keys: workdir, step, start_step, train_loss, val_loss, tokens_per_s,
  tflops_per_device, mfu, flops_per_step, train_seconds, n_params.

  The run holds the workdir's lock (`workdirs/lock.py`) throughout: a second run there gets
  `LockedError` naming this one. Before the lock, the config and the mesh (it must fit
  these devices) are checked; after it, the data, the tokenizer of `init_from` and a
  resumed workdir's config: a failing check leaves at most the lock file behind.
  """
  cfg = with_resolved_paths(cfg)
  workdir = as_path(workdir)
  _check_not_a_model(workdir)
  obj = objective(cfg.objective)
  mesh = None if cfg.mesh is None else sharding.resolve_mesh(cfg.mesh)  # fits the devices?
  with lock.hold(workdir, what="training workdir"):
    return _train(cfg, workdir, obj.needs_step, mesh, progress=progress, max_steps=max_steps,
                  profile_steps=profile_steps)


def _check_not_a_model(workdir: epath.Path) -> None:
  """Refuse a Hugging Face directory or a `paraflax convert` output as the workdir before its
  lock is taken: a run would write checkpoints into the user's model."""
  what = None if is_remote(workdir) else destination.kind(workdir)
  if what in (destination.HF, destination.CONVERTED):
    raise ValueError(f"{str(workdir)!r} is a {what}, not a training workdir: start from it "
                     f"with --hf {workdir} (or init_from) and give a new --workdir")


def _train(cfg: TrainConfig, workdir: epath.Path, needs_step: bool, mesh, *,
           progress: bool, max_steps: int | None, profile_steps) -> dict:
  workdir.mkdir(parents=True, exist_ok=True)
  main = jax.process_index() == 0  # the one process that writes files (multi-host)
  progress = progress and main
  data = _checked_data(cfg, workdir, main, progress)
  cfg = cfg.with_row_args()  # after the saved config, which keeps what the user set
  loss_fn = objective(cfg.objective).bind(cfg.objective_args)
  it = data.train
  cfg, tried, _ = fit_to_device(cfg, mesh)  # "auto" memory choices (an accelerator's only)
  if main:
    write_json(workdir / RUN_CONTROL, {**cfg.run.resolved(cfg.model, cfg.data.seq_len),
                                       "loss_chunk": cfg.run.loss_chunk,
                                       "grad_accum": cfg.grad_accum, "fit": tried,
                                       "device": jax.devices()[0].device_kind})

  place = (lambda b: b) if mesh is None else (lambda b: sharding.shard_batch(b, mesh))
  place_key = (lambda k: k) if mesh is None else (
      lambda k: sharding.put(k, sharding.replicated(mesh)))
  train_key, eval_key = keys(cfg.seed)
  eval_key = place_key(eval_key)
  graphdef, params, tx, opt_state = _initial_state(cfg, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  lr = optim.schedule(cfg.optim, cfg.schedule_steps)
  with_step = _with_step if needs_step else (lambda b, s: b)
  val = [place(with_step(b, cfg.steps))  # the step at the end of curricula
         for b in data.validation[:cfg.eval_batches]]

  ckpt = Checkpoints(workdir, keep=cfg.keep_checkpoints)
  try:
    start, restored = ckpt.restore_latest(params, opt_state)  # the newest intact step
  except BaseException:  # nothing to resume from (a params-only or broken workdir)
    ckpt.close()
    raise
  if restored is not None:
    params, opt_state, data_state = restored
    it.set_state(data_state)
  log = MetricsLog(workdir / METRICS, resume_step=start) if main else _NoLog()
  target = cfg.steps if max_steps is None else min(cfg.steps, max_steps)

  step_fn = jit_train_step(graphdef, loss_fn, tx, mesh, params, opt_state, cfg.grad_accum)
  eval_fn = jax.jit(sharding.traced_on(mesh, functools.partial(eval_step, graphdef,
                                                                loss_fn=loss_fn)))

  def validate(step: int) -> float:
    val_loss = mean_loss(eval_fn, params, val, eval_key)
    log.write({"step": step, "val_loss": val_loss, "val_batches": len(val)})
    if main:
      plot_losses(workdir)
    return val_loss

  flops_per_step = flops.train_flops(cfg.model, cfg.objective, cfg.data.batch_size,
                                     cfg.data.seq_len, cfg.objective_args)
  speed = functools.partial(flops.speed, flops_per_step, devices=1 if mesh is None else mesh.size,
                            peak=peak_flops())
  summary = {"workdir": str(workdir), "step": start, "start_step": start, "train_loss": None,
             "val_loss": None, "tokens_per_s": None, "tflops_per_device": None, "mfu": None,
             "flops_per_step": flops_per_step, "train_seconds": 0.0, "n_params": n_params}
  bar, saved, guard = None, start, contextlib.ExitStack()
  trace = StepTrace(profile_steps, workdir / PROFILE_DIR)
  try:
    # Ctrl-C stops between steps (with a save); not on several hosts, where one process alone
    # would see it and could not save
    stop = guard.enter_context(interrupt.deferred_sigint(jax.process_count() == 1))
    if start == 0 and target > 0:
      summary["val_loss"] = validate(0)
    compiled, meter = None, _Meter()
    for step in range(start, target):
      if stop.requested:
        _save_and_stop(ckpt, step, saved, params, opt_state, it)
      batch = with_step(next(it), step)
      rng = place_key(jax.random.fold_in(train_key, step))
      device_batch = place(batch)
      if compiled is None:  # compile ahead so throughput and the ETA exclude it
        compiled = step_fn.lower(params, opt_state, device_batch, rng).compile()
        bar = tqdm(total=target, initial=start, desc="train", unit="step",
                   disable=not progress, dynamic_ncols=True)
        meter.start()
      trace.before(step, params)
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        params, opt_state, metrics = compiled(params, opt_state, device_batch, rng)
      trace.after(step, params)
      meter.tokens += math.prod(batch["tokens"].shape)
      meter.steps += 1
      done = step + 1
      if done % cfg.log_every == 0 or done == target:
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        tps, sps = meter.rate()
        log.write({"step": done, **metrics, "lr": float(lr(step)), "tokens_per_s": tps,
                   **speed(sps), "batch_fingerprint": batch_fingerprint(batch["tokens"])})
        summary["train_loss"] = metrics["loss"]
        val_str = "-" if summary["val_loss"] is None else f"{summary['val_loss']:.3f}"
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", val=val_str, tok_s=f"{tps:,.0f}",
                        **_bar_speed(speed(sps)))
      if done % cfg.eval_every == 0 or done == target:
        with meter.paused():  # validation and saving are not training time
          summary["val_loss"] = validate(done)
      if done % cfg.checkpoint_every == 0 or done == target:
        with meter.paused():  # only the copy to host: writing goes on beside the next steps
          ckpt.save(done, params, opt_state, it.get_state())
        saved = done
      bar.update(1)
      summary["step"] = done
  finally:
    trace.stop()
    guard.close()
    if bar is not None:
      bar.close()
    ckpt.close()  # waits until the last save is committed and hashed
  if summary["step"] > start:
    summary.update(tokens_per_s=meter.total_tokens / max(meter.total_s, 1e-9),
                   **speed(meter.total_steps / max(meter.total_s, 1e-9)),
                   train_seconds=meter.total_s)
  return summary


def _checked_data(cfg: TrainConfig, workdir: epath.Path, main: bool, progress: bool) -> TrainData:
  """The opened data, once the run's tokenizer (the data's with the method tokens
  `data.mask_token` / `sep_token`) fits the model, a resumed workdir's config and tokenizer
  match and `init_from` shares it; then process 0 saves config and tokenizer."""
  data = open_data(cfg, progress)
  tokenizer = with_method_tokens(data.tokenizer, cfg.data)
  cfg.check_tokenizer(tokenizer)
  check_workdir(cfg, workdir, tokenizer)
  check_init_from(cfg, tokenizer, data.tokenizer_source)
  if main:
    write_json(workdir / CONFIG, cfg.to_dict())
    tokenizer.save(workdir / TOKENIZER)
  return data


def _initial_state(cfg: TrainConfig, mesh):
  """(graphdef, params, tx, opt_state) before any step: fresh params or `init_from`'s,
  stacked by layer (`layout.py`: the optimizer's update in a few kernels)."""
  if cfg.init_from is None:
    graphdef, params = init_params(cfg.model, cfg.seed, mesh, cfg.run)
  else:
    graphdef, params = initial_params(cfg, mesh)
  params = stack_params(params, mesh)
  tx = optim.optimizer(cfg.optim, cfg.schedule_steps)
  return graphdef, params, tx, init_opt_state(tx, params, mesh)


def _save_and_stop(ckpt: Checkpoints, step: int, saved: int, params, opt_state, it):
  """After Ctrl-C: save step `step` (params, optimizer state, data position) unless it is
  saved already, wait until it is committed, then raise `interrupt.Interrupted` saying where."""
  if step > saved:
    ckpt.save(step, params, opt_state, it.get_state())
  ckpt.wait()
  where = ckpt.directory / str(step) if step else None
  raise interrupt.Interrupted(
      f"interrupted at step {step}: saved {where}; run the same command again to resume"
      if where else "interrupted before the first step: nothing to save")


class _NoLog:
  """The metrics log of processes other than 0 (multi-host): writes nothing."""

  def write(self, entry: dict) -> None:
    pass


def train_from_config_path(config_path: str | os.PathLike, workdir: str | os.PathLike,
                           steps: int | None = None, overrides: dict | None = None, *,
                           progress: bool = True, max_steps: int | None = None) -> dict:
  """`train` on a config file's `get_config()`, with `steps` and dotted `overrides` applied."""
  cfg = apply_overrides(load_config(config_path), overrides)
  if steps is not None:
    cfg = dataclasses.replace(cfg, steps=steps)
  return train(cfg, workdir, progress=progress, max_steps=max_steps)


def _with_step(batch: dict, step: int) -> dict:
  """`batch` with the field `"step"` (int32 [B]) for objectives that read it."""
  return {**batch, STEP: np.full(len(batch["tokens"]), step, np.int32)}
