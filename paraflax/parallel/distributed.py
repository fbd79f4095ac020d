"""Multi-host start-up: `jax.distributed.initialize` driven by arguments, flags or environment.

Every process of a run calls `initialize()` before any other JAX work, then builds the same
mesh (`sharding.make_mesh`, over all processes' devices) and runs the same program. Sources,
first given wins: arguments, then `PARAFLAX_COORDINATOR` (host:port of process 0),
`PARAFLAX_NUM_PROCESSES`, `PARAFLAX_PROCESS_ID`. `PARAFLAX_DISTRIBUTED=auto` (or `auto=True`)
lets JAX detect the cluster itself (Cloud TPU, SLURM, ...). With none of these it is a
single-process run and nothing happens.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

import jax

ENV_COORDINATOR = "PARAFLAX_COORDINATOR"
ENV_NUM_PROCESSES = "PARAFLAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PARAFLAX_PROCESS_ID"
ENV_AUTO = "PARAFLAX_DISTRIBUTED"


def _int(value, name: str) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be an integer, got {value!r}") from None


def resolve(coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, env: Mapping[str, str] | None = None
            ) -> tuple[str, int, int] | None:
  """(coordinator, num_processes, process_id) from arguments then `env`; None if no
  coordinator is given anywhere. Raises ValueError on incomplete or inconsistent settings."""
  env = os.environ if env is None else env
  coordinator = coordinator or env.get(ENV_COORDINATOR) or None
  n = _int(num_processes if num_processes is not None else env.get(ENV_NUM_PROCESSES),
           f"num_processes ({ENV_NUM_PROCESSES})")
  i = _int(process_id if process_id is not None else env.get(ENV_PROCESS_ID),
           f"process_id ({ENV_PROCESS_ID})")
  if coordinator is None:
    if n is not None or i is not None:
      raise ValueError(f"num_processes/process_id given without a coordinator address: set "
                       f"{ENV_COORDINATOR}=host:port (process 0's address)")
    return None
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise ValueError(f"coordinator address must be host:port, got {coordinator!r}")
  if n is None or i is None:
    raise ValueError(f"a coordinator needs num_processes ({ENV_NUM_PROCESSES}) and process_id "
                     f"({ENV_PROCESS_ID}), got {n} and {i}")
  if n < 1 or not 0 <= i < n:
    raise ValueError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got "
                     f"num_processes={n}, process_id={i}")
  return coordinator, n, i


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool | None = None,
               timeout_s: int = 300, env: Mapping[str, str] | None = None) -> bool:
  """Join the multi-process run if one is configured; returns whether it did.

  Call before any other JAX work. `auto` (default: `PARAFLAX_DISTRIBUTED=auto`) calls
  `jax.distributed.initialize()` without arguments, for clusters JAX detects itself.
  """
  env = os.environ if env is None else env
  spec = resolve(coordinator, num_processes, process_id, env)
  if spec is None:
    if auto if auto is not None else env.get(ENV_AUTO, "").lower() == "auto":
      jax.distributed.initialize(initialization_timeout=timeout_s)
      return True
    return False
  coordinator, n, i = spec
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=i,
                             initialization_timeout=timeout_s)
  return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """`--coordinator`, `--num-processes`, `--process-id` (defaults from the environment)."""
  group = parser.add_argument_group("multi-host (or set PARAFLAX_COORDINATOR, ...)")
  group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help=f"process 0's address (env {ENV_COORDINATOR})")
  group.add_argument("--num-processes", type=int, default=None,
                     help=f"processes in the run (env {ENV_NUM_PROCESSES})")
  group.add_argument("--process-id", type=int, default=None,
                     help=f"this process's index (env {ENV_PROCESS_ID})")


def initialize_from_args(args: argparse.Namespace) -> bool:
  """`initialize` with the flags of `add_arguments` (the environment fills the gaps)."""
  return initialize(args.coordinator, args.num_processes, args.process_id)
