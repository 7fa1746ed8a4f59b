"""A device's requests survive a replica's death (issue "Past one server", item 2): `RemoteTarget`
given several replicas' URLs re-opens a session from its committed ids on the next replica when
the one holding it stops answering or answers 503 while it drains, and on the same one when it lost
the session (a restart); the request names its committed length, so no token is committed twice
and the output stays the target's own."""

from __future__ import annotations

import httpx
import pytest

from omnidraft.errors import TargetUnavailableError
from omnidraft.server.app import ServerConfig, create_app
from omnidraft.targets.remote import RemoteTarget

from .conftest import target_greedy
from .test_remote import KEY, PROMPTS, _Flaky


@pytest.fixture
def replicas(tiny_target):
    from fastapi.testclient import TestClient

    apps = [create_app(tiny_target, ServerConfig(api_key=KEY)) for _ in range(2)]
    with TestClient(apps[0]) as a, TestClient(apps[1]) as b:
        yield apps, [a, b]


def _sessions(app) -> int:
    return len(app.state.service.sessions)


def test_a_replica_that_dies_mid_request_hands_the_session_to_the_next(replicas, tiny_drafter, tiny_target):
    apps, (a, b) = replicas
    want = target_greedy(tiny_target, PROMPTS[0], 30)
    for ok in (3, 5, 8):  # the first replica stops answering after `ok` requests
        remote = RemoteTarget(["http://a", "http://b"], api_key=KEY, client=[_Flaky(a, ok=ok), b], retries=0)
        out = tiny_drafter.pair(remote, k=2, objective="compute").generate(PROMPTS[0], max_new_tokens=30)
        assert out.token_ids == want, ok
        assert remote.url == "http://b" and _sessions(apps[1]) == 0  # finished there, and closed


class _Draining:
    """A replica that answers 503 to every verify (it is draining)."""

    def __init__(self, inner) -> None:
        self.inner, self.headers = inner, inner.headers

    def request(self, method, path, **kw):
        if path.endswith("/verify"):
            return httpx.Response(503, json={"error": "draining"})
        return self.inner.request(method, path, **kw)

    def close(self) -> None:
        pass


def test_a_draining_replica_or_a_lost_session_reopens_from_the_committed_ids(
    replicas, tiny_drafter, tiny_target
):
    apps, (a, b) = replicas
    want = target_greedy(tiny_target, PROMPTS[1], 20)
    remote = RemoteTarget(["http://a", "http://b"], api_key=KEY, client=[_Draining(a), b], retries=0)
    pair = tiny_drafter.pair(remote, k=2, objective="compute")
    assert pair.generate(PROMPTS[1], max_new_tokens=20).token_ids == want
    # one replica that restarts (its sessions gone) mid-request: the session opens there again
    import torch

    from omnidraft.target import Rule

    one = RemoteTarget("http://b", api_key=KEY, client=b)
    session = one.begin(tiny_target.tokenizer(PROMPTS[1])["input_ids"])
    session.verify(torch.tensor([], dtype=torch.long), Rule())
    apps[1].state.service.sessions.clear()  # the restart
    session.verify(torch.tensor([], dtype=torch.long), Rule())
    assert session.ids[-2:] == want[:2] and len(apps[1].state.service.sessions) == 1
    session.close()


def test_with_every_replica_gone_the_request_fails_with_what_it_committed(
    replicas, tiny_drafter, tiny_target
):
    _, (a, b) = replicas
    remote = RemoteTarget(
        ["http://a", "http://b"], api_key=KEY, client=[_Flaky(a, ok=4), _Flaky(b, ok=1)], retries=0
    )
    with pytest.raises(TargetUnavailableError) as info:
        tiny_drafter.pair(remote, k=2, objective="compute").generate(PROMPTS[0], max_new_tokens=30)
    done = info.value.partial.token_ids
    assert done == target_greedy(tiny_target, PROMPTS[0], 30)[: len(done)]
    with pytest.raises(ValueError, match="replicas"):
        RemoteTarget(["http://a", "http://b"], api_key=KEY, client=[a])


def test_a_draining_replica_turns_unready_refuses_new_work_and_serves_its_sessions(replicas, tiny_target):
    """server/drain.py: once draining, /ready answers 503 (a router's health check), a session's
    open, a sessionless generate and an OpenAI completion get 503 before any byte (retried
    elsewhere), while a session already open here is still served."""
    apps, (a, _) = replicas
    auth = {"authorization": f"Bearer {KEY}"}
    ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]
    assert a.get("/ready").json() == {"status": "ready"}
    sid = a.post("/v1/sessions", json={"prompt_ids": ids}, headers=auth).json()["session"]
    apps[0].state.drain.begin()
    assert a.get("/ready").status_code == 503 and a.get("/health").status_code == 200
    for path, body in (
        ("/v1/sessions", {"prompt_ids": ids}),
        ("/v1/generate", {"prompt_ids": ids, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ):
        r = a.post(path, json=body, headers=auth)
        assert r.status_code == 503 and "draining" in r.text and r.headers["retry-after"] == "1", path
    r = a.post(f"/v1/sessions/{sid}/verify", json={"committed": len(ids), "proposal": []}, headers=auth)
    assert r.status_code == 200 and r.json()["token"] == target_greedy(tiny_target, PROMPTS[0], 1)[0]
    assert apps[0].state.drain.in_flight == 0 and apps[0].state.drain.quiet_for() >= 0
