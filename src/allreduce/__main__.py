"""``python -m allreduce``: the allreduce command line."""

import sys

from allreduce.cli import main

sys.exit(main())
