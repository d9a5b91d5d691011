"""`python -m adapt.cli`: the same as the `adapt` command."""

import sys

from adapt.cli import main

sys.exit(main())
