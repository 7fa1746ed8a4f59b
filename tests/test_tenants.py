"""Prefixes shared within a tenant, never across (issue "Past one server", item 3): a server's
sessions of one API key get one prefix-cache salt, another key's sessions another, and no client
can know either (on vLLM, tests/test_vllm.py shows the pages reused and the verdicts exact)."""

from __future__ import annotations

from omnidraft.server.sessions import Session, tenant_salt
from omnidraft.target import SessionBase


class Salted(SessionBase):
    salt = "own"

    def share_prefix_cache(self, tenant: str) -> None:
        self.salt = tenant


def test_one_keys_sessions_share_a_salt_and_two_keys_never_do():
    a, b, c = (Session(Salted(), 0.0, key) for key in (0, 0, 1))
    assert a.inner.salt == b.inner.salt == tenant_salt(0) != c.inner.salt == tenant_salt(1)
    assert len(a.inner.salt) == 32  # a keyed hash of the key number, with a secret of the process
    Session(SessionBase(), 0.0, 0)  # an engine without a shared prefix cache: nothing to do
