"""Decoders by name: the bench's method tables, `generate --decoder`'s names, and the sampler
named by the sampling flags (`--temperature`, `--top-k`, `--top-p`)."""

from __future__ import annotations

import dataclasses

from paraflax import decoders, sampling
from paraflax.evaluation.bench import Method


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


MR_SETTINGS = "K1 pool16 C3"  # the bench's MR: the best of README's sweep at 64 tokens/forward


def mr_decoder(n: int = 16, sampler=None):
  """The bench's Jacobi + MR decoder (`MR_SETTINGS`, the released recycling rule)."""
  return decoders.JacobiMR(block_size=n, num_blocks=1, pool_size=16, num_candidates=3,
                           sampler=sampler or sampling.Greedy())


# `generate --decoder` name -> (decoder of (block size, sampler), default block size, needs a
# draft model); the settings are the bench's
DECODERS = {
    "ar": (lambda n, s: decoders.AR(s), None, False),
    "jacobi": (lambda n, s: decoders.Jacobi(block_size=n, sampler=s), 16, False),
    "jacobi-mr": (mr_decoder, 16, False),
    "tidar": (lambda n, s: decoders.TiDAR(block_size=n, beta=1.0, sampler=s), 8, False),
    "speculative": (lambda n, s: decoders.Speculative(n, sampler=s), 4, True),
    "deer": (lambda n, s: decoders.DEER(n, sampler=s), 8, True),
    "prompt-lookup": (lambda n, s: decoders.PromptLookup(max_ngram=3, num_tokens=n, sampler=s),
                      8, False),
}


def decoder(name: str, sampler=None, block_size: int | None = None, ngram: int | None = None):
  """The decoder `name` (a key of `DECODERS`) with its default settings; `block_size` sets its
  tokens per step (Jacobi block, drafts of TiDAR, speculative, DEER and prompt lookup), `ngram`
  the longest n-gram prompt lookup matches."""
  if name not in DECODERS:
    raise ValueError(f"unknown decoder {name!r}: pick one of {', '.join(DECODERS)}")
  make, default, _ = DECODERS[name]
  if block_size is not None and default is None:
    raise ValueError(f"--block-size does not apply to the {name} decoder")
  dec = make(default if block_size is None else block_size, sampler or sampling.Greedy())
  if ngram is None:
    return dec
  if not hasattr(dec, "max_ngram"):
    raise ValueError(f"--ngram does not apply to the {name} decoder (only prompt-lookup)")
  return dataclasses.replace(dec, max_ngram=ngram)


def needs_drafter(name: str) -> bool:
  return DECODERS[name][2]


def bench_methods(others=None, drafters=None):
  """Every method the bench runs after the AR baseline. `others` maps a weights name to a
  model of the base's architecture and tokenizer: "jf" (Jacobi Forcing, distilled from the
  base) adds its rows, "tidar" (TiDAR, trained on from the base) adds TiDAR rows. `drafters`
  maps "deer" (a DEER block-diffusion drafter) and "ar_drafter" (a small AR drafter) to
  (draft model for the base, the ids it may propose: `loading.load_drafter`): speculative rows
  at k = 4, 8, 16."""
  others, drafters = others or {}, drafters or {}
  mr, mr_label = mr_decoder(), f"n16 {MR_SETTINGS}"
  methods = [Method("jacobi", decoders.Jacobi(block_size=16), "block 16"),
             Method("jacobi_mr", mr, mr_label),
             Method("prompt_lookup", decoders.PromptLookup(max_ngram=3, num_tokens=8), "n<=3 k=8")]
  if "jf" in others:
    jf = others["jf"]
    methods += [Method("jacobi_forcing", decoders.Jacobi(block_size=16), "block 16",
                       model=jf, weights="jf"),
                Method("jacobi_forcing_mr", mr, mr_label, model=jf, weights="jf")]
  if "tidar" in others:
    methods += [Method(f"tidar_k{k}", decoders.TiDAR(block_size=k, beta=1.0), f"block {k} beta 1",
                       model=others["tidar"], weights="tidar") for k in (4, 8, 16)]
  for name, kind, key in (("deer", decoders.DEER, "deer"),
                          ("spec_ar", decoders.Speculative, "ar_drafter")):
    if key in drafters:
      draft, vocab = drafters[key]
      methods += [Method(f"{name}_k{k}", kind(k, vocab=vocab), f"block {k}", draft_model=draft)
                  for k in (4, 8, 16)]
  return methods


def infill_methods(greedy: bool) -> list:
  """The AS-ARM table's (name, settings, decoder) rows: sequential any-order sampling and ASSD
  with its own drafts and with n-gram drafts (k = 5); greedy, or sampled at temperature 1."""
  from paraflax.decoders import ASSD, AnyOrder
  if greedy:
    return [("any_order", "greedy", AnyOrder()), ("assd_self", "k=5 greedy", ASSD(5)),
            ("assd_ngram", "k=5 greedy", ASSD(5, draft="ngram"))]
  sampled = sampling.Temperature(1.0)
  return [("any_order", "T=1", AnyOrder(sampled)),
          ("assd_self", "k=5 T=1", ASSD(5, sampler=sampled)),
          ("assd_ngram", "k=5 T=1", ASSD(5, draft="ngram", sampler=sampled))]
