"""Deprecated path (one release): `paraflax.meshes` is `paraflax.parallel.meshes`."""

import warnings

from paraflax.parallel.meshes import *  # noqa: F401, F403

warnings.warn("paraflax.meshes moved to paraflax.parallel.meshes", DeprecationWarning, stacklevel=2)
