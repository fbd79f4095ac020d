"""The dry-run memory table: `paraflax train --dry-run` of the shipped objective configs at a
real model's shapes, one subprocess per cell (one at a time), printed as markdown (GiB per
device, from XLA's memory analysis; nothing is allocated or trained).

    python scripts/dry_run_table.py                                # Qwen2.5-0.5B, 2048 and 4096
    python scripts/dry_run_table.py --seq-lens 8192 --configs tiny_ar tidar_scratch
    python scripts/dry_run_table.py --model qwen2.5-7b --devices 8 --mesh 1,8,1 --batch 8 \\
        --seq-lens 4096

Each cell's command is printed to stderr as it starts; `--jsonl FILE` appends every report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("tiny_ar", "jacobi_forcing_r1", "tidar_scratch", "deer_drafter_stage1",
           "deer_drafter", "asarm")
MODELS = {  # the --set flags of a model's shapes (bf16 compute, float32 params)
    "qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         d_ff=4864, max_seq_len=32768, qkv_bias=True, tie_embeddings=True,
                         dtype="bfloat16"),
    "qwen2.5-7b": dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       d_ff=18944, max_seq_len=32768, qkv_bias=True, tie_embeddings=False,
                       dtype="bfloat16"),
}
GIB = 2 ** 30


def command(config: str, model: dict, seq_len: int, batch: int, mesh: str | None,
            workdir: str) -> list[str]:
  sets = [f"model.{k}={v}" for k, v in model.items()]
  sets += [f"data.seq_len={seq_len}", f"data.batch_size={batch}"]
  sets += [f"mesh={mesh}"] if mesh else []
  return [sys.executable, "-m", "paraflax.training", "--config", config,
          "--workdir", workdir, "--dry-run", *[x for s in sets for x in ("--set", s)]]


def measure(cmd: list[str], devices: int | None) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  if devices:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} " \
                       f"--xla_force_host_platform_device_count={devices}".strip()
  t = time.perf_counter()
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if out.returncode:
    return {"error": (out.stderr.strip().splitlines() or ["?"])[-1],
            "wall_s": time.perf_counter() - t}
  return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t}


def row(config: str, seq_len: int, r: dict) -> str:
  if "error" in r:
    return f"| {config} | {seq_len} | error: {r['error']} |||||"
  g = lambda k: f"{r[k] / GIB:.2f}"
  return (f"| {config} ({r['objective']}) | {seq_len} | {g('argument_bytes')} | "
          f"{g('temp_bytes')} | {g('output_bytes')} | {g('total_bytes')} | "
          f"{r['compile_s']:.0f} |")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
  p.add_argument("--configs", nargs="+", default=list(CONFIGS))
  p.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 4096])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--layers", type=int, default=None, help="override the model's n_layers")
  p.add_argument("--mesh", default=None, help="(data, fsdp, tensor) sizes, e.g. 1,8,1")
  p.add_argument("--devices", type=int, default=None, help="forced host devices (CPU)")
  p.add_argument("--jsonl", default=None, help="append every report to this file")
  args = p.parse_args(argv)
  model = dict(MODELS[args.model], **({"n_layers": args.layers} if args.layers else {}))
  lines = [f"{args.model} shapes ({model['n_layers']} layers), batch {args.batch}, "
           f"mesh {args.mesh or 'one device'}; GiB per device", "",
           "| config (objective) | data.seq_len | arguments | temporaries | outputs | total | "
           "compile s |", "|---|---|---|---|---|---|---|"]
  with tempfile.TemporaryDirectory() as tmp:
    for seq_len in args.seq_lens:
      for config in args.configs:
        cmd = command(config, model, seq_len, args.batch, args.mesh, str(Path(tmp) / "w"))
        prefix = f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices} " \
            if args.devices else ""
        print(prefix + "python " + " ".join(cmd[1:]), file=sys.stderr,
              flush=True)
        r = measure(cmd, args.devices)
        print("  " + row(config, seq_len, r), file=sys.stderr, flush=True)
        lines.append(row(config, seq_len, r))
        if args.jsonl:
          with open(args.jsonl, "a") as f:
            f.write(json.dumps({"config": config, "model": args.model, **r}) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
