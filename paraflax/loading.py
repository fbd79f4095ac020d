"""A model and its tokenizer from a paraflax workdir or a local Hugging Face directory alike."""

from __future__ import annotations

from paraflax.paths import model_dirs


def load_model(workdir=None, hf=None):
  """(model, tokenizer, encode) from `hf` (a Hugging Face checkpoint) or `workdir` (a training
  run, a `paraflax convert` output, or a Hugging Face directory too)."""
  from paraflax import hf as hf_io
  workdir, hf = model_dirs(workdir, hf)
  if hf:
    tok = hf_io.load_hf_tokenizer(hf)
    return hf_io.load_hf(hf), tok, lambda text: hf_io.encode_prompt(tok, text)
  from paraflax.training import load_trained
  model, tok, _ = load_trained(workdir)  # the tokenizer with its saved roles (BOS, EOS set)
  if tok.has_default_roles():  # a paraflax BPE: text encodes as is
    return model, tok, tok.encode
  return model, tok, lambda text: hf_io.encode_prompt(tok, text)  # as HF: its BOS first


def load_related(workdir, tok, vocab_size: int, flag: str):
  """A training run's model made with the base's tokenizer and vocabulary (a ValueError naming
  `flag`, the option that gave `workdir`, otherwise)."""
  from paraflax.training import load_trained
  other, other_tok, _ = load_trained(workdir)
  if other_tok.fingerprint() != tok.fingerprint() or other.cfg.vocab_size != vocab_size:
    raise ValueError(f"{flag} {workdir!r} was not trained "
                     "with the base model's tokenizer and vocabulary")
  return other


def load_drafter(workdir, hf, tok):
  """A draft model (workdir or HF dir) made with the verifier's tokenizer `tok`. Row counts may
  differ (Qwen2.5-0.5B has 151936, 7B 152064, one 151665-id tokenizer): the decoders draft
  only below `shared_vocab`."""
  draft, draft_tok, _ = load_model(workdir, hf)
  if draft_tok.fingerprint() != tok.fingerprint():
    raise ValueError(f"the drafter {workdir or hf!r} has another tokenizer than the model: "
                     f"fingerprint {draft_tok.fingerprint()[:12]} ({draft_tok.vocab_size} ids) "
                     f"!= {tok.fingerprint()[:12]} ({tok.vocab_size} ids)")
  return draft


def shared_vocab(tok, model, draft) -> int:
  """The ids a drafter may propose to a verifier sharing tokenizer `tok`: the tokenizer's real
  ids, within both models' rows (`vocab=` of `Speculative` / `DEER`)."""
  return min(tok.vocab_size, model.cfg.vocab_size, draft.cfg.vocab_size)
