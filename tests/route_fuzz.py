"""Fuzzed bodies for every request route of the verification server (both engines' tests use it):
OpenAI completions and chat, prompt generation, and on an engine that verifies in its own step the
speculate stream and its proposals. Valid-typed bodies with extreme values sit beside wrong types
and unknown fields; `fuzz_route` posts `examples` of them and asserts none gets a 5xx.

`OMNIDRAFT_FUZZ_EXAMPLES` sets the count (the suite's default keeps it quick; the server issue's
bar, 5,000 a route, is a run with it set)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("OMNIDRAFT_FUZZ_EXAMPLES", "150"))

_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 10**6), max_size=4),
)
_TOKENS = st.one_of(st.integers(-2, 6), st.sampled_from([10**6, 4097, "3", None, True]))
_SAMPLING = {
    "temperature": st.one_of(st.sampled_from([0.0, 1e-320, 0.7, 1.0, 100.0, -1.0, float("nan")]), _ANY),
    "top_p": st.one_of(st.sampled_from([1e-300, 0.5, 0.95, 1.0, 0.0, 2.0]), _ANY),
    "top_k": st.one_of(st.sampled_from([0, 1, 5, 64, 65, 10**6, -1]), _ANY),
    "seed": st.one_of(st.none(), st.integers(-1, 2**64)),
}


def _ids(vocab: int) -> Any:
    return st.lists(
        st.one_of(st.integers(0, vocab - 1), st.sampled_from([-1, vocab, 10**9, True])), max_size=6
    )


def completion_bodies(vocab: int) -> Any:
    prompt = st.one_of(st.text(max_size=30), _ids(vocab), st.just(""), st.just([]), _ANY)
    return st.fixed_dictionaries(
        {"prompt": prompt, "max_tokens": _TOKENS},
        optional={
            **_SAMPLING,
            "model": st.one_of(st.just("target"), _ANY),
            "stream": st.one_of(st.booleans(), _ANY),
            "echo": st.one_of(st.booleans(), _ANY),
            "logprobs": st.one_of(st.integers(-1, 30), _ANY),
            "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), _ANY),
            "n": st.integers(0, 3),
            "presence_penalty": st.floats(allow_nan=True),
            "unknown": _ANY,
        },
    )


def chat_bodies() -> Any:
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
            "content": st.text(max_size=20),
        }
    )
    messages = st.one_of(st.lists(message, max_size=3), _ANY, st.lists(_ANY, max_size=2))
    return st.fixed_dictionaries(
        {"messages": messages, "max_tokens": _TOKENS},
        optional={
            **_SAMPLING,
            "stream": st.one_of(st.booleans(), _ANY),
            "logprobs": st.one_of(st.booleans(), _ANY),
            "top_logprobs": st.one_of(st.integers(-1, 30), _ANY),
            "unknown": _ANY,
        },
    )


def generate_bodies(vocab: int) -> Any:
    return st.fixed_dictionaries(
        {"prompt_ids": st.one_of(_ids(vocab), _ANY), "max_tokens": _TOKENS},
        optional={**_SAMPLING, "version": st.integers(-1, 3), "unknown": _ANY},
    )


def speculate_bodies(committed: int, sampling: bool = True) -> Any:
    """`committed` stands for the session's real length (`route_poster` moves it with the session's);
    `sampling`: with the sampling fields (a session's plain generate takes none)."""
    return st.fixed_dictionaries(
        {"committed": st.one_of(st.integers(committed - 1, committed + 1), _ANY), "max_tokens": _TOKENS},
        optional={**(_SAMPLING if sampling else {}), "version": st.integers(-1, 3), "unknown": _ANY},
    )


def proposal_bodies(vocab: int, committed: int) -> Any:
    return st.fixed_dictionaries(
        {
            "at": st.one_of(st.integers(committed - 2, committed + 3), st.sampled_from([0, -1, 10**9]), _ANY),
            "proposal": st.one_of(_ids(vocab), _ANY),
        },
        optional={"version": st.integers(-1, 3), "unknown": _ANY},
    )


def fuzz_route(post: Callable[[dict[str, Any]], Any], bodies: Any, examples: int = EXAMPLES) -> list[int]:
    """Post `examples` bodies drawn from `bodies` (`post(body)` returns the reply); every status
    is below 500. Returns the statuses."""
    statuses: list[int] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies)
    def fuzz(body: dict[str, Any]) -> None:
        r = post(body)
        statuses.append(r.status_code)
        assert r.status_code < 500, (body, r.text[:500])

    fuzz()
    return statuses


def as_json(body: dict[str, Any]) -> dict[str, Any]:
    """Request keywords that send `body` as it is, NaN included."""
    return {"content": json.dumps(body, allow_nan=True), "headers": {"content-type": "application/json"}}


def verify_bodies(vocab: int, committed: int) -> Any:
    return st.fixed_dictionaries(
        {"committed": st.one_of(st.integers(committed - 1, committed + 1), _ANY), "proposal": _ids(vocab)},
        optional={
            **_SAMPLING,
            "mode": st.sampled_from(["greedy", "match", "exact", "omnidraft", "x"]),
            "topk": st.integers(-1, 70),
            "q": st.one_of(st.none(), _ANY),
            "unknown": _ANY,
        },
    )


