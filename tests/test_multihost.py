"""Multi-host: two processes on localhost (2 CPU devices each) form one 4-device run through
`paraflax.parallel.distributed`; a sharded training step and a sharded greedy `generate` across both
equal the same computations on one device."""

import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENVIRON, background_job, background_result

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two(worker: Path, tmp_path: Path, env: dict | None = None) -> list[dict]:
  """Run `worker` as processes 0 and 1 of one run (2 CPU devices each); the `RESULT {json}`
  each printed last, sorted by process."""
  port = _free_port()
  logs = [tmp_path / f"worker{i}.log" for i in range(2)]
  with contextlib.ExitStack() as stack:
    procs = []
    for i, log in enumerate(logs):
      penv = {**ENVIRON, **(env or {}),
              "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
              "JAX_PLATFORMS": "cpu", "PARAFLAX_COORDINATOR": f"127.0.0.1:{port}",
              "PARAFLAX_NUM_PROCESSES": "2", "PARAFLAX_PROCESS_ID": str(i)}
      out = stack.enter_context(log.open("w"))
      procs.append(subprocess.Popen([sys.executable, str(worker)],
                                    env=penv, stdout=out, stderr=subprocess.STDOUT))
    try:
      codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
      for p in procs:  # only on a timeout or an error: never leave a worker behind
        if p.poll() is None:
          p.kill()
          p.wait()
  results = []
  for log, code in zip(logs, codes):
    text = log.read_text()
    assert code == 0, f"worker exited with {code}:\n{text[-4000:]}"
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, f"worker printed no result:\n{text[-4000:]}"
    results.append(json.loads(lines[-1][len("RESULT "):]))
  results.sort(key=lambda r: r["process"])
  assert [r["process"] for r in results] == [0, 1]
  return results


# (started early in the background: conftest.background_job)
background_job(__file__, "test_two_processes_train_and_generate_as_one_device",
               lambda tmp: run_two(HERE / "multihost_worker.py", tmp))


@pytest.mark.slow
def test_two_processes_train_and_generate_as_one_device(request, tmp_path):
  results = background_result(request, tmp_path)
  for r in results:
    assert all(r["checks"].values()), r
  # process 0 checked loss, params and tokens against one device; process 1 saw the same
  assert {"loss", "params", "tokens"} <= set(results[0]["checks"])
  assert results[0]["loss"] == results[1]["loss"]
  assert results[0]["tokens"] == results[1]["tokens"]
