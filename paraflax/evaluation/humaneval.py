"""HumanEval pass@1: run each completion against the problem's tests in a sandboxed subprocess.

A generated program may loop, crash, exit, fork or allocate without bound: each one runs in
its own session (killed as a group at the timeout), isolated mode (`python -I`), an empty
temporary working directory, no stdin, and CPU-time, memory and file-size limits. A program
passes only if, within the timeout, it exits 0 after printing a random nonce that follows the
tests (so `os._exit(0)` inside the completion is not a pass).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from paraflax.data.humaneval import Problem, load_humaneval

# a completion ends where the model starts the next top-level statement (HumanEval's stops)
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
MEMORY_BYTES = 1 << 30


def truncate(completion: str) -> str:
  """The function body only: cut at the first top-level stop sequence."""
  cut = min((i for i in (completion.find(s) for s in STOPS) if i >= 0), default=len(completion))
  return completion[:cut]


def program(problem: Problem, completion: str) -> str:
  """The file that is executed: prompt + completion + the problem's tests + the check call."""
  return (problem.prompt + truncate(completion) + "\n\n" + problem.test + "\n\n"
          + f"check({problem.entry_point})\n")


# sets the limits in the child, then runs the program (no preexec_fn: forking a JAX process
# and running Python before exec can deadlock; this way the child is a plain spawn)
_LAUNCHER = """
import resource, runpy, sys
cpu, mem = int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def passes(source: str, timeout: float = 5.0) -> bool:
  """Whether `source` runs to its end and exits 0 within `timeout` seconds in the sandbox."""
  nonce = secrets.token_hex(16)
  with tempfile.TemporaryDirectory(prefix="paraflax-humaneval-") as tmp:
    path, out = os.path.join(tmp, "program.py"), os.path.join(tmp, "stdout")
    with open(path, "w") as f:
      f.write(source + f"\nprint({nonce!r})\n")
    with open(out, "wb") as stdout:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-c", _LAUNCHER, path, str(int(timeout) + 1), str(MEMORY_BYTES)],
          cwd=tmp, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL,
          start_new_session=True, env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"})
    try:
      ok = proc.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
      ok = False
    finally:
      try:  # the whole session: children the program forked die too
        os.killpg(proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      proc.wait()
    with open(out, "rb") as f:
      return ok and f.read().rstrip().endswith(nonce.encode())


def pass_at_1(problems: Sequence[Problem], completions: Sequence[str], timeout: float = 5.0,
              workers: int = 2) -> float:
  """Fraction of problems whose (one, greedy) completion passes its tests."""
  if len(problems) != len(completions):
    raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
  if not problems:
    raise ValueError("pass@1 of no problems")
  with ThreadPoolExecutor(workers) as pool:
    ok = list(pool.map(lambda pc: passes(program(*pc), timeout), zip(problems, completions)))
  return sum(ok) / len(ok)


def humaneval_prompts(encode, n: int, max_tokens: int) -> list[list[int]]:
  """The first n HumanEval prompts, tokenised, keeping the last `max_tokens` tokens."""
  return [encode(p.prompt)[-max_tokens:] for p in load_humaneval()[:n]]


def greedy_pass_at_1(model, tok, prompts, max_new_tokens: int) -> float:
  """pass@1 of the model's greedy completions of the first HumanEval problems (`prompts`: their
  prompts, tokenised, as `humaneval_prompts` gives them)."""
  import jax

  from paraflax.decoding.generate import generate
  out = jax.device_get(generate(model, prompts, max_new_tokens=max_new_tokens,
                                eos_id=tok.eos_ids))
  texts = [tok.decode(row[:n].tolist()) for row, n in zip(out.tokens, out.lengths)]
  return pass_at_1(load_humaneval()[:len(prompts)], texts)
