"""Deprecated path (one release): `paraflax.config` is `paraflax.model.config`."""

import warnings

from paraflax.model.config import *  # noqa: F401, F403

warnings.warn("paraflax.config moved to paraflax.model.config", DeprecationWarning, stacklevel=2)
