"""The training loop: one jitted pure step, periodic validation, resumable checkpoints.

`train(cfg, workdir)` writes into `workdir`:
    config.json     the TrainConfig (`TrainConfig.from_dict` reads it back)
    tokenizer.json  the tokenizer the data was encoded with
    metrics.jsonl   one object per logged step and per validation (see `metrics.py`)
    loss.png        training and validation loss against step
    checkpoints/    params + optimizer state + data-iterator state per saved step
    paraflax.lock   held by the run writing here: a second one is refused (`lock.py`)
and resumes from the newest intact checkpoint there when one exists (a corrupt newer one is
set aside with a warning; a params-only one is refused: see `Checkpoints.restore`). Step `s`
(0-based) consumes the s-th batch of the iterator and the key `fold_in(train_key, s)`, so a
resumed run repeats an uninterrupted one exactly (no RNG state is saved).

With `cfg.mesh` set, params and optimizer state live sharded on that mesh (by the logical
axis rules of `sharding.py`; `MeshConfig.axis_rules` names its axes), each batch is split
over its data axes, and the same pure `train_step` runs under `jax.jit` shardings;
checkpoints are saved sharded and restore onto whatever mesh the resuming run uses. On
several hosts (`paraflax.distributed`) every process runs `train` with the same config; only
process 0 writes logs, config and plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from paraflax.data.corpus import corpus_name
from paraflax.data.pipeline import prepare_stdlib, train_iterator, validation_batches
from paraflax import sharding
from paraflax.config import ModelConfig
from paraflax.data.tokenizer import Tokenizer
from paraflax.json_io import read_json, write_json
from paraflax.model import Transformer
from paraflax.training import interrupt, lock, optim
from paraflax.training.checkpoint import CHECKPOINTS, Checkpoints
from paraflax.training.config import (TrainConfig, apply_overrides, config_differences, load_config,
                                      with_resolved_paths)
from paraflax.training.metrics import METRICS, MetricsLog, batch_fingerprint, plot_losses
from paraflax.training.objectives import OBJECTIVES, get_objective

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"


def train_step(graphdef, params, opt_state, batch, rng, *, loss_fn, tx):
  """One optimizer update. Pure: returns (params, opt_state, metrics of scalars)."""
  def objective(p):
    return loss_fn(nnx.merge(graphdef, p), batch, rng)

  (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}


def eval_step(graphdef, params, batch, rng, *, loss_fn):
  """The objective's loss on one batch (no gradients)."""
  return loss_fn(nnx.merge(graphdef, params), batch, rng)[0]


def evaluate(model: nnx.Module, batches, loss_fn, rng: jax.Array) -> float:
  """Mean loss of `model` over equally sized `batches` (what validation logs)."""
  graphdef, params = nnx.split(model, nnx.Param)
  step = jax.jit(functools.partial(eval_step, graphdef, loss_fn=loss_fn))
  return _mean_loss(step, params, batches, rng)


def _mean_loss(step, params, batches, rng) -> float:
  total = sum(step(params, b, rng) for b in batches)
  return float(total) / len(batches)


class _Meter:
  """Tokens per second of training time (compilation, validation, saving excluded)."""

  def __init__(self):
    self.tokens, self.seconds, self.total_tokens, self.total_s = 0, 0.0, 0, 0.0
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

  def rate(self) -> float:
    """Throughput since the last call (call after a device sync)."""
    self.stop()
    rate = self.tokens / max(self.seconds, 1e-9)
    self.total_tokens, self.total_s = self.total_tokens + self.tokens, self.total_s + self.seconds
    self.tokens, self.seconds = 0, 0.0
    self.start()
    return rate


def init_params(model_cfg: ModelConfig, seed: int, mesh=None):
  """(graphdef, params) of a freshly initialised Transformer, built in one compiled call
  (directly sharded on `mesh` when given: the same values as on one device).

  The init key uses the `rbg` PRNG: XLA:CPU compiles a threefry sampler per parameter
  (~0.2 s each), rbg costs a third of that. Training keys stay threefry (portable).
  """
  def init(k):
    return nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(params=k)), nnx.Param)[1]

  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
  out = None if mesh is None else sharding.state_shardings(abstract, mesh)
  return graphdef, jax.jit(init, out_shardings=out)(jax.random.key(seed, impl="rbg"))


def init_opt_state(tx: optax.GradientTransformation, params, mesh=None):
  """`tx.init(params)`, sharded like the params it mirrors when `mesh` is given."""
  if mesh is None:
    return tx.init(params)
  out = sharding.state_shardings(jax.eval_shape(tx.init, params), mesh)
  return jax.jit(tx.init, out_shardings=out)(params)


