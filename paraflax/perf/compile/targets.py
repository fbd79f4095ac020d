"""Compile targets: the accelerators `paraflax perf compile --target T` compiles for, on a host
without them (deviceless ahead-of-time compilation).

`T` is a name of `TARGETS`, optionally with a mesh: `h200`, `tpu-v5e`, `tpu-v5e:2x4` (eight
v5e chips), `h100:2` (two GPUs on one host). `devices(target)` gives the target's abstract
devices (`jax.experimental.topologies`): arrays placed on them lower and compile for the target,
never run. GPUs need the JAX CUDA plugin and CUDA's compiler, TPUs libtpu (the `compile` extra);
both need JAX to run on the CPU (`check_process` sees to it), or the plugins try to open
devices that are not here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
from pathlib import Path

GIB = 2**30
GPU_CONFIGS = Path(__file__).parent / "gpu_targets"  # openxla/xla's specs (README there)
# libtpu's variables for a host with no TPU: no cloud metadata query (it would wait on the
# network), no worker discovery, and no lock on a chip it will not open (so several
# processes may compile for TPUs at once: a background `perf compile` beside the suite)
TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-1",
           "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@dataclasses.dataclass(frozen=True)
class Target:
  """One accelerator kind and how many of it (`chips`, arranged `grid`)."""

  name: str  # the spelling of `--target` and of a row's `target`
  platform: str  # "gpu" | "tpu": the `RunControl.platform` programs resolve for
  device_kind: str  # `jax.Device.device_kind` of the real device (peaks: `paraflax.devices`)
  capacity: int  # memory per device in bytes
  source: str  # GPU: the `gpu_targets/` config; TPU: the topology's chip name
  grid: tuple[int, ...] = (1,)

  @property
  def chips(self) -> int:
    return math.prod(self.grid)


def _gpu(name: str, config: str) -> Target:
  text = (GPU_CONFIGS / config).read_text()
  kind = re.search(r'device_description_str: "([^"]+)"', text).group(1)
  memory = int(re.search(r"device_memory_size: (\d+)", text).group(1))
  return Target(name, "gpu", kind, memory, config)


# TPU memory: HBM per chip (Google Cloud's system-architecture pages)
TARGETS = {t.name: t for t in (
    _gpu("a100", "a100_sxm_80.txtpb"), _gpu("h100", "h100_sxm.txtpb"), _gpu("h200", "h200.txtpb"),
    Target("tpu-v5e", "tpu", "TPU v5 lite", 16 * GIB, "v5e"),
    Target("tpu-v6e", "tpu", "TPU v6 lite", 32 * GIB, "v6e"))}


def parse(spec: str) -> Target:
  """The target `spec` names (`h200`, `tpu-v5e:2x4`, `h100:2`); one ValueError line when it
  names none."""
  name, _, grid = spec.partition(":")
  if name not in TARGETS:
    raise ValueError(f"unknown target {spec!r}: pick one of {', '.join(TARGETS)} "
                     "(a mesh after a colon: tpu-v5e:2x4, h100:2)")
  target = TARGETS[name]
  if not grid:
    return target
  if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", grid):
    raise ValueError(f"target {spec!r}: the mesh after the colon is chips per axis, e.g. 2x4")
  dims = tuple(int(d) for d in grid.split("x"))
  if target.platform == "gpu" and len(dims) != 1:
    raise ValueError(f"target {spec!r}: a GPU mesh is one number, the GPUs of one host")
  if target.platform == "tpu" and len(dims) != 2:
    raise ValueError(f"target {spec!r}: a TPU mesh is two numbers, chips per axis (2x4)")
  return dataclasses.replace(target, name=spec, grid=dims)


def check_process() -> None:
  """Run JAX on this host's CPU, as compiling for a target needs (set before JAX starts its
  backends; a process set to another platform, or already started, is refused in one line),
  with libtpu's host variables (`TPU_ENV`)."""
  import jax
  from jax._src import xla_bridge
  for k, v in TPU_ENV.items():
    os.environ.setdefault(k, v)
  if jax.config.jax_platforms == "cpu":
    return
  if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
    raise RuntimeError("compiling for a target needs JAX on the CPU: run with JAX_PLATFORMS=cpu "
                       f"(this process has {jax.config.jax_platforms or 'started its backends'})")
  jax.config.update("jax_platforms", "cpu")


@functools.cache
def devices(target: Target) -> tuple:
  """The target's abstract devices, `target.chips` of them (a mesh's in row-major order)."""
  check_process()
  from jax.experimental import topologies
  try:
    if target.platform == "gpu":
      config = (GPU_CONFIGS / target.source).read_text()
      topo = topologies.get_topology_desc(target.name.split(":")[0], "cuda", target_config=config,
                                          topology=f"1x1x{target.chips}")
    else:
      x, y = target.grid if len(target.grid) == 2 else (1, 1)
      topo = topologies.get_topology_desc(
          f"{target.source}:{x}x{y}", "tpu", chip_config_name="default",
          chips_per_host_bounds=(min(x, 2), min(y, 4), 1), num_slices=1, wrap=(False,) * 3)
  except Exception as e:  # a missing plugin: say what to install
    need = "the JAX CUDA plugin and CUDA's compiler" if target.platform == "gpu" else "libtpu"
    raise RuntimeError(f"cannot compile for {target.name}: {type(e).__name__}: {e} (needs "
                       f"{need}: pip install -e '.[compile]')") from None
  found = tuple(topo.devices)
  if len(found) != target.chips:
    raise RuntimeError(f"{target.name}: the topology has {len(found)} devices, expected "
                       f"{target.chips}")
  return found


def compiler_options(target: Target) -> dict:
  """XLA's options for compiling for `target` here (`jax.stages.Lowered.compile`'s). A GPU's:
  autotuning off. Deviceless, XLA cannot autotune, yet at its default level its config
  assigner still works through every GEMM and fusion candidate, then assigns the configs
  level 0 assigns: the same optimised HLO (`tests/test_compile.py`) in half a training
  step's compile time."""
  return {"xla_gpu_autotune_level": 0} if target.platform == "gpu" else {}


@contextlib.contextmanager
def compiling_for(target: Target):
  """Trace and compile for `target`: its first device is JAX's default device (Pallas and
  Triton kernels read it), and tokamax lowers its kernels for it instead of checking the
  host's devices (`tokamax.config.cross_compile`), its default configs unannounced (no
  device here to autotune on: each kernel would log an autotuning cache miss)."""
  import logging

  import jax

  from paraflax.model.attention import tokamax_module
  absl = logging.getLogger("absl")
  absl.addFilter(_no_autotuning_misses)
  try:
    with jax.default_device(devices(target)[0]), tokamax_module().config.cross_compile(True):
      yield
  finally:
    absl.removeFilter(_no_autotuning_misses)


def _no_autotuning_misses(record) -> bool:
  return not record.getMessage().startswith("Autotuning cache miss")
