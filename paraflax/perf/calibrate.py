"""`paraflax perf calibrate`: each program measured on a device beside its compile row.

A train row with a trace (`perf train --profile`) gives the kernels one step ran; a decode row
with a trace (`perf decode --profile`) gives the kernels per decode step (its call's kernels,
prefill included, over its steps). Each is set beside the newest compile row of the same
program at the defaults (`perf compile`, the same objective or decoder and batch): measured
and compiled kernels, their ratio, and the measured milliseconds per kernel. The rows carry
both JAX versions: the device's (`jax`) and the compile's (`compiled_jax`).
"""

from __future__ import annotations

import dataclasses

from paraflax.perf.rows import read_rows


@dataclasses.dataclass(frozen=True)
class CalibratePlan:
  measured: str = ""  # a perf JSON file of a device (train / decode rows with traces)
  compiled: str = "docs/compile/h200.json"  # its target's compile rows


def measured_kernels(row: dict) -> tuple[str, float, float] | None:
  """(program, kernels per step, ms per step) of a measured row with a trace, else None."""
  events = (row.get("trace") or {}).get("device_events")
  if not events:
    return None
  if row["kind"] == "train":
    return "train", float(events), 1e3 * row["step_s"]
  if row["kind"] == "decode" and row.get("kernels_per_step"):
    return "decode", row["kernels_per_step"], row["ms_per_step"]
  return None


def compile_row(compiled: list[dict], program: str, row: dict) -> dict | None:
  """The newest compile row of `program` at the defaults for `row`'s objective or decoder,
  shape and batch."""
  name = row.get("objective") or row.get("decoder")
  same = [c for c in compiled if c["program"] == program and c["defaults"]
          and (c.get("objective") or c.get("decoder")) == name and c["shape"] == row["shape"]
          and c["batch"] == row["batch"]]
  return max(same, key=lambda c: c.get("utc", ""), default=None)


def calibration_rows(measured: list[dict], compiled: list[dict]) -> list[dict]:
  """One calibration row per measured row with a trace that has a compile row."""
  out = []
  for r in measured:
    m = measured_kernels(r)
    c = m and compile_row(compiled, m[0], r)
    if not c:
      continue
    program, kernels, ms = m
    out.append({"kind": "calibration", "device": r["device"], "backend": r["backend"],
                "jax": r["jax"], "shape": r["shape"], "dtype": r["dtype"], "program": program,
                "objective": r.get("objective"), "decoder": r.get("decoder"),
                "batch": r["batch"], "measured_kernels": kernels,
                "compiled_kernels": c["kernels_per_step"],
                "measured_per_compiled": kernels / c["kernels_per_step"],
                "ms_per_step": ms, "ms_per_kernel": ms / kernels,
                "compiled_target": c["target"], "compiled_jax": c["jax"],
                "compiled_utc": c.get("utc"), "measured_utc": r.get("utc")})
  return out


def run(plan: CalibratePlan, add, log) -> list[str]:
  if not plan.measured:
    raise ValueError("calibrate what? give --measured FILE.json (a device's perf rows)")
  rows = calibration_rows(read_rows(plan.measured), read_rows(plan.compiled))
  if not rows:
    return [(f"calibrate: no traced train or decode row of {plan.measured} has a compile row "
             f"in {plan.compiled}")]
  for row in rows:
    row = add(row)
    log(f"[calibrate] {row['program']} {row['objective'] or row['decoder']} batch "
        f"{row['batch']}: {row['measured_kernels']:,.0f} measured / "
        f"{row['compiled_kernels']:,.0f} compiled kernels, {row['ms_per_kernel'] * 1e3:.1f} "
        f"us per kernel")
  return []
