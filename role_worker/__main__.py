"""`python -m role_worker --role prefill|decode -c CONFIG [--port P] [--kv-port K] [--router HOST:PORT]`"""

import sys

from role_worker.main import main

sys.exit(main())
