"""``python -m torchtitan_grpo.server --model DIR --port N ...``: the built-in server."""

import sys

from torchtitan_grpo.server.app import main

sys.exit(main())
