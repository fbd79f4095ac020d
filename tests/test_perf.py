"""`paraflax perf` at micro shapes, one part at a time in this process: every row carries the
contract's fields (DESIGN.md section 6), every decoder equals greedy AR, c(1) is 1, MFU is the
hand count's, later runs merge into a report of the same device, and the GPU page's tables are
the ones its JSON files render."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paraflax import cli, devices
from paraflax.model.run import RunControl
from paraflax.perf import batches, decode, pages, rows, shapes, tables, train
from paraflax.perf import cli as perf_cli
from paraflax.perf.report import Report
from paraflax.perf.trace import kernel_kind, trace_summary
from paraflax.training.config.train import apply_overrides, load_config
from paraflax.training.run import flops as training_flops
from conftest import ENVIRON, background_job, background_result

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "docs" / "gpu"
CPU = {"device": "cpu", "backend": "cpu", "jax": "0"}


def _rows(path):
  return json.loads(Path(path).read_text())


@pytest.mark.fast
def test_the_weight_read_floor_is_bytes_over_bandwidth():
  assert devices.floor_ms(48 * 10**8, "NVIDIA H200") == pytest.approx(1.0)  # 4.8 GB at 4.8 TB/s
  assert devices.floor_ms(2 * 10**9, "NVIDIA H100 PCIe") == pytest.approx(1.0)  # not the SXM part
  assert devices.floor_ms(10**9, "cpu") is None


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
  s = trace_summary({"traceEvents": meta + events})
  # streams only: [0, 15] and [30, 40] busy over a 40 us span; the op row and host ignored
  assert s["device_events"] == 3 and s["busy_ms"] == 25e-3 and s["span_ms"] == 40e-3
  assert s["long_gaps"] == 0  # the 15 us gap is under the 50 us of a host round trip
  events.append(x(1, 1, 100, 10, "gemm"))
  assert trace_summary({"traceEvents": meta + events})["long_gaps_ms"] == 60e-3
  assert [k["name"] for k in s["top_kernels"]] == ["gemm", "fusion"]
  assert [(k["kind"], k["kernels"], k["ms"]) for k in s["kinds"]] == [
      ("other (Pallas, custom)", 2, 20e-3), ("elementwise", 1, 10e-3)]
  assert trace_summary({"traceEvents": meta[1:2]}) == {"device_events": 0}


@pytest.mark.fast
def test_a_kernel_kind_comes_from_its_name():
  """Names from the H200 traces of 2026-11-28 (docs/gpu/h200-2026-11-28.json)."""
  kinds = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
           "nvjet_sm90_tst_256x96_64x4_1x2_h_bz_coopA_NNT": "GEMM (cuBLAS)",
           "gemm_fusion_dot_98": "GEMM (Triton fusion)", "input_scatter_fusion": "scatter",
           "input_reduce_fusion_276": "reduction", "memcpy32_post": "copy / memset",
           "loop_multiply_fusion_25": "elementwise", "decode_attention": "other"}
  for name, kind in kinds.items():
    assert kernel_kind(name).startswith(kind), name


def _slot_row(cache, batch, slots, ms):
  return {"kind": "slots", "shape": "micro", "dtype": "bfloat16", "cache_len": cache,
          "batch": batch, "slots": slots, "mask": "causal", "forward_ms": ms,
          "vs_one_slot": 1.0}


@pytest.mark.fast
def test_a_later_run_merges_into_the_report_of_its_device(tmp_path):
  path, md = tmp_path / "run.json", tmp_path / "run.md"
  first = Report(path, md, "first", env=CPU)
  for cache, batch in ((64, 1), (64, 8), (16, 1)):
    first.add(_slot_row(cache, batch, 1, 2.0))
  again = Report(path, md, "second", env=CPU)
  again.add(_slot_row(64, 8, 1, 1.0))  # the same setting measured again: replaces the first
  kept = _rows(path)
  assert [(r["cache_len"], r["batch"], r["command"]) for r in kept] == [
      (64, 1, "first"), (16, 1, "first"), (64, 8, "second")]
  assert all(list(r)[:6] == list(rows.COMMON) for r in kept)
  assert md.read_text() == tables.render(kept)
  with pytest.raises(ValueError, match="holds rows of cpu, not of this NVIDIA H200"):
    Report(path, None, "x", env={**CPU, "device": "NVIDIA H200"})
  path.write_text('{"rows": []}')
  with pytest.raises(ValueError, match="not a perf file"):
    Report(path, None, "x", env=CPU)
  with pytest.raises(ValueError, match="a decode row lacks decoder"):
    Report(None, None, "x", env=CPU).add({"kind": "decode", "shape": "s", "dtype": "d"})
  # compile rows of one decoder at two settings (TiDAR at k = 4 and 8) are two programs
  assert rows.setting({"kind": "compile", "shape": "s", "dtype": "d", "decoder": "tidar",
                       "settings": "block 4"}) != rows.setting(
      {"kind": "compile", "shape": "s", "dtype": "d", "decoder": "tidar", "settings": "block 8"})


@pytest.mark.fast
def test_tables_render_each_kind_and_the_cache_share():
  slot_rows = [{**CPU, "command": "c", **r} for r in (_slot_row(64, 1, 4, 4.0),
                                                      _slot_row(16, 1, 4, 3.0))]
  text = tables.render(slot_rows)
  assert text.startswith("**slots** on cpu (cpu), JAX 0")
  assert "| micro | bfloat16 | 64 | 1 | 4 | causal | 4.000 | 1.00 |" in text
  assert "| micro | 1 | 4 | 16 / 64 | 3.000 / 4.000 | 25% |" in text  # 1 - 3 / 4
  assert text.count("    c") == 1  # the command, once per table


@pytest.mark.fast
def test_a_traced_train_row_shows_its_time_by_kind():
  kinds = [{"kind": "GEMM (cuBLAS)", "kernels": 300, "ms": 20.0, "share": 0.5},
           {"kind": "scatter", "kernels": 1, "ms": 4.0, "share": 0.1}]
  row = {**CPU, "kind": "train", "command": "c", "shape": "micro", "objective": "tidar",
         "batch": 1, "seq_len": 64, "attention": "cudnn", "remat": "none", "scan_layers": False,
         "step_s": 0.04, "tokens_per_s": 1600.0, "mfu": None,
         "trace": {"busy_ms": 40.0, "kinds": kinds}}
  text = tables.render([row])
  assert "| objective / decoder | batch | busy ms | attention (cuDNN) | GEMM (cuBLAS) |" in text
  assert "| tidar | 1 | 40.00 | - | 20.00 (300) | - | 4.00 (1) | - |" in text
  assert "by kind" not in tables.render([{**row, "trace": {"device_events": 0}}])


@pytest.mark.fast
@pytest.mark.parametrize("folder", [GPU, ROOT / "docs" / "compile"], ids=["gpu", "compile"])
def test_each_rows_page_holds_the_tables_its_json_files_render(folder):
  page = (folder / "README.md").read_text()
  rendered = pages.update_page(page, folder)
  assert rendered == page, f"run: paraflax perf render --page docs/{folder.name}/README.md"
  files = sorted(folder.glob("*.json"))
  assert files and all(f"<!-- perf: {f.name}" in page for f in files)
  for f in files:  # every committed run is rows of the schema
    assert {r["kind"] for r in rows.read_rows(f)} <= set(rows.KINDS)


@pytest.mark.fast
def test_the_drafter_of_perf_decode_runs_with_the_targets_attention():
  parser = cli.build_parser()
  for attention in ("auto", "xla_chunked"):
    plan = perf_cli.plan_of(parser.parse_args(["perf", "decode", "--shape", "micro",
                                               "--attention", attention]))
    cfg = shapes.model_config(plan.shape, plan.dtype)
    target = shapes.random_model(cfg, attention=plan.attention)
    assert target.run == RunControl(attention=attention)
    for kind in ("ar", "diffusion"):
      assert decode.drafter_model(kind, cfg, plan).run == target.run


@pytest.mark.fast
def test_perf_scan_layers_takes_any_case_as_the_config_overrides_do():
  parser = cli.build_parser()
  for value, want in (("auto", "auto"), ("Auto", "auto"), ("true", True), ("True", True),
                      ("TRUE", True), ("yes", True), ("false", False), ("False", False),
                      ("NO", False)):
    plan = perf_cli.plan_of(parser.parse_args(["perf", "train", "--scan-layers", value]))
    assert (plan.scan_layers, type(plan.scan_layers)) == (want, type(want)), value
    assert train.recipe("ar", plan, 64).run.scan_layers == want
    if want != "auto":  # bools as `--set run.scan_layers=...` reads them
      assert apply_overrides(load_config("micro_ar"), {"run.scan_layers": value}
                             ).run.scan_layers is want
  for value in ("maybe", "1", "None"):
    with pytest.raises(SystemExit):
      parser.parse_args(["perf", "train", "--scan-layers", value])


@pytest.mark.fast
def test_synthetic_batches_fit_every_objective():
  plan = train.TrainPlan(shape="micro", seq_len=64, batch=2)
  for objective in train.RECIPES:
    cfg = train.recipe(objective, plan, 64)
    batch = batches.synthetic_batch(cfg)  # checked against the trainer's abstract batch
    assert batch["tokens"].shape[0] == 2 and batch["tokens"].max() < cfg.model.vocab_size
  bad = train.recipe("ar", plan, 64)
  object.__setattr__(bad, "data_source", "mystery")
  with pytest.raises(ValueError, match="no synthetic rows for the data source 'mystery'"):
    batches.synthetic_batch(bad)


MICRO = ["--shape", "micro", "--batches", "2", "--repeats", "1"]


@pytest.mark.slow
def test_slots_rows(tmp_path):
  path = tmp_path / "slots.json"
  assert cli.main(["perf", "slots", *MICRO, "--cache-len", "32", "--slots", "1",
                   "--tidar-k", "2", "--short-cache", "8", "--short-slots", "1",
                   "--json", str(path), "--md", str(tmp_path / "slots.md")]) == 0
  got = _rows(path)
  assert [(r["cache_len"], r["slots"], r["mask"]) for r in got] == [
      (32, 1, "causal"), (32, 6, "tidar k=2"), (8, 1, "causal")]
  for r in got:
    assert r["device"] and r["backend"] == "cpu" and r["shape"] == "micro" and r["forward_ms"] > 0
    assert r["command"].startswith("paraflax perf slots --shape micro")
  assert all(r["vs_one_slot"] == 1.0 for r in got if r["slots"] == 1)
  assert "The filled cache's share" in (tmp_path / "slots.md").read_text()


@pytest.mark.slow
def test_decode_rows_are_exact_against_ar(tmp_path, capsys):
  path = tmp_path / "decode.json"
  assert cli.main(["perf", "decode", *MICRO, "--prompt-len", "16", "--new-tokens", "8",
                   "--decoders", "ar,prompt-lookup,speculative", "--cost", "--json",
                   str(path)]) == 0
  got = {r["decoder"]: r for r in _rows(path)}
  assert list(got) == ["ar", "prompt-lookup", "speculative"]
  for r in got.values():
    assert r["exact_vs_ar"] == 1.0 and r["tokens_per_forward"] >= 1.0 and r["ms_per_step"] > 0
    assert r["batch"] == 2 and r["new_tokens"] == 8 and r["dtype"] == "float32"
    assert r["floor_ms"] is None  # no bandwidth known for a CPU
    # the step's XLA cost: at least every weight read once, the drafter's too
    assert r["bytes_per_floor"] >= 1.0 and r["step_flops"] > 0 and r["step_ops"] > 0
  assert got["speculative"]["floor_bytes"] > got["ar"]["floor_bytes"]  # + the drafter's
  assert "| XLA bytes / floor |" in tables.render(list(got.values()))  # shown where measured
  assert got["ar"]["speedup_vs_ar"] == 1.0 and got["ar"]["steps"] == 7  # the prefill gives one
  assert got["prompt-lookup"]["tokens_per_forward"] > 1.0  # the repetitive prompts' case
  assert got["speculative"]["draft_forwards"] > 0
  capsys.readouterr()
  assert cli.main(["perf", "decode", "--decoders", "assd"]) == 2
  assert "assd is a decoder for pf.infill, not pf.generate" in capsys.readouterr().err


@pytest.mark.slow
def test_train_row_has_mfu_fields_and_the_run_control(tmp_path):
  path = tmp_path / "train.json"
  assert cli.main(["perf", "train", "--shape", "micro", "--objectives", "ar", "--seq-len",
                   "64", "--steps", "1", "--profile", str(tmp_path / "traces"), "--json",
                   str(path)]) == 0
  [r] = _rows(path)
  assert r["defaults"] and r["compile_s"] > 0  # no run-control flag given
  assert r["trace"]["device_events"] == 0  # one more step traced: a CPU has no device rows
  assert (tmp_path / "traces" / "profile_train_ar.json.gz").exists()
  assert r["objective"] == "ar" and r["batch"] == 1 and r["seq_len"] == 64 and r["finite"]
  assert r["tokens_per_s"] == pytest.approx(64 / r["step_s"])
  cfg = train.recipe("ar", train.TrainPlan(shape="micro"), 64).model
  assert r["flops_per_token"] == training_flops.comparison_flops_per_token(cfg, 64)
  assert r["real_flops_per_token"] == training_flops.train_flops(cfg, "ar", 1, 64) / 64
  assert r["mfu"] is None and r["mfu_real"] is None  # no peak known for a CPU
  assert (r["attention"], r["remat"], r["scan_layers"]) == ("xla", "none", False)
  assert r["params_moved"].split("/")[0] == r["params_moved"].split("/")[1]


def run_family(out: Path) -> tuple:
  """`paraflax perf family` at micro shapes as a user runs it, twice (the second refuses the
  directory the first trained in), with XLA's cheapest compiles (the micro programs are all
  compile time): (return codes, stderr of the second, rows)."""
  env = {**ENVIRON, "XLA_FLAGS": "--xla_backend_optimization_level=0 "
                                 "--xla_llvm_disable_expensive_passes=true"}
  path = out / "family.json"
  cmd = [sys.executable, "-m", "paraflax.cli", "perf", "family", "--shape", "micro", "--out",
         str(out / "fam"), "--stages", "tiny_ar", "--steps", "2", "--batch", "2", "--prompts",
         "2", "--new-tokens", "8", "--bench-batch", "2", "--no-mr", "--json", str(path)]
  procs = [subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600) for _ in range(2)]
  return [p.returncode for p in procs], procs[0].stdout[-3000:] + procs[1].stderr, _rows(path)


# (a subprocess started early in the background: conftest.background_job)
background_job(__file__, "test_family_trains_and_benches_the_stages_it_is_given", run_family)


@pytest.mark.slow
def test_family_trains_and_benches_the_stages_it_is_given(request, tmp_path):
  codes, out, got = background_result(request, tmp_path)
  assert codes == [0, 2], out  # the directory holds the first run: refused, not trained over
  assert "is not empty: name a new directory with --out" in out
  assert [r["stage"] for r in got if "stage" in r] == ["tiny_ar"]
  assert all(r["val_loss"] > 0 for r in got if "stage" in r)
  bench = {r["method"]: r for r in got if "method" in r}
  assert list(bench) == ["ar", "jacobi", "jacobi_released", "prompt_lookup"]
  assert all(r["exact_vs_ar"] == 1.0 and r["tokens_per_forward"] >= 1.0 for r in bench.values())


@pytest.mark.fast
def test_render_prints_the_tables_of_files(tmp_path, capsys):
  path = tmp_path / "r.json"
  path.write_text(json.dumps([{**CPU, "command": "c", **_slot_row(64, 1, 1, 1.0)}]))
  assert cli.main(["perf", "render", str(path)]) == 0
  assert "| micro | bfloat16 | 64 | 1 | 1 | causal | 1.000 | 1.00 |" in capsys.readouterr().out
  assert cli.main(["perf", "render"]) == 2
