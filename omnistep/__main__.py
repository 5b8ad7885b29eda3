"""``python -m omnistep ...``: the ``omnistep`` command (``omnistep.cli``), for environments
without the console script on ``PATH``. Imports ``omnistep.cli``."""

from omnistep.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
