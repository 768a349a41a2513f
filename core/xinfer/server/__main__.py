"""``python -m xinfer.server [flags]``: ``xinfer`` itself (its flags, ``--i`` and ``--prompts`` included)."""

import sys

from xinfer.cli import main

sys.exit(main())
