"""Markdown tables of perf rows (`render`; pages of them: `pages.py`)."""

from __future__ import annotations

from paraflax.devices import bandwidth, peak_flops
from paraflax.perf.rows import KINDS
from paraflax.perf.slots import cache_shares
from paraflax.perf.trace import KINDS as TRACE_KINDS


def fmt(x, spec: str = ".2f") -> str:
  return "-" if x is None else format(x, spec)


def pct(x, spec: str = ".0f") -> str:
  return "-" if x is None else f"{100 * x:{spec}}%"


def notes(r: dict) -> str:
  """The row's settings that are not columns: a Python loop, a run-control variant, its note
  (else its XLA flags)."""
  parts = [f"loop={r['loop']}"] if r.get("loop", "while") != "while" else []
  parts += [r["variant"]] if r.get("variant") else []
  return "; ".join(parts + [r.get("note") or r.get("xla_flags") or ""]).strip("; ")


def bound_ms(r: dict) -> str:
  """A compile row's FLOPs at the target's bf16 peak and bytes at its memory bandwidth, in
  ms (`paraflax.devices`): what the step could take were it compute- or bandwidth-bound."""
  peak, bw = peak_flops(r["device"]), bandwidth(r["device"])
  return (f"{fmt(peak and 1e3 * r['flops_per_step'] / peak, '.2f')} / "
          f"{fmt(bw and 1e3 * r['bytes_per_step'] / bw, '.2f')}")


def mix_summary(r: dict) -> str:
  """A compile row's GEMM, attention and other kernels per step."""
  mix = r["kernel_mix"]
  gemm = mix.get("gemm", 0)
  attention = sum(v for k, v in mix.items() if k.startswith("attention:"))
  return f"{gemm:,.0f} / {attention:,.0f} / {r['kernels_per_step'] - gemm - attention:,.0f}"


COLUMNS = {
    "numerics": [("shape", lambda r: r["shape"]), ("dtype", lambda r: r["dtype"]),
                 ("check", lambda r: r["check"]),
                 ("objective / decoder", lambda r: r.get("objective") or r.get("decoder")),
                 ("batch x tokens", lambda r: f"{r['batch']} x "
                                              f"{r.get('seq_len') or r.get('new_tokens')}"),
                 ("path vs reference", lambda r: f"{r['attention']} vs {r['reference']}"
                  if "attention" in r else "greedy vs greedy AR"),
                 ("loss rel", lambda r: fmt(r.get("loss_rel"), ".1e")),
                 ("grad rel L2 (cos)", lambda r: "-" if "grad_rel_l2" not in r else
                  f"{r['grad_rel_l2']:.1e} ({r['grad_cos']:.5f})"),
                 ("exact vs AR", lambda r: fmt(r.get("exact_vs_ar"))),
                 ("tolerance", lambda r: f"{r['loss_rtol']:g} / {r['grad_rtol']:g}"
                  if "loss_rtol" in r else f"rel L2 {r['rel_l2']:.1e} <= {r['rtol']:g}"
                  if "rtol" in r else "token equal"),
                 ("ok", lambda r: "yes" if r["ok"] else "**no**")],
    "slots": [("shape", lambda r: r["shape"]), ("dtype", lambda r: r["dtype"]),
              ("cache", lambda r: r["cache_len"]), ("batch", lambda r: r["batch"]),
              ("slots", lambda r: r["slots"]), ("mask", lambda r: r["mask"]),
              ("forward ms", lambda r: f"{r['forward_ms']:.3f}"),
              ("c(k)", lambda r: f"{r['vs_one_slot']:.2f}")],
    "decode": [("shape", lambda r: r["shape"]), ("dtype", lambda r: r["dtype"]),
               ("batch", lambda r: r["batch"]), ("decoder", lambda r: r["decoder"]),
               ("settings", lambda r: r.get("settings", "")),
               ("new tokens", lambda r: r["new_tokens"]),
               ("ms/step", lambda r: fmt(r["ms_per_step"], ".3f")),
               ("weight-read floor ms", lambda r: fmt(r.get("floor_ms"), ".3f")),
               ("XLA bytes / floor", lambda r: fmt(r.get("bytes_per_floor"))),
               ("tokens/forward", lambda r: fmt(r["tokens_per_forward"])),
               ("tokens/s", lambda r: fmt(r["tokens_per_s"], ".1f")),
               ("speedup vs AR", lambda r: fmt(r.get("speedup_vs_ar")) + "x" * (
                   r.get("speedup_vs_ar") is not None)),
               ("exact vs AR", lambda r: fmt(r["exact_vs_ar"])), ("notes", notes)],
    "train": [("shape", lambda r: r["shape"]), ("objective", lambda r: r["objective"]),
              ("batch x tokens", lambda r: f"{r['batch']} x {r['seq_len']}"),
              ("attention, remat, scan",
               lambda r: f"{r['attention']}, {r['remat']}, {r['scan_layers']}"),
              ("compile s", lambda r: fmt(r.get("compile_s"), ".1f")),
              ("step s", lambda r: f"{r['step_s']:.3f}"),
              ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
              ("MFU", lambda r: pct(r["mfu"], ".1f")),
              ("XLA GiB", lambda r: fmt(r.get("xla_gib"))), ("notes", notes)],
    "compile": [("target", lambda r: r["target"]), ("program", lambda r: r["program"]),
                ("objective / decoder", lambda r: r.get("objective") or (
                    f"{r['decoder']} ({r['settings']})" if r.get("settings") else r["decoder"])),
                ("batch x tokens",
                 lambda r: f"{r['batch']} x {r.get('seq_len') or r.get('cache_len')}"),
                ("run control", lambda r: "defaults" if r["defaults"] else ", ".join(
                    f"{k}={v}" for k, v in r["run_control"].items() if k != "platform")),
                ("kernels/step", lambda r: f"{r['kernels_per_step']:,.0f}"),
                ("GEMM / attention / other", mix_summary),
                ("host syncs", lambda r: fmt(r["host_syncs_per_step"], "g")),
                ("GiB / capacity", lambda r: f"{r['memory']['total'] / 2**30:.1f} / "
                                             f"{r['memory']['capacity'] / 2**30:.0f}"),
                ("GB/step", lambda r: fmt(r["bytes_per_step"] / 1e9, ".3f")),
                ("x floor", lambda r: fmt(r.get("bytes_per_floor"))),
                ("TFLOP/step", lambda r: fmt(r["flops_per_step"] / 1e12, ".3f")),
                ("ms at peak / bandwidth", bound_ms),
                ("compile s", lambda r: fmt(r["compile_s"], ".0f"))],
    "calibration": [("shape", lambda r: r["shape"]), ("program", lambda r: r["program"]),
                    ("objective / decoder", lambda r: r.get("objective") or r.get("decoder")),
                    ("batch", lambda r: r["batch"]),
                    ("kernels measured / compiled", lambda r: f"{r['measured_kernels']:,.0f}"
                     f" / {r['compiled_kernels']:,.0f} ({r['measured_per_compiled']:.2f}x)"),
                    ("ms/step", lambda r: f"{r['ms_per_step']:.3f}"),
                    ("us/kernel", lambda r: f"{1e3 * r['ms_per_kernel']:.1f}"),
                    ("compiled for, JAX", lambda r: f"{r['compiled_target']}, "
                                                    f"{r['compiled_jax']}")],
    "stage": [("stage", lambda r: r["stage"]), ("steps", lambda r: r["steps"]),
              ("wall s", lambda r: f"{r['wall_s']:.1f}"),
              ("tokens/s", lambda r: fmt(r.get("tokens_per_s"), ",.0f")),
              ("last train loss", lambda r: fmt(r.get("train_loss"), ".3f")),
              ("val loss", lambda r: fmt(r.get("val_loss"), ".3f"))],
    "method": [("method", lambda r: r["method"]), ("settings", lambda r: r["settings"]),
               ("weights", lambda r: r["weights"]),
               ("tokens/forward", lambda r: f"{r['tokens_per_forward']:.2f}"),
               ("tokens/s", lambda r: f"{r['tokens_per_s']:.1f}"),
               ("speedup vs AR", lambda r: f"{r['speedup_vs_ar']:.2f}x"),
               ("exact vs AR", lambda r: fmt(r["exact_vs_ar"]))],
}


