"""``python -m flextensor``: the command line, where the ``flextensor`` script is not on the PATH."""

from flextensor.cli.main import main

raise SystemExit(main())
