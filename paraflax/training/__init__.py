"""Training: configs, objectives registry, optimizer, resumable trainer, `load_trained`."""

from paraflax.training import asarm as _asarm  # noqa: F401  registers the "asarm" objective
from paraflax.training import deer as _deer  # noqa: F401  registers "deer_stage1", "deer_stage2"
from paraflax.training import tidar as _tidar  # noqa: F401  registers the "tidar" objective
from paraflax.training.config import OptimConfig, TrainConfig, apply_overrides, load_config
from paraflax.training.metrics import batch_fingerprint, plot_losses, read_metrics
from paraflax.training.objectives import (
    OBJECTIVES,
    cross_entropy,
    get_objective,
    register_objective,
)
from paraflax.training.trainer import evaluate, load_trained, train, train_from_config_path

__all__ = [
    "OBJECTIVES", "OptimConfig", "TrainConfig", "apply_overrides", "batch_fingerprint",
    "cross_entropy", "evaluate", "get_objective", "load_config", "load_trained", "plot_losses",
    "read_metrics", "register_objective", "train", "train_from_config_path",
]
