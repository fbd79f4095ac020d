"""Masks in structured form: per-token metadata and a pointwise rule, beside `masks.py`'s dense
bool arrays (the reference). What an attention kernel can take instead of `[B, T, K]`.

A `Structured` mask holds, for every query and every key, a few int/bool fields (`i` the
index in the chunk, and per builder kinds, block ids, validity, cache slots) and a `rule`:

    dense[b, q, k] = rule(queries[b, q], keys[b, k])

`dense()` expands it to the bool array the `masks.py` builder of the same name returns
(tested equal for every builder). `layout(bq, bk)` classifies the (query block, key block)
tiles as EMPTY (no pair attends: a kernel skips the tile), FULL (every pair attends: no mask
to apply) or PARTIAL, computed one block of queries at a time from the metadata, so it never
holds the dense mask; the layout is the same for every layer and head of a step.

`attention.attend` gives a kernel the causal rules (`causal_rule`, `full_causal_rule`) as
its own causal mask, which skips the tiles above the diagonal (`attention.kernel_mask`); a
rule in `SUBCAUSAL` (no key after its query) reaches it dense with the causal mask on top, so
the kernel still skips those tiles; any other rule reaches it dense.

Per-query key ranges alone cannot express Jacobi Forcing's streams (a clean block sees the
prompt and the earlier clean blocks, not the noisy stream between them), or the AS-ARM
lattice; a rule over token fields can, and tiles give kernels their skip list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from paraflax.model.masks import CLEAN, MASKED, PROMPT

EMPTY, PARTIAL, FULL = 0, 1, 2  # tile classes of `Structured.layout`

Fields = dict[str, jax.Array]  # name -> [B, N] per-token field
Rule = Callable[[Fields, Fields], jax.Array]  # (queries [B, T, 1], keys [B, 1, K]) -> bool


@flax.struct.dataclass
class Structured:
  """A mask `[B, T, K]` as per-token fields and a rule (see the module docstring)."""

  queries: Fields  # each [B, T]
  keys: Fields  # each [B, K]
  rule: Rule = flax.struct.field(pytree_node=False)  # hashable: a function or frozen dataclass
  # the first `causal_rows` queries see exactly the keys up to their own index (TiDAR's clean
  # half; padding queries, whose outputs nothing reads, excepted): a kernel attends them with
  # its own causal mask (`attention.kernel_calls`)
  causal_rows: int = flax.struct.field(pytree_node=False, default=0)
  # after them, the other queries in windows (r0, r1, segments, causal): queries [r0, r1) see
  # no key outside the key segments ((k0, k1), ...; None: all), so a kernel attends each
  # window over those keys alone (TiDAR's mask half: a block sees the clean keys before it and
  # its own mask keys), with its causal mask on top where `causal` (`subcausal` below)
  windows: tuple = flax.struct.field(pytree_node=False, default=())
  # no query whose output is read sees a key after its own index, and none is left without a
  # key under a causal mask: a kernel may add its causal mask (AS-ARM's query stream over rows
  # sorted prompt first; `SUBCAUSAL` rules claim it of every row)
  subcausal: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def shape(self) -> tuple[int, int, int]:
    b, t = self.queries["i"].shape
    return b, t, self.keys["i"].shape[1]

  def window(self, r0: int, r1: int, segments: tuple | None) -> Structured:
    """The mask of queries `r0:r1` over the keys of `segments` ((k0, k1), ...; None: all), in
    order."""
    keys = self.keys if segments is None else {
        n: jnp.concatenate([a[:, k0:k1] for k0, k1 in segments], 1) for n, a in self.keys.items()}
    return Structured({n: a[:, r0:r1] for n, a in self.queries.items()}, keys, self.rule)

  def dense(self) -> jax.Array:
    """The bool mask `[B, T, K]`."""
    return self.rule({n: a[:, :, None] for n, a in self.queries.items()},
                     {n: a[:, None, :] for n, a in self.keys.items()})

  def layout(self, bq: int, bk: int) -> jax.Array:
    """int8 `[B, ceil(T/bq), ceil(K/bk)]`: EMPTY, PARTIAL or FULL per tile (padding beyond
    T or K counts as either, whichever the real pairs of the tile make it)."""
    b, t, k = self.shape
    nq, nk = -(-t // bq), -(-k // bk)
    pad = lambda a, n: jnp.pad(a, [(0, 0), (0, n - a.shape[1])], mode="edge")
    keys = {n: pad(a, nk * bk)[:, None, :] for n, a in self.keys.items()}
    k_real = (jnp.arange(nk * bk) < k).reshape(nk, bk)

    def row(block):  # one block of queries: ([B, bq] fields, [bq] real) -> [B, nk]
      fields, q_real = block
      m = self.rule({n: a[:, :, None] for n, a in fields.items()}, keys)
      m = m.reshape(b, bq, nk, bk)
      real = q_real[:, None, None] & k_real[None]  # [bq, nk, bk]
      empty = ~jnp.any(m & real, (1, 3))
      full = jnp.all(m | ~real, (1, 3))
      return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)

    queries = {n: jnp.moveaxis(pad(a, nq * bq).reshape(b, nq, bq), 1, 0)
               for n, a in self.queries.items()}
    q_real = (jnp.arange(nq * bq) < t).reshape(nq, bq)
    return jnp.moveaxis(jax.lax.map(row, (queries, q_real)), 0, 1)


def tile_counts(layout: jax.Array) -> dict[str, float]:
  """Shares of a layout's tiles: empty (skippable), full (unmasked) and partial."""
  n = layout.size
  return {name: float(jnp.sum(layout == c)) / n
          for name, c in (("empty", EMPTY), ("full", FULL), ("partial", PARTIAL))}


