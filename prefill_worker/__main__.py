"""`python -m prefill_worker -c CONFIG [--port P] [--router HOST:PORT]`"""

import sys

from deploy.worker_main import main

sys.exit(main("prefill"))
