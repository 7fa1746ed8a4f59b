"""Remote targets: the wire protocol, a verification server and the RemoteTarget client."""

KEY_ENV = "OMNIDRAFT_API_KEY"  # the API key(s), comma-separated: the server's, and a client's default
