"""How much of each objective's training attention a tiled kernel can skip: the structured
training mask of every objective (`mask_structure.py`), built by the objectives' own row
code at `seq_len` data tokens, and the share of its (query block, key block) tiles that are
empty (skippable), full (no mask to apply) or partial.

    python scripts/mask_tiles.py --seq-len 4096 --tile 128   # the table in docs/performance.md

Layouts are drawn like a training step draws them (objective defaults; rows differ by their
random cuts, rates, visible sets). Jacobi Forcing rows are full: a prompt of about a quarter
of the row, then the noisy and the clean stream of blocks of 16; DEER rows have a prompt of a
quarter.
The "sorted" rows reorder the tokens of a row (attention does not depend on the order of the
rows, given their positions): the AS-ARM's as [prompt, targets in ascending position]; the
same pairs, in tiles a kernel can skip (Jacobi Forcing's rows come as [prompt, noisy blocks,
clean blocks] already).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paraflax.model import mask_structure as ms
from paraflax.training.objectives import asarm, deer, tidar
from paraflax.training.objectives import jacobi_forcing as jf

MASK, SEP = 2, 3  # token ids for the DEER rows (their values do not change the masks)
JF_BLOCK = 16  # Jacobi Forcing's block size (the paper's)


def _sorted(mask: ms.Structured, group_BxT: jax.Array) -> ms.Structured:
  """`mask` with its tokens reordered by `group`, then by index (a square mask: queries and
  keys alike): the same pairs, permuted; the rule still sees each token's own fields."""
  t = group_BxT.shape[1]
  order = jnp.argsort(group_BxT * t + jnp.arange(t), axis=1)
  permute = lambda fields: {n: jnp.take_along_axis(a, order, 1) for n, a in fields.items()}
  return ms.Structured(permute(mask.queries), permute(mask.keys), mask.rule)


def training_masks(seq_len: int, rows: int = 4, seed: int = 0) -> dict[str, list[ms.Structured]]:
  """{objective: its structured masks over `rows` rows of `seq_len` data tokens} (AS-ARM: the
  content and the query stream's; each mask's rows are queries of one attention call)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  n_blocks = seq_len * 3 // 4 // (2 * JF_BLOCK)
  prompt = seq_len - 2 * JF_BLOCK * n_blocks  # a full row: the prompt, then the streams
  row = jf.example(np.arange(prompt) % 7 + 4, np.full((n_blocks, JF_BLOCK), 5),
                   np.full((n_blocks, JF_BLOCK), 6), seq_len)
  kinds, valid = (jnp.broadcast_to(jnp.asarray(row[k]), (rows, seq_len))
                  for k in ("kinds", "valid"))
  lo, hi = 0.85, 0.99  # `asarm_loss`'s default rate_end (the curriculum's end)
  visible = asarm.lattice_visible(keys[0], asarm.low_discrepancy_rates(keys[1], rows, lo, hi),
                                  seq_len)
  content, query = ms.lattice(visible)
  teacher = {"tokens": jnp.zeros((rows, seq_len), jnp.int32),
             "prompt_lens": jnp.full((rows,), prompt), "lengths": jnp.full((rows,), seq_len)}
  prefix, _, _ = deer.stage1_draws(keys[2], teacher["prompt_lens"], teacher["lengths"], seq_len,
                                   1e-3)
  stage1 = deer.layout(teacher["tokens"], teacher["lengths"], prefix, SEP)
  prefix, r = deer.stage2_draws(keys[3], teacher["prompt_lens"], teacher["lengths"], 16)
  stage2 = deer.stage2_rows(teacher, prefix, r, 16, MASK, SEP, 1.01)
  drafter = lambda rows_: ms.deer(rows_["kinds"], rows_["blocks"], rows_["valid"], False)
  return {
      "ar": [ms.causal(jnp.full((rows,), seq_len), seq_len)],
      "tidar": [ms.tidar_train(seq_len, tidar.block_sizes_for(keys[0], rows, 8))],
      "jacobi_forcing": [ms.noise_aware(kinds, valid)],
      "asarm": [content, query],
      "asarm sorted": [_sorted(m, jnp.where(visible, 0, 1)) for m in (content, query)],
      "deer_stage1": [drafter(stage1)],
      "deer_stage2": [drafter(stage2)],
  }


def tile_table(seq_len: int, tile: int = 128, rows: int = 4, seed: int = 0) -> list[dict]:
  """One row per objective: `shape` (queries x keys per row), `pairs` (share of the dense
  pairs the mask allows), tile shares `empty` / `full` / `partial` (tile x tile), and
  `computed` = the share of dense pairs a kernel computes when it skips empty tiles."""
  table = []
  for name, structured in training_masks(seq_len, rows, seed).items():
    layouts = [jax.jit(lambda m: m.layout(tile, tile))(m) for m in structured]
    allowed = sum(float(jax.jit(lambda m: m.dense().sum())(m)) for m in structured)
    area = sum(m.shape[0] * m.shape[1] * m.shape[2] for m in structured)
    counts = ms.tile_counts(jnp.concatenate([x.reshape(-1) for x in layouts]))
    t = sum(m.shape[1] for m in structured)
    table.append({"objective": name, "shape": f"{t} x {structured[0].shape[2]}",
                  "pairs": allowed / area, **counts, "computed": 1.0 - counts["empty"]})
  return table
