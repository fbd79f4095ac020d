"""Where device time goes in one call: a `jax.profiler` trace, summarised."""

from __future__ import annotations

import collections
import gzip
import json
import re
import shutil
import time
from pathlib import Path

GAP_US = 50  # an idle gap longer than this between kernels: a host round trip
TOP = 25  # kernels listed by name

# a GPU kernel's kind from its name, first match: the library kernels (cuBLAS's nvjet / xmma /
# cutlass, cuDNN's), XLA's Triton GEMM fusions, Pallas calls (named after their function) and
# XLA's own fusions by the emitter its name starts with
KINDS = (("attention (cuDNN)", r"cudnn|sdpa"),
         ("GEMM (cuBLAS)", r"^nvjet|xmma|cutlass|cublas|^sm\d+_.*gemm"),
         ("GEMM (Triton fusion)", r"gemm_fusion|triton_gemm"),
         ("scatter", r"scatter"),
         ("reduction", r"reduce"),
         ("copy / memset", r"memcpy|memset|^copy|dynamic_update_slice|^concatenate"),
         ("elementwise", r"^loop_|^wrapped_|fusion"),
         ("other (Pallas, custom)", r""))


def kernel_kind(name: str) -> str:
  """The first of `KINDS` whose pattern the kernel's name matches."""
  return next(kind for kind, pattern in KINDS if re.search(pattern, name))


def trace_summary(trace: dict) -> dict:
  """Device time in a Chrome/perfetto trace: the span from the first to the last kernel, the
  time some kernel ran (`busy_ms`, the union over streams), the idle gaps over `GAP_US` (host
  round trips), the `TOP` kernels that took most of it and each kind's kernels and time
  (`kernel_kind`). A trace without device events (a CPU backend) is {"device_events": 0}."""
  events = trace["traceEvents"]
  meta = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  procs, threads = meta("process_name"), meta("thread_name")
  dev = {pid for (pid, _), n in procs.items() if "GPU" in n or "TPU" in n}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev]
  streams = [e for e in kernels if "Stream" in threads.get((e["pid"], e.get("tid")), "")]
  kernels = streams or kernels  # kernel rows only: the XLA op/module rows repeat them
  if not kernels:
    return {"device_events": 0}
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  busy, end, gaps = 0.0, spans[0][0], []
  for a, b in spans:
    gaps += [a - end] if a - end > GAP_US else []
    busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
  totals, counts = collections.Counter(), collections.Counter()
  for e in kernels:
    totals[e["name"]] += e["dur"]
    counts[e["name"]] += 1
  top = totals.most_common(TOP)
  kinds: dict[str, list[float]] = {}  # kind -> [kernels, us], each name classified once
  for name, t in totals.items():
    kind = kinds.setdefault(kernel_kind(name), [0, 0.0])
    kind[0], kind[1] = kind[0] + counts[name], kind[1] + t
  return {"device_events": len(kernels), "span_ms": (end - spans[0][0]) / 1e3,
          "busy_ms": busy / 1e3, "busy_share": busy / max(end - spans[0][0], 1e-9),
          "long_gaps": len(gaps), "long_gaps_ms": sum(gaps) / 1e3,
          "top_kernels": [{"name": n[:80], "ms": t / 1e3, "share": t / busy} for n, t in top],
          "kinds": [{"kind": k, "kernels": n, "ms": t / 1e3, "share": t / busy}
                    for k, (n, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]}


def profiled(fn, where: Path, name: str) -> dict:
  """One warm call of `fn` (compiled before) under `jax.profiler.trace`: its wall time and
  `trace_summary`; the perfetto trace kept as `where/profile_<name>.json.gz`."""
  import jax
  where.mkdir(parents=True, exist_ok=True)
  tmp = where / f"trace_{name}"
  with jax.profiler.trace(str(tmp), create_perfetto_trace=True):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    wall = time.perf_counter() - t0
  path = max(tmp.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda q: q.stat().st_mtime)
  kept = where / f"profile_{name}.json.gz"
  shutil.copy(path, kept)
  shutil.rmtree(tmp)
  with gzip.open(kept) as f:
    return {"wall_ms": wall * 1e3, **trace_summary(json.load(f))}
