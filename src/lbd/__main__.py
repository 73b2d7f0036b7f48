import sys

from lbd.cli import main

sys.exit(main())
