"""``python -m compressor``; also the entry for launchers: ``torchrun --nproc-per-node 2 -m compressor run …``."""

import sys

from compressor.cli import main

sys.exit(main())
