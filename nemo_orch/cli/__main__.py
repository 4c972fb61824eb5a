"""``python -m nemo_orch.cli``: what torchrun, the launcher and the tests run."""

import sys

from nemo_orch.cli import main

sys.exit(main())
