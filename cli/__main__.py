"""`python -m cli ...` is `pdcluster ...`."""

import sys

from cli.main import main

sys.exit(main())
