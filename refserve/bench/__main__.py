import sys

from refserve.bench.cli import main

sys.exit(main())
