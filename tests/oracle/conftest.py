"""The helper modules beside this file (planted: attention implementations with planted bugs)
import by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
