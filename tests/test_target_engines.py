"""The declared target interface and the engine registry: a target engine defined in this file alone
(a `TargetBase` subclass registered under a name) is paired, served by `omnidraft serve --engine`
and benchmarked by `omnidraft bench --target-backend`, with nothing else edited; an object that is
no target is refused by name."""

from __future__ import annotations

import json

import pytest

import omnidraft as od
from omnidraft.target import Capabilities, SessionBase, TargetBase, check_target
from omnidraft.targets.registry import ENGINES, Engine, engine, register_engine

from .test_cli_runs import FEW, models, own_cache, run_cli  # noqa: F401 - fixtures


class _Session(SessionBase):
    """Delegates to a PyTorch session, counting the verifies that reach it."""

    def __init__(self, inner, owner) -> None:
        self.inner, self.owner = inner, owner

    @property
    def ids(self):
        return self.inner.ids

    def verify(self, proposal, rule, q=None, generator=None, *, topk=0):
        self.owner.verifies += 1
        return self.inner.verify(proposal, rule, q, generator, topk=topk)

    def decode(self, max_tokens):
        return self.inner.decode(max_tokens)


class ToyTarget(TargetBase):
    """A new engine as a user would add one: verifies (through a tiny PyTorch model here) and
    decodes alone; nothing else declared."""

    capabilities = Capabilities(decodes_alone=True)

    def __init__(self, inner) -> None:
        self.inner, self.name, self.verifies = inner, "toy", 0
        self.tokenizer, self.token_bytes, self.codec, self.eos_ids = (
            inner.tokenizer,
            inner.token_bytes,
            inner.codec,
            inner.eos_ids,
        )

    def begin(self, prompt_ids):
        return _Session(self.inner.begin(prompt_ids), self)


@pytest.fixture
def toy_engine(models):  # noqa: F811
    loaded = []

    def load(spec, options):
        loaded.append(ToyTarget(od.LocalTarget.load(spec)))
        return loaded[-1]

    register_engine(Engine("toy", "a toy engine defined in a test", load))
    yield loaded
    del ENGINES["toy"]


def test_a_pairing_uses_only_what_a_target_declares(tiny_drafter, tiny_target):
    toy = ToyTarget(tiny_target)
    pair = tiny_drafter.pair(toy, objective="compute")
    out = pair.generate("Tom has 3 apples", max_new_tokens=12)
    alone = list(tiny_target.begin(tiny_target.tokenizer("Tom has 3 apples")["input_ids"]).decode(12))
    assert out.token_ids == alone[: len(out.token_ids)] and toy.verifies > 0


def test_an_object_that_is_no_target_is_refused_by_name(tiny_drafter, tiny_target):
    class Half:  # a target of an older release: no capabilities declared
        name, tokenizer, token_bytes, codec, eos_ids = "half", None, None, None, frozenset()

        def begin(self, ids):
            return None

    with pytest.raises(TypeError, match="lacks capabilities"):
        check_target(Half())
    with pytest.raises(TypeError, match="is not a target"):
        tiny_drafter.pair(Half())
    assert tiny_target.capabilities.in_process and tiny_target.generates_alone  # the old names: aliases


def test_serve_and_bench_accept_a_registered_engine(toy_engine, models, tmp_path, monkeypatch):  # noqa: F811
    from fastapi.testclient import TestClient

    from omnidraft.server.drain import DrainingServer

    apps = []
    monkeypatch.setattr(DrainingServer, "run", lambda self, **_: apps.append(self.config.app))
    assert run_cli(["serve", "--engine", "toy", "--target", models["target"], "--no-auth"]) == 0
    with TestClient(apps[0]) as client:
        assert client.get("/v1/info").json()["name"] == "toy"
        ids = toy_engine[0].tokenizer("Tom has 3 apples")["input_ids"]
        sid = client.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
        reply = client.post(f"/v1/sessions/{sid}/verify", json={"committed": len(ids), "proposal": []})
        assert reply.status_code == 200 and toy_engine[0].verifies == 1
        echo = {"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
        assert (
            client.post("/v1/completions", json=echo).status_code == 400
        )  # it scores no positions: refused, not a 5xx

    pair = f"{models['drafter']}:{models['target']}"
    argv = ["bench", "--target-backend", "toy", "--pair", pair, "--dataset", "gsm8k", *FEW]
    assert run_cli([*argv, "--out", str(tmp_path), "--name", "t"]) == 0
    (summary,) = json.loads((tmp_path / "t.json").read_text())["summaries"]
    assert summary["identical_rate"] == 1.0 and toy_engine[-1].verifies > 0


def test_an_unknown_engine_is_refused_naming_the_engines():
    with pytest.raises(ValueError, match="the engines are torch, llama.cpp, vllm"):
        engine("sglang")
