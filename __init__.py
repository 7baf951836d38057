"""This folder is the dmref repository, not the dmref package (that is ./dmref, installed by
``pip install -e .``).

Without this file, a clone named ``dmref`` in the current directory is what ``import dmref``
finds first (the current directory comes first on sys.path): an empty namespace package, on
which ``dmref.attention`` is an AttributeError. With it, that import stops with a message that
says what happened. Nothing imports this file otherwise: the installed package is ./dmref, and
pytest finds the installed package under the same name first.
"""

import os as _os

if __name__ == "dmref":
    _here = _os.path.dirname(_os.path.abspath(__file__))
    raise ImportError(
        f"'import dmref' found {_here}, a clone of the dmref repository in the current directory, "
        f"not the dmref package inside it (Python looks in the current directory first). Run Python "
        f"from another directory (after 'pip install -e {_here}'), or from inside the clone.")
