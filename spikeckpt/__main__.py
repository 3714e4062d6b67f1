"""``python -m spikeckpt`` runs the command line."""

import sys

from spikeckpt.cli import main

sys.exit(main())
