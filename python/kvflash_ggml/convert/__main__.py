import sys

from ..commands.convert import main

sys.exit(main())
