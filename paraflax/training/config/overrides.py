"""Dotted overrides of a config, what `--set NAME=VALUE` does:
`apply_overrides(cfg, {"optim.peak_lr": "1e-3", "data_source_args.path": "runs/store"})`.

An objective's or a data source's arguments are set one by one as `objective_args.NAME` /
`data_source_args.NAME` (a data source's are type-checked against its fields), or whole. When
the overrides change `objective` or `data_source`, the old one's arguments are dropped unless
they are set too. Schema-1 keys (`trajectories.path`, `teacher.val_fraction`, `teacher={...}`,
fields of their own before data sources were registered) and schema-2 run-control keys
(`model.remat`, now `run.remat`) still work, with a DeprecationWarning.
"""

from __future__ import annotations

import ast
import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from paraflax.data.source import source_class
from paraflax.model.config import MOVED
from paraflax.training.config import fields

ARGS = {"objective_args": "objective", "data_source_args": "data_source"}  # args -> their name
LEGACY_SOURCES = ("trajectories", "teacher")  # schema-1 fields, now data sources of that name


BOOLS = {"true": True, "yes": True, "false": False, "no": False}


def parse(value: Any, annotation) -> Any:
  """An override's value: a Python literal when the string is one ("1e-3", "None", "(1, 2)");
  for a field that takes a bool (`bool`, `bool | str`), also true/false/yes/no in any case;
  for a string field, the string itself unless it is a quoted string or None; for a float
  field, an int as a float."""
  if not isinstance(value, str):
    return value
  kinds = fields.options(annotation)
  if bool in kinds and value.strip().lower() in BOOLS:
    return BOOLS[value.strip().lower()]
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value  # a bare string such as a path
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
  overrides = _legacy(cfg, _moved_run_control(cfg, dict(overrides or {})))
  tree: dict[str, Any] = {}
  for key, value in overrides.items():
    obj, node, names = cfg, tree, key.split(".")
    for i, name in enumerate(names):
      known = {f.name for f in dataclasses.fields(obj)}
      if name not in known:
        raise ValueError(f"unknown config field {key!r}: {type(obj).__name__} has {sorted(known)}")
      if i == len(names) - 1:
        if isinstance(node.get(name), dict):
          raise ValueError(f"config field {key!r} is set both whole and by its fields")
        value = parse(value, fields.field_types(type(obj))[name])
        fields.check_value(type(obj), name, value, key, loose=True)
        node[name] = _Set(value)
        break
      if isinstance(node.get(name), _Set):
        raise ValueError(f"config field {'.'.join(names[:i + 1])!r} is set both whole and by "
                         "its fields")
      if name in ARGS and i == len(names) - 2:  # one argument: `data_source_args.path`
        node.setdefault(name, {})[names[-1]] = _Set(_argument(obj, overrides, name, names[-1],
                                                              value, key))
        break
      obj = getattr(obj, name)
      if not dataclasses.is_dataclass(obj):
        raise ValueError(f"cannot set {key!r}: {'.'.join(names[:i + 1])} is {obj!r}, not a "
                         "config; set it whole")
      node = node.setdefault(name, {})
  return _rebuild(cfg, tree)


def _argument(cfg, overrides: Mapping, args: str, name: str, value, key: str):
  """The parsed, checked value of argument `name` of `args` ("data_source_args": typed by the
  source's fields; "objective_args": any literal)."""
  if args != "data_source_args":
    return parse(value, Any)
  source = parse(overrides.get("data_source", cfg.data_source), str)
  cls = source_class(source)
  known = [f.name for f in dataclasses.fields(cls)]
  if name not in known:
    raise ValueError(f"unknown config field {key!r}: data source {source!r} takes {known}")
  value = parse(value, fields.field_types(cls)[name])
  fields.check_value(cls, name, value, key)
  return value


def _rebuild(obj, tree: Mapping[str, Any]):
  changes = {k: v.value if isinstance(v, _Set) else _rebuild(getattr(obj, k), v)
             for k, v in tree.items() if not (k in ARGS and isinstance(v, dict))}
  for k, name in ARGS.items():
    renamed = name in changes and changes[name] != getattr(obj, name)
    if isinstance(tree.get(k), dict):  # set one by one: onto those of the same objective/source
      kept = {} if renamed else dict(getattr(obj, k))
      changes[k] = {**kept, **{arg: s.value for arg, s in tree[k].items()}}
    elif renamed and k not in changes:  # a new one starts without the old one's arguments
      changes[k] = {}
  return dataclasses.replace(obj, **changes) if changes else obj


def _moved_run_control(cfg, overrides: dict) -> dict:
  """Schema-2 keys of run control as its own (`model.remat` -> `run.remat`)."""
  out = {}
  for key, value in overrides.items():
    head, _, name = key.partition(".")
    if head == "model" and name in MOVED and hasattr(cfg, "run"):
      warnings.warn(f"config field {key!r} is now 'run.{name}'", DeprecationWarning,
                    stacklevel=3)
      key = f"run.{name}"
      if key in overrides:
        raise ValueError(f"config field {key!r} is set twice: as {key!r} and as 'model.{name}'")
    out[key] = value
  return out


def _legacy(cfg, overrides: dict) -> dict:
  """Schema-1 keys as data-source overrides (`teacher.path` -> `data_source_args.path`)."""
  if not any(k.partition(".")[0] in LEGACY_SOURCES for k in overrides) or not hasattr(
      cfg, "data_source"):
    return overrides
  source = parse(overrides.get("data_source", cfg.data_source), str)
  out = {}
  for key, value in overrides.items():
    head, dot, rest = key.partition(".")
    if head not in LEGACY_SOURCES:
      out[key] = value
      continue
    new = f"data_source_args.{rest}" if dot else f"data_source={head!r} and data_source_args"
    warnings.warn(f"config field {key!r} is now {new}", DeprecationWarning, stacklevel=3)
    if dot and source != head:
      raise ValueError(f"cannot set {key!r}: this config's data_source is {source!r}, not "
                       f"{head!r}; set data_source={head} and data_source_args.{rest}")
    if dot:
      out[f"data_source_args.{rest}"] = value
    elif parse(value, Any) is not None:
      out["data_source"], out["data_source_args"] = head, parse(value, Any)
    elif source == head:  # `teacher=None`: back to the corpus
      out["data_source"], out["data_source_args"] = "stdlib", {}
  return out
