"""``python -m runstile`` is the ``runstile`` command."""

import sys

from .cli import main

sys.exit(main())
