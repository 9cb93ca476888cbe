import sys

from lorafarm.cli import main

sys.exit(main())
