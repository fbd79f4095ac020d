"""The one table of decoding methods: each one's CLI name, label, how it is built with the
bench's defaults, the draft model it needs and its kind (`generate` or `infill`).

`paraflax generate --decoder NAME`, `paraflax bench` (`evaluation.methods.bench_methods`),
`paraflax perf decode` and the notebooks read `METHODS`; a new decoder gets its entry here.

    pf.methods.decoder("jacobi")                 # Jacobi(block_size=16): the bench's setting
    pf.methods.decoder("prompt-lookup", block_size=4, ngram=2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from paraflax import decoders, sampling

MR_SETTINGS = "K1 pool16 C3"  # the bench's MR: the best of README's sweep at 64 tokens/forward


def mr_decoder(n: int = 16, sampler=None):
  """The bench's Jacobi + MR decoder (`MR_SETTINGS`; paraflax's variant, its "stream"
  recycling rule; the released loop is `jacobi-mr-released`)."""
  return decoders.JacobiMR(block_size=n, num_blocks=1, pool_size=16, num_candidates=3,
                           sampler=sampler or sampling.Greedy())


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One decoding method. `build(n, sampler)` makes the decoder with `n` tokens per step (its
  block, drafts or n-gram continuation; ignored where `n` is None). `bench` names its rows in
  `paraflax bench` per weights it runs on ("base": the bench's model; "jf": Jacobi Forcing
  weights, "tidar": TiDAR weights, "asarm": an AS-ARM); with a `sweep` there is one row per
  n, named `<bench name>_k<n>`."""
  name: str  # the CLI name: `generate --decoder`, `perf decode --decoders`, perf rows
  label: str
  build: Callable  # (n, sampler) -> decoder
  n: int | None  # the bench's tokens per step; None: the method takes none
  settings: str  # the bench's settings column, formatted with n
  bench: dict  # weights name -> bench row name
  drafter: str | None = None  # the draft model it needs: "ar" (small AR), "diffusion" (DEER)
  kind: str = "generate"  # "generate" (`pf.generate`) or "infill" (`pf.infill`)
  sweep: tuple = ()  # bench rows at these n

  def make(self, n: int | None = None, sampler=None):
    """The decoder with `n` tokens per step (default: the bench's) and `sampler` (greedy)."""
    return self.build(self.n if n is None else n, sampler or sampling.Greedy())

  def describe(self, n: int | None = None) -> str:
    """The bench's settings text at `n` (default: the bench's)."""
    return self.settings.format(n=self.n if n is None else n)


METHODS = {m.name: m for m in [
    MethodSpec("ar", "autoregressive: one token per forward", lambda n, s: decoders.AR(s),
               None, "greedy", {"base": "ar"}),
    MethodSpec("jacobi", "Jacobi: a block of n guesses refined in parallel (paraflax's "
               "running window)", lambda n, s: decoders.Jacobi(block_size=n, sampler=s), 16,
               "block {n}", {"base": "jacobi", "jf": "jacobi_forcing"}),
    MethodSpec("jacobi-released", "Jacobi as the released Jacobi Forcing code runs it: fixed "
               "blocks, each started from tokens drawn from the context",
               lambda n, s: decoders.Jacobi(block_size=n, sampler=s, variant="released"), 16,
               "block {n} released", {"base": "jacobi_released", "jf": "jacobi_forcing_released"}),
    MethodSpec("jacobi-mr", "Jacobi + multi-block decoding and rejection recycling (paraflax's "
               "running window and whole-generation pool)",
               mr_decoder, 16, "n{n} " + MR_SETTINGS,
               {"base": "jacobi_mr", "jf": "jacobi_forcing_mr"}),
    MethodSpec("jacobi-mr-released", "Jacobi + MR as the released Jacobi Forcing code runs it: "
               "fixed blocks from context draws, a pool of 4 made anew for every block, K = 2",
               lambda n, s: decoders.JacobiMR(block_size=n, num_blocks=2, pool_size=4,
                                              sampler=s, variant="released"), 16,
               "n{n} K2 pool4 r0.85 released",
               {"base": "jacobi_released_mr", "jf": "jacobi_forcing_released_mr"}),
    MethodSpec("prompt-lookup", "prompt lookup: drafts copied from an earlier n-gram match",
               lambda n, s: decoders.PromptLookup(max_ngram=3, num_tokens=n, sampler=s), 8,
               "n<=3 k={n}", {"base": "prompt_lookup"}),
    MethodSpec("tidar", "TiDAR: diffusion drafts and AR verification in one forward",
               lambda n, s: decoders.TiDAR(block_size=n, beta=1.0, sampler=s), 8,
               "block {n} beta 1", {"tidar": "tidar"}, sweep=(4, 8, 16)),
    MethodSpec("deer", "DEER: a block-diffusion drafter, AR verification",
               lambda n, s: decoders.DEER(n, sampler=s), 8, "block {n}", {"base": "deer"},
               drafter="diffusion", sweep=(4, 8, 16)),
    MethodSpec("speculative", "speculative decoding with a small AR drafter",
               lambda n, s: decoders.Speculative(n, sampler=s), 4, "block {n}",
               {"base": "spec_ar"}, drafter="ar", sweep=(4, 8, 16)),
    MethodSpec("any-order", "sequential any-order decoding of an AS-ARM",
               lambda n, s: decoders.AnyOrder(s), None, "", {"asarm": "any_order"},
               kind="infill"),
    MethodSpec("assd", "ASSD: the AS-ARM drafts k holes itself, verifies them in one call",
               lambda n, s: decoders.ASSD(n, sampler=s), 5, "k={n}", {"asarm": "assd_self"},
               kind="infill"),
    MethodSpec("assd-ngram", "ASSD with drafts from the context's bigrams",
               lambda n, s: decoders.ASSD(n, draft="ngram", sampler=s), 5, "k={n}",
               {"asarm": "assd_ngram"}, kind="infill"),
]}


def names(kind: str = "generate") -> list[str]:
  """The CLI names of the methods of `kind`, in the table's order."""
  return [m.name for m in METHODS.values() if m.kind == kind]


def spec(name: str, kind: str = "generate") -> MethodSpec:
  """The entry `name`; an unknown name, or one of another kind, is a one-line ValueError."""
  if name not in METHODS:
    raise ValueError(f"unknown decoder {name!r}: pick one of {', '.join(names(kind))}")
  if METHODS[name].kind != kind:
    raise ValueError(f"{name} is a decoder for pf.{METHODS[name].kind}, not pf.{kind}: pick one "
                     f"of {', '.join(names(kind))}")
  return METHODS[name]


def decoder(name: str, sampler=None, block_size: int | None = None, ngram: int | None = None):
  """The generate decoder `name` with the bench's settings; `block_size` sets its tokens per
  step (Jacobi block, drafts of TiDAR, speculative, DEER and prompt lookup), `ngram` the
  longest n-gram prompt lookup matches."""
  m = spec(name)
  if block_size is not None and m.n is None:
    raise ValueError(f"--block-size does not apply to the {name} decoder")
  dec = m.make(block_size, sampler)
  if ngram is None:
    return dec
  if not hasattr(dec, "max_ngram"):
    raise ValueError(f"--ngram does not apply to the {name} decoder (only prompt-lookup)")
  return dataclasses.replace(dec, max_ngram=ngram)


def needs_drafter(name: str) -> bool:
  return spec(name).drafter is not None
