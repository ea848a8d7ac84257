"""``python -m flows.cli`` = ``ppoflow``."""

import sys

from flows.cli import main

sys.exit(main())
