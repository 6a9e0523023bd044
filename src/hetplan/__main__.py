"""``python -m hetplan``: the ``hetplan`` command, for an environment whose scripts directory
is not on ``PATH``."""

from hetplan.cli import main

if __name__ == "__main__":
    main()
