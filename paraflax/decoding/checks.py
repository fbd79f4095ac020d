"""Host-side argument checks shared by `generate` and `infill`: one clear line per mistake,
raised before any device work (no guessing: 1.7 is not token 1, True is not 1)."""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np

LIST_OF_LISTS = "prompts must be a list of token-id lists (or an int array [B, P])"


def _is_array(x) -> bool:
  return isinstance(x, (np.ndarray, jax.Array))


def is_int(x) -> bool:
  """A Python or NumPy integer, or a 0-d integer array; never a bool or a float."""
  if isinstance(x, (bool, np.bool_)):
    return False
  if isinstance(x, (int, np.integer)):
    return True
  return _is_array(x) and x.ndim == 0 and jax.numpy.issubdtype(x.dtype, np.integer)


def integer(name: str, value, lo: int | None = None, *, none_ok: bool = False) -> int | None:
  """`value` (a Python or NumPy int, >= `lo`) as an int, or None when allowed; anything else
  (a bool, a float, an array) is a ValueError."""
  if value is None and none_ok:
    return None
  if _is_array(value) or not is_int(value) or (lo is not None and int(value) < lo):
    need = "an int" + ("" if lo is None else f" >= {lo}") + (" or None" if none_ok else "")
    raise ValueError(f"{name} must be {need}, got {value!r} ({type(value).__name__})")
  return int(value)


def _int_array(name: str, arr) -> np.ndarray:
  arr = np.asarray(arr)
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must hold integer token ids, got a {arr.dtype} array")
  return arr


def _row(i: int, row) -> np.ndarray:
  """One prompt row (a list of ints or an int array [n]) as an int array, refusing floats
  and bools with the first offender's position."""
  if _is_array(row):
    if row.ndim != 1:
      raise ValueError(f"{LIST_OF_LISTS}: row {i} has shape {tuple(row.shape)}")
    return _int_array(f"prompt row {i}", np.asarray(row))
  if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
    raise ValueError(f"{LIST_OF_LISTS}: row {i} is {type(row).__name__} {_short(row)}")
  row = list(row)
  kinds = set(map(type, row))  # a few types per row, whatever its length
  if all(k is int or issubclass(k, np.integer) for k in kinds):
    return np.asarray(row, np.int64).reshape(len(row))
  for j, t in enumerate(row):  # only to name the offender (or to read 0-d int arrays)
    if not is_int(t):
      raise ValueError(f"prompt row {i} holds {t!r} ({type(t).__name__}) at position {j}: "
                       "token ids must be integers")
  return np.asarray([int(t) for t in row], np.int64).reshape(len(row))


