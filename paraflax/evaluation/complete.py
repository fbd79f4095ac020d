"""One text prompt completed by any decoder, timed warm: what `paraflax generate` prints."""

from __future__ import annotations

import dataclasses
import time

import jax

from paraflax.decoding.generate import generate
from paraflax.evaluation import methods
from paraflax.loading import load_drafter, load_model, shared_vocab


@dataclasses.dataclass(frozen=True)
class Completion:
  text: str  # the new text only
  tokens: int
  seconds: float  # warm: the compiling first run is not counted
  forwards: int  # target-model forwards, the prefill included
  draft_forwards: int | None  # None: no draft model

  def summary(self) -> str:
    """"N tokens in S s: R tokens/s, F forwards" (and the drafter's forwards)."""
    drafted = "" if self.draft_forwards is None else f", {self.draft_forwards} drafter forwards"
    return (f"{self.tokens} tokens in {self.seconds:.3f}s: {self.tokens / self.seconds:.1f} "
            f"tokens/s, {self.forwards} forwards{drafted}")


def complete(prompt: str, *, workdir=None, hf=None, decoder: str = "ar", block_size=None,
             draft_workdir=None, draft_hf=None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, max_new_tokens: int = 64) -> Completion:
  """`prompt` completed by the model of `workdir` or `hf` with the decoder named `decoder`
  (`methods.DECODERS`; speculative and deer take a drafter: `draft_workdir` or `draft_hf`).
  Flag errors (sampling, decoder, drafter) are ValueErrors raised before any model loads."""
  sampler = methods.sampler_from_flags(temperature, top_k, top_p)
  sampler.validate()
  dec = methods.decoder(decoder, sampler, block_size)
  drafts = bool(draft_workdir or draft_hf)
  if drafts != methods.needs_drafter(decoder):
    raise ValueError(f"--decoder {decoder} takes no draft model" if drafts else
                     f"--decoder {decoder} needs a draft model: --draft-workdir or --draft-hf")
  model, tok, encode = load_model(workdir, hf)
  draft = load_drafter(draft_workdir, draft_hf, tok) if drafts else None
  if drafts:  # drafts stay off padding rows and method tokens past the tokenizer
    dec = dataclasses.replace(dec, vocab=shared_vocab(tok, model, draft))
  ids = encode(prompt)
  if not ids:
    raise SystemExit("--prompt encodes to no tokens: give some text")
  kw = dict(decoder=dec, max_new_tokens=max_new_tokens, rng=jax.random.key(seed),
            eos_id=tok.eos_id, draft_model=draft)
  jax.block_until_ready(generate(model, [ids], **kw).tokens)  # compile
  t0 = time.perf_counter()
  out = jax.device_get(generate(model, [ids], **kw))
  seconds = time.perf_counter() - t0
  n = int(out.lengths[0])
  return Completion(tok.decode(out.tokens[0, :n].tolist()), n, seconds,
                    int(out.forwards[0]) + 1, int(out.draft_forwards[0]) if drafts else None)
