"""`python -m ddpo_group.cli SUBCOMMAND ...`: the `ddpo-group` command without its installed entry point."""

import sys

from ddpo_group.cli import main

sys.exit(main())