def _index(b: int, n: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))


def _fields(**arrays) -> Fields:
  b, n = next(iter(arrays.values())).shape
  return {"i": _index(b, n), **{k: jnp.asarray(v) for k, v in arrays.items()}}


def _pad_self(q, k):
  """An invalid query (padding, output ignored) sees itself, so no row is empty."""
  return ~q["valid"] & (k["i"] == q["i"])


# ---- rules: each the pointwise form of the `masks.py` builder named in its docstring ----

def causal_rule(q, k):
  """`masks.causal`: keys up to the query that are real tokens."""
  return (k["i"] <= q["i"]) & k["valid"]


def full_causal_rule(q, k):
  """`masks.causal` of rows with no padding: keys up to the query."""
  return k["i"] <= q["i"]


def block_causal_rule(q, k):
  """`masks.block_causal`: causal within the query's block."""
  return (k["i"] <= q["i"]) & (k["block"] == q["block"])


def noise_aware_rule(q, k):
  """`masks.noise_aware`: earlier (or same) prompt keys and keys of the query's stream."""
  see = (k["i"] <= q["i"]) & ((k["kind"] == PROMPT) | (k["kind"] == q["kind"]))
  return (see & k["valid"]) | _pad_self(q, k)


# rules that allow no key after its query (k["i"] <= q["i"]) and always the query's own key
# (no empty row): a kernel's causal mask over T = K keys changes none of their pairs
SUBCAUSAL = (block_causal_rule, noise_aware_rule)


def tidar_rule(q, k):
  """`masks.tidar`: clean causal; a mask block sees itself and the clean keys of lower blocks."""
  clean_q, clean_k = q["kind"] == CLEAN, k["kind"] == CLEAN
  mask_q, mask_k = q["kind"] == MASKED, k["kind"] == MASKED
  see = ((clean_q & clean_k & (k["i"] <= q["i"])) | (mask_q & mask_k & (k["block"] == q["block"]))
         | (mask_q & clean_k & (k["block"] < q["block"])))
  return (see & k["valid"]) | _pad_self(q, k)


def deer_bidirectional_rule(q, k):
  """`deer_layout.mask(..., bidirectional=True)`: `tidar_rule`, and clean queries also see
  every valid clean key."""
  clean = (q["kind"] == CLEAN) & (k["kind"] == CLEAN) & k["valid"]
  return tidar_rule(q, k) | clean


def _lattice(q, k, earlier):
  target = ~q["visible"] & ~k["visible"]
  see = k["visible"] | (target & earlier)
  return (see & k["valid"] & q["valid"]) | _pad_self(q, k)


def lattice_content_rule(q, k):
  """`masks.lattice` content: the prompt, and targets up to the query (a target)."""
  return _lattice(q, k, k["i"] <= q["i"])


# rules under which every query sees its own key (no row is empty, so a kernel's padding of
# empty rows never adds keys): splash attention's tiles empty in the rule's structure stay
# empty at run time (`attention.splash_tiles`)
SEES_SELF = (*SUBCAUSAL, tidar_rule, deer_bidirectional_rule, lattice_content_rule)


def lattice_query_rule(q, k):
  """`masks.lattice` query: the prompt, and targets strictly before the query (a target)."""
  return _lattice(q, k, k["i"] < q["i"])


@dataclasses.dataclass(frozen=True)
class OverCache:
  """`masks.over_cache`: cache keys (field `cached`) visible where `slot_visible`, chunk keys
  as `chunk` says."""
  chunk: Rule

  def __call__(self, q, k):
    return jnp.where(k["cached"], k["slot_visible"], self.chunk(q, k))


