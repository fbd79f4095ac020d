"""scripts/accelerator_report.py end to end at micro shapes (issue 23): every part reports,
every decoder equals greedy AR, c(1) is 1, the tables and plots render."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import accelerator_report as report_mod  # noqa: E402
from conftest import ENVIRON, background_job, background_result  # noqa: E402

FAMILY = ["tiny_ar", "jacobi_forcing_r1", "tidar_continual", "deer_drafter_stage1",
          "deer_drafter", "ar_drafter"]


@pytest.mark.fast
def test_trace_summary_counts_overlapping_kernels_once():
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
  meta += [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
           for t, n in ((1, "Stream #1"), (2, "Stream #2"), (3, "XLA Ops"))]
  x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                                       "name": name}
  events = [x(1, 1, 0, 10, "gemm"), x(1, 2, 5, 10, "fusion"), x(1, 1, 30, 10, "gemm"),
            x(1, 3, 0, 40, "op"), x(2, 9, 0, 100, "python")]
  s = report_mod.trace_summary({"traceEvents": meta + events})
  # streams only: [0, 15] and [30, 40] busy over a 40 us span; the op row and host ignored
  assert s["device_events"] == 3 and s["busy_ms"] == 25e-3 and s["span_ms"] == 40e-3
  assert s["long_gaps"] == 0  # the 15 us gap is under the 50 us of a host round trip
  events.append(x(1, 1, 100, 10, "gemm"))
  assert report_mod.trace_summary({"traceEvents": meta + events})["long_gaps_ms"] == 60e-3
  assert [k["name"] for k in s["top_kernels"]] == ["gemm", "fusion"]
  assert report_mod.trace_summary({"traceEvents": meta[1:2]}) == {"device_events": 0}


@pytest.mark.fast
def test_merge_part_keeps_what_a_run_did_not_redo():
  one = lambda shape, cache, b, k: {"shape": shape, "cache_len": cache, "batch": b, "slots": k}
  earlier = {"rows": [one("a", 64, 1, 1), one("a", 64, 8, 1), one("b", 64, 1, 1)],
             "errors": ["a cache 64 batch 8: boom", "c cache 64 batch 1: boom"]}
  new = report_mod.merge_part("1", {"rows": [one("a", 64, 8, 1)], "errors": []}, earlier)
  assert new["rows"] == [one("a", 64, 1, 1), one("a", 64, 8, 1), one("b", 64, 1, 1)]
  assert new["errors"] == ["c cache 64 batch 1: boom"]  # the redone sweep's error is gone
  earlier = {"rows": [{"batch": 1, "method": "ar"}, {"batch": 8, "method": "ar", "x": 0}],
             "profile": ["p1"], "profile_batch": 1, "profile_tokens": 64}
  new = report_mod.merge_part("2", {"rows": [{"batch": 8, "method": "ar", "x": 1}]}, earlier)
  assert new["rows"] == [{"batch": 1, "method": "ar"}, {"batch": 8, "method": "ar", "x": 1}]
  assert new["profile"] == ["p1"]  # a run cut before its profile keeps the earlier one
  new = report_mod.merge_part("3", {"rows": [{"objective": "ar", "s": 2}]},
                              {"rows": [{"objective": "ar", "s": 1}, {"objective": "tidar"}]})
  assert new["rows"] == [{"objective": "tidar"}, {"objective": "ar", "s": 2}]
  assert report_mod.merge_part("4", {"rows": []}, {"rows": [1]}) == {"rows": []}


def run_micro(out: Path) -> subprocess.CompletedProcess:
  """The script at micro shapes as a user runs it, with XLA's cheapest compiles (the micro
  programs are all compile time)."""
  env = {**ENVIRON, "XLA_FLAGS": "--xla_backend_optimization_level=0 "
                                 "--xla_llvm_disable_expensive_passes=true",
         "PYTHONPATH": os.pathsep.join([str(ROOT), ENVIRON.get("PYTHONPATH", "")])}
  return subprocess.run([sys.executable, "scripts/accelerator_report.py", "--micro", "--out",
                         str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)


# (a subprocess started early in the background: conftest.background_job)
background_job(__file__, "test_report_micro_all_parts", run_micro)


@pytest.mark.slow
def test_report_micro_all_parts(request, tmp_path):
  proc = background_result(request, tmp_path)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  tmp_path = Path(proc.args[proc.args.index("--out") + 1])  # the job's own directory
  report = json.loads((tmp_path / "report.json").read_text())
  parts = report["parts"]
  assert sorted(parts) == ["1", "2", "3", "4"]
  assert report["meta"]["device_kind"] and report["meta"]["jax"]
  assert report["meta"]["command"].endswith(f"--micro --out {tmp_path}")

  slots = parts["1"]["rows"]
  assert {r["shape"] for r in slots} == {"micro", "micro-wide"}
  assert {r["cache_len"] for r in slots} == {16, 64} and parts["1"]["errors"] == []
  assert len(report_mod.cache_shares(parts["1"])) == 2  # the short cache's widths 1, 4
  for r in slots:  # each (shape, batch) curve is relative to its own one-slot forward
    assert r["forward_ms"] > 0
    if r["slots"] == 1:
      assert r["vs_one_token"] == 1.0

  decode = [r for r in parts["2"]["rows"] if r["method"] != "transformers generate"]
  assert [r["method"] for r in decode] == ["ar", "jacobi", "prompt_lookup", "speculative",
                                           "ar_again"]
  assert all(r["exact_match_vs_ar"] == 1.0 for r in decode)
  assert all(r["tokens_per_forward"] >= 1.0 for r in decode)
  # the repetitive prompts are prompt lookup's case: it drafts something that is accepted
  assert next(r for r in decode if r["method"] == "prompt_lookup")["tokens_per_forward"] > 1.0
  hf = [r for r in parts["2"]["rows"] if r["method"] == "transformers generate"]
  assert hf and all("skipped" in r or r["same_tokens_as_paraflax_ar"] == 1.0 for r in hf)

  profile = parts["2"]["profile"]  # one traced call per decoder, its trace kept
  assert [r["method"] for r in profile] == ["ar", "jacobi", "prompt_lookup", "speculative"]
  assert all(r["forwards"] >= 1 and r["wall_ms"] > 0 for r in profile)
  assert all((tmp_path / f"profile_{r['method']}.json.gz").stat().st_size > 0 for r in profile)

  train = parts["3"]["rows"]
  assert train and all(r.get("finite") and r["tokens_per_second"] > 0 for r in train), train

  family = parts["4"]
  assert [s["stage"] for s in family["stages"]] == FAMILY
  assert all(s["val_loss"] > 0 for s in family["stages"])
  methods = {r["method"] for r in family["rows"]}
  assert {"ar", "jacobi", "jacobi_forcing", "tidar_k4", "deer_k4", "spec_ar_k4"} <= methods
  assert all(r["exact_match_vs_ar"] == 1.0 for r in family["rows"])

  md = (tmp_path / "report.md").read_text()
  for title in ("## 1. Slot cost", "## 2. Decode", "## 3. Training step", "## 4. Demo family"):
    assert title in md
  assert "| prompt_lookup |" in md and "| spec_ar_k4 |" in md
  for png in ("slot_cost.png", "decode_conversion.png", "family_plots/bench_speed.png"):
    assert (tmp_path / png).stat().st_size > 0
