"""``python -m pcr_rag.cli``: the `pcr-rag` command."""

import sys

from pcr_rag.cli import main

sys.exit(main())
