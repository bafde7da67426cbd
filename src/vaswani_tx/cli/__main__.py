"""`python -m vaswani_tx.cli ...` (what `accelerate launch -m vaswani_tx.cli` and `torchrun -m` run)."""

import sys

from vaswani_tx.cli import main

sys.exit(main())
