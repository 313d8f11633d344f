from __future__ import annotations

import sys

from llmgw.cli import main

sys.exit(main())
