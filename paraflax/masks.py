"""Deprecated path (one release): `paraflax.masks` is `paraflax.model.masks`."""

import warnings

from paraflax.model.masks import *  # noqa: F401, F403

warnings.warn("paraflax.masks moved to paraflax.model.masks", DeprecationWarning, stacklevel=2)
