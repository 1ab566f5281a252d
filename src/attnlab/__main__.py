"""``python -m attnlab ...`` (and ``torchrun ... -m attnlab train ...``): the ``attnlab`` command."""
import sys

from .cli import main

sys.exit(main())
