"""The skippable-tile table: each objective's training mask at a row length, split into
(query block, key block) tiles, with the share a tiled attention kernel can skip (empty),
run without a mask (full) or must mask (partial). Printed as markdown
(`paraflax.training.objectives.mask_tiles.tile_table`; the table in docs/performance.md).

    python scripts/mask_tiles.py                          # 4096 tokens, 128 x 128 tiles
    python scripts/mask_tiles.py --seq-len 2048 --tile 512
"""

from __future__ import annotations

import argparse

from paraflax.training.objectives.mask_tiles import tile_table


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq-len", type=int, default=4096, help="data tokens per row")
  p.add_argument("--tile", type=int, default=128, help="tile edge (queries = keys)")
  p.add_argument("--rows", type=int, default=4, help="rows drawn per objective")
  a = p.parse_args()
  print(f"| objective ({a.seq_len} tokens, {a.tile} x {a.tile} tiles) | queries x keys | "
        "pairs allowed | tiles empty (skipped) | full | partial |")
  print("|---|---|---|---|---|---|")
  for r in tile_table(a.seq_len, a.tile, a.rows):
    print(f"| {r['objective']} | {r['shape']} | {r['pairs']:.1%} | {r['empty']:.1%} | "
          f"{r['full']:.1%} | {r['partial']:.1%} |")


if __name__ == "__main__":
  main()
