"""pytest's set-up for the test suite: the Hypothesis profile. What the test modules share
(tolerances, the dense oracle, probes) is in ``helpers.py``, which they import by name.

Hypothesis runs under the profile registered here: derandomized (the same examples on every
run and machine), no deadline (timings on a shared CI box are noise), no example database
(nothing written into the checkout). Maintainers can ask for a longer search with
``HYPOTHESIS_PROFILE=thorough pytest tests``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "flash",
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("flash"),
    derandomize=False,
    max_examples=2000,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "flash"))
