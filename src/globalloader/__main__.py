"""`python -m globalloader`: the same as the `globalloader` command."""

import sys

from globalloader.cli import main

sys.exit(main())
