"""Training configuration: frozen dataclasses, JSON round trip, dotted overrides, config files.

A config file is a Python file exposing `get_config() -> TrainConfig` (see `configs/`).
Variants: `dataclasses.replace`, or `apply_overrides(cfg, {"optim.peak_lr": 1e-3})`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paraflax.config import ModelConfig
from paraflax.data.pipeline import DataConfig
from paraflax.sharding import MeshConfig
from paraflax.training import fields
from paraflax.training.deer import TeacherData
from paraflax.training.jacobi_forcing import TrajectoryData

VOCAB_MISMATCH = "vocab mismatch between tokenizer and model"


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
  """One training run: model, data, optimiser, loop cadence and objective.

  `steps` is the run length; `max_steps` of `train` may stop earlier without changing
  the learning-rate schedule. `objective` names a function in `objectives.OBJECTIVES`;
  `objective_args` are keyword arguments for it (a mapping, stored as sorted pairs so the
  config stays hashable; values must be JSON-serialisable).
  `init_from` continues from another run's weights (same model config; Jacobi Forcing, TiDAR
  continual pretraining). `trajectories` swaps the stdlib rows for packed Jacobi Forcing rows
  (`jacobi_forcing.TrajectoryData`; then `data` gives only batch_size and seed). `teacher`
  trains on raw prompt + answer rows of a DEER teacher store (`deer.TeacherData`; the same).
  `mesh`: None trains on one device; a `MeshConfig` (or `(data, fsdp, tensor)` sizes, -1 for
  the rest, or a mapping such as `{"data": 2, "model": 4, "axis_rules": {"tensor": "model"}}`)
  shards params, optimizer state and batches over a device mesh (`sharding.py`).
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
  mesh: MeshConfig | None = None  # also (data, fsdp, tensor) sizes or a mapping -> MeshConfig
  init_from: str | None = None  # a training workdir whose latest params start this run
  trajectories: TrajectoryData | None = None  # train on a Jacobi trajectory store instead
  teacher: TeacherData | None = None  # train on a DEER teacher store instead

  def __post_init__(self):
    for name, cls in (("trajectories", TrajectoryData), ("teacher", TeacherData)):
      value = getattr(self, name)
      if isinstance(value, Mapping):  # from JSON or an override
        object.__setattr__(self, name, _build(cls, value, name))
    if self.mesh is not None:
      object.__setattr__(self, "mesh", _mesh(self.mesh))
    args = self.objective_args
    pairs = tuple(sorted((dict(args) if not isinstance(args, Mapping) else args).items()))
    object.__setattr__(self, "objective_args", pairs)
    fields.check_fields(self)  # types first: the checks below compare numbers
    for name in ("steps", "eval_every", "checkpoint_every", "keep_checkpoints", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.eval_batches is not None and self.eval_batches < 1:
      raise ValueError(f"TrainConfig.eval_batches must be >= 1 or None, got {self.eval_batches}")
    if not 0 <= self.seed < 2**31:
      raise ValueError(f"TrainConfig.seed must be in [0, 2**31), got {self.seed}")
    if self.trajectories is not None and self.teacher is not None:
      raise ValueError("TrainConfig takes one data source: trajectories or teacher, not both")
    if self.data.seq_len > self.model.max_seq_len:
      raise ValueError(f"sequence length data.seq_len={self.data.seq_len} is above the model's "
                       f"max_seq_len={self.model.max_seq_len}: lower seq_len or raise "
                       "model.max_seq_len")
    if self.data.vocab_size > self.model.vocab_size:
      raise ValueError(f"{VOCAB_MISMATCH}: data.vocab_size={self.data.vocab_size} (tokenizer) > "
                       f"model.vocab_size={self.model.vocab_size}")
    from paraflax.training.objectives import OBJECTIVES  # registry filled at import
    if self.objective not in OBJECTIVES:
      raise ValueError(f"unknown objective {self.objective!r}; registered: {sorted(OBJECTIVES)}")

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
    """JSON-serialisable nested dict (`from_dict` inverts it)."""
    d = dataclasses.asdict(self)
    d["objective_args"] = dict(self.objective_args)
    return d

  @classmethod
  def from_dict(cls, d: Mapping) -> TrainConfig:
    d = dict(d)
    return cls(model=ModelConfig(**d.pop("model")), data=DataConfig(**d.pop("data")),
               optim=OptimConfig(**d.pop("optim")), **d)


def _build(cls, value: Mapping, name: str):
  try:
    return cls(**value)
  except TypeError as e:  # an unknown or missing field
    raise ValueError(f"config field {name!r}: {e}") from None


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
                         "mesh", "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.axis_rules"})

