"""``python -m gateway.loadgen``: the same as ``tts-gateway bench``."""

import sys

from gateway.loadgen import main

sys.exit(main())
