"""`python -m tinypaged ...` is the `tinypaged` command."""

import sys

from tinypaged.entrypoints.cli import main

sys.exit(main())
