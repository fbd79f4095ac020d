"""The `paraflax` command end to end on a micro run: train, generate text, bench JSON."""

import json
import re

import pytest

from paraflax import cli

CONFIG, JF_CONFIG = "micro_ar", "micro_jacobi_forcing"  # recipes, by name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  cli.CACHE = root / "cache"
  wd = root / "run"
  assert cli.main(["train", "--config", CONFIG, "--workdir", str(wd), "--steps", "12",
                   "--set", f"data.cache_dir={root / 'data'}", "--set", "data.progress=False"]) == 0
  return wd


@pytest.mark.slow
def test_generate_is_text_in_text_out(workdir, capsys):
  assert cli.main(["generate", "--workdir", str(workdir), "--prompt", "def add(a, b):",
                   "--max-new-tokens", "8"]) == 0
  out, err = capsys.readouterr()
  assert out.startswith("def add(a, b):") and len(out) > len("def add(a, b):")
  assert "tokens/s" in err


@pytest.mark.slow
def test_bench_writes_the_contract_json(workdir, tmp_path, capsys):
  path = tmp_path / "bench.json"
  assert cli.main(["bench", "--workdir", str(workdir), "--prompts", "3", "--max-new-tokens",
                   "8", "--batch-size", "2", "--json", str(path)]) == 0
  # the released MR loop's 80-token step does not fit the 64 positions: skipped, said so
  assert "[bench] jacobi_released_mr skipped: JacobiMR" in capsys.readouterr().out
  rows = json.loads(path.read_text())
  assert [r["method"] for r in rows] == ["ar", "jacobi", "jacobi_released", "jacobi_mr",
                                         "prompt_lookup"]
  ar = rows[0]
  for row in rows[1:]:
    assert row["exact_match_vs_ar"] == 1.0  # greedy parallel decoders reproduce AR
    assert row["tokens_per_forward"] >= 1.0
  for key in ("tokens_per_forward", "tokens_per_second", "speedup_vs_ar", "exact_match_vs_ar"):
    assert key in ar
  assert ar["tokens_per_forward"] == 1.0  # AR: one forward (the prefill counted) per token
  assert ar["speedup_vs_ar"] == 1.0 and ar["exact_match_vs_ar"] == 1.0
  assert 0.0 <= ar["humaneval_pass_at_1"] <= 1.0  # executed; a 12-step micro model passes none
  for row in rows:  # steps that emitted i tokens, for i >= 1, add up to the tokens
    hist = row["accepted_histogram"]
    assert hist[0] == 0 and sum(i * c for i, c in enumerate(hist)) + 3 == row["tokens"]
    assert row["max_accepted"] == len(hist) - 2 and 0 <= row["mean_accepted"] <= len(hist) - 2
  assert ar["max_accepted"] == 0 and ar["mean_accepted"] == 0.0
  for png in ("bench_speed.png", "bench_accepted.png"):
    assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
  assert ar["tokens_per_second"] > 0


