"""Compile rows beside measured GPU rows of the same program: the milliseconds a step took on
the device next to the kernels and bytes its program compiles to here, and the least-squares
fit ms ~ a x kernels + bytes / bandwidth over them, with each program's residual.

A pair is a compile row (`kind: "compile"`) and a `perf train` or `perf decode` row of the
same device kind and program: a training step of the same objective, batch, tokens and
resolved run control (attention, remat, scanned layers); a decode step of the same decoder,
batch and steps per loop iteration (a measured row without `steps_per_iter` ran one: it
predates the setting) whose cache is the compile row's (`prompt_len + new_tokens ==
cache_len`), measured with XLA's default flags in the compiled loop.
"""

from __future__ import annotations

import numpy as np

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


def fit(rows: list[dict]) -> dict:
  """Least squares ms ~ a x kernels + bytes / bandwidth over the pairs, in relative error (a
  1.6 ms decode step weighs as much as a 320 ms training step): `a_us` (microseconds a
  kernel), `bandwidth` (bytes/s), each pair's `fit_ms` and `residual` (measured / fit - 1)."""
  if len(rows) < 2:
    raise ValueError(f"a fit of two parameters needs two pairs or more, got {len(rows)}")
  x = np.array([[r["kernels"], r["bytes"]] for r in rows], float)
  y = np.array([r["ms"] for r in rows], float)
  (a, b), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
  pred = x @ np.array([a, b])
  return {"a_us": 1e3 * a, "bandwidth": None if b <= 0 else 1e3 / b,
          "rows": [{**r, "fit_ms": p, "residual": r["ms"] / p - 1} for r, p in zip(rows, pred)]}


def render(rows: list[dict]) -> str:
  """The pairs and the fit, as markdown."""
  f = fit(rows)
  bw = "-" if f["bandwidth"] is None else f"{f['bandwidth'] / 1e12:.2f} TB/s"
  columns = [("program", lambda r: f"{r['program']} {r['name']}"), ("batch", lambda r: r["batch"]),
             ("tokens", lambda r: r["tokens"]),
             ("run control", lambda r: ", ".join(str(r["run_control"].get(k)) for k in (
                 "attention", "remat", "scan_layers", "steps_per_iter") if k in r["run_control"])),
             ("kernels", lambda r: f"{r['kernels']:,.0f}"),
             ("GB", lambda r: f"{r['bytes'] / 1e9:.3f}"),
             ("measured ms", lambda r: fmt(r["ms"], ".3f")),
             ("fit ms", lambda r: fmt(r["fit_ms"], ".3f")),
             ("residual", lambda r: f"{100 * r['residual']:+.0f}%")]
  worst = max(abs(r["residual"]) for r in f["rows"])
  return "\n".join([*table(columns, f["rows"]), "",
                    f"Fit over {len(rows)} programs: ms = {f['a_us']:.2f} µs x kernels + bytes / "
                    f"{bw}; the largest residual is {100 * worst:.0f}%."])
