"""The GPU session's parts (`scripts/gpu_session.sh`, docs/gpu/README.md) on this CPU: the
numerics check holds where two paths agree and fails where its tolerance is missed, every
part the script runs parses, and calibration rows set a traced program beside its compile
row."""

import json
import re
import shlex
from pathlib import Path

import pytest

from paraflax import cli
from paraflax.perf import rows
from paraflax.perf.compile import calibrate
from paraflax.perf.cli import plan_of as perf_plan_of
from paraflax.perf.numerics import NumericsPlan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def _rows(path):
  return json.loads(Path(path).read_text())


@pytest.mark.fast
def test_every_part_of_the_session_script_parses_as_its_plan():
  """Each `part SECONDS FILE perf-args` line of the script, its variables at their defaults,
  is a valid `paraflax perf` command (a typo would cost a GPU session its part)."""
  lines = re.findall(r"^part \d+ \S+ (.+?)(?<!\\)$", SCRIPT.read_text().replace("\\\n", " "),
                     re.MULTILINE)
  assert len(lines) == 4
  parser = cli.build_parser()
  for line in lines:
    line = re.sub(r"\$\{DECODERS\+[^}]*\}", "", line)
    line = line.replace('"$SHAPE"', "qwen2.5-0.5b").replace("$small", "--steps 3")
    args = parser.parse_args(["perf", *shlex.split(line), "--json", "x.json"])
    plan = perf_plan_of(args)
    assert plan.shape in ("micro", "qwen2.5-0.5b"), line


@pytest.mark.slow
def test_numerics_rows_hold_where_paths_agree_and_fail_past_their_tolerance(tmp_path):
  path = tmp_path / "n.json"
  base = ["perf", "numerics", "--attention", "xla_chunked", "--objectives", "ar",
          "--seq-len", "64", "--json", str(path)]
  assert cli.main([*base, "--decoders", "jacobi", "--batches", "2", "--new-tokens", "8"]) == 0
  rows = _rows(path)
  decode = ("decode_kernel", "decode_layer", "greedy_head")
  [loss, greedy] = [r for r in rows if r["check"] not in decode]
  # the GPU decode kernel, layer and greedy head (interpreted here) against the dense path /
  # the model's head, float32 and bf16
  for check in decode:
    kernel = [r for r in rows if r["check"] == check]
    assert {(r["dtype"], r["rows"]) for r in kernel} == {
        (d, t) for d in ("float32", "bfloat16") for t in (1, 16)}
    assert all(r["ok"] and r["rel_l2"] <= r["rtol"] for r in kernel)
  assert (loss["check"], loss["attention"], loss["reference"]) == ("loss_grad", "xla_chunked",
                                                                   "xla")
  assert loss["ok"] and 0 < loss["loss_rel"] <= NumericsPlan.loss_rtol  # bf16: not bit-equal
  assert 0 < loss["grad_rel_l2"] <= NumericsPlan.grad_rtol and loss["grad_cos"] > 0.999
  assert greedy["check"] == "greedy_equal_ar" and greedy["dtype"] == "float32"
  assert greedy["exact_vs_ar"] == 1.0 and greedy["ok"]
  # the same paths against a tolerance they miss: a row that says so, and exit status 1
  assert cli.main([*base, "--decoders", "", "--grad-rtol", "1e-9"]) == 1
  [row] = [r for r in _rows(path) if r["check"] == "loss_grad"]
  assert not row["ok"] and row["grad_rtol"] == 1e-9


def _measured(kind, **fields):
  return {"kind": kind, "device": "NVIDIA H200", "backend": "gpu", "jax": "0.11.2",
          "shape": "s", "dtype": "bfloat16", "batch": 1, **fields}


def _compiled(program, name, kernels, utc):
  return {"kind": "compile", "device": "NVIDIA H200 141GB HBM3e", "backend": "gpu",
          "jax": "0.12.0", "shape": "s", "dtype": "bfloat16", "compiled_only": True,
          "target": "h200", "program": program, "batch": 1, "defaults": True,
          "run_control": {}, "kernels_per_step": kernels, "kernel_mix": {},
          "host_syncs_per_step": 0, "memory": {}, "bytes_per_step": 0, "flops_per_step": 0,
          "compile_s": 1, "utc": utc,
          **({"objective": name} if program == "train" else {"decoder": name})}


@pytest.mark.fast
def test_calibration_sets_each_traced_program_beside_its_newest_compile_row():
  measured = [_measured("train", objective="ar", step_s=0.05, trace={"device_events": 1200}),
              _measured("train", objective="tidar", step_s=0.2),  # not traced: no row
              _measured("decode", decoder="ar", ms_per_step=1.5, kernels_per_step=500.0,
                        trace={"device_events": 128000})]
  compiled = [_compiled("train", "ar", 40000, "2026-11-24"), _compiled("train", "ar", 1000,
                                                                       "2026-11-27"),
              _compiled("decode", "ar", 550, "2026-11-27")]
  got = calibrate.calibration_rows(measured, compiled)
  assert [(r["program"], r["measured_kernels"], r["compiled_kernels"]) for r in got] == [
      ("train", 1200, 1000), ("decode", 500.0, 550)]
  assert got[0]["ms_per_kernel"] == pytest.approx(50 / 1200)
  assert got[0]["measured_per_compiled"] == pytest.approx(1.2)
  assert (got[0]["jax"], got[0]["compiled_jax"]) == ("0.11.2", "0.12.0")
  assert all(rows.check({**r, "command": "c"}) for r in got)
