"""Several EOS ids: the tokenizer's roles travel with the model (HF dir -> workdir -> HF export),
and every decoder stops where greedy AR stops at the first token of the EOS set it emits."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import tokenizers
from flax import nnx

import paraflax as pf
from paraflax.data.chat import chat_template
from paraflax.data.tokenizer import Tokenizer
from paraflax.decoding import checks
from paraflax.decoding.generate import TRACES
from paraflax.hf import export_hf, load_hf_tokenizer
from paraflax.training.workdirs.convert import convert_hf
from conftest import micro_model

PROMPTS = [[3, 6, 9], [40, 41, 42, 43, 44, 45, 0, 1, 2], [11], [5, 9, 30, 7, 5, 22]]
N = 16
MASK, SEP = 46, 47

# --- decoding --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
  return micro_model(seed=0, mask_token_id=MASK)  # TiDAR needs the mask id; AR ignores it


@pytest.fixture(scope="module")
def drafter():  # an AR drafter for Speculative, a block-diffusion one for DEER
  return micro_model(seed=7, d_model=16, n_layers=1, mask_token_id=MASK, sep_token_id=SEP)


@pytest.fixture(scope="module")
def eos_set(target):
  """(EOS ids, lengths they must give): the first id is never emitted, row 2 stops at the 2nd
  (7th token), row 1 at the 3rd (6th token), rows 0 and 3 run to N (greedy tokens before an
  EOS do not depend on the EOS set)."""
  free = np.asarray(pf.generate(target, PROMPTS, max_new_tokens=N).tokens)
  unused = next(i for i in range(MASK) if i not in free)
  ids = [unused, int(free[2, 6]), int(free[1, 5])]
  hits = np.isin(free, ids)
  lengths = np.where(hits.any(1), hits.argmax(1) + 1, N)
  assert lengths.tolist() == [N, 6, 7, N]
  return ids, lengths


def test_ar_stops_at_any_id_of_the_set_and_compiles_once(target, eos_set):
  ids, lengths = eos_set
  before = TRACES["AR"]
  out = pf.generate(target, PROMPTS, max_new_tokens=N, eos_id=ids)
  np.testing.assert_array_equal(out.lengths, lengths)
  for row, n in zip(np.asarray(out.tokens), lengths):
    assert (n == N or row[n - 1] in ids) and np.all(row[n:] == -1)
  first_only = pf.generate(target, PROMPTS, max_new_tokens=N, eos_id=ids[0])
  assert np.all(np.asarray(first_only.lengths) == N)  # ids[0] alone never stops a row
  again = pf.generate(target, PROMPTS, max_new_tokens=N, eos_id=np.array(ids[::-1]))
  np.testing.assert_array_equal(again.tokens, out.tokens)
  assert TRACES["AR"] == before  # traced ids: None (the fixture's run) and sets share a compile
  fn = pf.generate_fn(target, max_new_tokens=N, eos_id=tuple(ids))
  padded, lens = checks.prepare_prompts(PROMPTS, target.cfg.vocab_size)
  pure = jax.jit(fn)(nnx.state(target), padded, lens, jax.random.key(0))
  np.testing.assert_array_equal(pure.tokens, out.tokens)


DECODERS = {
    "jacobi": (pf.decoders.Jacobi(4), False),
    "jacobi-mr": (pf.decoders.JacobiMR(4, num_blocks=2, pool_size=4, num_candidates=2), False),
    "prompt-lookup": (pf.decoders.PromptLookup(), False),
    "speculative": (pf.decoders.Speculative(3), True),
    "tidar": (pf.decoders.TiDAR(4), False),
    "deer": (pf.decoders.DEER(3), True),
}


@pytest.mark.parametrize("name", list(DECODERS))
def test_every_decoder_stops_where_ar_stops(target, drafter, eos_set, name):
  ids, lengths = eos_set
  decoder, drafted = DECODERS[name]
  out = pf.generate(target, PROMPTS, decoder=decoder, max_new_tokens=N, eos_id=ids,
                    draft_model=drafter if drafted else None)
  ar = pf.generate(target, PROMPTS, max_new_tokens=N, eos_id=ids)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, lengths)


@pytest.mark.parametrize("eos_id, match", [
    ([1, 48], "eos_id 48 is outside the vocabulary"),
    ((1, -1), "eos_id -1 is outside the vocabulary"),
    ([1, 2.0], "eos_id must hold ints, got 2.0"),
    ([1, True], "eos_id must hold ints, got True"),
    ("<eos>", "eos_id must be an int or None"),
    (np.zeros((1, 2), np.int32), "eos_id must be an int or None"),
])
def test_bad_eos_ids_are_one_line_errors(target, eos_id, match):
  with pytest.raises(ValueError, match=match) as e:
    pf.generate(target, [[1]], max_new_tokens=2, eos_id=eos_id)
  assert "\n" not in str(e.value)


def test_checks_accept_duplicates_and_empty_sets():
  eos_ids = checks.eos_ids
  assert eos_ids([], 10) == eos_ids(None, 10) == ()
  assert eos_ids([3, 3, np.int64(4)], 10) == (3, 3, 4)
  assert eos_ids(np.array([2, 5]), 10) == (2, 5)
  arr = checks.eos_array((3, 4))
  assert arr.dtype == np.int32 and arr.tolist() == [3, 4] + [-1] * 6


# --- the tokenizer's roles -------------------------------------------------------------------

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>",
            "<|finetune_right_pad_id|>", "<|fim_pad|>"]
BOS, END, EOM, EOT, PAD, FIM = range(30, 36)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|eot_id|>{% endfor %}")


def _backend() -> tokenizers.Tokenizer:
  """A word-level tokenizer: "w0".."w29", then Llama-3.1's specials at ids 30..35."""
  vocab = {f"w{i}": i for i in range(30)} | {t: 30 + i for i, t in enumerate(SPECIALS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(SPECIALS)
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS)])
  return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A Llama-3.1-Instruct-like directory written by transformers' own `save_pretrained`:
  three EOS ids in generation_config.json and config.json, `<|eot_id|>` as eos_token."""
  import transformers
  path = tmp_path_factory.mktemp("llama31")
  transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, bos_token_id=BOS,
                           eos_token_id=[END, EOM, EOT]).save_pretrained(path)
  transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=[END, EOM, EOT]).save_pretrained(
      path)
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=_backend(), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
      pad_token="<|finetune_right_pad_id|>", chat_template=TEMPLATE).save_pretrained(path)
  return path


def _roles(tok: Tokenizer) -> tuple:
  return (tok.eos_ids, tok.eos_id, tok.pad_id, tok.bos_id, tok.mask_id, tok.sep_id,
          tok.chat_template, tok.fingerprint(), tok.backend.encode_special_tokens)


def test_hf_dir_gives_every_eos_id_bos_pad_and_the_chat_template(hf_dir):
  tok = load_hf_tokenizer(hf_dir)
  assert tok.eos_ids == (END, EOM, EOT) and tok.eos_id == END
  assert (tok.bos_id, tok.pad_id, tok.mask_id, tok.sep_id) == (BOS, PAD, None, None)
  assert tok.chat_template == TEMPLATE == chat_template(hf_dir)
  kept = tok.with_special_tokens({"mask": "<mask>", "sep": "<|fim_pad|>"})
  assert (kept.mask_id, kept.sep_id) == (36, FIM)
  assert _roles(kept)[:4] + _roles(kept)[6:7] == _roles(tok)[:4] + _roles(tok)[6:7]


def test_workdir_save_reads_back_like_the_hf_dir(hf_dir, tmp_path):
  """load_hf_tokenizer(hf) -> save(workdir) -> Tokenizer.load(workdir): the same roles, chat
  template and fingerprint (non-literal mask/sep tokens included)."""
  tok = load_hf_tokenizer(hf_dir).with_special_tokens({"mask": "<mask>", "sep": "<|fim_pad|>"})
  (tmp_path / "work").mkdir()
  tok.save(tmp_path / "work")
  for loaded in (Tokenizer.load(tmp_path / "work"), load_hf_tokenizer(tmp_path / "work"),
                 Tokenizer.load(tmp_path / "work" / "tokenizer.json")):
    assert _roles(loaded) == _roles(tok)
  assert chat_template(tmp_path / "work") == TEMPLATE
  gen = json.loads((tmp_path / "work" / "generation_config.json").read_text())
  assert gen["eos_token_id"] == [END, EOM, EOT]


def test_default_roles_write_tokenizer_json_only(tmp_path):
  """Paraflax-trained tokenizers (<pad> <eos> <mask> <sep> by name): workdirs keep exactly the
  files shipped checkpoints have."""
  tok = Tokenizer.load(Path(__file__).resolve().parent.parent / "checkpoints" / "tiny_ar")
  assert tok.has_default_roles() and tok.eos_ids == (1,) and tok.bos_id is None
  tok.save(tmp_path)
  assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
  assert _roles(Tokenizer.load(tmp_path)) == _roles(tok)


def test_constructor_validates_eos_ids():
  backend = _backend()
  assert Tokenizer(backend, eos_ids=[EOT, EOT, END]).eos_ids == (EOT, END)
  assert Tokenizer(backend, eos_ids=[]).eos_id is None
  with pytest.raises(ValueError, match=r"eos_ids \[36\] are not ids of the vocabulary"):
    Tokenizer(backend, eos_ids=[END, 36])


def test_export_and_convert_keep_every_eos_id_and_the_chat_template(target, hf_dir, tmp_path):
  tok = load_hf_tokenizer(hf_dir)
  out = export_hf(target, tmp_path / "out", tok)
  gen = json.loads((out / "generation_config.json").read_text())
  cfg = json.loads((out / "config.json").read_text())
  assert gen["eos_token_id"] == cfg["eos_token_id"] == [END, EOM, EOT]
  assert gen["bos_token_id"] == BOS
  back = load_hf_tokenizer(out)
  assert _roles(back) == _roles(tok) and chat_template(out) == TEMPLATE
  convert_hf(out, tmp_path / "conv")  # a workdir load_trained reads, with the same roles
  assert _roles(Tokenizer.load(tmp_path / "conv")) == _roles(tok)
  assert chat_template(tmp_path / "conv") == TEMPLATE
