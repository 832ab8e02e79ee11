import sys

from composable_atorch.cli import main

sys.exit(main())
