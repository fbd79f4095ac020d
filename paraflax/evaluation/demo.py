"""Deprecated path (one release): `paraflax.evaluation.demo` is
`paraflax.apps.demo + paraflax.training.family`."""

import warnings

from paraflax.apps.demo import *  # noqa: F401, F403
from paraflax.training.family import *  # noqa: F401, F403

warnings.warn("paraflax.evaluation.demo moved to paraflax.apps.demo + paraflax.training.family",
              DeprecationWarning, stacklevel=2)