# Fields naming directories: compared (and saved) resolved, however they were spelled.
PATH_FIELDS = ("init_from", "trajectories.path", "teacher.path")


def resolve_path(path: str) -> str:
  """`path` absolute, without `~`, `..`, symlinks or a trailing `/`."""
  return str(Path(path).expanduser().resolve())


def with_resolved_paths(cfg: TrainConfig) -> TrainConfig:
  """`cfg` with every `PATH_FIELDS` entry that is set resolved (`resolve_path`)."""
  def get(dotted):
    obj = cfg
    for name in dotted.split("."):
      obj = None if obj is None else getattr(obj, name)
    return obj
  paths = {k: get(k) for k in PATH_FIELDS}
  return apply_overrides(cfg, {k: resolve_path(v) for k, v in paths.items() if v is not None})


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


def _parse(value: Any, annotation) -> Any:
  """An override's value: a Python literal when the string is one ("1e-3", "None", "(1, 2)");
  for a string field, the string itself unless it is a quoted string or None; for a float
  field, an int as a float."""
  if not isinstance(value, str):
    return value
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value  # a bare string such as a path
  kinds = fields.options(annotation)
  if str in kinds and not isinstance(parsed, str):
    return None if parsed is None and type(None) in kinds else value
  if float in kinds and type(parsed) is int:
    return float(parsed)
  return parsed


@dataclasses.dataclass(frozen=True)
class _Set:
  value: Any


def apply_overrides(cfg, overrides: Mapping[str, Any] | None):
  """`cfg` with dotted overrides: `{"data.cache_dir": "/tmp/c", "steps": "50"}`.

  String values are parsed as Python literals when they are one ("1e-3", "None", "(1, 2)").
  Each value is type-checked against its field's annotation, then all of them are applied
  together: each config is rebuilt once, so its checks see every override at once (their
  order does not matter) and run once. Errors are one-line ValueErrors naming the field.
  """
  tree: dict[str, Any] = {}
  for key, value in (overrides or {}).items():
    obj, node, names = cfg, tree, key.split(".")
    for i, name in enumerate(names):
      known = {f.name for f in dataclasses.fields(obj)}
      if name not in known:
        raise ValueError(f"unknown config field {key!r}: {type(obj).__name__} has {sorted(known)}")
      if i == len(names) - 1:
        if isinstance(node.get(name), dict):
          raise ValueError(f"config field {key!r} is set both whole and by its fields")
        value = _parse(value, fields.field_types(type(obj))[name])
        fields.check_value(type(obj), name, value, key, loose=True)
        node[name] = _Set(value)
        break
      if isinstance(node.get(name), _Set):
        raise ValueError(f"config field {'.'.join(names[:i + 1])!r} is set both whole and by "
                         "its fields")
      obj = getattr(obj, name)
      if not dataclasses.is_dataclass(obj):
        raise ValueError(f"cannot set {key!r}: {'.'.join(names[:i + 1])} is {obj!r}, not a "
                         "config; set it whole")
      node = node.setdefault(name, {})
  return _rebuild(cfg, tree)


def _rebuild(obj, tree: Mapping[str, Any]):
  changes = {k: v.value if isinstance(v, _Set) else _rebuild(getattr(obj, k), v)
             for k, v in tree.items()}
  return dataclasses.replace(obj, **changes) if changes else obj


def load_config(path: str | os.PathLike) -> TrainConfig:
  """Import a config file by path and return its `get_config()`."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"config file {str(path)!r} not found")
  spec = importlib.util.spec_from_file_location(f"paraflax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {str(path)!r} defines no get_config()")
  cfg = module.get_config()
  if not isinstance(cfg, TrainConfig):
    raise ValueError(f"{path}: get_config() returned {type(cfg).__name__}, expected TrainConfig")
  return cfg
