import sys

import ds4t  # noqa: F401  (selects the kernel backend before triton is imported)
from ds4t.serve.cli import main

sys.exit(main())
