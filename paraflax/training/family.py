"""The demo family: the tiny models `paraflax demo` benches (and `paraflax perf family` trains
at a larger shape), each made by a recipe from the models it needs.

A stage is one trained model. Stages that distil another model (Jacobi Forcing rounds) first
collect that model's trajectories; the DEER drafters (and the small AR drafter they are compared
with) train on one teacher store of the `teacher` stage's greedy answers (`TEACHER` settings),
generated once and shared. `ensure` returns a stage's workdir under the cache: reused
when it holds a checkpoint, copied from a shipped snapshot (params only, `Build.shipped`) when
there is one, trained otherwise (its dependencies first).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

from paraflax.training.run.trainer import train_from_config_path
from paraflax.training.stores.collect import collect_trajectories, teacher_data
from paraflax.training.stores.teacher import TeacherConfig
from paraflax.training.stores.trajectories import CollectConfig


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str  # workdir name under the cache and shipped name under checkpoints/
  config: str  # the recipe that trains it (`paraflax/recipes/<config>.py`)
  init_from: str | None = None  # the stage whose weights this one starts from
  collect: CollectConfig | None = None  # trajectories of `init_from`'s model to train on
  teacher: str | None = None  # the stage whose greedy answers (`TEACHER`) this one trains on

  def __post_init__(self):
    if self.collect is not None and self.init_from is None:
      raise ValueError(f"stage {self.name!r} collects trajectories but has no init_from model")
    if self.collect is not None and self.teacher is not None:
      raise ValueError(f"stage {self.name!r} takes one data source: collect or teacher")


# The DEER teacher store: the verifier's greedy answers to stdlib prompts (~4 min on 2 cores).
TEACHER = TeacherConfig(examples=8192, answer_len=128, min_prompt_len=32, max_prompt_len=96,
                        batch_size=64)


STAGES = {s.name: s for s in [
    Stage("tiny_ar", "tiny_ar"),
    Stage("jacobi_forcing_r1", "jacobi_forcing_r1", init_from="tiny_ar",
          collect=CollectConfig(block_size=16, num_blocks=4, examples=2048)),
    Stage("tidar_continual", "tidar_continual", init_from="tiny_ar"),
    Stage("deer_drafter_stage1", "deer_drafter_stage1", teacher="tiny_ar"),
    Stage("deer_drafter", "deer_drafter", init_from="deer_drafter_stage1", teacher="tiny_ar"),
    Stage("ar_drafter", "ar_drafter", teacher="tiny_ar"),
    Stage("asarm", "asarm", init_from="tiny_ar"),
]}

# the distilled model the bench compares: round 1 (paper windows); round 2 (recipe
# jacobi_forcing_r2) collapses into repetition at this size (README, Jacobi Forcing)
JACOBI_FORCING = "jacobi_forcing_r1"


def has_checkpoint(workdir: Path) -> bool:
  return (workdir / "checkpoints").is_dir() and any(
      p.name.isdigit() for p in (workdir / "checkpoints").iterdir())


def latest(workdir: Path) -> Path:
  """The latest checkpoint directory of a workdir."""
  steps = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  return workdir / "checkpoints" / str(max(steps))


def stamp(workdir: Path) -> str:
  """Which save a model is: its latest checkpoint's metadata (orbax's save times)."""
  meta = latest(workdir) / "_CHECKPOINT_METADATA"
  return hashlib.sha256(meta.read_bytes() if meta.is_file() else meta.parent.name.encode()
                        ).hexdigest()


def is_copy(workdir: Path) -> bool:
  """A copy of a shipped model (params only), not a run trained here (which keeps opt_state)."""
  return not (latest(workdir) / "opt_state").exists()


def ship(workdir: Path, dest: Path) -> None:
  """Copy a run's latest params (no optimizer state) with its config and tokenizer."""
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  if dest.exists():
    shutil.rmtree(dest)
  old = lambda d, n: Path(d).name == "checkpoints" and n.isdigit() and int(n) != steps[-1]
  shutil.copytree(workdir, dest, ignore=lambda d, names: [
      n for n in names if n in ("opt_state", "paraflax.lock") or old(d, n)])
  print(f"[demo] shipped {workdir} -> {dest}")


@dataclasses.dataclass
class Build:
  """Where stages live and how to make them; `built` remembers what this run retrained."""
  cache: Path  # workdirs: cache / NAME
  configs: Path  # the recipes (`paraflax/recipes/`, or resized copies)
  shipped: Path  # params-only snapshots to start from (the clone's checkpoints/)
  retrain: bool = False
  ship: bool = False  # copy what was trained to `shipped`
  steps: int | None = None  # override every stage's training steps
  built: set = dataclasses.field(default_factory=set)  # stage names, "<teacher>_teacher" stores


def teacher_store(teacher: str, b: Build) -> Path:
  """The store of `teacher`'s greedy answers (`TEACHER`), generated once per build (resumed
  when a run was cut short; remade by a --retrain build)."""
  store = b.cache / f"{teacher}_teacher"
  key = f"{teacher}_teacher"
  if key not in b.built:
    source = ensure(teacher, b)
    if b.retrain and store.exists():
      shutil.rmtree(store)
    teacher_data(source, store, TEACHER)
    b.built.add(key)
  return store


def ensure(name: str, b: Build) -> Path:
  """The workdir of stage `name`, trained (with its dependencies) when needed."""
  stage = STAGES[name]
  workdir = b.cache / name
  if name in b.built:
    return workdir
  if b.retrain and workdir.exists():
    shutil.rmtree(workdir)
  shipped = b.shipped / name
  if not b.retrain and has_checkpoint(shipped):
    if has_checkpoint(workdir) and is_copy(workdir) and stamp(workdir) != stamp(shipped):
      print(f"[demo] {shipped} was re-shipped since it was copied: copying it again")
      shutil.rmtree(workdir)
    if not has_checkpoint(workdir):
      print(f"[demo] using the shipped model {shipped} (retrain: paraflax demo --retrain)")
      shutil.copytree(shipped, workdir, dirs_exist_ok=True)
  if has_checkpoint(workdir):
    return workdir
  overrides = {}
  if stage.init_from is not None:
    source = ensure(stage.init_from, b)
    overrides["init_from"] = str(source)
  if stage.collect is not None:
    store = b.cache / f"{name}_trajectories"
    if b.retrain and store.exists():
      shutil.rmtree(store)
    collect_trajectories(source, store, stage.collect)
    overrides["data_source_args.path"] = str(store)
  if stage.teacher is not None:
    overrides["data_source_args.path"] = str(teacher_store(stage.teacher, b))
  print(f"[demo] training {name} ({b.configs / (stage.config + '.py')}) in {workdir}")
  train_from_config_path(b.configs / f"{stage.config}.py", workdir, steps=b.steps,
                         overrides=overrides)
  b.built.add(name)
  if b.ship:
    ship(workdir, b.shipped / name)
  return workdir
