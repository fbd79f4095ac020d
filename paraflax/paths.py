"""Where the repository's configs and shipped checkpoints live, and the user's cache."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SHIPPED = REPO / "checkpoints"  # params-only snapshots made by `paraflax demo --retrain --ship`
CACHE = Path(os.environ.get("PARAFLAX_CACHE", "~/.cache/paraflax")).expanduser()