def jit_train_step(graphdef, loss_fn, tx, mesh=None, params=None, opt_state=None):
  """`train_step` jitted with params and optimizer state donated; on a mesh their output
  shardings are pinned to those of `params` / `opt_state` (so every step compiles alike)."""
  out = None
  if mesh is not None:
    out = (sharding.state_shardings(params, mesh), sharding.state_shardings(opt_state, mesh),
           sharding.replicated(mesh))
  return jax.jit(functools.partial(train_step, graphdef, loss_fn=loss_fn, tx=tx),
                 donate_argnums=(0, 1), out_shardings=out)


def _keys(seed: int):
  """(per-step training, validation) keys, derived from the seed."""
  return jax.random.split(jax.random.key(seed), 2)


def _check_workdir(cfg: TrainConfig, workdir: Path, tokenizer: Tokenizer) -> None:
  """Refuse to resume a run trained with a different config or tokenizer."""
  if (workdir / CONFIG).is_file():
    saved = TrainConfig.from_dict(read_json(workdir / CONFIG))
    diffs = config_differences(saved, cfg)
    if diffs:
      raise ValueError(f"config mismatch: workdir {str(workdir)!r} holds a run with a different "
                       "config; use a fresh workdir (or set optim.total_steps to extend a run):\n  "
                       + "\n  ".join(diffs))
  if (workdir / TOKENIZER).is_file():
    saved_tok = Tokenizer.load(workdir / TOKENIZER)
    if saved_tok.fingerprint() != tokenizer.fingerprint():
      raise ValueError(f"config mismatch: the tokenizer in {str(workdir)!r} differs from the one "
                       "built from the data config (did the corpus change?); use a fresh workdir")


def _tokenizer_source(cfg: TrainConfig) -> str:
  """Where this run's tokenizer comes from, for messages."""
  for kind, store in (("trajectory", cfg.trajectories), ("teacher", cfg.teacher)):
    if store is not None:
      return f"{str(Path(store.path) / TOKENIZER)!r} (the {kind} store's)"
  name = corpus_name(cfg.data.val_fraction, cfg.data.max_files)
  return (f"the tokenizer trained on the data config's corpus {name} "
          f"(data.vocab_size={cfg.data.vocab_size}, cached in {cfg.data.cache_dir!r})")


def _check_init_from(cfg: TrainConfig, tokenizer: Tokenizer) -> None:
  """Refuse `init_from` weights learnt on other token ids than this run's data."""
  if cfg.init_from is None:
    return
  file = Path(cfg.init_from) / TOKENIZER
  if not file.is_file():
    raise FileNotFoundError(f"init_from={cfg.init_from!r}: {str(file)!r} not found (not a "
                            "training workdir or `paraflax convert` output)")
  theirs = Tokenizer.load(file)
  if theirs.fingerprint() != tokenizer.fingerprint():
    raise ValueError(
        f"tokenizer mismatch: init_from's weights were trained with {str(file)!r} (vocab "
        f"{theirs.vocab_size}, fingerprint {theirs.fingerprint()[:12]}) but this run's data is "
        f"tokenized with {_tokenizer_source(cfg)} (vocab {tokenizer.vocab_size}, fingerprint "
        f"{tokenizer.fingerprint()[:12]}); train on data made with init_from's tokenizer "
        "(e.g. a store collected from it) or drop init_from")


def train(cfg: TrainConfig, workdir: str | os.PathLike, *, progress: bool = True,
          max_steps: int | None = None) -> dict:
  """Train (or resume) to `cfg.steps` (or `max_steps`, same schedule); return a summary dict.

  Summary keys: workdir, step, start_step, train_loss, val_loss, tokens_per_s,
  train_seconds, n_params.

  The run holds the workdir's lock (`lock.py`) throughout: a second run there gets
  `LockedError` naming this one. Before the lock, the config and the mesh (it must fit
  these devices) are checked; after it, the data, the tokenizer of `init_from` and a
  resumed workdir's config: a failing check leaves at most the lock file behind.
  """
  cfg = with_resolved_paths(cfg)
  workdir = Path(workdir).expanduser().absolute()
  loss_fn = get_objective(cfg.objective, cfg.objective_args)
  mesh = None if cfg.mesh is None else sharding.resolve_mesh(cfg.mesh)  # fits the devices?
  with lock.hold(workdir, what="training workdir"):
    return _train(cfg, workdir, loss_fn, mesh, progress=progress, max_steps=max_steps)


