"""``python -m fe_megatron.convert``: the same as ``fe-convert``."""

import sys

from fe_megatron.convert.cli import main

sys.exit(main())
