"""``python -m flextensor``: the command line, where the ``flextensor`` script is not on the PATH."""

from .cli import main

raise SystemExit(main())
