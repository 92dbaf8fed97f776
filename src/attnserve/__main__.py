import sys

from attnserve.cli import main

sys.exit(main())
