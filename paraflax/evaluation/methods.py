"""The bench's method rows, read from the method table (`paraflax.methods`), and the sampler
named by the sampling flags (`--temperature`, `--top-k`, `--top-p`)."""

from __future__ import annotations

import dataclasses

from paraflax import sampling
from paraflax.decoding.checks import DoesNotFit
from paraflax.evaluation.bench import Method
from paraflax.methods import METHODS


def sampler_from_flags(temperature: float, top_k: int = 0, top_p: float = 1.0):
  """The sampler of the flags; a combination that would ignore a flag is a ValueError
  (temperature 0 is greedy: no top-k or top-p; top-k and top-p are exclusive)."""
  if not temperature >= 0:
    raise ValueError(f"--temperature must be >= 0 (0 = greedy decoding), got {temperature}")
  if top_k < 0 or not 0 < top_p <= 1:
    raise ValueError(f"--top-k must be >= 0 (0 = off) and --top-p in (0, 1] (1 = off), got "
                     f"{top_k} and {top_p}")
  if temperature == 0 and (top_k or top_p < 1):
    flag = "--top-k" if top_k else "--top-p"
    raise ValueError(f"{flag} needs --temperature > 0 (temperature 0 is greedy decoding, "
                     f"which would ignore {flag})")
  if top_k and top_p < 1:
    raise ValueError("give --top-k or --top-p, not both")
  if temperature == 0:
    return sampling.Greedy()
  if top_k:
    return sampling.TopK(top_k, temperature=temperature)
  if top_p < 1:
    return sampling.TopP(top_p, temperature=temperature)
  return sampling.Temperature(temperature)


DRAFTERS = {"ar": "ar_drafter", "diffusion": "deer"}  # a method's drafter -> `drafters` key


def bench_methods(others=None, drafters=None, ks=None) -> list[Method]:
  """Every generate method the bench runs after the AR baseline, in the table's order, on
  every weights it has rows for. `others` maps a weights name to a model of the base's
  architecture and tokenizer ("jf": Jacobi Forcing, distilled from the base; "tidar": TiDAR,
  trained on from the base); `drafters` maps "deer" (a DEER block-diffusion drafter) and
  "ar_drafter" (a small AR drafter) to (draft model for the base, the ids it may propose:
  `loading.load_drafter`). `ks`: only these n of the swept methods (default: every one of
  their `sweep`)."""
  models = {"base": None, **(others or {})}
  drafters = drafters or {}
  rows = []
  for m in METHODS.values():
    if m.kind != "generate" or m.name == "ar":
      continue
    pair = drafters.get(DRAFTERS[m.drafter]) if m.drafter else None
    if m.drafter and pair is None:
      continue
    draft, vocab = pair or (None, None)
    for weights, name in m.bench.items():
      if weights not in models:
        continue
      for n in [k for k in m.sweep if ks is None or k in ks] if m.sweep else [m.n]:
        dec = m.make(n) if vocab is None else dataclasses.replace(m.make(n), vocab=vocab)
        rows.append(Method(f"{name}_k{n}" if m.sweep else name, dec, m.describe(n),
                           draft_model=draft, model=models[weights], weights=weights))
  return rows


def fitting(methods: list[Method], model) -> tuple[list[Method], list[str]]:
  """The methods whose steps fit their model's (and drafter's) positions, and a line for each
  one that does not: a model of short context skips those rows instead of failing the bench."""
  kept, skipped = [], []
  for m in methods:
    draft = None if m.draft_model is None else m.draft_model.cfg
    try:
      m.decoder.validate((m.model or model).cfg, draft)
    except DoesNotFit as e:
      skipped.append(f"[bench] {m.name} skipped: {e}")
      continue
    kept.append(m)
  return kept, skipped


def infill_methods(greedy: bool) -> list:
  """The AS-ARM table's (name, settings, decoder) rows: every infill method (sequential
  any-order decoding, ASSD with its own and with n-gram drafts, k = 5), greedy or sampled at
  temperature 1."""
  sampler, how = (sampling.Greedy(), "greedy") if greedy else (sampling.Temperature(1.0), "T=1")
  return [(m.bench["asarm"], f"{m.describe()} {how}".strip(), m.make(sampler=sampler))
          for m in METHODS.values() if m.kind == "infill"]
