"""A blocking-facade program on NIXL for ``test_nixl_stalled_owner.py``: it leaves its endpoint to an atexit
finalize (the facade's own, or the program's: argv ``facade`` / ``explicit``) and says, from a hook that runs
after it, whether the NIXL worker was joined."""

import atexit
import json
import sys
import threading


def after_the_finalize() -> None:
    alive = [t.name for t in threading.enumerate() if t.name.startswith("aio_datadist-nixl-") and t.is_alive()]
    print(json.dumps({"nixl_workers_alive": alive}), flush=True)


atexit.register(after_the_finalize)  # registered before the facade's hook: runs after it

from aio_datadist.compat import LLMConfig, LLMDataDist, LLMRole  # noqa: E402

dd = LLMDataDist(LLMRole.PROMPT, 1)
config = LLMConfig()
config.device_id = 0
config.transport = "nixl"
config.listen_ip_info = "127.0.0.1:0"
dd.init(config.generate_options())
if sys.argv[1:] == ["explicit"]:
    atexit.register(dd.finalize)  # the program's own hook: runs first
