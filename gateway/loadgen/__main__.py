"""``python -m tts_gateway.gateway.loadgen``: the same as ``tts-gateway bench``."""

import sys

from tts_gateway.gateway.loadgen import main

sys.exit(main())
