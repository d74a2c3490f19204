"""`python -m latentsweep` runs the CLI."""
import sys

from latentsweep.search.cli.main import main

sys.exit(main())
