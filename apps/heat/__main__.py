"""``python -m commlib.apps.heat``: the command line (:func:`commlib.apps.heat.cli.main`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
