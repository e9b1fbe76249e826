"""End-to-end tests need Docker, kind, kubectl, helm and network access. They are NOT part of
the default test run (nor CI): nothing here is even collected unless PPOJOB_E2E=1, so they are
never counted as passed or skipped. Run them with:

    PPOJOB_E2E=1 pytest tests/e2e
"""

import os

collect_ignore_glob = [] if os.environ.get("PPOJOB_E2E") == "1" else ["test_*.py"]
