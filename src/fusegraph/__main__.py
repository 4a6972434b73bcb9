"""`python -m fusegraph ...` is the `fusegraph` command (handy with PYTHONPATH=src on the GPU machine)."""

import sys

from .cli import main

sys.exit(main())
