"""A training workdir: its files, what a run checks before training there (a resumed run's
config and tokenizer, `init_from`'s tokenizer) and `load_trained`, which reads it back.

    config.json     the TrainConfig (`TrainConfig.from_dict` reads it back)
    tokenizer.json  the tokenizer the data was encoded with
    checkpoints/    params + optimizer state + data-iterator state per saved step
"""

from __future__ import annotations

import os
from etils import epath
from flax import nnx

from paraflax import sharding
from paraflax.data.tokenizer import Tokenizer
from paraflax.json_io import read_json
from paraflax.paths import as_path
from paraflax.model import Transformer
from paraflax.training.checkpoint import CHECKPOINTS, Checkpoints
from paraflax.training.config import TrainConfig, config_differences
from paraflax.training.step import init_params

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"


def check_workdir(cfg: TrainConfig, workdir: epath.Path, tokenizer: Tokenizer) -> None:
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


def check_init_from(cfg: TrainConfig, tokenizer: Tokenizer, tokenizer_source: str) -> None:
  """Refuse `init_from` weights learnt on other token ids than this run's data."""
  if cfg.init_from is None:
    return
  file = as_path(cfg.init_from) / TOKENIZER
  if not file.is_file():
    raise FileNotFoundError(f"init_from={cfg.init_from!r}: {str(file)!r} not found (not a "
                            "training workdir or `paraflax convert` output)")
  theirs = Tokenizer.load(file)
  if theirs.fingerprint() != tokenizer.fingerprint():
    raise ValueError(
        f"tokenizer mismatch: init_from's weights were trained with {str(file)!r} (vocab "
        f"{theirs.vocab_size}, fingerprint {theirs.fingerprint()[:12]}) but this run's data is "
        f"tokenized with {tokenizer_source} (vocab {tokenizer.vocab_size}, fingerprint "
        f"{tokenizer.fingerprint()[:12]}); train on data made with init_from's tokenizer "
        "(e.g. a store collected from it) or drop init_from")


def initial_params(cfg: TrainConfig, mesh):
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
  workdir = as_path(workdir)
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
