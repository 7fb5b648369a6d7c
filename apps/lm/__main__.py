"""``python -m commlib.apps.lm``: see :mod:`commlib.apps.lm`."""
import sys

from . import main

sys.exit(main())
