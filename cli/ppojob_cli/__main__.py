"""`python -m ppojob_cli` is the `ppojob` command."""

import sys

from ppojob_cli.main import main

if __name__ == "__main__":
    sys.exit(main())
