"""Shared test setup: float32 'highest' matmuls and micro models with well-separated logits."""

import atexit
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

# The suite runs on the CPU, with the compile extra's plugins installed (the JAX CUDA plugin,
# libtpu): they must not probe for devices that are not here (`perf/compile/targets.py`).
# (JAX reads JAX_PLATFORMS when imported; libtpu its variables when a TPU target is compiled.)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from paraflax.perf.compile.targets import TPU_ENV  # noqa: E402

for _k, _v in TPU_ENV.items():
  os.environ.setdefault(_k, _v)

# The suite compiles hundreds of small programs and runs each a few times: XLA:CPU's LLVM
# backend at -O0 compiles them faster than it loses running them (about a fifth off the whole
# suite, docs/testing.md). HLO optimisation is unchanged; every exactness test compares
# programs compiled alike. Set before JAX starts its backend (CPU runs only, and not over a
# level already given); subprocesses inherit it.
if (os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import paraflax as pf  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for this pytest process, new for every run (never a
# previous run's): a program compiled again within the run (after `jax.clear_caches()`, by a
# new jitted closure, by another test of the same shapes) is loaded, not recompiled. Tracing
# still happens, so trace counters ("compiles once") are unaffected. Set before the first
# compile: JAX fixes the cache at its first use (`paraflax.cli.main` later points the config at
# its own cache dir, which no longer changes the cache in use).
_COMPILE_CACHE = tempfile.mkdtemp(prefix="paraflax-test-jax-cache-")
atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Scale logits a little past the target std: recomputing the std after scaling may land a few
# ulps below it on another machine (FMA or not, other reduction order).
STD_MARGIN = 1 + 1e-4

MICRO = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
             max_seq_len=128)


def micro_model(seed: int = 0, logit_std: float = 3.0, **overrides) -> pf.Transformer:
  """A micro model whose logits have std >= 2, so greedy top-2 gaps are not near ties."""
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  model = pf.Transformer(cfg, rngs=nnx.Rngs(seed))
  tokens = jax.random.randint(jax.random.key(seed), (4, 16), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (4, 16))
  logits, _ = model(tokens, pos, pf.masks.causal(jnp.full((4,), 16), 16))
  scale = logit_std * STD_MARGIN / float(jnp.std(logits))
  if cfg.tie_embeddings:
    model.final_norm.scale[...] = model.final_norm.scale[...] * scale
  else:
    model.lm_head[...] = model.lm_head[...] * scale
  logits, _ = model(tokens, pos, pf.masks.causal(jnp.full((4,), 16), 16))
  assert float(jnp.std(logits)) >= 2.0
  return model


def compiled_micro_model(seed: int = 0, logit_std: float = 3.0, **overrides) -> pf.Transformer:
  """`micro_model` built in two compiled calls (init, one forward) instead of op by op, for
  subprocess tests where eager initialisation would dominate; identical on every process."""
  from paraflax.training.run.trainer import init_params
  cfg = pf.ModelConfig(**{**MICRO, **overrides})
  model = nnx.merge(*init_params(cfg, seed))
  tokens = jax.random.randint(jax.random.key(seed), (4, 16), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (4, 16))
  graphdef, params = nnx.split(model)
  std = jax.jit(lambda p: jnp.std(nnx.merge(graphdef, p)(
      tokens, pos, pf.masks.causal(jnp.full((4,), 16), 16))[0]))
  model.lm_head[...] = model.lm_head[...] * (logit_std * STD_MARGIN / std(params))
  assert float(std(nnx.split(model)[1])) >= 2.0
  return model


def compiled_forward(model):
  """`model(tokens, positions, mask)` as one compiled program (the weights are arguments), for
  reference computations over many rows: eager dispatch would compile each op for each new
  shape (and again after `jax.clear_caches()`)."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
  return lambda *args: forward(state, *args)


def full_logits(model, tokens_BxT, positions_BxT=None) -> np.ndarray:
  """float32 logits `[B, T, V]` of whole rows under the causal mask (positions 0..T-1 unless
  given): what a Hugging Face model's forward returns for the same ids."""
  b, t = np.shape(tokens_BxT)
  positions = np.broadcast_to(np.arange(t), (b, t)) if positions_BxT is None else positions_BxT
  logits, _ = model(jnp.asarray(tokens_BxT), jnp.asarray(positions),
                    pf.masks.causal(jnp.full((b,), t), t))
  return np.asarray(logits)


def reference_libs():
  """(torch, transformers): the reference implementation, from the dev extra. A test module that
  needs them is skipped where they are not installed (the lower-bound venv has the test extra
  only); one that is installed but fails to import is an error."""
  return (pytest.importorskip("torch", exc_type=ModuleNotFoundError),
          pytest.importorskip("transformers", exc_type=ModuleNotFoundError))


class StubTokenizer:
  """What a trajectory / teacher store keeps of the tokenizer of the model that made it."""

  def fingerprint(self):
    return "micro"

  def save(self, path):
    path.write_text("{}")


@pytest.fixture(autouse=True)
def _persistent_cache_takes_every_compile():
  """`paraflax.cli.main` raises the threshold to 0.5 s (for users' runs): lower it again."""
  yield
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture
def ctrl_c():
  """SIGINT raises KeyboardInterrupt here and in processes started meanwhile, as in a terminal,
  even where the suite itself was started with SIGINT ignored (`nohup`, `cmd &` in a script)."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def model():
  return micro_model()


def run_cases_on_devices(cases: Path, devices: int = 8, timeout: int = 480) -> None:
  """Run the test file `cases` in a pytest subprocess with `devices` forced CPU devices (the
  flag must be set before JAX starts); fail with its output unless every case passed."""
  env = {**ENVIRON, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
      check=False, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True,
      text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "failed" not in proc.stdout


# ---- subprocess tests started early, in the background --------------------------------------
# A test whose work is a subprocess (forced-device pytest runs, two-process runs, notebook
# kernels) leaves this process idle while it waits. So such work is registered here by its test
# and, when that test is selected, started as the session begins on one background thread (one
# job at a time, in test order), where it overlaps the in-process tests; the test then waits for
# the result and makes every assertion on it as before. Not selected: nothing starts.

# The environment subprocesses get: as the session began, whatever a test running meanwhile
# sets (monkeypatch.setenv) in this process's.
ENVIRON = dict(os.environ)
_JOBS: dict[str, Callable[[Path], Any]] = {}
_STARTED: dict[str, concurrent.futures.Future] = {}


def _job_key(item) -> str:
  return f"{Path(str(item.fspath)).name}::{item.name}"


def background_job(test_file: str, test_name: str, job: Callable[[Path], Any]) -> None:
  """Register `job(tmp_dir)` (no fixtures, no jax in this process, returns its result) as the
  work of the test `test_name` (with its parameters, as pytest names it) of `test_file`."""
  _JOBS[f"{Path(test_file).name}::{test_name}"] = job


def background_result(request, tmp_path: Path):
  """The result of this test's registered job, waited for (raising what the job raised)."""
  key = _job_key(request.node)
  future = _STARTED.pop(key, None)
  return _JOBS[key](tmp_path) if future is None else future.result()


@pytest.fixture(scope="session", autouse=True)
def _start_background_jobs(request, tmp_path_factory):
  # A pytest-xdist worker collects every test but runs only those sent to it: it starts
  # nothing early (its job runs when its test does, while the other worker goes on).
  items = [] if os.environ.get("PYTEST_XDIST_WORKER") else request.session.items
  keys = [k for k in map(_job_key, items) if k in _JOBS]
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="test-subprocess")
  for key in keys:
    _STARTED[key] = pool.submit(_JOBS[key], tmp_path_factory.mktemp("background"))
  yield
  for future in _STARTED.values():  # tests that never ran (-x, interrupted): no new jobs
    future.cancel()
  pool.shutdown(wait=True)
