"""`python -m specdec` is the `specdec` console script."""

import sys

from specdec.launcher.cli import main

sys.exit(main())
