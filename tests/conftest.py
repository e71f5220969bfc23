"""Test-wide settings. In CI (``CI`` set) Hypothesis runs derandomized, so a
submission's result does not depend on which examples a run happens to draw;
locally it explores afresh each run."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
