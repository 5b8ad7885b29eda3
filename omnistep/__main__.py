"""``python -m omnistep``: the ``omnistep`` command (``omnistep.cli.main``), for an environment
whose scripts folder is not on ``PATH``. Imports ``omnistep.cli`` only."""

import sys

from omnistep.cli import main

if __name__ == "__main__":
    sys.exit(main())
