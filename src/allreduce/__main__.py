import sys

from allreduce.cli import main

sys.exit(main())
