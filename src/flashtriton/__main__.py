"""`python -m flashtriton ...`: the same as the `flashtriton` command."""

from .cli import main

raise SystemExit(main())
