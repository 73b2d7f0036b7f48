from __future__ import annotations

import sys
from pathlib import Path

# e2e tests drive every component: they share the supervisor's and the router's test helpers
_TESTS = Path(__file__).parent.parent
for sub in ("supervisor", "router"):
    if str(_TESTS / sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / sub))
