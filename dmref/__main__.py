import sys

from dmref.cli import main

sys.exit(main())