# ---- builders: same names and arguments as in `masks.py` ----

def causal(lengths_B: jax.Array, t: int) -> Structured:
  b = lengths_B.shape[0]
  fields = _fields(valid=_index(b, t) < lengths_B[:, None])
  return Structured(fields, fields, causal_rule)


def full_causal(b: int, t: int) -> Structured:
  """`masks.causal(full((b,), t), t)`: rows of `t` real tokens (a kernel's own causal mask)."""
  fields = {"i": _index(b, t)}
  return Structured(fields, fields, full_causal_rule)


def block_causal(block_ids_BxT: jax.Array) -> Structured:
  fields = _fields(block=block_ids_BxT)
  return Structured(fields, fields, block_causal_rule)


def over_cache(cache_lengths_B: jax.Array, slots: int, chunk: Structured) -> Structured:
  """The chunk's keys after S cache slots (the chunk's fields are 0 / False on the slots)."""
  b = cache_lengths_B.shape[0]
  cache = lambda a: jnp.zeros((b, slots), a.dtype)
  keys = {n: jnp.concatenate([cache(a), a], 1) for n, a in chunk.keys.items()}
  keys["cached"] = jnp.concatenate([jnp.ones((b, slots), bool),
                                    jnp.zeros_like(chunk.keys["i"], bool)], 1)
  keys["slot_visible"] = jnp.concatenate([_index(b, slots) < cache_lengths_B[:, None],
                                          jnp.zeros_like(chunk.keys["i"], bool)], 1)
  return Structured(chunk.queries, keys, OverCache(chunk.rule))


def decode(cache_lengths_B: jax.Array, slots: int, t: int) -> Structured:
  b = cache_lengths_B.shape[0]
  return over_cache(cache_lengths_B, slots, causal(jnp.full((b,), t, jnp.int32), t))


def decode_candidates(cache_lengths_B: jax.Array, slots: int, main: int, n: int,
                      c: int) -> Structured:
  b = cache_lengths_B.shape[0]
  ids = jnp.concatenate([jnp.zeros((main,), jnp.int32), 1 + jnp.repeat(jnp.arange(c), n)])
  return over_cache(cache_lengths_B, slots, block_causal(jnp.broadcast_to(ids, (b, ids.size))))


def noise_aware(kinds_BxT: jax.Array, valid_BxT: jax.Array,
                prompt_len: int | None = None) -> Structured:
  """With `prompt_len`: rows [prompt, noisy stream, padding | clean stream] whose clean
  stream starts at `prompt_len` + M (`jacobi_forcing.example`; streams of M slots). The prompt
  and the noisy stream see exactly the slots before them (padding queries excepted): causal
  rows, which a kernel attends under its causal mask. The clean stream sees the prompt region
  and itself: a window over those keys, dense (its M^2/2 pairs above the diagonal computed,
  not the noisy stream's)."""
  fields = _fields(kind=kinds_BxT, valid=valid_BxT)
  if prompt_len is None:
    return Structured(fields, fields, noise_aware_rule)
  length = kinds_BxT.shape[1]
  m, odd = divmod(length - prompt_len, 2)
  if prompt_len < 0 or m < 1 or odd:
    raise ValueError(f"rows of {length} slots cannot be a prompt region of {prompt_len} and "
                     f"two equal streams (objective_args.prompt_len must be the store's "
                     f"max_prompt_len)")
  s = prompt_len + m
  return Structured(fields, fields, noise_aware_rule, causal_rows=s,
                    windows=((s, length, ((0, prompt_len), (s, length)), False),))


def tidar(kinds_BxT: jax.Array, blocks_BxT: jax.Array, valid_BxT: jax.Array | None = None,
          rule: Rule = tidar_rule) -> Structured:
  valid = jnp.ones(kinds_BxT.shape, bool) if valid_BxT is None else valid_BxT
  fields = _fields(kind=kinds_BxT, block=blocks_BxT, valid=valid)
  return Structured(fields, fields, rule)


def tidar_train(length: int, block_sizes_B: jax.Array, max_block: int | None = None) -> Structured:
  """With `max_block` (no row's block is larger) the mask half comes in windows of
  `WINDOW_ROWS` slots: slots [g0, g1) see clean keys before g1 and mask keys within
  `max_block - 1` of them (`tidar_windows`)."""
  b = block_sizes_B.shape[0]
  ids = jnp.arange(length)[None, :] // block_sizes_B[:, None]
  kinds = jnp.concatenate([jnp.full((b, length), CLEAN), jnp.full((b, length), MASKED)], 1)
  mask = tidar(kinds, jnp.concatenate([ids, ids], 1))
  windows = () if max_block is None else tidar_windows(length, max_block)
  # the clean half: causal, no mask keys
  return dataclasses.replace(mask, causal_rows=length, windows=windows)


