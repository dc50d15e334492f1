"""``python -m speculum``: the same as the ``speculum`` console script."""

import sys

from speculum.runtime.cli import main

sys.exit(main())
