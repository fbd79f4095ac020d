"""Pages whose tables are rendered from perf JSON files (`update_page`). A region

    <!-- perf: h100-2026-11-24.json decode -->
    ...
    <!-- /perf -->

holds the tables of that file's rows (of the kinds named after it; all when none), and

    <!-- fit: h200.json,h200-calibration.json ../gpu/h200-2026-11-26.json -->
    ...
    <!-- /fit -->

the compile rows of the first files (comma-separated) beside the measured rows of the same
programs in the last, and the fit of milliseconds to kernels and bytes (`compile/calibrate.py`); files
named relative to the page."""

from __future__ import annotations

import re
from pathlib import Path

from paraflax.perf.compile import calibrate
from paraflax.perf.rows import read_rows
from paraflax.perf.tables import render

REGION = re.compile(r"(<!-- perf: (\S+)((?: \w+)*) -->\n)(.*?)(<!-- /perf -->)", re.DOTALL)
FIT = re.compile(r"(<!-- fit: (\S+) (\S+) -->\n)(.*?)(<!-- /fit -->)", re.DOTALL)


def update_page(text: str, folder: Path) -> str:
  """`text` with each region's tables rendered again from its files under `folder`."""
  def region(m):
    kinds = m.group(3).split()
    rows = [r for r in read_rows(folder / m.group(2)) if not kinds or r["kind"] in kinds]
    return m.group(1) + "\n" + render(rows) + "\n" + m.group(5)

  def fit(m):
    compiled = [r for name in m.group(2).split(",") for r in read_rows(folder / name)]
    pairs = calibrate.pairs(compiled, read_rows(folder / m.group(3)))
    return m.group(1) + "\n" + calibrate.render(pairs) + "\n\n" + m.group(5)
  return FIT.sub(fit, REGION.sub(region, text))
