"""`python -m tinypaged ...` is the `tinypaged` command."""

import sys

from tinypaged.cli import main

sys.exit(main())
