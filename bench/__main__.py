"""`python -m bench`: run the benchmark and write its results."""

import sys

from bench.run import main

sys.exit(main())
