import sys

from lbd.engine.launch import main

sys.exit(main())
