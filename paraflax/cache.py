"""Deprecated path (one release): `paraflax.cache` is `paraflax.model.cache`."""

import warnings

from paraflax.model.cache import *  # noqa: F401, F403

warnings.warn("paraflax.cache moved to paraflax.model.cache", DeprecationWarning, stacklevel=2)
