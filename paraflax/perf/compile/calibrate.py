"""Compile rows beside measured GPU rows of the same program: the milliseconds a step took on
the device next to the kernels and bytes its program compiles to here, and the least-squares
fit ms ~ a x kernels + bytes / bandwidth over them, with each program's residual.

A pair is a compile row (`kind: "compile"`) and a `perf train` or `perf decode` row of the
same device kind and program: a training step of the same objective, batch, tokens and
resolved run control (attention, remat, scanned layers); a decode step of the same decoder,
batch and steps per loop iteration (a measured row without `steps_per_iter` ran one: it
predates the setting) whose cache is the compile row's (`prompt_len + new_tokens ==
cache_len`), measured with XLA's default flags in the compiled loop.

`paraflax perf calibrate` (`calibration_rows`) sets each program traced on a device (`perf
train --profile`, `perf decode --profile`) beside the newest compile row of its program at the
defaults: measured and compiled kernels, their ratio, ms per kernel, both JAX versions. Kernel
counts do not depend on the cache's length, so a decode step pairs with any compile row of its
decoder and batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paraflax.perf.rows import read_rows
from paraflax.perf.tables import fmt, table


def _same_device(compiled: dict, measured: dict) -> bool:
  return compiled["device"].split()[:2] == measured["device"].split()[:2]  # "NVIDIA H200"


def _matches(c: dict, m: dict) -> bool:
  if not _same_device(c, m) or c["batch"] != m.get("batch"):
    return False
  if c["program"] == "train" and m["kind"] == "train":
    rc = c["run_control"]
    return (c["objective"], c["seq_len"]) == (m["objective"], m["seq_len"]) and all(
        rc.get(k) == m.get(k) for k in ("attention", "remat", "scan_layers"))
  if c["program"] == "decode" and m["kind"] == "decode":
    return (c["decoder"] == m["decoder"] and not m.get("xla_flags") and m.get("loop", "while")
            == "while" and m.get("prompt_len", 0) + m.get("new_tokens", 0) == c["cache_len"]
            and c["run_control"]["steps_per_iter"] == m.get("steps_per_iter", 1))
  return False


def pairs(compiled: list[dict], measured: list[dict]) -> list[dict]:
  """Each compile row that has a measured row of its program, with the measured ms (the
  first measured row found)."""
  out = []
  for c in compiled:
    if c["kind"] != "compile":
      continue
    m = next((m for m in measured if _matches(c, m)), None)
    if m is not None:
      ms = 1e3 * m["step_s"] if m["kind"] == "train" else m["ms_per_step"]
      out.append({"program": c["program"], "name": c.get("objective") or c["decoder"],
                  "batch": c["batch"], "tokens": c.get("seq_len") or c["cache_len"],
                  "run_control": c["run_control"], "kernels": c["kernels_per_step"],
                  "bytes": c["bytes_per_step"], "flops": c["flops_per_step"], "ms": ms,
                  "measured_jax": m["jax"], "compiled_jax": c["jax"]})
  return out


TERMS = {"kernels": "µs x kernels", "bytes": "bytes / {} TB/s", "flops": "FLOPs / {} TFLOP/s"}


def fit(rows: list[dict], terms: tuple[str, ...] = ("kernels", "bytes")) -> dict:
  """Least squares ms ~ a x kernels + bytes / bandwidth (+ FLOPs / rate, with "flops" in
  `terms`) over the pairs, in relative error (a 1.6 ms decode step weighs as much as a
  320 ms training step): `coefficients` (ms per kernel, byte, FLOP), each pair's `fit_ms`
  and `residual` (measured / fit - 1)."""
  if len(rows) < len(terms):
    raise ValueError(f"a fit of {len(terms)} parameters needs {len(terms)} pairs or more, "
                     f"got {len(rows)}")
  x = np.array([[r[t] for t in terms] for r in rows], float)
  y = np.array([r["ms"] for r in rows], float)
  coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
  pred = x @ coef
  return {"coefficients": dict(zip(terms, coef.tolist())),
          "rows": [{**r, "fit_ms": p, "residual": r["ms"] / p - 1} for r, p in zip(rows, pred)]}


def describe(f: dict) -> str:
  """The fitted model in words: "ms = 2.26 µs x kernels + bytes / 5.56 TB/s"."""
  parts = []
  for term, c in f["coefficients"].items():
    if term == "kernels":
      parts.append(f"{1e3 * c:.2f} µs x kernels")
    else:
      rate = "-" if c <= 0 else f"{1e-9 / c:.2f}"  # per ms -> TB/s, TFLOP/s
      parts.append(TERMS[term].format(rate))
  return "ms = " + " + ".join(parts)


def render(rows: list[dict]) -> str:
  """The pairs, the fit of kernels and bytes (the issue's model) and the fit with FLOPs added,
  as markdown."""
  two, three = fit(rows), fit(rows, ("kernels", "bytes", "flops"))
  columns = [("program", lambda r: f"{r['program']} {r['name']}"), ("batch", lambda r: r["batch"]),
             ("tokens", lambda r: r["tokens"]),
             ("run control", lambda r: ", ".join(str(r["run_control"].get(k)) for k in (
                 "attention", "remat", "scan_layers", "steps_per_iter") if k in r["run_control"])),
             ("kernels", lambda r: f"{r['kernels']:,.0f}"),
             ("GB", lambda r: f"{r['bytes'] / 1e9:.3f}"),
             ("TFLOP", lambda r: f"{r['flops'] / 1e12:.3f}"),
             ("measured ms", lambda r: fmt(r["ms"], ".3f")),
             ("fit ms (residual)", lambda r: f"{r['fit_ms']:.3f} ({100 * r['residual']:+.0f}%)"),
             ("with FLOPs", lambda r: f"{r['with_flops']:.3f} ({100 * r['residual_3']:+.0f}%)")]
  merged = [{**a, "with_flops": b["fit_ms"], "residual_3": b["residual"]}
            for a, b in zip(two["rows"], three["rows"])]

  def worst(f):
    return 100 * max(abs(r["residual"]) for r in f["rows"])
  return "\n".join([*table(columns, merged), "",
                    f"Fit over {len(rows)} programs: {describe(two)} (largest residual "
                    f"{worst(two):.0f}%); with FLOPs: {describe(three)} (largest residual "
                    f"{worst(three):.0f}%)."])


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