WINDOW_ROWS = 512  # query rows of a window (`Structured.windows`)


def tidar_windows(length: int, max_block: int, rows: int = WINDOW_ROWS) -> tuple:
  """TiDAR's mask half `[length, 2 length)` in windows of `rows` slots. Slot i of a
  block of s <= `max_block` slots sees the clean keys before its block (before i + 1) and its
  block's mask keys (within s - 1 of i), so slots [g0, g1) see clean keys [0, g1) and mask keys
  [g0 - max_block + 1, g1 + max_block - 1): a window attends ~g1 + `rows` keys, not 2 length."""
  n, out = length, []
  for g0 in range(0, n, rows):
    g1 = min(n, g0 + rows)
    out.append((n + g0, n + g1, ((0, g1), (n + max(0, g0 - max_block + 1),
                                           n + min(n, g1 + max_block - 1))), False))
  return tuple(out)


def tidar_prefill(prompt_lens_B: jax.Array, p: int, k: int) -> Structured:
  b = prompt_lens_B.shape[0]
  kinds = jnp.broadcast_to(jnp.array([CLEAN] * p + [MASKED] * k), (b, p + k))
  blocks = jnp.broadcast_to(jnp.array([0] * p + [1] * k), (b, p + k))
  valid = jnp.concatenate([_index(b, p) < prompt_lens_B[:, None], jnp.ones((b, k), bool)], 1)
  # the right-padded prompt's real rows are causal over the prompt's keys (real, all of them)
  return dataclasses.replace(tidar(kinds, blocks, valid), causal_rows=p)


def tidar_decode(cache_lengths_B: jax.Array, slots: int, k: int) -> Structured:
  b = cache_lengths_B.shape[0]
  kinds = jnp.array([CLEAN] * k + [MASKED] * (k * k))
  blocks = jnp.concatenate([jnp.arange(1, k + 1), jnp.repeat(jnp.arange(2, k + 2), k)])
  chunk = tidar(jnp.broadcast_to(kinds, (b, kinds.size)),
                jnp.broadcast_to(blocks, (b, blocks.size)))
  return over_cache(cache_lengths_B, slots, chunk)


def deer(kinds_BxT, blocks_BxT, valid_BxT, bidirectional: bool) -> Structured:
  """`deer_layout.mask`: the DEER drafter's attention."""
  return tidar(kinds_BxT, blocks_BxT, valid_BxT,
               deer_bidirectional_rule if bidirectional else tidar_rule)


def lattice(visible_BxN: jax.Array, valid_BxN: jax.Array | None = None,
            sorted_rows: bool = False):
  """(content, query) `Structured` of `masks.lattice`. With `sorted_rows` (each row's prompt
  first, then its targets in generation order) a target's query sees the prompt and the
  targets before it, all before its own index, so the query mask is `subcausal` (a prompt
  token's query, which nothing reads, sees the whole prompt)."""
  valid = jnp.ones(visible_BxN.shape, bool) if valid_BxN is None else valid_BxN
  fields = _fields(visible=visible_BxN, valid=valid)
  return (Structured(fields, fields, lattice_content_rule),
          Structured(fields, fields, lattice_query_rule, subcausal=sorted_rows))


@dataclasses.dataclass(frozen=True)
class Streams:
  """The rule of two streams' rows stacked (field `stream`: 0 the first's, 1 the second's)."""
  first: Rule
  second: Rule

  def __call__(self, q, k):
    return jnp.where(q["stream"] == 0, self.first(q, k), self.second(q, k))


def two_stream(content: Structured, query: Structured) -> Structured:
  """The content rows then the query rows of a two-stream call, over the content keys, as
  one mask: a window each (the query rows' with the kernel's causal mask where `subcausal`)."""
  t, q = content.shape[1], query.shape[1]
  stream = lambda s, n, b: jnp.full((b, n), s, jnp.int32)
  b = content.shape[0]
  queries = {n: jnp.concatenate([content.queries[n], query.queries[n]], 1)
             for n in content.queries}
  queries["stream"] = jnp.concatenate([stream(0, t, b), stream(1, q, b)], 1)
  return Structured(queries, content.keys, Streams(content.rule, query.rule),
                    windows=((0, t, None, False), (t, t + q, None, query.subcausal)))
