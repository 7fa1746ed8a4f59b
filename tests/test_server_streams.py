"""Server round 3 (issue 66) on the PyTorch engine: an empty prompt is a 400, a stale request's
409 names the committed length, streams hold their tokens in the key's share, deleting a session
ends its stream, and a prefill stops when its client leaves."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from omnidraft.server.app import ServerConfig, create_app

KEY = "streams-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = "Question: Tom has 3 apples and buys 5 more."


@pytest.fixture
def slow_forward(tiny_target, monkeypatch):
    """Every forward of the tiny target takes 20 ms more; the list counts them."""
    model, calls = tiny_target.model, []
    forward = model.forward

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)
    return calls


def _open(c, tiny_target, prompt: str = PROMPT) -> tuple[str, list[int]]:
    ids = tiny_target.tokenizer(prompt)["input_ids"]
    reply = c.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()["session"], ids


def test_an_empty_prompt_is_a_400_naming_it(tiny_target):
    from fastapi.testclient import TestClient

    with TestClient(create_app(tiny_target, ServerConfig(api_key=KEY))) as c:
        for prompt in ("", []):
            r = c.post(
                "/v1/completions",
                json={"model": "tiny-target", "prompt": prompt, "max_tokens": 4},
                headers=AUTH,
            )
            assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_a_stale_requests_409_names_the_committed_length(tiny_target):
    from fastapi.testclient import TestClient

    from omnidraft.targets.remote import RemoteTarget

    with TestClient(create_app(tiny_target, ServerConfig(api_key=KEY))) as c:
        sid, ids = _open(c, tiny_target)
        r = c.post(f"/v1/sessions/{sid}/verify", json={"committed": 1, "proposal": []}, headers=AUTH)
        assert r.status_code == 409 and r.json()["committed"] == len(ids)
        remote = RemoteTarget("http://testserver", api_key=KEY, client=c)
        session = remote.begin(ids)
        session.sid = sid
        session.ids = ids[:1]  # out of step with the server: the 409 says where the server is
        from omnidraft.errors import RemoteRequestError

        with pytest.raises(RemoteRequestError) as refused:
            list(session.decode(2))
        assert refused.value.status == 409 and refused.value.committed == len(ids)


def test_streams_hold_their_tokens_in_the_keys_share(tiny_target, slow_forward):
    """One key opened 40 streams of 4,096 tokens past its share, all accepted. Each stream now
    holds its max_tokens in the key's share while it runs: past the share, a 429."""
    from fastapi.testclient import TestClient

    config = ServerConfig(api_key=KEY, max_tokens=2000)
    with TestClient(create_app(tiny_target, config)) as c:
        statuses, streams = [], []
        for _ in range(5):
            sid, ids = _open(c, tiny_target)
            body = {"committed": len(ids), "max_tokens": 500}
            stream = c.stream("POST", f"/v1/sessions/{sid}/generate", json=body, headers=AUTH)
            reply = stream.__enter__()
            statuses.append(reply.status_code)
            streams.append(stream)
        for stream in streams:
            stream.__exit__(None, None, None)
    assert statuses[:3] == [200, 200, 200] and 429 in statuses


def test_deleting_a_session_ends_its_stream(tiny_target, slow_forward):
    from fastapi.testclient import TestClient

    with TestClient(create_app(tiny_target, ServerConfig(api_key=KEY))) as c:
        sid, ids = _open(c, tiny_target)
        got: list[dict] = []

        def read() -> None:
            body = {"committed": len(ids), "max_tokens": 1000}
            with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body, headers=AUTH) as reply:
                got.extend(json.loads(line) for line in reply.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.5)
        assert c.delete(f"/v1/sessions/{sid}", headers=AUTH).status_code == 200
        reader.join(timeout=5)
        assert not reader.is_alive() and 0 < len(got) < 200  # ended long before its 1,000 tokens
        seen = len(slow_forward)
        time.sleep(0.5)
        assert len(slow_forward) <= seen + 1


def test_a_prefill_stops_when_its_client_leaves(tiny_target):
    """A client that leaves during its session's first verify no longer leaves the whole prefill
    behind (it took 38 s of server CPU after the client had gone): the chunks stop within about a
    chunk's time of the server noticing."""
    import httpx

    from omnidraft.bench.remote import serve_in_thread

    app = create_app(tiny_target, ServerConfig(api_key=KEY))
    url, stop = serve_in_thread(app)
    chunks: list[int] = []
    try:
        http = httpx.Client(base_url=url, headers=AUTH)
        ids = (tiny_target.tokenizer(PROMPT * 30)["input_ids"] * 2)[:900]
        sid = http.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
        session = app.state.service.sessions[sid]
        prefill = session.inner.prefill

        def slow(limit: int) -> int:  # 0.1 s a chunk of at most 32 tokens: 900 tokens take 3 s
            chunks.append(limit)
            time.sleep(0.1)
            return prefill(min(limit, 32))

        session.inner.prefill = slow
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"committed": len(ids), "proposal": []}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                f"POST /v1/sessions/{sid}/verify HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.5)
        time.sleep(0.8)
        seen = len(chunks)
        time.sleep(0.5)
        assert len(chunks) == seen and seen < 20  # stopped, long before its 29 chunks
    finally:
        stop()


def test_a_stream_ended_by_the_garbage_collector_inside_a_locked_section_does_not_deadlock(tiny_target):
    """A stream dropped unread is released by a finalizer (`sessions.ended`), which the garbage
    collector may run at any allocation, also while the same thread holds the session table's
    lock (it did, inside `_reserve`, and the fuzz test hung): the release must go through."""
    from omnidraft.server.service import Service

    service = Service(tiny_target, ServerConfig())
    release, done = service._hold(5, 0), threading.Event()

    def inside() -> None:
        with service.table_lock:
            release()  # what the finalizer does when the collector runs here
        done.set()

    threading.Thread(target=inside, daemon=True).start()
    assert done.wait(10) and service.inflight[0] == 0
