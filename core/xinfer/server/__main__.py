"""``python -m xinfer.server [flags]``: the same flags as ``xinfer``."""

import sys

from xinfer.server.launch import main

sys.exit(main())
