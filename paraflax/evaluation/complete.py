"""Deprecated path (one release): `paraflax.evaluation.complete` is
`paraflax.apps.generate + paraflax.data.prompts`."""

import warnings

from paraflax.apps.generate import *  # noqa: F401, F403
from paraflax.data.prompts import *  # noqa: F401, F403

warnings.warn("paraflax.evaluation.complete moved to paraflax.apps.generate + "
              "paraflax.data.prompts",
              DeprecationWarning, stacklevel=2)
