"""``python -m flash_check package.module:function [--features ...] ...``: runs
:func:`flash_check.main` (``_cli.py``) and exits with its status, 1 on any failure."""

import sys

from flash_check import main

if __name__ == "__main__":
    sys.exit(main())
