"""``python -m nri_plugin``: the ``rekindle`` command line (nri_plugin.cli)."""

import sys

from .cli import main

sys.exit(main())
