"""The verification server (`omnidraft serve`): the ASGI app (`app`), its routes, the service
behind them, sessions, limits, metrics and the wire protocol devices speak (`protocol`). The
clients are targets: `targets/remote.py` (`RemoteTarget`) and `targets/openai_client.py`.
"""
