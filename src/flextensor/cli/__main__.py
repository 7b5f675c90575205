"""``python -m flextensor.cli``: the command line, as ``python -m flextensor``."""

from flextensor.cli.main import main

raise SystemExit(main())
