"""A model and its tokenizer from a paraflax workdir or a local Hugging Face directory alike."""

from __future__ import annotations

from paraflax import destination
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


def export_model(workdir, hf, to_hf, *, overwrite: bool = False):
  """`paraflax export`: the model of `workdir` or `hf` written to `to_hf` as a Hugging Face
  directory (every EOS id, roles), `to_hf` checked before the model loads; the path written."""
  from paraflax import hf as hf_io
  source = next(d for d in model_dirs(workdir, hf) if d)
  destination.check_output(to_hf, overwrite=overwrite, source=source)  # before loading
  model, tok, _ = load_model(workdir, hf)
  return hf_io.export_hf(model, to_hf, tokenizer=tok, overwrite=overwrite, source=source)


def common_ids(a, b) -> int | None:
  """How many ids mean the same text to the tokenizers `a` and `b`: the ids of the tokenizer
  both are once each one's own method tokens are removed (`Tokenizer.without_method_tokens`:
  a TiDAR's `<mask>`, a DEER drafter's `<mask>` and `<sep>`, added after its base's ids);
  None when they differ otherwise."""
  base_a, base_b = a.without_method_tokens(), b.without_method_tokens()
  return base_a.vocab_size if base_a.fingerprint() == base_b.fingerprint() else None


def load_related(workdir, tok, vocab_size: int, flag: str):
  """A training run's model made with the base's tokenizer (each may have its own method
  tokens: `common_ids`) and the base's `vocab_size` rows, grown only to hold its own method
  tokens (a TiDAR trained from the base's HF dir: `<mask>` after its ids); a ValueError naming
  `flag`, the option that gave `workdir`, otherwise."""
  from paraflax.training import load_trained
  other, other_tok, _ = load_trained(workdir)
  if common_ids(other_tok, tok) is None or other.cfg.vocab_size != max(vocab_size,
                                                                       other_tok.vocab_size):
    raise ValueError(f"{flag} {workdir!r} was not trained "
                     "with the base model's tokenizer and vocabulary")
  return other


def load_drafter(workdir, hf, tok, model) -> tuple:
  """(drafter, vocab): the draft model of `workdir` or `hf` for the verifier `model` whose
  tokenizer is `tok`, and the ids it may propose (`vocab=` of `Speculative` / `DEER`). One
  rule both ways: their tokenizers must be equal once each one's own method tokens are
  removed (a DEER drafter's, a TiDAR verifier's: `common_ids`), and the drafter proposes only
  those common ids, within both models' rows, so that every id it proposes means the same text
  to the verifier; row counts may differ (Qwen2.5-0.5B has 151936, 7B 152064, one 151665-id
  tokenizer). Otherwise one ValueError line naming both tokenizers."""
  draft, draft_tok, _ = load_model(workdir, hf)
  common = common_ids(draft_tok, tok)
  if common is None:
    raise ValueError(f"the drafter {workdir or hf!r} has another tokenizer than the model: "
                     f"fingerprint {draft_tok.fingerprint()[:12]} ({draft_tok.vocab_size} ids) "
                     f"!= {tok.fingerprint()[:12]} ({tok.vocab_size} ids), and not only in "
                     "their own method tokens (<mask>, <sep>)")
  return draft, min(common, model.cfg.vocab_size, draft.cfg.vocab_size)
