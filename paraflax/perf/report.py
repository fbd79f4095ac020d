"""The JSON file a perf run writes as it measures (and its markdown tables): rewritten after
every row, so a run cut short keeps what it measured; a later run on the same device kind
merges into it, its rows replacing the earlier rows of the same setting (`rows.SETTING`)."""

from __future__ import annotations

import time
from pathlib import Path

from paraflax.json_io import write_atomic, write_json
from paraflax.perf.rows import COMMON, check, environment, read_rows, setting
from paraflax.perf.tables import render


class Report:
  """The rows of one run, written to `json_path` (and rendered to `md_path`) after each `add`.
  Rows already in `json_path` are kept unless this run measures their setting again; a file
  of another device kind is refused (name another file)."""

  def __init__(self, json_path=None, md_path=None, command: str = "", env: dict | None = None):
    self.json_path, self.md_path = json_path and Path(json_path), md_path and Path(md_path)
    self.env = env or environment()
    self.base = {**self.env, "command": command,
                 "utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    self.rows = []
    if self.json_path and self.json_path.exists():
      self.rows = read_rows(self.json_path)
      other = {r["device"] for r in self.rows} - {self.env["device"]}
      if other:
        raise ValueError(f"{self.json_path} holds rows of {', '.join(sorted(other))}, not of "
                         f"this {self.env['device']}: write this run to another --json file")

  def add(self, row: dict) -> dict:
    """`row` with the device fields, command and time, kept (replacing an earlier row of the
    same setting) and written."""
    row = check({**self.base, **row})
    row = {k: row[k] for k in COMMON} | row  # the common fields first, for a reader
    self.rows = [r for r in self.rows if setting(r) != setting(row)] + [row]
    self.write()
    return row

  def write(self) -> None:
    if self.json_path:
      self.json_path.parent.mkdir(parents=True, exist_ok=True)
      write_json(self.json_path, self.rows)
    if self.md_path:
      self.md_path.parent.mkdir(parents=True, exist_ok=True)
      write_atomic(self.md_path, render(self.rows))
