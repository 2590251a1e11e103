import sys

from longfit.cli import main

sys.exit(main())
