"""Perf rows: the fields every row carries, each kind's own, and reading a run's file.

A row is one measurement, a flat JSON object. Every row has `kind` (`KINDS`), `device`
(`jax.devices()[0].device_kind`), `backend`, `jax`, `shape`, `dtype`, the `command` that
measured it and when (`utc`); `REQUIRED[kind]` names the fields of its kind. A run's file is a
JSON list of rows (`report.Report` writes it); rows equal in their `setting` are the same
measurement.
"""

from __future__ import annotations

import os

from paraflax.json_io import read_json

KINDS = ("numerics", "slots", "decode", "train", "family", "compile", "calibration")
COMMON = ("kind", "device", "backend", "jax", "shape", "dtype")
REQUIRED = {
    # a check of a device's numerics against a reference (`perf numerics`): `ok` if it held
    "numerics": ("check", "ok"),
    "slots": ("cache_len", "batch", "slots", "mask", "forward_ms", "vs_one_slot"),
    "decode": ("decoder", "batch", "new_tokens", "ms_per_step", "tokens_per_forward",
               "tokens_per_s", "exact_vs_ar"),
    "train": ("objective", "batch", "seq_len", "step_s", "tokens_per_s", "flops_per_token", "mfu",
              "attention", "remat", "scan_layers"),
    "family": (),  # a trained stage (`stage`) or a bench row (`method`)
    # compiled for a target, never run (`perf compile`): `device` is the target's kind
    "compile": ("compiled_only", "target", "program", "batch", "defaults", "run_control",
                "kernels_per_step", "kernel_mix", "host_syncs_per_step", "memory",
                "bytes_per_step", "flops_per_step", "compile_s"),
    # a measured program beside its compile row (`perf calibrate`)
    "calibration": ("program", "batch", "measured_kernels", "compiled_kernels",
                    "ms_per_kernel", "compiled_jax"),
}
# the fields that say what a row measured: rows equal in these (and in `kind`, `shape`,
# `dtype`) are the same measurement, and a later one replaces the earlier
SETTING = {
    "numerics": ("check", "objective", "decoder", "settings", "batch", "seq_len", "layers",
                 "attention", "new_tokens"),
    "slots": ("cache_len", "batch", "slots", "mask", "attention"),
    "decode": ("decoder", "settings", "batch", "prompt_len", "new_tokens", "loop", "xla_flags"),
    "train": ("objective", "batch", "seq_len", "attention", "remat", "scan_layers", "variant"),
    "family": ("stage", "method", "weights"),
    "compile": ("target", "program", "objective", "decoder", "settings", "batch", "seq_len",
                "cache_len", "defaults", "run_control", "layers"),
    "calibration": ("program", "objective", "decoder", "batch", "compiled_target"),
}


def environment() -> dict:
  """The device fields of a row measured in this process."""
  import jax
  return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "jax": jax.__version__}


def setting(row: dict) -> tuple:
  return (row["kind"], row["shape"], row["dtype"], *(row.get(k) for k in SETTING[row["kind"]]))


def check(row: dict) -> dict:
  """`row` if it has its kind's fields, else a ValueError naming what is missing."""
  if row.get("kind") not in KINDS:
    raise ValueError(f"a perf row's kind is one of {KINDS}, got {row.get('kind')!r}")
  missing = [k for k in COMMON + REQUIRED[row["kind"]] if k not in row]
  if missing:
    raise ValueError(f"a {row['kind']} row lacks {', '.join(missing)}: {row}")
  return row


def read_rows(path: str | os.PathLike) -> list[dict]:
  """The rows of a perf JSON file, each checked; one ValueError line naming the file when it
  is not one."""
  rows = read_json(path)
  if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
    raise ValueError(f"{path}: not a perf file (a JSON list of rows)")
  try:
    return [check(r) for r in rows]
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
