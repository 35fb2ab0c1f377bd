"""``python -m lmforge`` is the ``lmforge`` command."""

import sys

from lmforge.cli.main import main

sys.exit(main())
