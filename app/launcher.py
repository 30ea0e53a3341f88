"""The ``specplay`` entry point: the desktop app without arguments, the headless CLI with a command.

Kept free of Qt imports at module level so headless commands never load Qt.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # In a frozen app the GGUF conversion's "spawn" child re-runs this executable; this turns
    # that run into the child (a no-op when not frozen). It must come before anything else.
    import multiprocessing

    multiprocessing.freeze_support()
    argv = sys.argv[1:] if argv is None else argv
    from specplay.core.models.llamacpp import PROBE_ARGUMENT

    if argv and argv[0] == PROBE_ARGUMENT:  # the frozen app as a child trying llama.cpp (core.models.llamacpp)
        from specplay.core.models.llamacpp import probe_child

        return probe_child(argv[1:])
    if argv and argv[0] not in ("--gui",):
        from specplay.core.cli import main as cli_main

        return cli_main(argv)
    from specplay.app.main import run_app

    return run_app(argv[1:] if argv else [])


if __name__ == "__main__":
    sys.exit(main())
