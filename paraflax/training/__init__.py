"""Training: configs, the objective and data-source registries, optimizer, resumable trainer,
`load_trained`, `dry_run` (one step compiled with abstract shapes: its memory). Importing it
registers every method's objective and data source."""

from paraflax.training.config.overrides import apply_overrides
from paraflax.training.config.train import OptimConfig, TrainConfig, load_config
from paraflax.training.objectives import ar as _ar  # noqa: F401  registers the "ar" objective
from paraflax.training.objectives import asarm as _asarm  # noqa: F401  registers the "asarm" objective
from paraflax.training.objectives import deer as _deer  # noqa: F401  "deer_stage1", "deer_stage2", "teacher"
from paraflax.training.objectives import jacobi_forcing as _jf  # noqa: F401  "jacobi_forcing", "trajectories"
from paraflax.training.objectives import tidar as _tidar  # noqa: F401  registers the "tidar" objective
from paraflax.training.objectives.means import Loss, Mean
from paraflax.training.objectives.protocol import (
    OBJECTIVES,
    Objective,
    cross_entropy,
    get_objective,
    objective,
    register_objective,
)
from paraflax.training.run.dry_run import dry_run
from paraflax.training.run.metrics import batch_fingerprint, plot_losses, read_metrics
from paraflax.training.run.step import evaluate
from paraflax.training.run.trainer import train, train_from_config_path
from paraflax.training.workdirs.workdir import load_trained

__all__ = [
    "Loss", "Mean", "OBJECTIVES", "Objective", "OptimConfig", "TrainConfig", "apply_overrides",
    "batch_fingerprint", "cross_entropy", "dry_run", "evaluate", "get_objective", "load_config",
    "load_trained", "objective", "plot_losses", "read_metrics", "register_objective", "train",
    "train_from_config_path",
]