@pytest.mark.fast
def test_user_errors_are_one_line(tmp_path, capsys):
  assert cli.main(["generate", "--workdir", str(tmp_path / "missing"), "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("paraflax generate: error:") and "missing" in err and "\n" not in err


@pytest.mark.fast
@pytest.mark.parametrize("flags, match", [
    (["--top-k", "5"], "--top-k needs --temperature > 0"),
    (["--temperature", "0", "--top-p", "0.9"], "--top-p needs --temperature > 0"),
    (["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9"], "--top-k or --top-p, not both"),
    (["--temperature", "0.8", "--top-p", "1.5"], "--top-p in \\(0, 1\\]"),
    (["--temperature", "-1"], "--temperature must be >= 0 \\(0 = greedy decoding\\), got -1.0$"),
])
def test_sampling_flags_that_would_be_ignored_are_refused(tmp_path, capsys, flags, match):
  """Checked before the model loads (the workdir does not exist): one line, exit code 2,
  in the command's own terms (flags, not API calls)."""
  argv = ["generate", "--workdir", str(tmp_path / "missing"), "--prompt", "x", *flags]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("paraflax generate: error:") and "\n" not in err
  assert re.search(match, err) and "missing" not in err and "()" not in err


@pytest.mark.fast
def test_a_missing_or_empty_prompts_file_is_named(tmp_path, capsys):
  (tmp_path / "empty.jsonl").write_text("\n")
  for name, says in (("nope.jsonl", "not found"), ("empty.jsonl", "holds no records: one JSON "
                     "object per line, {\"prompt\": TEXT} or {\"messages\": [...]}")):
    file = tmp_path / name
    assert cli.main(["generate", "--workdir", str(tmp_path / "missing"), "--prompts-file",
                     str(file)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paraflax generate: error: --prompts-file {str(file)!r} {says}")


@pytest.mark.slow
def test_jacobi_forcing_round_trip_collect_train_bench(workdir, tmp_path):
  """collect-trajectories -> a Jacobi Forcing run initialised from the AR run -> bench rows."""
  store, jf = tmp_path / "traj", tmp_path / "jf"
  assert cli.main(["collect-trajectories", "--workdir", str(workdir), "--out", str(store),
                   "--block-size", "4", "--num-blocks", "2", "--examples", "32",
                   "--min-prompt-len", "4", "--max-prompt-len", "16", "--batch-size", "8"]) == 0
  assert json.loads((store / "progress.json").read_text()) == {"batches": 4}  # 4 x 8 examples
  assert cli.main(["train", "--config", JF_CONFIG, "--workdir", str(jf),
                   "--set", f"init_from={workdir}", "--set", f"data_source_args.path={store}",
                   "--set", "data.seq_len=32"]) == 0  # 16 prompt + 2 x 2 blocks x 4
  metrics = [json.loads(line) for line in (jf / "metrics.jsonl").read_text().splitlines()]
  assert {"consistency", "ar_loss", "noisy_accuracy"} <= set(metrics[-2])
  path = tmp_path / "bench.json"
  assert cli.main(["bench", "--workdir", str(workdir), "--jf-workdir", str(jf), "--prompts", "2",
                   "--max-new-tokens", "8", "--batch-size", "2", "--json", str(path)]) == 0
  rows = {r["method"]: r for r in json.loads(path.read_text())}
  assert len(rows) == 8  # ar, jacobi (two variants), jacobi_mr, prompt_lookup + the three
  #   distilled rows
  for name in ("jacobi_forcing", "jacobi_forcing_released", "jacobi_forcing_mr"):
    assert rows[name]["weights"] == "jf"
    assert rows[name]["exact_match_vs_ar"] == 1.0  # vs greedy AR of the distilled weights
    assert rows[name]["heldout_loss"] > 0 and rows[name]["heldout_loss"] != rows["ar"]["heldout_loss"]


@pytest.mark.slow
def test_tidar_continued_from_the_ar_run_benches_exactly(workdir, tmp_path):
  tidar = tmp_path / "tidar"
  assert cli.main(["train", "--config", CONFIG, "--workdir", str(tidar), "--steps", "3",
                   "--set", f"init_from={workdir}", "--set", "objective=tidar",
                   "--set", "model.mask_token_id=2", "--set", "data.progress=False",
                   "--set", f"data.cache_dir={workdir.parent / 'data'}"]) == 0
  path = tmp_path / "bench.json"
  assert cli.main(["bench", "--workdir", str(workdir), "--tidar-workdir", str(tidar),
                   "--prompts", "2", "--max-new-tokens", "8", "--batch-size", "2",
                   "--json", str(path)]) == 0
  rows = {r["method"]: r for r in json.loads(path.read_text())}
  for k in (4, 8, 16):
    row = rows[f"tidar_k{k}"]
    assert row["weights"] == "tidar" and row["exact_match_vs_ar"] == 1.0  # beta = 1
    assert row["heldout_diffusion_loss"] > 0


@pytest.mark.slow
def test_drafter_and_asarm_rows(workdir, tmp_path):
  """A DEER-shaped drafter, an AR drafter and an AS-ARM trained on from the AR run (the query
  vector is the one new parameter) give exact speculative rows and the any-subset table."""
  common = ["--steps", "2", "--set", "data.progress=False",
            "--set", f"data.cache_dir={workdir.parent / 'data'}"]
  deer, asarm = tmp_path / "deer", tmp_path / "asarm"
  assert cli.main(["train", "--config", CONFIG, "--workdir", str(deer), "--set",
                   "model.mask_token_id=2", "--set", "model.sep_token_id=3", *common]) == 0
  assert cli.main(["train", "--config", CONFIG, "--workdir", str(asarm), "--set",
                   "model.two_stream=True", "--set", "objective=asarm", "--set",
                   f"init_from={workdir}", *common]) == 0
  path = tmp_path / "bench.json"
  assert cli.main(["bench", "--workdir", str(workdir), "--deer-workdir", str(deer),
                   "--ar-drafter-workdir", str(workdir), "--asarm-workdir", str(asarm),
                   "--prompts", "2", "--max-new-tokens", "8", "--batch-size", "2",
                   "--infill-windows", "2", "--infill-length", "32", "--json", str(path)]) == 0
  rows = json.loads(path.read_text())
  by_name = {(r["method"], r.get("task")): r for r in rows}
  for k in (4, 8, 16):
    assert by_name[(f"deer_k{k}", None)]["exact_match_vs_ar"] == 1.0
    spec = by_name[(f"spec_ar_k{k}", None)]  # the verifier drafting for itself: all accepted
    # (7 tokens follow the prefill's: at most 6 drafts + the bonus in one step)
    assert spec["exact_match_vs_ar"] == 1.0 and spec["max_accepted"] == min(k, 6)
  for task in ("generate", "line"):
    for method in ("any_order", "assd_self", "assd_ngram"):
      row = by_name[(method, task)]
      assert row["calls"] <= row["tokens"] and row["weights"] == "asarm"
    if task == "line":
      assert by_name[("assd_self", task)]["exact_match_vs_ar"] == 1.0
      assert 0.0 <= by_name[("assd_self", task)]["pass_at_1"] <= 1.0
    else:
      assert by_name[("assd_self", task)]["gen_ppl"] > 1


@pytest.mark.fast
@pytest.mark.parametrize("flags, match", [
    (["--decoder", "deer"], "--decoder deer needs a draft model"),
    (["--decoder", "speculative"], "--decoder speculative needs a draft model"),
    (["--decoder", "jacobi", "--draft", "d"], "--decoder jacobi takes no draft model"),
    (["--decoder", "ar", "--block-size", "4"], "--block-size does not apply to the ar decoder"),
])
def test_decoder_flags_are_checked_before_the_model_loads(tmp_path, capsys, flags, match):
  argv = ["generate", "--workdir", str(tmp_path / "missing"), "--prompt", "x", *flags]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("paraflax generate: error:") and "\n" not in err
  assert match in err and "missing" not in err


@pytest.mark.fast
def test_demo_benches_its_stages_quick_shrinks_the_bench_and_hf_benches_that_dir(
    tmp_path, monkeypatch):
  """`paraflax demo` with the stages, completions and bench faked: the stages' workdirs (one
  given on the command line kept), made by the installed recipes from the shipped models in
  --shipped (default: the clone's checkpoints/), --quick's 4 prompts x 32 tokens, the JSON in
  the cache."""
  import collections
  import types

  import numpy as np

  from paraflax.apps import demo
  from paraflax.training.config.recipes import RECIPES
  out = collections.namedtuple("Out", "tokens lengths")
  tok = types.SimpleNamespace(encode=lambda text: [1], decode=lambda ids: "", eos_id=0)
  runs, builds = [], []
  monkeypatch.setattr(cli, "CACHE", tmp_path)
  monkeypatch.setattr(demo, "ensure", lambda name, b: builds.append(b) or b.cache / name)
  monkeypatch.setattr(demo, "load_model", lambda workdir: (None, tok, None))
  monkeypatch.setattr(demo, "humaneval_prompts", lambda encode, n, m: [[1, 2]] * n)
  monkeypatch.setattr(demo, "generate", lambda model, prompts, **kw: out(
      np.zeros((len(prompts), 2), np.int32), np.zeros(len(prompts), np.int32)))
  monkeypatch.setattr(demo.suite, "run", lambda models, s, log=print: runs.append((models, s)))
  assert cli.main(["demo", "--quick", "--tidar-workdir", "mine"]) == 0
  (models, s), d = runs[-1], tmp_path / "demo"
  assert models.workdir == str(d / "tiny_ar") and models.hf is None
  assert models.jf_workdir == str(d / demo.JACOBI_FORCING) and models.tidar_workdir == "mine"
  assert models.asarm_workdir == str(d / "asarm") and models.deer_workdir == str(d / "deer_drafter")
  assert (s.prompts, s.max_new_tokens, s.json) == (4, 32, str(d / "bench.json"))
  assert (builds[-1].configs, str(builds[-1].shipped)) == (RECIPES, "checkpoints")
  assert cli.main(["demo", "--shipped", str(tmp_path / "mine")]) == 0
  assert builds[-1].shipped == tmp_path / "mine"
  assert cli.main(["demo", "--hf", "hfdir", "--prompts", "2", "--json", "x.json"]) == 0
  models, s = runs[-1]
  assert (models.hf, models.workdir, s.prompts, s.max_new_tokens, s.json) == (
      "hfdir", None, 2, 64, "x.json")
