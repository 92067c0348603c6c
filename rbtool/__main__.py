"""`python -m rbtool` runs the command line."""

from rbtool.cli import main

main()
