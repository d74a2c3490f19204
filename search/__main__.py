"""`python -m search` runs the CLI."""
import sys

from search.cli import main

sys.exit(main())
