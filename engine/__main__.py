import sys

from engine.launch import main

sys.exit(main())
