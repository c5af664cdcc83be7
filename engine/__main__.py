"""`python -m engine COMMAND ...`: validate, train, plan, explain, prepare-data, plot, schema, docs
and the launch helpers (`engine.cli.COMMANDS`; `python -m engine --help` lists them)."""

import sys

from engine.cli import main

sys.exit(main())
