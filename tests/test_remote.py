"""Remote target: a verification server (in-process, and over loopback) and the RemoteTarget client."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest
import torch

from omnidraft.errors import IncompatibleError, RemoteRequestError, TargetUnavailableError
from omnidraft.server.app import ServerConfig, create_app
from omnidraft.target import Rule
from omnidraft.targets.remote import RemoteTarget

from .conftest import target_greedy

KEY = "s3cret-key"
PROMPTS = ["Question: Tom has 3 apples and buys 5 more.", "Question: A farmer sells 12 eggs a day."]


@pytest.fixture(scope="module")
def app(tiny_target):
    return create_app(tiny_target, ServerConfig(api_key=KEY, max_body_bytes=64 << 10, max_sessions=40))


@pytest.fixture()
def http(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        yield client


def _remote(http, **kw) -> RemoteTarget:
    return RemoteTarget("http://testserver", api_key=KEY, client=http, **kw)


def _open(http, ids) -> str:
    r = http.post("/v1/sessions", json={"prompt_ids": ids}, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["session"]


def test_remote_greedy_is_token_identical_to_local(http, tiny_drafter, tiny_target):
    remote, held = _remote(http), _sessions(http)
    assert (
        remote.token_bytes.fingerprint == tiny_target.token_bytes.fingerprint
    )  # tokenizer came from the server
    pair = tiny_drafter.pair(remote, k=4)
    for prompt in PROMPTS:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)
    assert _sessions(http) == held  # every finished generation closed its session


def _sessions(http) -> int:
    return http.get("/health", headers={"authorization": f"Bearer {KEY}"}).json()["sessions"]


def test_remote_sampling_modes_are_reproducible_by_seed(http, tiny_drafter):
    for mode in ("match", "exact"):
        pair = tiny_drafter.pair(_remote(http), k=3, mode=mode, temperature=0.8)
        runs = [
            pair.generate(PROMPTS[0], max_new_tokens=12, generator=torch.Generator().manual_seed(7)).token_ids
            for _ in range(2)
        ]
        assert runs[0] == runs[1] and len(runs[0]) == 12


def test_remote_verdicts_carry_topk_rows_for_learning(http, draft_tokenizer, tiny_target, tmp_path):
    from omnidraft import TorchDrafter as Drafter
    from omnidraft.distill.adapters import AdapterConfig
    from omnidraft.distill.trainer import TrainConfig
    from omnidraft.store.profiles import ProfileStore

    from .conftest import tiny_llama

    drafter = Drafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny-drafter"
    )
    pair = drafter.pair(
        _remote(http),
        k=4,
        user="alice",
        learn=True,
        adapter=AdapterConfig(rank=4, alpha=8),
        train=TrainConfig(
            interval=1, lr=1e-2, cpu_share=0, background=False
        ),  # it steps before generate returns
        store=ProfileStore(tmp_path),
    )
    out = pair.generate(PROMPTS[1], max_new_tokens=16)
    assert out.token_ids == target_greedy(tiny_target, PROMPTS[1], 16) and pair.steps == 1


def test_bad_requests_get_4xx_with_a_reason(http, tiny_target):
    auth = {"authorization": f"Bearer {KEY}"}
    assert http.get("/v1/info").status_code == 401
    assert http.get("/v1/info", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert (
        http.post("/v1/sessions/nope/verify", json={"committed": 1, "proposal": []}, headers=auth).status_code
        == 404
    )
    big = http.post("/v1/sessions", content=b"[" + b"1," * 40000 + b"1]", headers=auth)
    assert big.status_code == 413 and "limit" in big.json()["error"]
    assert http.post("/v1/sessions", json={"prompt_ids": [10**6]}, headers=auth).status_code == 422
    bad_json = http.post("/v1/sessions", content=b'{"prompt_ids": [1, 2', headers=auth)
    assert bad_json.status_code == 422 and "OpenRequest" in bad_json.json()["error"]
    sid = _open(http, [5, 6, 7])
    ok = http.post(f"/v1/sessions/{sid}/verify", json={"committed": 3, "proposal": [9]}, headers=auth)
    assert ok.status_code == 200
    again = http.post(f"/v1/sessions/{sid}/verify", json={"committed": 3, "proposal": [9]}, headers=auth)
    assert again.json() == ok.json()  # a retried request is answered, not applied twice
    stale = http.post(f"/v1/sessions/{sid}/verify", json={"committed": 3, "proposal": [8]}, headers=auth)
    assert stale.status_code == 409 and "stale" in stale.json()["error"]
    assert (
        http.post(
            f"/v1/sessions/{sid}/verify",
            json={"committed": ok.json()["committed"], "proposal": [1], "mode": "greedy", "temperature": 0.5},
            headers=auth,
        ).status_code
        == 422
    )
    assert http.delete(f"/v1/sessions/{sid}", headers=auth).status_code == 200
    with pytest.raises(RemoteRequestError, match="401"):
        RemoteTarget("http://testserver", api_key="wrong", client=http)


def test_the_server_keeps_serving_after_hundreds_of_malformed_bodies(http, tiny_drafter, tiny_target):
    auth = {"authorization": f"Bearer {KEY}"}
    sid = _open(http, [5, 6, 7])
    rng = random.Random(0)
    bodies = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(150)]
    bodies += [
        json.dumps(x).encode()
        for x in (
            [],
            {},
            {"committed": "x"},
            {"proposal": [-1], "committed": 3},
            {"committed": 3, "proposal": [1] * 500},
            {"version": 9},
            None,
            3.5,
        )
    ] * 19
    for i, body in enumerate(bodies):
        path = "/v1/sessions" if i % 2 else f"/v1/sessions/{sid}/verify"
        status = http.post(path, content=body, headers=auth).status_code
        assert 400 <= status < 500, (body[:40], status)
    assert len(bodies) >= 300
    metrics = http.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    assert http.get("/metrics").status_code == 401  # counters stay behind the key
    assert "omnidraft_rejected_requests_total" in metrics and "omnidraft_verify_seconds_bucket" in metrics
    pair = tiny_drafter.pair(_remote(http), k=4)
    assert pair.generate(PROMPTS[0], max_new_tokens=10).token_ids == target_greedy(
        tiny_target, PROMPTS[0], 10
    )


class _Flaky:
    """An httpx client stand-in: fails after `ok` requests (the server is gone), or loses the first
    verify response after the server applied it (a timeout on the way back)."""

    def __init__(self, inner, ok: int = 10**9, lose_first_verify: bool = False) -> None:
        self.inner, self.ok, self.lose = inner, ok, lose_first_verify
        self.headers = inner.headers

    def request(self, method, path, **kw):
        self.ok -= 1
        if self.ok < 0:
            raise httpx.ConnectError("connection refused")
        response = self.inner.request(method, path, **kw)
        if self.lose and path.endswith("/verify"):
            self.lose = False
            raise httpx.ReadTimeout("timed out")
        return response


def test_a_lost_reply_is_retried_safely(http, tiny_drafter, tiny_target):
    remote = _remote(http)
    remote.http = _Flaky(http, lose_first_verify=True)
    out = tiny_drafter.pair(remote, k=4).generate(PROMPTS[1], max_new_tokens=16)
    assert out.token_ids == target_greedy(tiny_target, PROMPTS[1], 16)


def test_server_gone_raises_a_clear_error_and_keeps_the_committed_text(http, tiny_drafter, tiny_target):
    remote = _remote(http, retries=1)
    remote.http = _Flaky(http, ok=4)  # open + 3 verify rounds, then nothing answers
    pair = tiny_drafter.pair(remote, k=2)
    with pytest.raises(TargetUnavailableError, match="unreachable after 2 attempts") as info:
        pair.generate(PROMPTS[0], max_new_tokens=30)
    partial = info.value.partial
    assert partial is pair.last and partial.finish_reason == "error" and len(partial.token_ids) >= 3
    assert partial.token_ids == target_greedy(tiny_target, PROMPTS[0], 30)[: len(partial.token_ids)]


def test_a_cut_request_continued_from_its_committed_ids_is_the_reference(http, tiny_drafter, tiny_target):
    """Issue 87 item 6: continuing a cut request from its partial text re-tokenizes at the join; from
    its committed ids (`after=partial.token_ids`) it is exactly the reference, at 8 cut points, on a
    remote target and a local one; bad `after` values are refused by name."""
    want = target_greedy(tiny_target, PROMPTS[0], 30)
    healthy = tiny_drafter.pair(_remote(http), k=2)
    local = tiny_drafter.pair(tiny_target, k=2)
    for ok in range(3, 11):
        remote = _remote(http, retries=0)
        remote.http = _Flaky(http, ok=ok)
        with pytest.raises(TargetUnavailableError) as info:
            tiny_drafter.pair(remote, k=2).generate(PROMPTS[0], max_new_tokens=30)
        done = info.value.partial.token_ids
        assert 0 < len(done) < 30
        for pair in (healthy, local):
            rest = pair.generate(PROMPTS[0], max_new_tokens=30 - len(done), after=done)
            assert done + rest.token_ids == want, (ok, len(done))
    for bad in ([1.5], "12", [10**9]):
        with pytest.raises(ValueError, match="after"):
            local.generate(PROMPTS[0], max_new_tokens=2, after=bad)


def test_a_tokenizer_that_is_not_the_servers_is_refused(http, draft_tokenizer):
    with pytest.raises(IncompatibleError, match="not the server's"):
        _remote(http, tokenizer=draft_tokenizer)


def test_32_concurrent_sessions_over_loopback(app, tiny_target):
    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.target import Rule

    url, stop = serve_in_thread(app)
    try:
        prompts = [f"Question: item {i} costs {i + 3} dollars." for i in range(32)]
        references = [target_greedy(tiny_target, p, 12) for p in prompts]
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            remote = RemoteTarget(url, api_key=KEY, tokenizer=tiny_target.tokenizer)
            session = remote.begin(tiny_target.tokenizer(prompts[i])["input_ids"])
            start = len(session.ids)
            while len(session.ids) - start < 12:
                done = len(session.ids) - start
                guess = references[i][done : done + 3]
                guess = guess[:1] + [(guess[1] + 1) % 700] + guess[2:] if i % 2 and len(guess) > 1 else guess
                session.verify(torch.tensor(guess, dtype=torch.long), Rule())
            results[i] = session.ids[start : start + 12]
            session.close()
            remote.close()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(results) == list(range(32))
        assert all(results[i] == references[i] for i in range(32))
    finally:
        stop()


# -- OpenAI-compatible path (targets/openai_client.py) against our own server's /v1/completions -------------


def _openai(http, tiny_target, **kw):
    from omnidraft.targets.openai_client import OpenAICompletionsTarget

    return OpenAICompletionsTarget(
        "http://testserver",
        model="tiny-target",
        api_key=KEY,
        tokenizer=tiny_target.tokenizer,
        vocab_size=len(tiny_target.token_bytes),
        eos_ids=set(tiny_target.eos_ids),
        client=http,
        **kw,
    )


def test_openai_completions_target_is_token_identical_to_local(http, tiny_drafter, tiny_target):
    target = _openai(http, tiny_target)
    pair = tiny_drafter.pair(target, k=4)
    for prompt in PROMPTS:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)
    with pytest.raises(ValueError, match="greedy drafts only"):
        tiny_drafter.pair(target, k=3, mode="match", temperature=0.8).generate(PROMPTS[0], max_new_tokens=4)


@pytest.mark.parametrize(
    "reply, reason",
    [
        ((400, {"error": "echo is not supported with logprobs"}), "cannot verify drafts"),  # OpenAI's API
        (
            (
                200,
                {
                    "choices": [
                        {
                            "text": "x",
                            "logprobs": {"tokens": ["token_id:5"], "top_logprobs": [{"token_id:5": -0.1}]},
                        }
                    ]
                },
            ),
            "cannot verify drafts",
        ),  # llama-server: log-probabilities of generated tokens only
        ((200, "ECHO_OTHER_IDS"), "echoed other token ids"),  # a server that re-tokenized the prompt
    ],
)
def test_an_openai_server_that_cannot_verify_is_refused_at_construction(tiny_target, reply, reason):
    """The probe: one scoring request at construction; a server without prompt log-probabilities or
    with another vocabulary is refused with an error that names what is missing."""
    from omnidraft.errors import IncompatibleError

    def answer(request: httpx.Request) -> httpx.Response:
        status, body = reply
        if body == "ECHO_OTHER_IDS":
            n = len(json.loads(request.content)["prompt"])
            body = {
                "choices": [
                    {
                        "text": "",
                        "logprobs": {
                            "tokens": ["token_id:7"] * (n + 1),
                            "top_logprobs": [None] + [{"token_id:7": -0.1}] * n,
                        },
                    }
                ]
            }
        return httpx.Response(status, json=body)

    client = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(answer))
    with pytest.raises(IncompatibleError, match=reason):
        _openai(client, tiny_target)


def test_openai_endpoint_speaks_the_completions_shape(http, tiny_target):
    auth = {"authorization": f"Bearer {KEY}"}
    ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]
    r = http.post(
        "/v1/completions",
        headers=auth,
        json={
            "model": "tiny-target",
            "prompt": ids,
            "max_tokens": 3,
            "echo": True,
            "logprobs": 2,
            "temperature": 0,
            "user": "ignored-field",
        },
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"]) == len(ids) + 3
        and lp["token_logprobs"][0] is None
        and lp["top_logprobs"][0] is None
    )
    assert all(len(row) == 2 for row in lp["top_logprobs"][1:])
    greedy = target_greedy(tiny_target, PROMPTS[0], 3)
    assert [tiny_target.token_bytes.id_of(t.encode()) for t in lp["tokens"][len(ids) :]] == greedy
    for body in ({"prompt": ids, "temperature": 0.7}, {"prompt": ids, "temperature": 0, "stream": True}):
        assert (
            http.post("/v1/completions", headers=auth, json=body).status_code == 200
        )  # sampled, streamed: served
    for body, reason in [
        ({"prompt": [10**9], "temperature": 0}, "token ids"),
        ({"prompt": ids, "logprobs": 99}, "logprobs"),
        ({"prompt": ids, "echo": True, "logprobs": 1, "temperature": 0.7}, "greedy"),
    ]:
        r = http.post("/v1/completions", headers=auth, json=body)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], (
            body,
            r.text,
        )  # OpenAI's shape


def test_openai_target_feeds_learning_with_top_rows(http, draft_tokenizer, tiny_target, tmp_path):
    from omnidraft import TorchDrafter as Drafter
    from omnidraft.distill.adapters import AdapterConfig
    from omnidraft.distill.trainer import TrainConfig
    from omnidraft.store.profiles import ProfileStore

    from .conftest import tiny_llama

    drafter = Drafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny-drafter"
    )
    pair = drafter.pair(
        _openai(http, tiny_target),
        k=4,
        user="bob",
        learn=True,
        adapter=AdapterConfig(rank=4, alpha=8),
        train=TrainConfig(interval=1, lr=1e-2, cpu_share=0, background=False),
        store=ProfileStore(tmp_path),
    )
    out = pair.generate(PROMPTS[1], max_new_tokens=16)
    assert out.token_ids == target_greedy(tiny_target, PROMPTS[1], 16) and pair.steps == 1


def test_a_session_hands_the_rest_of_a_completion_to_the_server(http, tiny_target):
    """POST /v1/sessions/{id}/generate streams the server's own greedy tokens, committed as they come."""
    remote = _remote(http)
    ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]
    session = remote.begin(ids)
    first = session.verify(torch.zeros(0, dtype=torch.long), Rule()).token
    rest = list(session.decode(15))
    assert [first, *rest] == target_greedy(tiny_target, PROMPTS[0], 16)[: 1 + len(rest)]
    assert session.ids == ids + [first, *rest] and session.forwards == 1 + len(rest)
    stale = http.post(
        f"/v1/sessions/{session.sid}/generate",
        json={"committed": len(ids), "max_tokens": 4},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert stale.status_code == 409 and "stale request" in stale.json()["error"]
    bad = http.post(
        f"/v1/sessions/{session.sid}/generate",
        json={"committed": len(session.ids), "max_tokens": 0},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert bad.status_code == 422
    session.close()


class _Counting:
    """An httpx client stand-in that records each exchange (method, path), streamed ones included."""

    def __init__(self, inner) -> None:
        self.inner, self.headers, self.calls = inner, inner.headers, []

    def request(self, method, path, **kw):
        self.calls.append((method, path))
        return self.inner.request(method, path, **kw)

    def stream(self, method, path, **kw):
        self.calls.append((method, path))
        return self.inner.stream(method, path, **kw)


def test_decoding_alone_is_one_exchange_and_keeps_no_session(app, http, tiny_target):
    """A session that only decodes is one streamed request, as a plain server's completion: no
    open, no close; its tokens leave the server's KV budget when the stream ends."""
    remote, held = _remote(http), _sessions(http)
    remote.http = counting = _Counting(http)
    ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]
    session = remote.begin(ids)
    out = list(session.decode(16))
    session.close()
    assert out == target_greedy(tiny_target, PROMPTS[0], 16) and session.ids == ids + out
    assert counting.calls == [("POST", "/v1/generate")] and session.sid is None
    assert _sessions(http) == held and sum(app.state.service.inflight.values()) == 0
    first = session.verify(
        torch.zeros(0, dtype=torch.long), Rule()
    ).token  # a verify after it opens on every id
    first_sid = session.sid
    assert [*out, first] == target_greedy(tiny_target, PROMPTS[0], 17) and counting.calls[1][
        1
    ] == "/v1/sessions"
    session.close()
    assert _sessions(http) == held and counting.calls[-1] == ("DELETE", f"/v1/sessions/{first_sid}")
    past = http.post(
        "/v1/generate",
        json={"prompt_ids": ids, "max_tokens": 10**6},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert past.status_code == 422


def test_the_latency_objective_measures_both_modes_and_stays_identical(http, tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(_remote(http))  # defaults: cost-driven k, latency objective
    assert pair.speculator.chooser is not None
    ref = target_greedy(tiny_target, PROMPTS[1], 20)
    outs = [pair.generate(PROMPTS[1], max_new_tokens=20) for _ in range(3)]
    assert all(o.token_ids == ref for o in outs)
    assert any(r.drafted for r in outs[0].rounds)  # first request: speculate
    assert all(r.drafted == 0 and r.emitted == 1 for r in outs[1].rounds)  # second: the server alone
    assert all(rate is not None for rate in pair.speculator.chooser.rates.values())
    compute = tiny_drafter.pair(_remote(http), objective="compute")
    assert (
        compute.speculator.chooser is None
        and tiny_drafter.pair(tiny_target, mode="match", temperature=1.0).speculator.chooser is None
    )
    with pytest.raises(ValueError, match="objective must be 'latency' or 'compute'"):
        tiny_drafter.pair(tiny_target, objective="fast")


def test_mode_chooser_takes_the_faster_mode_and_probes_the_other():
    from omnidraft.adaptive.policy import ServingChooser

    chooser = ServingChooser(probe_every=4, probe_cost=1.0)  # probes as often as probe_every allows
    assert chooser.choose() == "speculate"  # each mode is measured once first
    chooser.observe("speculate", 100, 10.0)
    assert chooser.choose() == "alone"
    chooser.observe("alone", 100, 5.0)
    picks = []
    for _ in range(16):
        mode = chooser.choose()
        picks.append(mode)
        chooser.observe(mode, 100, 10.0 if mode == "speculate" else 5.0)
    assert picks[3] == "speculate" and picks.count("speculate") == 2 and not chooser.speculating
    assert (
        picks.index("speculate", 4) == 11
    )  # the first probe confirmed "alone": the next waits twice as long


def test_mode_chooser_probes_a_far_slower_mode_rarely():
    from omnidraft.adaptive.policy import ServingChooser

    def first_probe(speculate_s, alone_s=10.0):
        chooser = ServingChooser(probe_every=8)
        for mode in ("speculate", "alone"):
            assert chooser.choose() == mode
            chooser.observe(mode, 100, speculate_s if mode == "speculate" else alone_s)
        for i in range(100):
            if chooser.choose() == "alone":
                return i + 1
        return None

    assert first_probe(9.5) == 8  # 5% apart: probe_every decides
    assert (
        first_probe(6.25) == 19
    )  # the server alone measured 37.5% slower: a probe costs that much of a request
    with pytest.raises(ValueError, match="probe_cost > 0"):
        ServingChooser(probe_cost=0)


def test_a_sampled_stream_without_a_proposal_source_is_refused_not_decoded_greedily():
    """`steps(rule=sampled)` without a proposal source sent a session's generate, which decodes greedily: the
    rule was dropped. It is refused, naming why, before any request."""
    from omnidraft.target import Rule
    from omnidraft.targets.remote import _RemoteSession

    session = _RemoteSession(owner=None, ids=[1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="greedy only"):
        next(session.steps(4, rule=Rule(mode="match", temperature=1.0)))


def test_a_remote_target_takes_its_key_from_the_servers_variable_and_a_401_says_how(http, monkeypatch):
    """`RemoteTarget` without `api_key=` sends the first key of $OMNIDRAFT_API_KEY (the variable
    `omnidraft serve` reads); without one, the server's 401 names both ways to pass it."""
    monkeypatch.delenv("OMNIDRAFT_API_KEY", raising=False)
    with pytest.raises(RemoteRequestError, match="api_key=.*OMNIDRAFT_API_KEY"):
        RemoteTarget("http://testserver", client=http)
    monkeypatch.setenv("OMNIDRAFT_API_KEY", f"{KEY}, another")
    assert RemoteTarget("http://testserver", client=http).name


def test_the_server_advertises_its_load(tiny_drafter, tiny_target):
    """`/v1/info` says the sessions verifying lately, the mean engine step since it last answered
    and the draft budget a stream gets (None: no measured costs); `RemoteTarget.load()` reads it."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(tiny_target, ServerConfig(api_key=KEY))) as http:
        remote = _remote(http)
        first = remote.load()
        assert first is not None and first.sessions == 0 and first.draft_budget is None
        ids = tiny_target.tokenizer(PROMPTS[0])["input_ids"]
        session = remote.begin(ids)  # held open: a session verifying lately
        for _ in range(3):
            session.verify(torch.zeros(0, dtype=torch.long), Rule())
        now = remote.load()
        assert now.sessions == 1 and now.step_s is not None and now.step_s > 0
        assert remote.load().step_s is None  # no step since the last answer
        session.close()
