"""Training: configs, the objective and data-source registries, optimizer, resumable trainer,
`load_trained`, `dry_run` (one step compiled with abstract shapes: its memory). Importing it
registers every method's objective and data source."""

from paraflax.training import ar as _ar  # noqa: F401  registers the "ar" objective
from paraflax.training import asarm as _asarm  # noqa: F401  registers the "asarm" objective
from paraflax.training import deer as _deer  # noqa: F401  "deer_stage1", "deer_stage2", "teacher"
from paraflax.training import jacobi_forcing as _jf  # noqa: F401  "jacobi_forcing", "trajectories"
from paraflax.training import tidar as _tidar  # noqa: F401  registers the "tidar" objective
from paraflax.training.config import OptimConfig, TrainConfig, load_config
from paraflax.training.dry_run import dry_run
from paraflax.training.means import Loss, Mean
from paraflax.training.metrics import batch_fingerprint, plot_losses, read_metrics
from paraflax.training.objectives import (
    OBJECTIVES,
    Objective,
    cross_entropy,
    get_objective,
    objective,
    register_objective,
)
from paraflax.training.overrides import apply_overrides
from paraflax.training.step import evaluate
from paraflax.training.trainer import train, train_from_config_path
from paraflax.training.workdir import load_trained

__all__ = [
    "Loss", "Mean", "OBJECTIVES", "Objective", "OptimConfig", "TrainConfig", "apply_overrides",
    "batch_fingerprint", "cross_entropy", "dry_run", "evaluate", "get_objective", "load_config",
    "load_trained", "objective", "plot_losses", "read_metrics", "register_objective", "train",
    "train_from_config_path",
]
