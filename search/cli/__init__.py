"""The `latentsweep` command line: the entry point (main.py), one module per command, and the local UI servers."""
