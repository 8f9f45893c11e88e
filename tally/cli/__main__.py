"""``python -m tally.cli``: the ``tally`` command without its console script (how ``tally demo``
starts its services)."""

import sys

from tally.cli import main

sys.exit(main())
