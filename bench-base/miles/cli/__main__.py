"""`python -m miles.cli <command>`: the `miles` console script without installing it."""

import sys

from miles.cli import main

sys.exit(main())
