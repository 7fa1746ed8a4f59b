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


def test_a_prefix_record_knows_a_tenants_whole_blocks_and_no_other_tenants():
    """What a vLLM target's requests put in its prefix cache, by salt (targets/vllm_session.py):
    the hint by which a session skips prefilling what its tenant's pages hold."""
    from omnidraft.targets.vllm_session import PrefixRecord

    record, ids = PrefixRecord(4, capacity=3), list(range(10))
    record.add("a", ids)  # two whole blocks: [0, 4) and [4, 8)
    assert record.longest("a", ids + [99], 11) == 8
    assert record.longest("a", ids, 7) == 4  # at most `upto` tokens
    assert record.longest("a", [0, 1, 2, 3, 9, 9, 9, 9], 8) == 4  # the second block differs
    assert record.longest("b", ids, 10) == 0  # another salt: nothing, though the ids are the same
    record.add("b", [5, 5, 5, 5, 6, 6, 6, 6])
    assert record.longest("a", ids, 10) == 0  # bounded: the oldest block went first, and the chain with it
