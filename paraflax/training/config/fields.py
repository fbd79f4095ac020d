"""Config values checked against their dataclass annotations, with one clear line each.

ints refuse floats, bools and strings; floats take ints; bools take only bools; `X | None`
takes None; a nested config takes an instance of its class (and, with `loose=True`, i.e. an
override not yet converted by its parent, a mapping or a sequence of its fields); `Any` and
annotations not listed here take anything.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np


@functools.cache
def field_types(cls) -> dict[str, Any]:
  """{field name: resolved annotation} of a dataclass type."""
  return typing.get_type_hints(cls)


def options(annotation) -> tuple:
  """The members of a union (`int | None` -> (int, NoneType)), or the annotation alone."""
  if typing.get_origin(annotation) in (typing.Union, types.UnionType):
    return typing.get_args(annotation)
  return (annotation,)


def _fits(value, ann, loose: bool) -> bool:
  if ann is Any:
    return True
  if ann is type(None):
    return value is None
  if ann is bool:
    return isinstance(value, (bool, np.bool_))
  if ann is int:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
  if ann is float:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
  if ann is str:
    return isinstance(value, str)
  if isinstance(ann, type) and dataclasses.is_dataclass(ann):
    return isinstance(value, ann) or (loose and isinstance(value, (Mapping, list, tuple)))
  return True  # not checked here


_NAMES = {int: "an int", float: "a number", bool: "True or False", str: "a string",
          type(None): "None"}


def _expected(annotation, loose: bool) -> str:
  def one(a):
    if a in _NAMES:
      return _NAMES[a]
    if isinstance(a, type) and dataclasses.is_dataclass(a) and loose:
      return f"a {a.__name__} (or its fields, as a mapping or a sequence)"
    return f"a {getattr(a, '__name__', a)}"
  return " or ".join(one(a) for a in options(annotation))


def check_value(cls, name: str, value, where: str, *, loose: bool = False) -> None:
  """Raise ValueError unless `value` fits the annotation of field `name` of dataclass `cls`
  (`where`: the dotted name the message shows)."""
  annotation = field_types(cls)[name]
  if not any(_fits(value, a, loose) for a in options(annotation)):
    raise ValueError(f"config field {where!r} must be {_expected(annotation, loose)}, "
                     f"got {value!r} ({type(value).__name__})")


def check_fields(obj, prefix: str = "") -> None:
  """`check_value` on every field of a config dataclass instance, nested configs included."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    check_value(type(obj), f.name, value, prefix + f.name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      check_fields(value, f"{prefix}{f.name}.")
