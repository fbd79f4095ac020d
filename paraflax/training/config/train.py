"""Training configuration: frozen dataclasses, JSON round trip (schema-versioned), config files.

A config file is a Python file exposing `get_config() -> TrainConfig`; the shipped ones are
recipes (`paraflax/recipes/`), loaded by name: `load_config("tiny_ar")`.
Variants: `dataclasses.replace`, or `apply_overrides(cfg, {"optim.peak_lr": 1e-3})`
(`overrides.py`). A config names its objective and its data source by their registered names
(`objectives/protocol.py`, `data/source.py`) and imports no method.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

from paraflax.data.pipeline import DataConfig
from paraflax.data.source import DataSource, as_pairs, get_source, source_args
from paraflax.json_io import read_json_object
from paraflax.model.config import MOVED, ModelConfig
from paraflax.model.run import FIELDS as RUN_FIELDS
from paraflax.model.run import RunControl
from paraflax.parallel.sharding import MeshConfig
from paraflax.paths import resolve_path
from paraflax.training.config import fields
from paraflax.training.config.overrides import LEGACY_SOURCES, apply_overrides
from paraflax.training.config.recipes import config_file
from paraflax.training.objectives.protocol import STEP, objective

VOCAB_MISMATCH = "vocab mismatch between tokenizer and model"
# of `to_dict`; 1: a store was a field of its own (`trajectories` or `teacher`); 2: run control
# was part of the model (`model.remat`, ...)
SCHEMA = 3


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup, cosine decay to `end_lr_fraction * peak_lr`, global-norm clip."""

  peak_lr: float = 3e-3
  warmup_steps: int = 100
  total_steps: int | None = None  # decay horizon; None: TrainConfig.steps
  end_lr_fraction: float = 0.1
  weight_decay: float = 0.1  # on matrices only (ndim >= 2), not norms or biases
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip_norm: float | None = 1.0  # None: no clipping

  def __post_init__(self):
    if not self.peak_lr > 0:
      raise ValueError(f"optim.peak_lr must be > 0, got {self.peak_lr}")
    if self.warmup_steps < 0:
      raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
    if self.total_steps is not None and self.total_steps < 1:
      raise ValueError(f"optim.total_steps must be >= 1 or None, got {self.total_steps}")
    if not 0.0 <= self.end_lr_fraction <= 1.0:
      raise ValueError(f"optim.end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}")
    if self.weight_decay < 0:
      raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
    if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
      raise ValueError(f"optim.grad_clip_norm must be > 0 or None, got {self.grad_clip_norm}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run: model, data, optimiser, loop cadence, objective and data source.

  `steps` is the run length; `max_steps` of `train` may stop earlier without changing
  the learning-rate schedule. `objective` names a registered `objectives.Objective`;
  `objective_args` are keyword arguments for its loss (a mapping, stored as sorted pairs so
  the config stays hashable; values must be JSON-serialisable). `data_source` names a
  registered `DataSource` (`data/source.py`): "stdlib" (the corpus rows `data` describes),
  "jsonl" (the records of a JSON Lines file), "trajectories" (a Jacobi trajectory store),
  "teacher" (a DEER teacher store); its `data_source_args` (stored as sorted pairs, defaults
  included; an argument named `path` is a file or directory, saved resolved) are its fields,
  e.g. `{"path": "runs/store"}`, and `data` gives batch_size and seed (and the text settings
  "stdlib" and "jsonl" read). The source's rows must carry the batch fields the objective
  reads.
  `init_from` continues from another run's weights (same model config; Jacobi Forcing, TiDAR
  continual pretraining) or a Hugging Face checkpoint's (`paths.is_hf_dir`); the data's
  tokenizer must be its tokenizer (plus the method tokens `data.mask_token` / `sep_token`, whose
  rows the embedding gains: `workdir.initial_params`). `train --hf` sets it (`from_hf.py`).
  `mesh`: None trains on one device; a `MeshConfig` (or `(data, fsdp, tensor)` sizes, -1 for
  the rest, or a mapping such as `{"data": 2, "model": 4, "axis_rules": {"tensor": "model"}}`)
  shards params, optimizer state and batches over a device mesh (`sharding.py`).
  `grad_accum`: the step sums the gradients of that many micro-batches of `data.batch_size /
  grad_accum` rows (`run/accumulate.py`), equal to the whole batch at once: memory of a
  micro-batch, the update of the batch (run control).
  `run`: how the model is computed (`RunControl`: attention, remat, scanned layers, loss
  chunks); like `mesh` and `grad_accum`, a resumed run may change it.
  """

  model: ModelConfig
  data: DataConfig
  optim: OptimConfig = OptimConfig()
  steps: int = 1000
  eval_every: int = 100
  eval_batches: int | None = 16  # None: the whole validation split
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  seed: int = 0
  log_every: int = 10
  objective: str = "ar"
  objective_args: Any = ()  # Mapping[str, Any] or pairs -> tuple[tuple[str, Any], ...]
  data_source: str = "stdlib"
  data_source_args: Any = ()  # Mapping[str, Any] or pairs -> sorted pairs, defaults included
  mesh: MeshConfig | None = None  # also (data, fsdp, tensor) sizes or a mapping -> MeshConfig
  init_from: str | None = None  # a training workdir or HF directory whose params start the run
  grad_accum: int = 1  # micro-batches per step (divides data.batch_size)
  run: RunControl = RunControl()

  def __post_init__(self):
    if self.mesh is not None:
      object.__setattr__(self, "mesh", _mesh(self.mesh))
    for name in ("objective_args", "data_source_args"):
      object.__setattr__(self, name, as_pairs(getattr(self, name)))
    fields.check_fields(self)  # types first: the checks below compare numbers
    for name in ("steps", "eval_every", "checkpoint_every", "keep_checkpoints", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.grad_accum < 1 or self.data.batch_size % self.grad_accum:
      raise ValueError(f"TrainConfig.grad_accum must be >= 1 and divide data.batch_size="
                       f"{self.data.batch_size}, got {self.grad_accum}")
    if self.eval_batches is not None and self.eval_batches < 1:
      raise ValueError(f"TrainConfig.eval_batches must be >= 1 or None, got {self.eval_batches}")
    if not 0 <= self.seed < 2**31:
      raise ValueError(f"TrainConfig.seed must be in [0, 2**31), got {self.seed}")
    if self.data.seq_len > self.model.max_seq_len:
      raise ValueError(f"sequence length data.seq_len={self.data.seq_len} is above the model's "
                       f"max_seq_len={self.model.max_seq_len}: lower seq_len or raise "
                       "model.max_seq_len")
    if self.data.tokenizer is None and self.data.vocab_size > self.model.vocab_size:
      # with data.tokenizer, data.vocab_size is unused: the trainer checks the tokenizer itself
      raise ValueError(f"{VOCAB_MISMATCH}: data.vocab_size={self.data.vocab_size} (tokenizer) > "
                       f"model.vocab_size={self.model.vocab_size}")
    source = get_source(self.data_source, self.data_source_args)
    fields.check_fields(source, "data_source_args.")
    object.__setattr__(self, "data_source_args", source_args(source))
    obj = objective(self.objective)
    obj.check_args(self.objective_args)
    missing = sorted(set(obj.fields) - {STEP} - set(source.fields))
    if missing:
      raise ValueError(f"objective {self.objective!r} reads batch fields {missing} that data "
                       f"source {self.data_source!r} does not give: it trains on data source "
                       f"{obj.source!r} (set data_source and data_source_args)")

  @property
  def source(self) -> DataSource:
    """The data source: `data_source` built with `data_source_args`."""
    return get_source(self.data_source, self.data_source_args)

  def with_row_args(self, missing_ok: bool = False) -> TrainConfig:
    """This config with the objective arguments its data source's rows fix (the optional
    `DataSource.objective_args`: a store's max_prompt_len, Jacobi Forcing's and DEER Stage
    I's `prompt_len`) set (`with_fixed_args`). With `missing_ok` a source with nothing to read
    yet (a store not collected, for `train --dry-run`) fixes its `stand_in_args`, if any."""
    try:
      return self.with_fixed_args(_call(self.source, "objective_args", self.data))
    except FileNotFoundError:
      if missing_ok:
        return self.with_fixed_args(_call(self.source, "stand_in_args", self.data))
      raise

  def with_fixed_args(self, fixed: Mapping[str, Any]) -> TrainConfig:
    """This config with the objective arguments `fixed` by its rows set, where the objective
    takes them; one set otherwise is refused."""
    args, obj = dict(self.objective_args), objective(self.objective)
    for k, v in fixed.items():
      if k in args and args[k] != v:
        raise ValueError(f"objective_args.{k}={args[k]!r}, but the {self.data_source!r} rows "
                         f"have {k}={v!r}: leave it unset")
      try:
        obj.check_args({**args, k: v})
      except ValueError:  # an objective that does not take it
        continue
      args[k] = v
    return dataclasses.replace(self, objective_args=args)

  @property
  def schedule_steps(self) -> int:
    """The learning-rate schedule's horizon."""
    return self.optim.total_steps if self.optim.total_steps is not None else self.steps

  def check_tokenizer(self, tokenizer) -> None:
    """Raise if the tokenizer's ids do not fit the model's embedding table."""
    if tokenizer.vocab_size > self.model.vocab_size:
      raise ValueError(f"{VOCAB_MISMATCH}: the tokenizer has {tokenizer.vocab_size} ids but "
                       f"model.vocab_size={self.model.vocab_size}")

  def to_dict(self) -> dict:
    """JSON-serialisable nested dict with its `schema` (`from_dict` inverts it)."""
    d = dataclasses.asdict(self)
    for name in ("objective_args", "data_source_args"):
      d[name] = dict(getattr(self, name))
    return {"schema": SCHEMA, **d}

  @classmethod
  def from_dict(cls, d: Mapping) -> TrainConfig:
    """The config of a `to_dict` of this or an older schema (`migrate`), checked by shape
    first: a missing, unknown or mistyped field is one ValueError naming it."""
    d = migrate(d)
    for name, section in (("model", ModelConfig), ("data", DataConfig), ("optim", OptimConfig),
                          ("run", RunControl)):
      if name in d:
        d[name] = _section(section, d[name], f"{name}.")
    return _section(cls, d, "")


