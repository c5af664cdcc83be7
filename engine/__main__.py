"""`python -m engine validate|train|schema|docs ...`"""

import sys

from engine.cli import main

sys.exit(main())
