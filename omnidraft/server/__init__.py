"""The verification server (`omnidraft serve`): the ASGI app (`app`), its routes, the service
behind them, sessions, limits, metrics (the wire protocol devices speak is omnidraft/wire.py). The
clients are targets: `targets/remote.py` (`RemoteTarget`) and `targets/openai_client.py`.
"""