def _train(cfg: TrainConfig, workdir: Path, loss_fn, mesh, *, progress: bool,
           max_steps: int | None) -> dict:
  workdir.mkdir(parents=True, exist_ok=True)
  main = jax.process_index() == 0  # the one process that writes files (multi-host)
  progress = progress and main
  it, val, tokenizer = _data(cfg, progress)
  cfg.check_tokenizer(tokenizer)
  _check_workdir(cfg, workdir, tokenizer)
  _check_init_from(cfg, tokenizer)
  if main:
    write_json(workdir / CONFIG, cfg.to_dict())
    tokenizer.save(workdir / TOKENIZER)

  place = (lambda b: b) if mesh is None else (lambda b: sharding.shard_batch(b, mesh))
  place_key = (lambda k: k) if mesh is None else (
      lambda k: sharding.put(k, sharding.replicated(mesh)))
  train_key, eval_key = _keys(cfg.seed)
  eval_key = place_key(eval_key)
  if cfg.init_from is None:
    graphdef, params = init_params(cfg.model, cfg.seed, mesh)
  else:
    graphdef, params = _initial_params(cfg, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  lr = optim.schedule(cfg.optim, cfg.schedule_steps)
  tx = optim.optimizer(cfg.optim, cfg.schedule_steps)
  opt_state = init_opt_state(tx, params, mesh)
  with_step = ((lambda b, s: {**b, "step": np.full(len(b["tokens"]), s, np.int32)})
               if getattr(OBJECTIVES[cfg.objective], "needs_step", False) else (lambda b, s: b))
  val = [place(with_step(b, cfg.steps)) for b in val[:cfg.eval_batches]]  # end of curricula

  ckpt = Checkpoints(workdir, keep=cfg.keep_checkpoints)
  start, restored = ckpt.restore_latest(params, opt_state)  # the newest intact step
  if restored is not None:
    params, opt_state, data_state = restored
    it.set_state(data_state)
  log = MetricsLog(workdir / METRICS, resume_step=start) if main else _NoLog()
  target = cfg.steps if max_steps is None else min(cfg.steps, max_steps)

  step_fn = jit_train_step(graphdef, loss_fn, tx, mesh, params, opt_state)
  eval_fn = jax.jit(functools.partial(eval_step, graphdef, loss_fn=loss_fn))

  def validate(step: int) -> float:
    val_loss = _mean_loss(eval_fn, params, val, eval_key)
    log.write({"step": step, "val_loss": val_loss, "val_batches": len(val)})
    if main:
      plot_losses(workdir)
    return val_loss

  summary = {"workdir": str(workdir), "step": start, "start_step": start, "train_loss": None,
             "val_loss": None, "tokens_per_s": None, "train_seconds": 0.0, "n_params": n_params}
  bar, saved, guard = None, start, contextlib.ExitStack()
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
      params, opt_state, metrics = compiled(params, opt_state, device_batch, rng)
      meter.tokens += math.prod(batch["tokens"].shape)
      done = step + 1
      if done % cfg.log_every == 0 or done == target:
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        tps = meter.rate()
        log.write({"step": done, **metrics, "lr": float(lr(step)), "tokens_per_s": tps,
                   "batch_fingerprint": batch_fingerprint(batch["tokens"])})
        summary["train_loss"] = metrics["loss"]
        val_str = "-" if summary["val_loss"] is None else f"{summary['val_loss']:.3f}"
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", val=val_str, tok_s=f"{tps:,.0f}")
      if done % cfg.eval_every == 0 or done == target:
        with meter.paused():  # validation and saving are not training time
          summary["val_loss"] = validate(done)
      if done % cfg.checkpoint_every == 0 or done == target:
        with meter.paused():
          ckpt.save(done, params, opt_state, it.get_state())
        saved = done
      bar.update(1)
      summary["step"] = done
  finally:
    guard.close()
    if bar is not None:
      bar.close()
    log.close()
    ckpt.close()
  if summary["step"] > start:
    summary.update(tokens_per_s=meter.total_tokens / max(meter.total_s, 1e-9),
                   train_seconds=meter.total_s)
  return summary


def _save_and_stop(ckpt: Checkpoints, step: int, saved: int, params, opt_state, it):
  """After Ctrl-C: save step `step` (params, optimizer state, data position) unless it is
  saved already, then raise `interrupt.Interrupted` saying where."""
  if step > saved:
    ckpt.save(step, params, opt_state, it.get_state())
  where = ckpt.directory / str(step) if step else None
  raise interrupt.Interrupted(
      f"interrupted at step {step}: saved {where}; run the same command again to resume"
      if where else "interrupted before the first step: nothing to save")


def _data(cfg: TrainConfig, progress: bool):
  """(train iterator, validation batches, tokenizer): stdlib rows, packed Jacobi Forcing rows
  of a trajectory store, or raw prompt + answer rows of a DEER teacher store (tokenizer of a
  store: the one its model used)."""
  if cfg.trajectories is not None:
    from paraflax.training import jacobi_forcing
    it, val, meta = jacobi_forcing.datasets(cfg.trajectories, cfg.data.batch_size, cfg.data.seed)
    top, path = meta["max_prompt_len"] + meta["num_blocks"] * meta["block_size"], \
        cfg.trajectories.path
  elif cfg.teacher is not None:
    from paraflax.training import deer
    it, val, meta = deer.datasets(cfg.teacher, cfg.data.batch_size, cfg.data.seed)
    top, path = deer.row_length(meta), cfg.teacher.path
  else:
    data = prepare_stdlib(dataclasses.replace(cfg.data, progress=cfg.data.progress and progress))
    return (train_iterator(data.train_tokens, cfg.data),
            validation_batches(data.val_tokens, cfg.data), data.tokenizer)
  if top > cfg.model.max_seq_len:
    kind = "trajectory" if cfg.trajectories is not None else "teacher"
    raise ValueError(f"{kind} rows reach position {top}, above the model's max_seq_len "
                     f"{cfg.model.max_seq_len}")
  return it, val, Tokenizer.load(Path(path).expanduser() / TOKENIZER)  # the store's model's


def _initial_params(cfg: TrainConfig, mesh):
  """(graphdef, params) of `cfg.model` holding `cfg.init_from`'s latest weights: any run whose
  parameters have the same shapes (a diffusion model may add a mask token id). Parameters the
  source lacks (an AS-ARM's query-stream vector) keep their fresh initialisation."""
  source, _, _ = load_trained(cfg.init_from, mesh=mesh)
  graphdef, params = init_params(cfg.model, cfg.seed, mesh)
  loaded = dict(nnx.to_flat_state(nnx.split(source, nnx.Param)[1]))
  fresh = dict(nnx.to_flat_state(params))
  extra = sorted(set(loaded) - set(fresh))
  clash = [k for k in loaded.keys() & fresh.keys()
           if (loaded[k].shape, loaded[k].dtype) != (fresh[k].shape, fresh[k].dtype)]
  if extra or clash:
    raise ValueError(f"init_from={cfg.init_from!r} holds parameters of other shapes than "
                     f"model config {cfg.model} (unknown: {extra[:3]}, other shapes: "
                     f"{sorted(clash)[:3]})")
  merged = nnx.from_flat_state({k: loaded.get(k, v) for k, v in fresh.items()})
  return graphdef, merged


class _NoLog:
  """The metrics log of processes other than 0 (multi-host): writes nothing."""

  def write(self, entry: dict) -> None:
    pass

  def close(self) -> None:
    pass


def train_from_config_path(config_path: str | os.PathLike, workdir: str | os.PathLike,
                           steps: int | None = None, overrides: dict | None = None, *,
                           progress: bool = True, max_steps: int | None = None) -> dict:
  """`train` on a config file's `get_config()`, with `steps` and dotted `overrides` applied."""
  cfg = apply_overrides(load_config(config_path), overrides)
  if steps is not None:
    cfg = dataclasses.replace(cfg, steps=steps)
  return train(cfg, workdir, progress=progress, max_steps=max_steps)


def load_trained(workdir: str | os.PathLike, step: int | None = None, *, mesh=None,
                 axis_rules=None):
  """(model, tokenizer, train_cfg) with the params of the latest (or given) checkpoint,
  restored straight onto `mesh` (any shape, whatever mesh trained it) when given: a
  `jax.sharding.Mesh` with Explicit or Auto axes whose own axis names `axis_rules` maps,
  e.g. `{"tensor": "model"}` (see `sharding.resolve_mesh`; the params then live on the
  equivalent Auto (data, fsdp, tensor) mesh over the same devices).

  The params files are verified against the step's checksums first: a file that differs is a
  `ChecksumError` naming it (no fallback here: resuming a run falls back, loading does not);
  a checkpoint saved without checksums loads with a `ChecksumWarning`."""
  mesh = sharding.resolve_mesh(mesh, axis_rules)
  workdir = Path(workdir).expanduser()
  if not workdir.is_dir():
    raise FileNotFoundError(f"training workdir {str(workdir)!r} not found")
  for name in (CONFIG, TOKENIZER):
    if not (workdir / name).is_file():
      raise FileNotFoundError(f"{str(workdir / name)!r} not found: {str(workdir)!r} is not a "
                              "paraflax training workdir")
  cfg = TrainConfig.from_dict(read_json(workdir / CONFIG))
  tokenizer = Tokenizer.load(workdir / TOKENIZER)
  steps = []
  if (workdir / CHECKPOINTS).is_dir():
    ckpt = Checkpoints(workdir, create=False)
    steps = list(ckpt.all_steps())
  if not steps or (step is not None and step not in steps):
    what = "no checkpoint" if not steps else f"no checkpoint of step {step} (saved: {steps})"
    raise FileNotFoundError(f"{what} in {str(workdir / CHECKPOINTS)!r}")
  step = max(steps) if step is None else step
  graphdef, params_like = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
  if mesh is not None:
    params_like = sharding.abstract_state(params_like, mesh)
  try:
    params = ckpt.restore_params(step, params_like)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, params), tokenizer, cfg
