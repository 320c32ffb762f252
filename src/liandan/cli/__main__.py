import sys

from liandan.cli.main import main

sys.exit(main())
