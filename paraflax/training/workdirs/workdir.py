"""A training workdir: its files, what a run checks before training there (a resumed run's
config and tokenizer, `init_from`'s tokenizer) and `load_trained`, which reads it back.

    config.json     the TrainConfig (`TrainConfig.from_dict` reads it back)
    run_control.json  the run control "auto" resolved to (`RunControl.resolved`), with the
                    platform and device it was resolved for
    tokenizer.json  the tokenizer the data was encoded with
    checkpoints/    params + optimizer state + data-iterator state per saved step
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from paraflax.data.tokenizer import Tokenizer, load_tokenizer
from paraflax.model.run import RunControl
from paraflax.model.transformer import Transformer
from paraflax.parallel import sharding
from paraflax.paths import as_path, is_hf_dir
from paraflax.training.config.train import TrainConfig, config_differences, read_config
from paraflax.training.run.step import init_params
from paraflax.training.workdirs.checkpoint import CHECKPOINTS, Checkpoints

CONFIG = "config.json"
RUN_CONTROL = "run_control.json"
TOKENIZER = "tokenizer.json"


def check_workdir(cfg: TrainConfig, workdir: epath.Path, tokenizer: Tokenizer) -> None:
  """Refuse to resume a run trained with a different config or tokenizer."""
  if (workdir / CONFIG).is_file():
    saved = read_config(workdir / CONFIG)
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


def with_method_tokens(tokenizer: Tokenizer, data) -> Tokenizer:
  """`tokenizer` with the run's method tokens (`data.mask_token` / `sep_token` of a
  `DataConfig`) in their roles, added when it lacks them: the run's tokenizer, whose ids the
  model has rows for, whether the data came encoded with them (text) or not (a store
  collected from the base model, whose rows the objective fills with <mask>/<sep> ids)."""
  roles = {k: v for k, v in (("mask", data.mask_token), ("sep", data.sep_token)) if v}
  return tokenizer.with_special_tokens(roles) if roles else tokenizer


def init_from_tokenizer(cfg: TrainConfig, *, method_tokens: bool = True) -> Tokenizer:
  """The tokenizer `cfg.init_from`'s weights were trained with (an HF directory's, a workdir's
  or a `paraflax convert` output's), with the run's method tokens (`data.mask_token` /
  `sep_token`) added as the data's tokenizer adds them unless `method_tokens` is False."""
  path = as_path(cfg.init_from)
  if not (is_hf_dir(path) or (path / CONFIG).is_file() and (path / TOKENIZER).is_file()):
    raise FileNotFoundError(f"init_from={cfg.init_from!r} is neither a training workdir "
                            "(config.json + tokenizer.json + checkpoints/) nor a Hugging Face "
                            "directory (config.json + *.safetensors + tokenizer.json)")
  tok = load_tokenizer(path)
  return with_method_tokens(tok, cfg.data) if method_tokens else tok


def check_init_from(cfg: TrainConfig, tokenizer: Tokenizer, tokenizer_source: str) -> None:
  """Refuse `init_from` weights learnt on other token ids than this run's data: compared by
  fingerprint (init_from's tokenizer with the run's method tokens added vs the data's), never
  by embedding size."""
  if cfg.init_from is None:
    return
  theirs = init_from_tokenizer(cfg)
  if theirs.fingerprint() != tokenizer.fingerprint():
    added = [t for t in (cfg.data.mask_token, cfg.data.sep_token) if t is not None]
    plus = f" plus {added}" if added else ""
    raise ValueError(
        f"tokenizer mismatch: init_from's weights were trained with "
        f"{str(as_path(cfg.init_from) / TOKENIZER)!r}{plus} (vocab {theirs.vocab_size}, "
        f"fingerprint {theirs.fingerprint()[:12]}) but this run's data is tokenized with "
        f"{tokenizer_source} (vocab {tokenizer.vocab_size}, fingerprint "
        f"{tokenizer.fingerprint()[:12]}); set data.tokenizer={cfg.init_from!r} (what "
        "`train --hf` does), train on data made with init_from's tokenizer (e.g. a store "
        "collected from it) or drop init_from")


VOCAB_AXIS = {("embed",): 0, ("lm_head",): 1}  # embed [V, D], lm_head [D, V]


def grow_vocab(value, rows: int, axis: int, added: range):
  """`value` with `rows` entries along `axis` (new ones zero), and the entries of the `added`
  token ids set to the mean of those below `added.start` (the source tokenizer's ids): a new
  token starts as an average token, not as a padding row's noise."""
  pad = [(0, 0)] * value.ndim
  pad[axis] = (0, rows - value.shape[axis])
  known = jax.lax.slice_in_dim(value, 0, min(added.start, value.shape[axis]), axis=axis)
  value = jnp.pad(value, pad)  # [V_new, D] or [D, V_new]
  if not len(added):
    return value
  mean = jnp.mean(known.astype(jnp.float32), axis=axis, keepdims=True).astype(value.dtype)
  idx = [slice(None)] * value.ndim
  idx[axis] = slice(added.start, added.stop)
  return value.at[tuple(idx)].set(jnp.broadcast_to(mean, value[tuple(idx)].shape))


