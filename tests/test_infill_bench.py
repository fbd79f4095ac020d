"""The any-subset bench: single-line HumanEval tasks whose canonical fill passes, quality
metrics on known inputs, and a miniature bench (greedy ASSD = sequential, calls <= tokens)."""

import numpy as np
import pytest
from conftest import micro_model

import paraflax as pf
from paraflax.data import load_humaneval
from paraflax.data.tokenizer import Tokenizer
from paraflax.decoders import ASSD, AnyOrder
from paraflax.evaluation import infill_bench as ib
from paraflax.evaluation.humaneval import passes

TOKENIZER = "checkpoints/tiny_ar/tokenizer.json"


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.load(TOKENIZER)


@pytest.mark.slow
def test_single_line_tasks_hide_one_line_that_the_tests_need(tok):
  problems = load_humaneval()[:2]
  tasks = ib.single_line_tasks(tok.encode, problems, 128, tok.eos_id)
  n_lines = sum(1 for p in problems for s in p.canonical_solution.split("\n") if s.strip())
  assert len(tasks) == n_lines
  for t in tasks:
    assert t.canvas.shape == (128,) and (t.canvas == pf.HOLE).sum() == len(tok.encode(t.line))
    holes = np.flatnonzero(t.canvas == pf.HOLE)
    assert np.all(np.diff(holes) == 1)  # one contiguous line
    window = t.canvas.copy()
    window[holes] = tok.encode(t.line)
    text = tok.decode([x for x in window.tolist() if x != tok.eos_id])
    assert t.line in text and text in t.prefix + t.line + t.suffix  # a window of the program
  assert all(passes(ib.line_program(t, t.line)) for t in tasks)  # the reference fill passes
  assert not any(passes(ib.line_program(t, "    pass")) for t in tasks[:4])


@pytest.mark.fast
def test_metrics_on_known_inputs():
  assert ib.entropy_bits(np.array([1, 1, 2, 2])) == pytest.approx(1.0)
  assert ib.entropy_bits(np.array([5, 5, 5])) == pytest.approx(0.0)
  uniform = micro_model(seed=0)
  uniform.lm_head[...] = uniform.lm_head[...] * 0  # every next-token distribution uniform
  rows = np.random.default_rng(0).integers(0, 48, (5, 12))
  np.testing.assert_allclose(ib.generative_perplexity(uniform, rows, batch_size=4), 48, rtol=1e-5)
  a = np.random.default_rng(1).normal(0, 1, 200)
  assert ib.welch_p(a, a) == 1.0 and ib.welch_p(a, a + 2) < 1e-6
  canvas = ib.masked_windows(np.zeros((3, 40), np.int32), 0.95)
  assert ((canvas == pf.HOLE).sum(1) == 38).all()


@pytest.mark.slow
def test_miniature_infill_bench(tok):
  asarm = micro_model(seed=4, vocab_size=2048, two_stream=True, max_seq_len=256)
  judge = micro_model(seed=5, vocab_size=2048, max_seq_len=256)
  windows = np.random.default_rng(2).integers(3, 2048, (6, 32))
  canvases = ib.masked_windows(windows, 0.9)
  sampler = pf.Temperature(1.0)
  methods = [("sequential", "", AnyOrder(sampler)), ("assd_self", "k=5", ASSD(5, sampler=sampler)),
             ("assd_ngram", "k=5", ASSD(5, draft="ngram", sampler=sampler))]
  rows = ib.run_infill_bench(asarm, methods, "generate", canvases, judge=judge, batch_size=4)
  assert [r.method for r in rows] == ["sequential", "assd_self", "assd_ngram"]
  for r in rows:
    assert r.calls <= r.tokens and r.gen_ppl > 1 and r.entropy > 0 and r.exact_match_vs_ar is None
  assert rows[0].tokens_per_forward == 1.0 and rows[0].gen_ppl_p == 1.0
  tasks = ib.single_line_tasks(tok.encode, load_humaneval()[:1], 96, tok.eos_id)
  greedy = [("sequential", "", AnyOrder()), ("assd_self", "k=5", ASSD(5))]
  rows = ib.run_infill_bench(asarm, greedy, "line", np.stack([t.canvas for t in tasks]),
                             line_tasks=tasks, decode=tok.decode, batch_size=4)
  assert rows[1].exact_match_vs_ar == 1.0 and 0.0 <= rows[1].pass_at_1 <= 1.0
  assert "assd_self" in ib.format_infill_table(rows)
