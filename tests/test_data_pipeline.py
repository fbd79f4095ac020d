"""Pipeline: lossless packing, seeded determinism, exact iterator-state restore."""

import dataclasses

import numpy as np
import pytest

from paraflax.data import corpus
from paraflax.data.packing import encode_documents, pack, stream_key, token_stream
from paraflax.data.pipeline import (
  DataConfig,
  prepare_stdlib,
  train_dataset,
  train_iterator,
  validation_batches,
)
from paraflax.data.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
  cache = tmp_path_factory.mktemp("cache")
  return DataConfig(
    seq_len=64,
    batch_size=4,
    seed=0,
    vocab_size=320,
    val_fraction=0.05,
    cache_dir=str(cache),
    max_files=12,
    progress=False,
  )


@pytest.fixture(scope="module")
def data(cfg):
  return prepare_stdlib(cfg)


def _take(it, n):
  return [next(it)["tokens"].copy() for _ in range(n)]


@pytest.mark.fast
def test_stream_is_documents_with_eos_separators(data, cfg):
  tok = data.tokenizer
  docs = corpus.stdlib_documents("train", cfg.val_fraction, cfg.max_files)
  expected = np.concatenate([np.array(tok.encode(d) + [tok.eos_id]) for d in docs])
  np.testing.assert_array_equal(data.train_tokens, expected)
  assert data.train_tokens.dtype == np.int32
  assert (data.train_tokens == tok.eos_id).sum() == len(docs)


@pytest.mark.fast
def test_packing_loses_nothing_but_the_documented_tail(data, cfg):
  stream = np.asarray(data.train_tokens)
  rows = pack(stream, cfg.seq_len)
  n_rows = len(stream) // cfg.seq_len
  assert rows.shape == (n_rows, cfg.seq_len)
  np.testing.assert_array_equal(rows.reshape(-1), stream[: n_rows * cfg.seq_len])
  assert len(stream) - rows.size == len(stream) % cfg.seq_len < cfg.seq_len  # tail dropped
  with pytest.raises(ValueError, match="shorter than seq_len"):
    pack(stream[:10], 64)


@pytest.mark.fast
def test_first_epoch_is_a_permutation_of_the_rows(data, cfg):
  rows = pack(np.asarray(data.train_tokens), cfg.seq_len)
  n_batches = -(-len(rows) // cfg.batch_size)
  seen = np.concatenate(_take(train_iterator(data.train_tokens, cfg), n_batches))[: len(rows)]
  as_set = lambda a: sorted(map(bytes, np.ascontiguousarray(a)))  # multiset of rows
  assert as_set(seen) == as_set(rows)
  assert not np.array_equal(seen, rows)  # but shuffled


@pytest.mark.fast
def test_same_seed_same_batches_different_seed_different(data, cfg):
  a = _take(train_iterator(data.train_tokens, cfg), 6)
  b = _take(train_iterator(data.train_tokens, cfg), 6)
  c = _take(train_iterator(data.train_tokens, dataclasses.replace(cfg, seed=1)), 6)
  assert all(x.shape == (cfg.batch_size, cfg.seq_len) and x.dtype == np.int32 for x in a)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.fast
def test_epochs_are_reshuffled_and_infinite(data, cfg):
  n_rows = len(pack(np.asarray(data.train_tokens), cfg.seq_len))
  ds = train_dataset(data.train_tokens, cfg.seq_len, 1, cfg.seed)  # batch 1: row-level view
  epoch0 = np.concatenate([ds[i]["tokens"] for i in range(n_rows)])
  epoch1 = np.concatenate([ds[i]["tokens"] for i in range(n_rows, 2 * n_rows)])
  assert sorted(map(bytes, epoch0)) == sorted(map(bytes, epoch1))
  assert not np.array_equal(epoch0, epoch1)
  it = train_iterator(data.train_tokens, cfg)
  n_batches = 3 * n_rows // cfg.batch_size + 1
  assert len(_take(it, n_batches)) == n_batches  # past three epochs, never exhausted


@pytest.mark.fast
def test_iterator_state_restores_exact_position(data, cfg):
  it = train_iterator(data.train_tokens, cfg)
  _take(it, 5)
  state = it.get_state()
  expected = _take(it, 5)
  fresh = train_iterator(data.train_tokens, cfg)
  fresh.set_state(state)
  assert all(np.array_equal(x, y) for x, y in zip(_take(fresh, 5), expected))


@pytest.mark.fast
def test_validation_batches_are_fixed_ordered_and_finite(data, cfg):
  val_cfg = dataclasses.replace(cfg, seq_len=32, batch_size=2)
  batches = validation_batches(data.val_tokens, val_cfg)
  rows = pack(np.asarray(data.val_tokens), 32)
  n_full = len(rows) // 2
  assert len(batches) == n_full >= 1
  np.testing.assert_array_equal(np.concatenate([b["tokens"] for b in batches]), rows[: 2 * n_full])
  again = validation_batches(data.val_tokens, val_cfg)
  assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(batches, again))
  with pytest.raises(ValueError, match="fewer than one batch"):
    validation_batches(data.val_tokens, dataclasses.replace(cfg, batch_size=10_000))


@pytest.mark.fast
def test_token_cache_is_keyed_and_reused(data, cfg, tmp_path):
  tok = data.tokenizer
  docs = corpus.stdlib_documents("train", max_files=3)
  first = token_stream(docs, tok, tmp_path, progress=False)
  files = list(tmp_path.glob("tokens-*.npy"))
  assert len(files) == 1 and stream_key(docs, tok) in files[0].name
  second = token_stream(docs, tok, tmp_path, progress=False)
  np.testing.assert_array_equal(first, second)
  np.testing.assert_array_equal(second, encode_documents(docs, tok, progress=False))
  token_stream(docs[:2], tok, tmp_path, progress=False)  # other corpus, other key
  other_tok = train_tokenizer(docs, vocab_size=300)
  token_stream(docs, other_tok, tmp_path, progress=False)  # other tokenizer, other key
  assert len(list(tmp_path.glob("tokens-*.npy"))) == 3


@pytest.mark.fast
def test_prepare_is_cached(data, cfg):
  again = prepare_stdlib(cfg)
  assert again.tokenizer.fingerprint() == data.tokenizer.fingerprint()
  np.testing.assert_array_equal(again.train_tokens, data.train_tokens)


@pytest.mark.fast
def test_config_validation():
  for bad in [
    dict(seq_len=1),
    dict(batch_size=0),
    dict(seed=-1),
    dict(val_fraction=1.0),
    dict(max_files=0),
  ]:
    with pytest.raises(ValueError):
      DataConfig(**bad)
