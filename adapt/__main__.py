import sys

from adapt.cli import main

sys.exit(main())