def _source_params(cfg: TrainConfig, mesh):
  """{path: Param} of `cfg.init_from`: an HF checkpoint (in the run's dtypes) or a training
  workdir's latest step."""
  if is_hf_dir(cfg.init_from):
    from paraflax.hf import load_hf  # heavy: only when starting from an HF checkpoint
    source = load_hf(cfg.init_from, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
  else:
    source, _, _ = load_trained(cfg.init_from, mesh=mesh)
  return dict(nnx.to_flat_state(nnx.split(source, nnx.Param)[1]))


def initial_params(cfg: TrainConfig, mesh):
  """(graphdef, params) of `cfg.model` holding `cfg.init_from`'s weights (a training workdir's
  latest step or a Hugging Face checkpoint): any run whose parameters have the same shapes (a
  diffusion model may add a mask token id). Parameters the source lacks (an AS-ARM's
  query-stream vector) keep their fresh initialisation. When the run's tokenizer adds method
  tokens to the source's, the embedding (and untied head) grows to `cfg.model.vocab_size`
  rows and the added ids' rows start at the mean row (`grow_vocab`); a reserved token the
  source's tokenizer has keeps its trained row."""
  loaded = _source_params(cfg, mesh)
  graphdef, params = init_params(cfg.model, cfg.seed, mesh, cfg.run)
  fresh = dict(nnx.to_flat_state(params))
  added = range(init_from_tokenizer(cfg, method_tokens=False).vocab_size,
                init_from_tokenizer(cfg).vocab_size)
  for key, axis in VOCAB_AXIS.items():
    if key in loaded and key in fresh and loaded[key].shape[axis] <= fresh[key].shape[axis]:
      rows = fresh[key].shape[axis]
      loaded[key] = loaded[key].replace(grow_vocab(loaded[key].get_value(), rows, axis, added))
  extra = sorted(set(loaded) - set(fresh))
  clash = [k for k in loaded.keys() & fresh.keys()
           if (loaded[k].shape, loaded[k].dtype) != (fresh[k].shape, fresh[k].dtype)]
  if extra or clash:
    raise ValueError(f"init_from={cfg.init_from!r} holds parameters of other shapes than "
                     f"model config {cfg.model} (unknown: {extra[:3]}, other shapes: "
                     f"{sorted(clash)[:3]})")
  merged = {k: v.replace(jax.device_put(loaded[k].get_value(), v.get_value().sharding))
            if k in loaded else v for k, v in fresh.items()}
  return graphdef, nnx.from_flat_state(merged)


def load_trained(workdir: str | os.PathLike, step: int | None = None, *,
                 run: RunControl | None = None, mesh=None, axis_rules=None):
  """(model, tokenizer, train_cfg) with the params of the latest (or given) checkpoint, the
  model computed as `run` says: by default `RunControl()`, "auto" resolved for the device that
  runs it, not the training run's `train_cfg.run` (which may name a kernel only the training
  device has; pass `run=train_cfg.run` for it, or set `model.run = ...` later), restored
  straight onto `mesh` (any shape, whatever mesh trained it) when given: a `jax.sharding.Mesh`
  with Explicit or Auto axes whose own axis names `axis_rules` maps, e.g. `{"tensor":
  "model"}` (see `sharding.resolve_mesh`; the params then live on the equivalent Auto (data,
  fsdp, tensor) mesh over the same devices).

  The params files are verified against the step's checksums first: a file that differs is a
  `ChecksumError` naming it (no fallback here: resuming a run falls back, loading does not);
  a checkpoint saved without checksums loads with a `ChecksumWarning`."""
  mesh = sharding.resolve_mesh(mesh, axis_rules)
  workdir = as_path(workdir)
  if not workdir.is_dir():
    raise FileNotFoundError(f"training workdir {str(workdir)!r} not found")
  for name in (CONFIG, TOKENIZER):
    if not (workdir / name).is_file():
      raise FileNotFoundError(f"{str(workdir / name)!r} not found: {str(workdir)!r} is not a "
                              "paraflax training workdir")
  cfg = read_config(workdir / CONFIG)
  tokenizer = Tokenizer.load(workdir / TOKENIZER)
  steps, ckpt = [], None
  if (workdir / CHECKPOINTS).is_dir():
    ckpt = Checkpoints(workdir, create=False)
    steps = list(ckpt.all_steps())
  if not steps or (step is not None and step not in steps):
    if ckpt is not None:
      ckpt.close()
    what = "no checkpoint" if not steps else f"no checkpoint of step {step} (saved: {steps})"
    raise FileNotFoundError(f"{what} in {str(workdir / CHECKPOINTS)!r}")
  step = max(steps) if step is None else step
  run = RunControl() if run is None else run
  graphdef, params_like = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), run=run)), nnx.Param)
  if mesh is not None:
    params_like = sharding.abstract_state(params_like, mesh)
  try:
    params = ckpt.restore_params(step, params_like)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, params), tokenizer, cfg