ROUTES = ("completions", "chat", "generate", "session-generate", "speculate", "proposal")


def route_poster(
    client: Any, route: str, vocab: int, prompt_ids: list[int], auth: dict[str, str], sid: str | None = None
) -> tuple[Any, Any]:
    """(post, bodies) for `route` (one of ROUTES, or "verify") on `client`'s server: session routes
    use session `sid` (or open one on `prompt_ids`, and a new one when it is gone or nears its
    end) and post near its real committed length (a body's int `committed` or `at` within 3 of
    the prompt's length moves with the session's)."""
    base = len(prompt_ids)
    live: list[str] = [sid] if sid else []

    def session() -> str:
        service = client.app.state.service
        if not live or live[0] not in service.sessions or len(service.sessions[live[0]].inner.ids) > 600:
            reply = client.post("/v1/sessions", json={"prompt_ids": prompt_ids}, headers=auth)
            assert reply.status_code == 200, reply.text
            live[:] = [reply.json()["session"]]
        return live[0]

    def near(body: dict[str, Any], key: str, sid: str) -> dict[str, Any]:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value - base) <= 3:
            real = len(client.app.state.service.sessions[sid].inner.ids)
            body = {**body, key: real + value - base}
        return body

    paths = {
        "completions": ("/v1/completions", completion_bodies(vocab)),
        "chat": ("/v1/chat/completions", chat_bodies()),
        "generate": ("/v1/generate", generate_bodies(vocab)),
        "session-generate": ("/v1/sessions/{sid}/generate", speculate_bodies(base, sampling=False)),
        "speculate": ("/v1/sessions/{sid}/speculate", speculate_bodies(base)),
        "proposal": ("/v1/sessions/{sid}/proposal", proposal_bodies(vocab, base)),
        "verify": ("/v1/sessions/{sid}/verify", verify_bodies(vocab, base)),
    }
    path, bodies = paths[route]
    few = st.integers(1, 4)
    valid_ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4)
    valid = {  # well-formed bodies beside the fuzz, so each route also serves while fuzzed
        "completions": st.fixed_dictionaries(
            {"prompt": valid_ids, "max_tokens": few, "temperature": st.sampled_from([0.0, 0.7])}
        ),
        "chat": st.fixed_dictionaries(
            {"messages": st.just([{"role": "user", "content": "Hi"}]), "max_tokens": few}
        ),
        "generate": st.fixed_dictionaries({"prompt_ids": valid_ids, "max_tokens": few}),
        "session-generate": st.fixed_dictionaries({"committed": st.just(base), "max_tokens": few}),
        "speculate": st.fixed_dictionaries({"committed": st.just(base), "max_tokens": few}),
        "proposal": st.fixed_dictionaries({"at": st.integers(base, base + 2), "proposal": valid_ids}),
        "verify": st.fixed_dictionaries({"committed": st.just(base), "proposal": valid_ids}),
    }[route]
    bodies = st.one_of(valid, bodies)

    def post(body: dict[str, Any]) -> Any:
        where = path
        if "{sid}" in path:
            sid = session()
            where = path.format(sid=sid)
            body = near(near(body, "committed", sid), "at", sid)
        kw = as_json(body)
        return client.post(where, content=kw["content"], headers={**auth, **kw["headers"]})

    return post, bodies


KEYS = ("ka", "kb", "op")  # `request_fuzz`'s server: two tenants' API keys and the operator's


def requests() -> Any:
    """Requests off the bodies' routes: any method on the ops, model and session paths (fuzzed
    ids, some 5,000 characters long) and paths no route serves, each with no key, a tenant's, the
    operator's or a wrong one."""
    printable = st.text(
        st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"), max_size=6
    )
    segment = st.one_of(printable, st.sampled_from(["x" * 5000, "..", "%00", "a/b", "é"]))
    path = st.one_of(
        st.sampled_from(["/health", "/metrics", "/v1/models", "/v1/info", "/v1/embeddings", "/v2", "/"]),
        st.builds(lambda s: f"/v1/models/{s}", segment),
        st.builds(lambda s, tail: f"/v1/sessions/{s}{tail}", segment, st.sampled_from(["", "/verify", "/x"])),
    )
    return st.fixed_dictionaries(
        {
            "method": st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]),
            "path": path,
            "key": st.sampled_from([None, *KEYS, "wrong"]),
        }
    )


def request_poster(client: Any) -> Callable[[dict[str, Any]], Any]:
    """`post(request)` for `requests()`: it sends the request; every reply's body is bounded
    (an echoed value is cut) and an error under /v1 is in OpenAI's shape or the server's own."""

    def post(r: dict[str, Any]) -> Any:
        headers = {"Authorization": f"Bearer {r['key']}"} if r["key"] else {}
        reply = client.request(r["method"], r["path"], headers=headers)
        assert len(reply.content) < 4000 or r["path"] == "/metrics", (r["path"][:80], len(reply.content))
        if reply.status_code >= 400 and r["path"].startswith("/v1/"):
            body = reply.json()
            assert "error" in body, body
        return reply

    return post
