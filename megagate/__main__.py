import sys

from megagate.cli import main

sys.exit(main())
