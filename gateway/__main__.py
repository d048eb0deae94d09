import sys

from tts_gateway.gateway.cli import main

sys.exit(main())
