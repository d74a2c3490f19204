"""`python -m search` runs the CLI."""
import sys

from search.cli.main import main

sys.exit(main())
