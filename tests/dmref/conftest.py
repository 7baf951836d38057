"""The helper module beside this file (dmref_problems: hypothesis strategies and inputs) imports
by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
