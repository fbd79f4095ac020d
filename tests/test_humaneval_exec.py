"""HumanEval execution: canonical solutions pass, wrong ones fail, and programs that hang,
crash, exit, fork or allocate without bound neither hang nor harm the caller."""

import time

import pytest

from paraflax.data import load_humaneval
from paraflax.evaluation import humaneval as he

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def problems():
  return load_humaneval()[:4]


def test_canonical_solutions_pass_and_wrong_ones_fail(problems):
  assert he.pass_at_1(problems, [p.canonical_solution for p in problems]) == 1.0
  assert he.pass_at_1(problems, ["    return None\n"] * 4) == 0.0
  half = [p.canonical_solution if i % 2 else "    pass\n" for i, p in enumerate(problems)]
  assert he.pass_at_1(problems, half) == 0.5


def test_completion_is_cut_at_the_next_top_level_statement(problems):
  p = problems[0]
  extra = p.canonical_solution + "\ndef helper():\n    raise SystemExit(1)\nhelper()\n"
  assert he.truncate(extra) == p.canonical_solution
  assert he.pass_at_1([p], [extra]) == 1.0


@pytest.mark.parametrize("body", [
    "    while True:\n        pass\n",  # hangs
    "    import os\n    os._exit(0)\n",  # exits 0 before the tests: must not count as a pass
    "    import os\n    os.fork()\n    while True:\n        pass\n",  # forks, both loop
    "    x = bytearray(1 << 34)\n",  # allocates 16 GiB
    "    import sys\n    sys.setrecursionlimit(10**9)\n    def f(): f()\n    f()\n",  # crashes
])
def test_hostile_programs_fail_fast_without_harm(problems, body):
  t0 = time.perf_counter()
  assert not he.passes(he.program(problems[0], body), timeout=2.0)
  assert time.perf_counter() - t0 < 10


def test_bad_input_is_a_clear_error(problems):
  with pytest.raises(ValueError, match="2 completions"):
    he.pass_at_1(problems, ["", ""])
