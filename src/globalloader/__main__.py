"""`python -m globalloader ...`: the `globalloader` command through this interpreter (no PATH needed)."""

import sys

from globalloader.cli import main

sys.exit(main())
