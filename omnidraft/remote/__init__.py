"""Remote targets: the wire protocol, a verification server and the RemoteTarget client."""
