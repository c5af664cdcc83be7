"""`python -m engine COMMAND ...`: validate, train, plan, explain, plot, schema, docs and the launch
helpers (`python -m engine --help` lists them)."""

import sys

from engine.cli import main

sys.exit(main())