def time_by_kind(rows: list[dict]) -> list[str]:
  """A table of traced rows' device time per kind of kernel (`trace.kernel_kind`)."""
  cell = lambda kind: lambda r: next((f"{k['ms']:.2f} ({k['kernels']})"
                                      for k in r["trace"]["kinds"] if k["kind"] == kind), "-")
  return table([("objective / decoder", lambda r: r.get("objective") or r.get("decoder")),
                ("batch", lambda r: r["batch"]),
                ("busy ms", lambda r: f"{r['trace']['busy_ms']:.2f}"),
                *((kind, cell(kind)) for kind, _ in TRACE_KINDS)], rows)


def table(columns, rows) -> list[str]:
  lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
  return lines + ["| " + " | ".join(str(f(r)) for _, f in columns) + " |" for r in rows]


# columns shown only where some row of the table has their field (measured on request)
OPTIONAL = {"XLA bytes / floor": "bytes_per_floor"}


def render(rows: list[dict]) -> str:
  """The tables of `rows`: one per device and kind (the family's stages and bench apart), each
  under the device, backend and JAX version, followed by the commands that measured it."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    part = r["kind"] if r["kind"] != "family" else ("stage" if "stage" in r else "method")
    groups.setdefault((r["device"], r["backend"], KINDS.index(r["kind"]), part), []).append(r)
  out = []
  for (device, backend, _, part), rs in sorted(groups.items(), key=lambda kv: kv[0][2]):
    jax = ", ".join(sorted({r["jax"] for r in rs}))
    columns = [c for c in COLUMNS[part] if c[0] not in OPTIONAL or any(OPTIONAL[c[0]] in r
                                                                       for r in rs)]
    out += [f"**{part}** on {device} ({backend}), JAX {jax}", "", *table(columns, rs), ""]
    if part == "slots" and (shares := cache_shares(rs)):
      out += ["The filled cache's share of a forward, 1 - t(short cache) / t(long cache):", "",
              *table([("shape", lambda s: s["shape"]), ("batch", lambda s: s["batch"]),
                      ("slots", lambda s: s["slots"]),
                      ("caches", lambda s: f"{s['short_cache']} / {s['long_cache']}"),
                      ("ms", lambda s: f"{s['short_ms']:.3f} / {s['long_ms']:.3f}"),
                      ("cache share", lambda s: pct(s["cache_share"]))], shares), ""]
    if traced := [r for r in rs if "kinds" in r.get("trace", {})]:
      out += ["Where a traced step's device time goes, by kind of kernel (ms, kernels):", "",
              *time_by_kind(traced), ""]
    commands = dict.fromkeys((r["command"], r.get("utc", "")) for r in rs)
    out += [f"    {c}    # {utc}" if utc else f"    {c}" for c, utc in commands] + [""]
  return "\n".join(out)
