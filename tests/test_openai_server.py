"""`omnidraft serve`'s OpenAI surface, driven by the official `openai` client: models, completions
and chat completions, plain and streamed, sampled with a seed, stopped by a stop string, and
errors in OpenAI's shape."""

from __future__ import annotations

import copy

import pytest

from omnidraft import LocalTarget
from omnidraft.server.app import ServerConfig, create_app

from .conftest import target_greedy

KEY = "open-sesame"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def served(tiny_target):
    from fastapi.testclient import TestClient
    from openai import OpenAI

    tokenizer = copy.deepcopy(tiny_target.tokenizer)
    tokenizer.chat_template = TEMPLATE
    target = LocalTarget(tiny_target.model, tokenizer, "tiny-target")
    with TestClient(create_app(target, ServerConfig(api_key=KEY))) as http:
        yield target, OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def test_models_lists_the_target(served):
    target, client = served
    assert [m.id for m in client.models.list().data] == [target.name]


def test_a_greedy_completion_is_the_targets_own_and_streams_the_same_text(served):
    target, client = served
    prompt = "Question: Tom has 3 apples and buys 5 more."
    out = client.completions.create(model=target.name, prompt=prompt, max_tokens=12, temperature=0)
    want = target.tokenizer.decode(target_greedy(target, prompt, 12), skip_special_tokens=True)
    assert out.choices[0].text == want and out.usage.completion_tokens == 12
    streamed = client.completions.create(
        model=target.name, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == want


def test_sampled_completions_follow_the_seed_and_the_default_temperature_is_served(served):
    target, client = served
    a = client.completions.create(
        model=target.name, prompt="Question:", max_tokens=8, seed=5
    )  # temperature 1
    b = client.completions.create(model=target.name, prompt="Question:", max_tokens=8, seed=5)
    assert a.choices[0].text == b.choices[0].text


def test_chat_completions_plain_and_streamed_with_a_stop_string(served):
    target, client = served
    messages = [{"role": "user", "content": "How many apples does Tom have?"}]
    whole = client.chat.completions.create(model=target.name, messages=messages, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text
    streamed = client.chat.completions.create(
        model=target.name, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(
        model=target.name, messages=messages, max_tokens=16, temperature=0, stop=stop
    )
    assert (
        cut.choices[0].message.content == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    )


def _forward_logprobs(target, ids: list[int], out: list[int]):
    """The target's own log-softmax rows over `out` after `ids` (one forward over the whole)."""
    import torch

    with torch.no_grad():
        logits = target.model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1)


def test_sampled_and_streamed_replies_carry_the_targets_logprobs(served):
    target, client = served
    prompt = "Question: Tom has 3 apples."
    out = client.completions.create(
        model=target.name,
        prompt=prompt,
        max_tokens=6,
        temperature=0.8,
        seed=3,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    ids = target.tokenizer(prompt)["input_ids"]
    got = out.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in got.tokens]
    rows = _forward_logprobs(target, ids, tokens)
    assert len(got.token_logprobs) == out.usage.completion_tokens == 6
    for i, (token, lp, top) in enumerate(zip(tokens, got.token_logprobs, got.top_logprobs)):
        assert lp == pytest.approx(float(rows[i, token]), abs=1e-3) and len(top) == 2
    messages = [{"role": "user", "content": "How many apples?"}]
    chat = client.chat.completions.create(
        model=target.name, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the top
    streamed = client.chat.completions.create(
        model=target.name, messages=messages, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    pieces = [c.choices[0].logprobs.content for c in streamed if c.choices[0].logprobs is not None]
    assert [e.token for piece in pieces for e in piece] == [c.token for c in content]


def test_errors_come_in_openais_shape(served):
    import openai

    target, client = served
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=target.name, prompt="x", max_tokens=4, top_p=5.0)
    assert "top_p" in str(bad.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url="http://testserver/v1", api_key="wrong", http_client=client._client, max_retries=0
        ).models.list()


def test_unknown_or_unimplemented_fields_are_refused_by_name(served):
    import openai

    target, client = served
    with pytest.raises(openai.BadRequestError, match="best_guess"):
        client.completions.create(model=target.name, prompt="x", max_tokens=2, extra_body={"best_guess": 1})
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=target.name, prompt="x", max_tokens=2, presence_penalty=0.5)
    ok = client.completions.create(
        model=target.name, prompt="x", max_tokens=2, temperature=0, user="u1", presence_penalty=0.0
    )
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("stop", ["", [""], ["", "zzz"]])
def test_an_empty_stop_string_is_refused_not_a_reply_cut_at_once(served, stop):
    """An empty stop string matches before the first character: once it returned 'S' or '' with
    finish reason "stop". It is refused, naming the field, on completions and chat alike."""
    import openai

    target, client = served
    with pytest.raises(openai.BadRequestError, match="stop strings must be non-empty"):
        client.completions.create(
            model=target.name, prompt="Question:", max_tokens=4, temperature=0, stop=stop
        )
    with pytest.raises(openai.BadRequestError, match="stop strings must be non-empty"):
        client.chat.completions.create(
            model=target.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stop=stop
        )


def test_a_request_for_another_model_is_refused_naming_the_served_one(served):
    import openai

    target, client = served
    with pytest.raises(
        openai.NotFoundError, match="'gpt-4o' is not served here: this server serves 'tiny-target'"
    ):
        client.completions.create(model="gpt-4o", prompt="Question:", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="tiny-target"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_log_requests_writes_one_line_a_request_without_the_key(tiny_target, caplog):
    import logging

    from fastapi.testclient import TestClient

    with TestClient(create_app(tiny_target, ServerConfig(api_key=KEY, log_requests=True))) as http:
        with caplog.at_level(logging.INFO, logger="omnidraft.requests"):
            http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
            http.get("/v1/models")
    lines = [r.getMessage() for r in caplog.records if r.name == "omnidraft.requests"]
    assert len(lines) == 2 and KEY not in "".join(lines)
    assert lines[0].startswith("GET /v1/models 200 ") and lines[0].endswith(" key #0")
    assert lines[1].startswith("GET /v1/models 401 ") and lines[1].endswith(" key none")
    with TestClient(create_app(tiny_target, ServerConfig(api_key=KEY))) as http:  # off by default
        with caplog.at_level(logging.INFO, logger="omnidraft.requests"):
            caplog.clear()
            http.get("/v1/models")
    assert not [r for r in caplog.records if r.name == "omnidraft.requests"]


def test_a_model_is_retrieved_by_id_and_unknown_routes_answer_in_openais_shape(served):
    """`client.models.retrieve` asks GET /v1/models/{id}: the served model is answered, another is
    OpenAI's 404; a path or method no route serves (/v1/embeddings, a malformed session path) is a
    404 or 405 in OpenAI's error shape, not FastAPI's {"detail": ...}, its path cut short."""
    import openai

    target, client = served
    assert client.models.retrieve(target.name).id == target.name
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("another-model")
    http = client._client
    auth = {"authorization": f"Bearer {KEY}"}
    for method, path in [
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/sessions/abc/nothing"),
        ("GET", "/v1/completions"),
        ("GET", "/v1/" + "x" * 5000),
    ]:
        reply = http.request(method, f"http://testserver{path}", headers=auth)
        error = reply.json()["error"]
        assert reply.status_code in (404, 405) and set(error) == {"message", "type", "param", "code"}
        assert error["code"] == reply.status_code and len(error["message"]) < 200, path
