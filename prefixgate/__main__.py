"""`python -m prefixgate`, the same as the `prefixgate` script."""

import sys

from prefixgate.cli import main

sys.exit(main())
