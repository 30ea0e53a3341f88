"""Entry script of the frozen app: the same ``specplay`` entry point as the installed command.

The desktop app without arguments, the command line with one (``SpecPlay models list``).
``specplay.app.launcher.main`` calls ``multiprocessing.freeze_support()`` first, which the GGUF
conversion's "spawn" child needs in a frozen app.
"""

import sys

from specplay.app.launcher import main

if __name__ == "__main__":
    sys.exit(main())
