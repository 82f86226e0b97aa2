import sys

from adapt.app.cli import main

sys.exit(main())
