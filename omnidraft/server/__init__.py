"""Remote targets: the wire protocol, a verification server and the RemoteTarget client."""

import os

KEY_ENV = "OMNIDRAFT_API_KEY"  # the API key(s), comma-separated: the server's, and a client's default


def env_keys() -> tuple[str, ...]:
    """The keys in $OMNIDRAFT_API_KEY (comma-separated; empty entries skipped)."""
    return tuple(k.strip() for k in os.environ.get(KEY_ENV, "").split(",") if k.strip())