def _call(source, method: str, data) -> dict:
  """`source.method(data)` of an optional `DataSource` method; {} without one."""
  fn = getattr(source, method, None)
  return {} if fn is None else fn(data)


def _section(cls, d, prefix: str):
  """`cls(**d)` once every field of `d` is one of `cls`'s, of its type, and none is missing."""
  if not isinstance(d, Mapping):
    raise ValueError(f"field {prefix.rstrip('.')!r} must be an object of {cls.__name__} "
                     f"fields, got {type(d).__name__}")
  known = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - set(known))
  if unknown:
    raise ValueError(f"unknown field {prefix + unknown[0]!r} ({cls.__name__} has no such field)")
  missing = [n for n, f in known.items() if n not in d and f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ValueError(f"missing field {prefix + missing[0]!r}")
  for name, value in d.items():
    fields.check_value(cls, name, value, prefix + name, loose=True)
  return cls(**d)


def read_config(path: str | os.PathLike) -> TrainConfig:
  """The TrainConfig a workdir's config.json holds; a file of another shape is one ValueError
  line naming the file and the field."""
  try:
    return TrainConfig.from_dict(read_json_object(path))
  except (ValueError, TypeError) as e:
    message = str(e)
    raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def migrate(d: Mapping) -> dict:
  """A `to_dict` of any schema as the current one's fields (without `schema`).

  Schema 1 (no `schema` key): `trajectories` and `teacher`, a store each or None, become
  `data_source` + `data_source_args` (neither: "stdlib"). Schemas 1 and 2: the run-control
  fields of `model` (those it has) become `run`.
  """
  if not isinstance(d, Mapping):
    raise ValueError(f"expected a JSON object of TrainConfig fields, got {type(d).__name__}")
  d = dict(d)
  schema = d.pop("schema", 1)
  if not isinstance(schema, int) or isinstance(schema, bool) or not 1 <= schema <= SCHEMA:
    raise ValueError(f"config schema {schema!r} is not one this paraflax reads (1..{SCHEMA}): "
                     "a config written by a newer paraflax?")
  if schema == 1:
    stores = [(k, v) for k in LEGACY_SOURCES if (v := d.pop(k, None)) is not None]
    if len(stores) > 1:
      raise ValueError("TrainConfig takes one data source: trajectories or teacher, not both")
    if stores:
      d["data_source"], d["data_source_args"] = stores[0]
  if schema < 3 and isinstance(d.get("model"), Mapping):
    model = dict(d["model"])
    moved = {k: model.pop(k) for k in MOVED if k in model}
    d["model"] = model
    if moved:
      run = d.get("run") or {}
      d["run"] = {**moved, **run} if isinstance(run, Mapping) else run
  return d


def _mesh(spec) -> MeshConfig:
  if isinstance(spec, (str, bytes)) or not isinstance(spec, (MeshConfig, Mapping, Sequence)):
    raise ValueError(f"config field 'mesh' must be a MeshConfig, (data, fsdp, tensor) sizes or "
                     f"a mapping of them, got {spec!r}")
  try:
    return MeshConfig.of(spec)
  except TypeError as e:
    raise ValueError(f"config field 'mesh': {e}") from None


# Fields that do not change what is trained: they may differ when a run resumes.
RUN_CONTROL = frozenset({"steps", "eval_every", "eval_batches", "checkpoint_every",
                         "keep_checkpoints", "log_every", "data.cache_dir", "data.progress",
                         "mesh", "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.axis_rules",
                         "grad_accum", *(f"run.{name}" for name in RUN_FIELDS)})

# Fields naming directories: compared (and saved) resolved, however they were spelled.
PATH_FIELDS = ("init_from", "data_source_args.path", "data_source_args.paths", "data.tokenizer")


def _get(cfg: TrainConfig, dotted: str):
  obj = cfg
  for name in dotted.split("."):
    if obj is None:
      return None
    obj = dict(obj).get(name) if isinstance(obj, tuple) else getattr(obj, name)  # args: pairs
  return obj


def with_resolved_paths(cfg: TrainConfig) -> TrainConfig:
  """`cfg` with every `PATH_FIELDS` entry that is set resolved (`resolve_path`)."""
  paths = {k: _get(cfg, k) for k in PATH_FIELDS}
  return apply_overrides(cfg, {k: [resolve_path(p) for p in v] if isinstance(v, (list, tuple))
                               else resolve_path(v) for k, v in paths.items() if v})


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping) and k != "objective_args":
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def config_differences(saved: TrainConfig, given: TrainConfig) -> list[str]:
  """Fields (dotted) that change what is trained, as 'field: saved vs given' lines (paths
  compared resolved)."""
  a, b = (_flatten(with_resolved_paths(c).to_dict()) for c in (saved, given))
  a["optim.total_steps"], b["optim.total_steps"] = saved.schedule_steps, given.schedule_steps
  return [f"{k}: {a.get(k)!r} (saved) vs {b.get(k)!r} (given)"
          for k in sorted(set(a) | set(b)) if k not in RUN_CONTROL and a.get(k) != b.get(k)]


def load_config(config: str | os.PathLike) -> TrainConfig:
  """The `get_config()` of a config file, given by path or by recipe name ("tiny_ar",
  "hf/sft": `recipes.py`)."""
  path = config_file(config)
  spec = importlib.util.spec_from_file_location(f"paraflax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {str(path)!r} defines no get_config()")
  cfg = module.get_config()
  if not isinstance(cfg, TrainConfig):
    raise ValueError(f"{path}: get_config() returned {type(cfg).__name__}, expected TrainConfig")
  return cfg
