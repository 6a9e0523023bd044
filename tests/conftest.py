"""Test-suite settings. Hypothesis runs derandomized and without per-example deadlines by
default, so a CI run is reproducible and a loaded machine cannot fail a property test on
time alone; ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples on every run."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("hetplan", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "hetplan"))
