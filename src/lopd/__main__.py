import sys

from lopd.cli import main

sys.exit(main())
