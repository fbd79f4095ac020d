"""DEER drafter training: Stage I (continuation distillation) and Stage II (prefix-conditioned
refinement) on AR teacher rows (`stores/teacher.py`), and the layout that ties the drafter to the
decoder.

The drafter's layout (`deer_layout.py`, shared with `decoding/deer.py`). A prefix x_0..x_{c-1} sits
at positions 0..c-1, causal among itself (it never sees what follows); then a block
[SEP, y_1, ..., y_m]: SEP at position c, y_i at position c+i. The block sees the whole prefix
and itself bidirectionally (`masks.tidar` with kinds CLEAN for the prefix, MASKED for the
block, block ids 0 / 1, `valid` for padding). The logits at y_i predict x_{c+i-1}, the i-th
token after the prefix (unshifted, like TiDAR's slots); SEP's logits are not used.

    prefix                 block
    x_0 .. x_{c-1}   |   SEP   y_1      y_2      ..  y_k
    pos 0 .. c-1     |   c     c+1      c+2      ..  c+k
                     |         ->x_c    ->x_{c+1}    ->x_{c+k-1}

At decoding the drafter's KV cache holds the prefix and one forward feeds [SEP, <mask> x k] at
positions c..c+k (`deer_layout.draft_inputs`); the k block logits are the draft
distributions q_1..q_k.

Training rows are built in jax inside the objectives from the per-step key, so the data stays
raw teacher rows: batches `{"tokens": [B, W] prompt + answer right-padded, "prompt_lens": [B],
"lengths": [B] = prompt_len + answer_len}` (`datasets`). Stage I cuts a row after
c = prompt_len + cut tokens and inserts SEP there by a gather (`layout`, `[B, W+1]`); Stage II
appends N blocks [SEP, <mask> x R] after the row's clean tokens, each seeing only the clean
tokens before its own cut (`stage2_rows`): N decoding situations for one forward. Only answer
tokens are ever targets, for the DEER objectives and for the AR-drafter baseline ("ar" on the
same rows counts the answer tokens only): both drafters get the same supervision, the
teacher's continuations.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from paraflax.data.source import TrainData, register_source
from paraflax.decoding import deer_layout
from paraflax.model import mask_structure
from paraflax.model.masks import CLEAN, MASKED
from paraflax.training.objectives.head_loss import weighted_nll
from paraflax.training.objectives.means import Loss, Mean
from paraflax.training.objectives.protocol import register_objective

FIELDS = ("tokens", "prompt_lens", "lengths")  # the batch keys of teacher rows (`datasets`)


def _check_ids(model, objective: str) -> tuple[int, int]:
  cfg = model.cfg
  if cfg.mask_token_id is None or cfg.sep_token_id is None:
    raise ValueError(f"the {objective!r} objective needs a drafter config with "
                     f"ModelConfig.mask_token_id and sep_token_id (the <mask> and <sep> ids: "
                     f"2 and 3 for paraflax tokenizers); got mask_token_id="
                     f"{cfg.mask_token_id}, sep_token_id={cfg.sep_token_id}")
  return cfg.mask_token_id, cfg.sep_token_id


def _check_batch(batch, objective: str) -> None:
  missing = set(FIELDS) - set(batch)
  if missing:
    raise ValueError(f"the {objective!r} objective trains on teacher rows "
                     f"(data_source='teacher'); the batch lacks {sorted(missing)}")


def layout(tokens_BxW: jax.Array, lengths_B: jax.Array, prefix_B: jax.Array, sep_id: int):
  """The drafter layout of rows cut after `prefix` tokens, SEP inserted: a dict of `[B, W+1]`
  arrays. tokens (slot y_i holds its own target x_{c+i-1}, to be masked by the caller),
  positions, kinds, blocks, valid (real tokens, SEP included), targets (x_{c+i-1} at y_i) and
  offset (j - c: < 0 in the prefix, 0 at SEP, i at y_i)."""
  b, w = tokens_BxW.shape
  j = jnp.arange(w + 1, dtype=jnp.int32)[None, :]
  offset = j - prefix_B[:, None]
  src = jnp.where(offset < 0, j, jnp.maximum(j - 1, 0))  # y_i (j = c+i) reads x_{c+i-1}
  source = jnp.take_along_axis(tokens_BxW, src, 1)
  block = offset >= 0
  return {"tokens": deer_layout.block_tokens(offset, sep_id, source),
          "positions": jnp.broadcast_to(j, (b, w + 1)),
          "kinds": jnp.where(block, MASKED, CLEAN).astype(jnp.int32),
          "blocks": block.astype(jnp.int32),
          "valid": j < lengths_B[:, None] + 1,
          "targets": source.astype(jnp.int32), "offset": offset}


def bidirectional(model) -> bool:
  """Whether `model` is a drafter whose prefix attends both ways (`ModelConfig.drafter_prefix`)."""
  return model.cfg.drafter_prefix == "bidirectional"


def forward(model, rows, hidden: bool = False, clean_rows: int = 0) -> jax.Array:
  """Logits `[B, T, V]` of built rows under the drafter mask, or with `hidden` their final
  hidden states `[B, T, D]` (what `block_loss` takes: it computes the head in chunks). With
  `clean_rows` the first rows are clean tokens, right-padded, that see no block (Stage II's):
  for a causal prefix they are causal over themselves, passed as `causal_rows` of the
  structured mask so a kernel attends them with its causal mask."""
  if clean_rows and not bidirectional(model):
    mask = dataclasses.replace(mask_structure.deer(rows["kinds"], rows["blocks"], rows["valid"],
                                                   False), causal_rows=clean_rows)
  else:
    mask = deer_layout.mask(rows["kinds"], rows["blocks"], rows["valid"], bidirectional(model))
  return model(rows["tokens"], rows["positions"], mask, hidden=hidden)[0]


def block_loss(model, hidden_BxTxD, rows, weights_BxT, counted_BxT):
  """(sum of weighted token cross entropy / B, metrics) as `means` of `hidden`'s head:
  accuracy over `counted` slots and at y_1 (the first draft, the one every verification
  starts with)."""
  nll_mean, _, hit = weighted_nll(model, hidden_BxTxD, rows["targets"], weights_BxT)
  counted = counted_BxT.astype(jnp.float32)
  first = counted * (rows["offset"] == 1)
  loss = Mean(nll_mean.total, jnp.float32(hidden_BxTxD.shape[0]))  # per row
  return Loss.of(loss), {"accuracy": Mean.of(hit, counted), "first_accuracy": Mean.of(hit, first)}


# ---- Stage I ----

def stage1_draws(rng, prompt_lens_B, lengths_B, width: int, eps: float):
  """(prefix [B], t [B], masked [B, W+1]): a cut uniform in 0..A-1 (at least one answer token
  after the prefix), a rate t = eps + (1 - eps) u, u ~ U(0, 1) (LLaDA's floor keeps 1/t
  finite), and each suffix slot masked with probability t; the slot with the smallest draw is
  always masked so every row has a target."""
  k_cut, k_t, k_r = jax.random.split(rng, 3)
  b = prompt_lens_B.shape[0]
  cut = jax.random.randint(k_cut, (b,), 0, lengths_B - prompt_lens_B)
  prefix = prompt_lens_B + cut
  t = eps + (1.0 - eps) * jax.random.uniform(k_t, (b,))
  j = jnp.arange(width + 1)[None, :]
  suffix = (j > prefix[:, None]) & (j <= lengths_B[:, None])
  r = jnp.where(suffix, jax.random.uniform(k_r, (b, width + 1)), 2.0)
  masked = suffix & ((r < t[:, None]) | (r == r.min(-1, keepdims=True)))
  return prefix, t, masked


def stage1_rows(batch, prefix_B, t_B, masked_BxT, mask_id: int, sep_id: int):
  """Built Stage I rows: masked slots hold <mask>, the other suffix slots keep their token
  (visible, bidirectional in the block). `weights` = masked / (t * m), m = the row's suffix
  length: LLaDA's estimator normalised as LLaDA's SFT loss (per row, divided by the number of
  tokens that could be masked), so a row's weighted sum estimates its mean token loss."""
  rows = layout(batch["tokens"], batch["lengths"], prefix_B, sep_id)
  rows["tokens"] = jnp.where(masked_BxT, mask_id, rows["tokens"])
  m = (batch["lengths"] - prefix_B).astype(jnp.float32)
  rows["weights"] = masked_BxT / (t_B * m)[:, None]
  return rows


def answers_aligned(rows, prompt_lens_B, prompt_len: int):
  """Built rows `[B, T]` with each row's answer part moved `prompt_len - prompt_lens` slots to
  the right: every answer starts at slot `prompt_len` (a store's max_prompt_len, whose answers
  fit the rest of the row), padding between a row's prompt and its answer. Positions travel
  with the tokens, so the loss is the same."""
  t = rows["tokens"].shape[1]
  j = jnp.arange(t)[None, :]
  p = prompt_lens_B[:, None]
  pad = (j >= p) & (j < prompt_len)
  # the padding takes slot 0's fields (a prefix slot: CLEAN, unweighted), made invalid
  src = jnp.where(j < p, j, jnp.where(pad, 0, j - (prompt_len - p)))
  out = {k: jnp.take_along_axis(v, src, 1) for k, v in rows.items()}
  out["valid"] = out["valid"] & ~pad
  return out


def stage1_mask(rows, prompt_len: int | None) -> mask_structure.Structured:
  """A causal-prefix drafter's Stage I attention; with `prompt_len` (rows `answers_aligned`)
  the prompts, always prefix and followed by padding, see exactly the slots before them
  (padding queries excepted): causal rows, which a kernel attends under its causal mask; the
  answer region, where the cut falls, sees every key."""
  mask = mask_structure.deer(rows["kinds"], rows["blocks"], rows["valid"], False)
  return mask if prompt_len is None else dataclasses.replace(mask, causal_rows=prompt_len)


@register_objective("deer_stage1", fields=FIELDS, source="teacher")
def deer_stage1_loss(model, batch, rng, eps: float = 1e-3, prompt_len: int | None = None):
  """Stage I: truncate each teacher row inside its answer, insert SEP, mask the rest of the
  answer at a per-row rate t and reconstruct the masked tokens (masked-diffusion CE, 1/t).

  `prompt_len`: the rows' longest prompt (the teacher store's max_prompt_len; the trainer
  takes it from the store, `TeacherData.objective_args`). With it, and a causal prefix, the
  rows are `answers_aligned` and a kernel attends the prompts under its causal mask alone
  (`stage1_mask`); without it the whole row under one dense mask."""
  mask_id, sep_id = _check_ids(model, "deer_stage1")
  _check_batch(batch, "deer_stage1")
  prefix, t, masked = stage1_draws(rng, batch["prompt_lens"], batch["lengths"],
                                   batch["tokens"].shape[1], eps)
  rows = stage1_rows(batch, prefix, t, masked, mask_id, sep_id)
  rows["masked"] = masked
  if bidirectional(model) or prompt_len is None:
    hidden = forward(model, rows, hidden=True)
  else:
    if not 0 < prompt_len < batch["tokens"].shape[1]:
      raise ValueError(f"objective_args.prompt_len={prompt_len} must be in (0, "
                       f"{batch['tokens'].shape[1]}): the teacher store's max_prompt_len")
    rows = answers_aligned(rows, batch["prompt_lens"], prompt_len)
    hidden = model(rows["tokens"], rows["positions"], stage1_mask(rows, prompt_len),
                   hidden=True)[0]
  return block_loss(model, hidden, rows, rows["weights"], rows["masked"])


# ---- Stage II ----

def stage2_draws(rng, prompt_lens_B, lengths_B, max_masked: int, blocks: int = 1):
  """(prefix [B, N], R [B, N]) for N = `blocks` drafting situations per row: R uniform in
  1..min(max_masked, A), then a cut uniform in 0..A-R (so R answer tokens follow the prefix)."""
  k_r, k_cut = jax.random.split(rng)
  answer = (lengths_B - prompt_lens_B)[:, None]
  shape = (answer.shape[0], blocks)
  r = jax.random.randint(k_r, shape, 1, jnp.minimum(max_masked, answer) + 1)
  cut = jax.random.randint(k_cut, shape, 0, answer - r + 1)
  return prompt_lens_B[:, None] + cut, r


def stage2_rows(batch, prefix_BxN, r_BxN, max_masked: int, mask_id: int, sep_id: int,
                alpha: float, bidirectional: bool = False):
  """Built Stage II rows `[B, W + N (max_masked + 1)]`: the row's clean tokens (causal,
  positions 0..W-1), then N blocks [SEP, <mask> x R_b] (padded to max_masked + 1 slots with
  invalid ones) at positions c_b..c_b+R_b. Block b sees the clean tokens before its cut c_b
  and itself only, nothing after its R_b masks: each block is exactly a decoding step with
  k = R_b after a cached prefix of c_b tokens, and N of them share one forward (block ids:
  blocks sorted by cut get 1..N, clean token j gets the number of cuts <= j, so `masks.tidar`
  lets block b see clean token j iff j < c_b).

  `weights` at y_i of block b: alpha^(R_b - i), normalised over the block's R_b slots (largest
  next to the prefix) and divided by N: each drafting situation weighs the same.

  With `bidirectional` (a drafter_prefix "bidirectional" drafter) a prefix is encoded
  differently after each cut, so the blocks cannot share the clean tokens: `[B N, W +
  max_masked + 1]` rows instead, one block each, the clean tokens valid up to its cut (~5x the
  slots of the shared layout at W = 224, N = 8); the weighted sum per row of the batch is the same.
  """
  if bidirectional:
    n = prefix_BxN.shape[1]
    batch = {k: jnp.repeat(v, n, 0) for k, v in batch.items()}
    prefix_BxN, r_BxN = prefix_BxN.reshape(-1, 1), r_BxN.reshape(-1, 1)
    batch["lengths"] = prefix_BxN[:, 0]
    return stage2_rows(batch, prefix_BxN, r_BxN, max_masked, mask_id, sep_id, alpha)
  tokens_BxW = batch["tokens"]
  b, w = tokens_BxW.shape
  n, s = prefix_BxN.shape[1], max_masked + 1
  order = jnp.argsort(prefix_BxN, axis=1)
  prefix = jnp.take_along_axis(prefix_BxN, order, 1)  # [B, N] ascending
  r = jnp.take_along_axis(r_BxN, order, 1)[..., None]  # [B, N, 1]
  j = jnp.arange(w, dtype=jnp.int32)
  slot = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [1, 1, S]: 0 is SEP, i is y_i
  pos = deer_layout.block_positions(prefix, slot)  # [B, N, S]
  targets = jnp.take_along_axis(tokens_BxW, jnp.clip(pos - 1, 0, w - 1).reshape(b, n * s), 1)
  masked = (slot >= 1) & (slot <= r)
  weights = jnp.where(masked, jnp.float32(alpha) ** (r - slot).astype(jnp.float32), 0.0)
  weights = weights / (weights.sum(-1, keepdims=True) * n)
  flat = lambda x: jnp.broadcast_to(x, (b, n, s)).reshape(b, n * s)
  cat = lambda clean, blk: jnp.concatenate([clean, flat(blk)], 1)
  clean_ids = (prefix[:, None, :] <= j[None, :, None]).sum(-1)  # [B, W]
  return {"tokens": cat(tokens_BxW, deer_layout.block_tokens(slot, sep_id, mask_id)),
          "positions": cat(jnp.broadcast_to(j, (b, w)), pos),
          "kinds": cat(jnp.full((b, w), CLEAN), jnp.full((1, 1, s), MASKED)),
          "blocks": cat(clean_ids, 1 + jnp.arange(n)[None, :, None]),
          "valid": cat(j[None, :] < batch["lengths"][:, None], slot <= r),
          "targets": cat(tokens_BxW, targets.reshape(b, n, s)),
          "offset": cat(jnp.full((b, w), -1), slot),
          "weights": cat(jnp.zeros((b, w)), weights), "masked": cat(jnp.zeros((b, w), bool), masked)}


@register_objective("deer_stage2", fields=FIELDS, source="teacher")
def deer_stage2_loss(model, batch, rng, max_masked: int = 16, alpha: float = 1.01,
                     blocks: int = 1):
  """Stage II: mask only the R ~ U(1, max_masked) answer tokens right after the prefix, see
  nothing after them, weight y_i by alpha^(R-i), normalised per block. `blocks` drafting
  situations (independent cuts) per row share one forward over the row's clean tokens."""
  mask_id, sep_id = _check_ids(model, "deer_stage2")
  _check_batch(batch, "deer_stage2")
  if max_masked < 1 or blocks < 1:
    raise ValueError(f"deer_stage2 needs max_masked >= 1 and blocks >= 1, got {max_masked}, "
                     f"{blocks}")
  prefix, r = stage2_draws(rng, batch["prompt_lens"], batch["lengths"], max_masked, blocks)
  rows = stage2_rows(batch, prefix, r, max_masked, mask_id, sep_id, alpha, bidirectional(model))
  hidden = forward(model, rows, hidden=True, clean_rows=batch["tokens"].shape[1])
  return block_loss(model, hidden, rows, rows["weights"], rows["masked"])


# ---- supervision ----

def stage1_targets(batch, rng, eps: float = 1e-3, prompt_len: int | None = None) -> jax.Array:
  """Positions carrying a loss in one `deer_stage1` step: the masked suffix slots (where the
  rows lie, `prompt_len`, moves none)."""
  del prompt_len
  return stage1_draws(rng, batch["prompt_lens"], batch["lengths"], batch["tokens"].shape[1],
                      eps)[2].sum()


def stage2_targets(batch, rng, max_masked: int = 16, alpha: float = 1.01, blocks: int = 1):
  """Positions carrying a loss in one `deer_stage2` step: the R masks of every block."""
  del alpha
  return stage2_draws(rng, batch["prompt_lens"], batch["lengths"], max_masked, blocks)[1].sum()


def ar_targets(batch, rng) -> jax.Array:
  """Positions carrying a loss in one `ar` step on teacher rows: the answer tokens."""
  del rng
  return (batch["lengths"] - batch["prompt_lens"]).sum()


TARGETS = {"deer_stage1": stage1_targets, "deer_stage2": stage2_targets, "ar": ar_targets}


def supervised_targets(cfg) -> int:
  """Positions that carry a loss over a whole run of the TrainConfig `cfg` (objective
  deer_stage1, deer_stage2 or ar, on teacher rows), exactly: its batches and per-step keys
  replayed as the trainer draws them (step s: the s-th batch, key fold_in(train_key, s))."""
  from paraflax.training.run.step import keys
  count = jax.jit(functools.partial(TARGETS[cfg.objective], **dict(cfg.objective_args)))
  it = cfg.source.open(cfg.data, progress=False).train
  train_key = keys(cfg.seed)[0]
  return sum(int(count(next(it), jax.random.fold_in(train_key, s))) for s in range(cfg.steps))


# ---- data ----

@register_source("teacher")
@dataclasses.dataclass(frozen=True)
class TeacherData:
  """The data source "teacher": raw prompt + answer rows of a teacher store (`paraflax
  teacher-data`; the objective builds its layout), tokenized by the store's model's tokenizer.
  The last `val_fraction` of the examples are held out. `data.seq_len` must be the store's row
  length, max_prompt_len + answer_len (the objectives add <sep> and blocks to it)."""
  fields: ClassVar[tuple[str, ...]] = FIELDS
  path: str
  val_fraction: float = 0.05

  def __post_init__(self):
    if not 0.0 < self.val_fraction < 1.0:
      raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

  def open(self, data, *, progress: bool = True) -> TrainData:
    """Batches of `data.batch_size` rows shuffled by `data.seed` (see `datasets`)."""
    del progress
    from paraflax.training.stores import store
    meta = store.read_meta(self.path, what="teacher store", command="teacher-data")
    store.check_row_length(self.path, "teacher store", meta["max_prompt_len"] + meta["answer_len"],
                           "max_prompt_len + answer_len", data.seq_len)
    it, val, meta = datasets(self, data.batch_size, data.seed)
    return TrainData(it, val, store.load_tokenizer(self.path), max_position=row_length(meta),
                     tokenizer_source=store.tokenizer_source(self.path, "teacher"),
                     rows="teacher")


  def objective_args(self, data) -> dict:
    """The objective arguments the store's rows fix: `prompt_len`, their longest prompt
    (`deer_stage1_loss`). Reads the store's meta alone."""
    del data
    from paraflax.training.stores import store
    meta = store.read_meta(self.path, what="teacher store", command="teacher-data")
    return {"prompt_len": meta["max_prompt_len"]}

  def shapes(self, data) -> dict:
    """{field: (shape, dtype)} of a batch: tokens `[B, data.seq_len]`, prompt_lens and
    lengths `[B]`, all int32."""
    b, i32 = data.batch_size, np.dtype(np.int32)
    return {"tokens": ((b, data.seq_len), i32), "prompt_lens": ((b,), i32), "lengths": ((b,), i32)}


def row_length(meta: dict) -> int:
  """Longest position + 1 a teacher row reaches in training: prompt + <sep> + answer."""
  return meta["max_prompt_len"] + meta["answer_len"] + 1


def datasets(cfg: TeacherData, batch_size: int, seed: int):
  """(train iterator (checkpointable, infinite, shuffled), validation batches, meta) of a
  teacher store. Batches: tokens [B, P+A], prompt_lens [B], lengths [B]."""
  import grain

  from paraflax.training.stores import teacher
  data = teacher.load(cfg.path)
  tokens, lengths = data.rows()
  total = len(tokens)
  n_val = max(1, round(total * cfg.val_fraction))
  if total - n_val < batch_size or n_val < batch_size:
    raise ValueError(f"teacher store {cfg.path!r} has {total} examples: too few for a batch of "
                     f"{batch_size} in both splits "
                     f"(data_source_args.val_fraction={cfg.val_fraction})")

  def row(i):
    i = int(i)
    return {"tokens": tokens[i], "prompt_lens": data.prompt_lens[i], "lengths": lengths[i]}

  train = (grain.MapDataset.range(total - n_val).shuffle(seed=seed).repeat(None).map(row)
           .batch(batch_size, drop_remainder=True))
  it = iter(train.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  val = [{"tokens": tokens[j:j + batch_size], "prompt_lens": data.prompt_lens[j:j + batch_size],
          "lengths": lengths[j:j + batch_size]}
         for j in range(total - n_val, total - batch_size + 1, batch_size)]
  return it, val, data.meta