def token_rows(prompts) -> list[np.ndarray]:
  """The rows of a list of token-id lists as int arrays (one conversion per row, no
  per-token Python loop). Refuses a flat list, a string, floats and bools, naming the row."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
    raise ValueError(f"{LIST_OF_LISTS}, got {type(prompts).__name__} {_short(prompts)}")
  return [_row(i, row) for i, row in enumerate(prompts)]


def _bucket(n: int) -> int:
  """Pad prompts to a power of two (>= 8) so new prompt lengths rarely retrace."""
  return max(8, 1 << (n - 1).bit_length())


def _as_matrix(prompts, lengths_arg):
  """(tokens [B, W] int, lengths [B]) from an int array [B, P] or a list of rows."""
  if _is_array(prompts):
    if prompts.ndim != 2:
      raise ValueError(f"{LIST_OF_LISTS}, got an array of shape {tuple(prompts.shape)}")
    arr = _int_array("prompts", np.asarray(prompts))
    b, w = arr.shape
    if lengths_arg is None:
      return arr, np.full((b,), w, np.int32)
    lengths = prompt_lengths(lengths_arg, b)
    if b and np.any(lengths > w):
      raise ValueError(f"prompt_lengths {lengths.tolist()} exceed the prompt width {w}")
    return arr, lengths
  rows = token_rows(prompts)
  lengths = np.array([len(r) for r in rows], np.int32)
  if lengths_arg is not None:
    widths = set(lengths.tolist())
    if len(widths) > 1:
      raise ValueError("prompts [B, P] with prompt_lengths [B] expected, got rows of widths "
                       f"{sorted(widths)}")
    cut = prompt_lengths(lengths_arg, len(rows))
    if rows and np.any(cut > lengths):
      raise ValueError(f"prompt_lengths {cut.tolist()} exceed the prompt width {len(rows[0])}")
    lengths = cut
  arr = np.zeros((len(rows), int(lengths.max(initial=0))), np.int64)
  for i, r in enumerate(rows):  # one copy per row
    arr[i, :lengths[i]] = r[:lengths[i]]
  return arr, lengths


def prepare_prompts(prompts, vocab_size: int, prompt_lengths=None, max_prompt_len=None):
  """Host-side checks and right padding, vectorised over the batch. Returns (prompts int32
  [B, P], lengths int32 [B]); P is a power of two >= 8 unless `max_prompt_len` is given."""
  arr, lengths = _as_matrix(prompts, prompt_lengths)
  if lengths.size == 0:
    raise ValueError("no prompts given: need a batch of at least one prompt")
  if np.any(lengths < 1):
    raise ValueError(f"empty prompt at batch rows {np.flatnonzero(lengths < 1).tolist()}: "
                     "every prompt needs at least one token")
  longest = int(lengths.max())
  width = _bucket(longest) if max_prompt_len is None else integer(
      "max_prompt_len", max_prompt_len, 1)
  if longest > width:
    raise ValueError(f"prompt of {longest} tokens is longer than the prompt buffer "
                     f"max_prompt_len={width}")
  arr = arr[:, :longest]
  inside = np.arange(longest)[None, :] < lengths[:, None]
  bad = inside & ((arr < 0) | (arr >= vocab_size))
  if bad.any():
    rows, cols = np.nonzero(bad)
    pairs = list(zip(rows.tolist(), arr[rows, cols].tolist()))
    raise ValueError(f"token ids outside the vocabulary [0, {vocab_size}): "
                     f"(row, id) = {pairs[:5]}")
  padded = np.zeros((arr.shape[0], width), np.int32)
  padded[:, :longest] = np.where(inside, arr, 0)
  return padded, lengths


def prompt_lengths(lengths, batch: int) -> np.ndarray:
  """`prompt_lengths` as int32 [B], refusing floats, bools and other shapes."""
  arr = np.asarray(lengths)
  ints = np.issubdtype(arr.dtype, np.integer) and (
      arr.ndim != 1 or _is_array(lengths) or all(map(is_int, lengths)))  # no bools in a list
  if arr.shape != (batch,) or not ints:
    raise ValueError(f"prompt_lengths must be ints [B] (B = {batch} prompt rows), got "
                     f"{_short(lengths)}")
  return arr.astype(np.int32)


def samples(decoder) -> bool:
  """Whether `decoder` draws random numbers (a stochastic sampler), so needs a key."""
  sampler = getattr(decoder, "sampler", None)
  return sampler is not None and not getattr(sampler, "greedy", True)


def key(rng, decoder):
  """One PRNG key for `decoder`: a typed `jax.random.key(seed)` or a raw `PRNGKey(seed)`
  (converted to typed, same stream). Required when the decoder samples; greedy decoders
  without one get a fixed key (unused by their results)."""
  name = type(decoder).__name__
  if rng is None:
    if samples(decoder):
      raise ValueError(f"{name} with {type(decoder.sampler).__name__} samples: pass "
                       "rng=jax.random.key(seed) (a fresh seed per call for fresh samples)")
    return jax.random.key(0)
  if is_int(rng) and not _is_array(rng):
    raise ValueError(f"rng must be a JAX key: pass rng=jax.random.key({int(rng)}), not the int "
                     f"{int(rng)}")
  if not _is_array(rng):
    raise ValueError(f"rng must be a JAX key such as jax.random.key(0), got "
                     f"{type(rng).__name__} {_short(rng)}")
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.ndim:
      raise ValueError(f"rng must be one key, got a batch of keys of shape {tuple(rng.shape)} "
                       "(the decoder splits one key per row itself)")
    return rng
  if rng.dtype == np.uint32 and rng.ndim > 1:
    raise ValueError(f"rng must be one key, got a batch of raw keys of shape {tuple(rng.shape)} "
                     "(the decoder splits one key per row itself)")
  if rng.dtype == np.uint32 and rng.ndim == 1:
    try:
      return jax.random.wrap_key_data(rng)  # a raw PRNGKey(seed): the same stream as key(seed)
    except (TypeError, ValueError):
      pass
  raise ValueError(f"rng must be a JAX key such as jax.random.key(0), got a {rng.dtype} array "
                   f"of shape {tuple(rng.shape)}")


class DoesNotFit(ValueError):
  """A decoder setting whose step is wider than the model's positions (`check_fits`)."""


def check_fits(name: str, setting: str, tokens: int, cfg, draft_cfg=None) -> None:
  """Refuse a step over `tokens` tokens at once (what `setting` of decoder `name` makes) that
  the model's (or drafter's) `max_seq_len` positions cannot hold: never computed, only cache
  and compute wasted (a step larger than max_new_tokens is fine: the output is cut)."""
  for who, c in (("model", cfg), ("drafter", draft_cfg)):
    if c is not None and tokens > c.max_seq_len:
      raise DoesNotFit(f"{name} {setting} does not fit the {who}'s max_seq_len {c.max_seq_len}: "
                       f"a step works on {tokens} tokens at once")


def _short(x, n: int = 40) -> str:
  s = repr(x)
  return s if len(s) <= n else s[:n - 3] + "..."


EOS_SLOTS = 8  # EOS id sets up to this size share one compiled loop


def eos_ids(value, vocab_size: int) -> tuple[int, ...]:
  """`eos_id` (an int, a sequence of ints, or None) as the tuple of its ids, each in
  [0, vocab_size); duplicates are fine, empty means none (like None)."""
  if value is None:
    return ()
  if is_int(value):
    ids = [value]
  elif isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable) or (
      _is_array(value) and value.ndim != 1):
    raise ValueError(f"eos_id must be an int or None, got {_short(value)} "
                     f"({type(value).__name__}); several EOS ids go in a list")
  else:
    ids = list(value)
  for j, i in enumerate(ids):
    if not is_int(i):
      raise ValueError(f"eos_id must hold ints, got {i!r} ({type(i).__name__}) at position {j}")
  bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
  if bad:
    raise ValueError(f"eos_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
  return tuple(int(i) for i in ids)


def eos_array(ids: tuple[int, ...]) -> np.ndarray:
  """`ids` as int32 [E], -1 padded to a multiple of `EOS_SLOTS` (-1 matches no token), so
  that another set of the same bucket reuses the compiled loop."""
  e = EOS_SLOTS * max(1, -(-len(ids) // EOS_SLOTS))
  out = np.full((e,), -1, np.int32)
  out[:len(ids)] = ids
  return out
