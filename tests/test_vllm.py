"""VLLMTarget and `omnidraft serve --engine vllm` on a tiny Llama served by vLLM's CPU engine: greedy
identity against vLLM's own decoding, the prefix-cache tail rule, crops, concurrent sessions, match
sampling, refused rules and bad input to the server."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omnidraft.target import Rule
from omnidraft.targets.vllm_target import tail_rows

from .conftest import chi_square_p, gsm8k_texts
from .route_fuzz import EXAMPLES, ROUTES, fuzz_route, route_poster

pytestmark = pytest.mark.exclusive  # vLLM binds its OpenMP threads itself: not on a pinned xdist worker

PROMPTS = ["Question: Tom has 3 apples and buys 5 more.", "Question: A train travels 60 miles in 2 hours."]


@pytest.fixture(scope="module")
def tiny_vllm_model(tmp_path_factory, target_tokenizer):
    """A 2-layer Llama whose heads are 32 wide (vLLM's CPU attention needs a width it has kernels
    for), saved as safetensors with the target tokenizer; and the HF model itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(target_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny-vllm")
    model.save_pretrained(path)
    target_tokenizer.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def vllm_target(tiny_vllm_model):
    from omnidraft import VLLMTarget

    target = VLLMTarget.load(
        str(tiny_vllm_model[0]),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
    )
    yield target
    target.close()


def _ids(target, prompt: str) -> list[int]:
    return target.tokenizer(prompt)["input_ids"]


def test_the_tail_rule_reads_only_computed_rows():
    assert tail_rows(prompt_len=70, num_cached=32, base=64)  # row base - 1 = 63 was computed
    assert not tail_rows(prompt_len=70, num_cached=64, base=64)  # row 63 came from the cache: not readable
    assert not tail_rows(prompt_len=70, num_cached=0, base=0)


def test_on_the_cpu_an_engine_loads_its_compiled_graph_from_the_cache(monkeypatch):
    """vLLM's CPU build fails to load its own AOT-compiled graphs (every start compiled again):
    engine_defaults turns that mode off where the caller has not chosen, and leaves a choice made."""
    from omnidraft.targets import vllm_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(vllm_engine.AOT_ENV, raising=False)
    vllm_engine.engine_defaults({})
    assert os.environ[vllm_engine.AOT_ENV] == "0"
    monkeypatch.setenv(vllm_engine.AOT_ENV, "1")
    vllm_engine.engine_defaults({})
    assert os.environ[vllm_engine.AOT_ENV] == "1"


def test_verifies_with_accepts_and_rejections_give_vllms_own_greedy_output(vllm_target):
    ids = _ids(vllm_target, PROMPTS[0])
    want = vllm_target.generate(ids, 24)
    session, rounds = vllm_target.begin(ids), 0
    while len(session.ids) < len(ids) + len(want):
        done = len(session.ids) - len(ids)
        proposal = want[done : done + 4]
        if rounds % 2:  # every other round, a wrong third token: accepted 2, then the correction
            proposal = (
                proposal[:2] + [(proposal[2] + 1) % vllm_target.vocab] if len(proposal) > 2 else proposal
            )
        verdict = session.verify(torch.tensor(proposal), Rule(), topk=3)
        assert verdict.topk[0].shape == (verdict.accepted + 1, 3)
        rounds += 1
    assert session.ids[len(ids) : len(ids) + len(want)] == want
    assert session.recomputed == 0  # its own salted pages never cover the rows a verify reads


def test_a_verify_whose_rows_the_cache_served_is_recomputed(vllm_target):
    """A block-aligned context (64 tokens, blocks of 32) that another request with the same salt
    computed: the cache covers position 63, whose logits the verify needs. The rule sees it and
    computes them again; reading the cached rows would give garbage instead of these verdicts."""
    ids = [
        int(i) for i in torch.randint(1, vllm_target.vocab, (64,), generator=torch.Generator().manual_seed(3))
    ]
    want = vllm_target.generate(ids, 3)
    first = vllm_target.begin(ids)
    first.verify(torch.tensor(want[:2]), Rule())
    second = vllm_target.begin(ids)
    second.salt = first.salt  # as if it were the same session's context computed before
    verdict = second.verify(torch.tensor(want[:2]), Rule())
    assert second.recomputed == 1 and (verdict.accepted, verdict.token) == (2, want[2])


def test_one_tenants_sessions_share_a_prompt_prefix_and_two_tenants_never_do(vllm_target):
    """Sessions given one tenant's salt reuse the pages of a shared 96-token prefix (the engine's
    own count of cached tokens), a session of another tenant reads none, and every verdict stays
    vLLM's own greedy choice."""
    from omnidraft.server.sessions import tenant_salt

    g = torch.Generator().manual_seed(5)
    prefix = [int(i) for i in torch.randint(1, vllm_target.vocab, (96,), generator=g)]
    first = vllm_target.begin(prefix + [7, 8, 9])
    first.share_prefix_cache(tenant_salt(0))
    first.verify(torch.tensor([], dtype=torch.long), Rule())
    for key, cached in ((0, True), (1, False)):
        ids = prefix + [11, 12, 13 + key]
        session = vllm_target.begin(ids)
        session.share_prefix_cache(tenant_salt(key))
        # the target knows what its tenant's pages hold: the short rest is read by the verify itself
        assert (session.cached >= 64, session.pending) == ((True, 0) if cached else (False, len(ids) - 1))
        seen = vllm_target.request(ids, tenant_salt(key), max_tokens=1).num_cached_tokens or 0
        assert (seen >= 64) is cached and (seen == 0) is not cached, (key, seen)
        want = vllm_target.generate(ids, 3)
        verdict = session.verify(torch.tensor(want[:2]), Rule())
        assert (verdict.accepted, verdict.token) == (2, want[2])


def test_a_pairing_on_vllm_is_lossless(vllm_target, tiny_drafter):
    pair = tiny_drafter.pair(vllm_target, k=3)
    for prompt in PROMPTS:
        out = pair.generate(prompt, max_new_tokens=20)
        assert out.token_ids == vllm_target.generate(_ids(vllm_target, prompt), 20)[: len(out.token_ids)]
        assert len(out.token_ids) == 20 or out.token_ids[-1] in vllm_target.eos_ids


def test_the_engine_verifies_a_pairings_drafts_in_its_own_step(vllm_target, tiny_drafter):
    """`VLLMTarget.load` builds the engine with omnidraft's proposer: a greedy request is one engine
    request whose steps verify the pairing's drafts; its output is the engine's own decoding."""
    assert vllm_target.drafts_in_engine
    pair, calls = tiny_drafter.pair(vllm_target, k=3), vllm_target.proposer.calls
    for prompt in PROMPTS:
        out = pair.generate(prompt, max_new_tokens=24)
        want = vllm_target.generate(_ids(vllm_target, prompt), 24)
        assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) in (24, len(want))
        assert sum(r.emitted for r in out.rounds) == len(out.token_ids)
        assert sum(r.proposed for r in out.rounds) > 0
    assert vllm_target.proposer.calls > calls


def test_concurrent_sessions_are_batched_and_each_exact(vllm_target):
    texts = [t.split("\n")[0][:80] for t in gsm8k_texts("test", 6)]
    wants = {t: vllm_target.generate(_ids(vllm_target, t), 12) for t in texts}
    got: dict[str, list[int]] = {}

    def run(text: str) -> None:
        ids = _ids(vllm_target, text)
        session = vllm_target.begin(ids)
        while len(session.ids) < len(ids) + 12:
            done = len(session.ids) - len(ids)
            session.verify(torch.tensor(wants[text][done : done + 3]), Rule())
        got[text] = session.ids[len(ids) : len(ids) + 12]

    threads = [threading.Thread(target=run, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == wants


def test_a_failed_request_leaves_the_session_as_it_was(vllm_target, monkeypatch):
    ids = _ids(vllm_target, PROMPTS[1])
    session = vllm_target.begin(ids)

    def fail(*args, **kwargs):
        raise RuntimeError("engine gone")

    monkeypatch.setattr(vllm_target, "request", fail)
    with pytest.raises(RuntimeError):
        session.verify(torch.tensor([5, 6]), Rule())
    assert session.ids == ids


def test_rules_it_cannot_verify_losslessly_are_refused_with_the_reason(vllm_target):
    session = vllm_target.begin(_ids(vllm_target, PROMPTS[0]))
    with pytest.raises(ValueError, match="rejection modes"):
        session.verify(
            torch.tensor([5]), Rule(mode="exact", temperature=1.0), torch.ones(1, vllm_target.vocab)
        )
    with pytest.raises(ValueError, match="top_k"):
        session.verify(torch.tensor([5]), Rule(mode="match", temperature=1.0))
    with pytest.raises(ValueError, match="prompt ids"):
        vllm_target.begin([vllm_target.vocab])


def test_match_sampling_with_top_k_follows_the_targets_distribution(vllm_target, tiny_vllm_model):
    """400 first tokens sampled by match verification (top_k 5, temperature 1.5) against the HF
    model's own top-5 distribution: chi-square, alpha 0.001 (fails by chance once in 1,000 seeds;
    the seed is fixed)."""
    ids = _ids(vllm_target, PROMPTS[0])
    rule, generator = Rule(mode="match", temperature=1.5, top_k=5), torch.Generator().manual_seed(0)
    counts: dict[int, int] = {}
    for _ in range(400):
        token = (
            vllm_target.begin(ids).verify(torch.tensor([], dtype=torch.long), rule, generator=generator).token
        )
        counts[token] = counts.get(token, 0) + 1
    with torch.no_grad():
        logits = tiny_vllm_model[1](torch.tensor([ids])).logits[0, -1]
    top = logits.topk(5)
    p = torch.softmax(top.values.double() / 1.5, -1)
    assert set(counts) <= set(top.indices.tolist())
    observed = [counts.get(int(t), 0) for t in top.indices]
    expected = [float(x) * 400 for x in p]
    expected[-1] = 400 - sum(expected[:-1])
    assert chi_square_p(observed, expected) > 1e-3


@pytest.fixture(scope="module")
def vllm_client(vllm_target):
    from fastapi.testclient import TestClient

    from omnidraft.server.app import ServerConfig, create_app

    with TestClient(create_app(vllm_target, ServerConfig(api_key="k"))) as client:
        yield client


AUTH = {"authorization": "Bearer k"}


def test_a_stock_openai_clients_sampled_request_is_served_in_the_engines_step(vllm_client, vllm_target):
    """Server round 3, item 7: OpenAI clients sample by default (temperature 1, no top_k); on the
    vLLM engine that was a 400 naming top_k. Now vLLM samples it in its own step; a seed gives the
    same completion twice."""
    for stream in (False, True):  # (the tiny tokenizer has no chat template: completions only)
        body = {
            "model": vllm_target.name,
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 1.0,
            "stream": stream,
        }
        r = vllm_client.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
    seeded = {
        "model": vllm_target.name,
        "prompt": PROMPTS[1],
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 5,
    }
    texts = [
        vllm_client.post("/v1/completions", json=seeded, headers=AUTH).json()["choices"][0]["text"]
        for _ in range(2)
    ]
    assert texts[0] == texts[1]
    other = vllm_client.post("/v1/completions", json={**seeded, "model": "x"}, headers=AUTH)
    assert other.status_code == 404 and vllm_target.name in other.json()["error"]["message"]


def test_the_vllm_server_serves_sessions_with_a_draft_budget(vllm_client, vllm_target, tiny_drafter):
    from omnidraft.targets.remote import RemoteTarget

    ids = _ids(vllm_target, PROMPTS[0])
    want = vllm_target.generate(ids, 16)
    sid = vllm_client.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH).json()["session"]
    reply = vllm_client.post(
        f"/v1/sessions/{sid}/verify", json={"committed": len(ids), "proposal": want[:3]}, headers=AUTH
    ).json()
    assert (reply["accepted"], reply["token"]) == (3, want[3]) and isinstance(reply["budget"], int)
    stream = vllm_client.post(
        f"/v1/sessions/{sid}/generate", json={"committed": len(ids) + 4, "max_tokens": 5}, headers=AUTH
    )
    assert [t for line in stream.text.splitlines() for t in __import__("json").loads(line)["tokens"]] == want[
        4:9
    ]
    assert vllm_client.delete(f"/v1/sessions/{sid}", headers=AUTH).status_code == 200
    pair = tiny_drafter.pair(RemoteTarget("http://testserver", api_key="k", client=vllm_client), k=3)
    assert pair.generate(PROMPTS[0], max_new_tokens=16).token_ids == want


def test_a_device_session_streams_while_the_engine_verifies_its_proposals(vllm_target, tiny_drafter):
    """`/speculate`: the rest of a completion is one engine request; proposals the device posts
    are verified in the engine's own step (several tokens a chunk), and a pairing on a
    RemoteTarget uses it for greedy requests. Served by uvicorn, as a device would reach it."""
    import json

    import httpx

    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.server.app import ServerConfig, create_app
    from omnidraft.targets.remote import RemoteTarget

    url, stop = serve_in_thread(create_app(vllm_target, ServerConfig(api_key="k", proposal_wait_s=0.5)))
    try:
        http = httpx.Client(base_url=url, headers=AUTH, timeout=60)
        ids = _ids(vllm_target, PROMPTS[0])
        want = vllm_target.generate(ids, 24)
        sid = http.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
        assert (
            http.post(f"/v1/sessions/{sid}/proposal", json={"at": len(ids), "proposal": [1]}).status_code
            == 409
        )
        stale = http.post(f"/v1/sessions/{sid}/speculate", json={"committed": 1, "max_tokens": 4})
        assert stale.status_code == 409
        got, chunks = [], 0
        body = {"committed": len(ids), "max_tokens": 24}
        with http.stream("POST", f"/v1/sessions/{sid}/speculate", json=body) as reply:
            bad = http.post(f"/v1/sessions/{sid}/proposal", json={"at": len(ids), "proposal": [10**6]})
            assert bad.status_code == 422
            for line in reply.iter_lines():
                chunk = json.loads(line)
                got, chunks = got + chunk["tokens"], chunks + 1
                at = len(ids) + len(got)  # the device proposes the reference's next tokens
                http.post(
                    f"/v1/sessions/{sid}/proposal", json={"at": at, "proposal": want[len(got) : len(got) + 4]}
                )
                if chunk["done"]:
                    assert chunk["committed"] == at and isinstance(chunk["budget"], int)
                    break
        assert got == want and chunks < len(want)  # drafts were accepted: several tokens a chunk
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
        # a stream its session's DELETE cuts ends with a chunk that says so, not an ordinary end
        sid = http.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
        with http.stream("POST", f"/v1/sessions/{sid}/speculate", json={**body, "max_tokens": 400}) as reply:
            lines = (json.loads(line) for line in reply.iter_lines() if line.strip())
            first = next(lines)
            assert http.delete(f"/v1/sessions/{sid}").status_code == 200
            *_, last = [first, *lines]
        assert last["done"] and last.get("cancelled") and not first["done"], last
        remote = RemoteTarget(url, api_key="k")
        assert remote.drafts_in_engine
        out = tiny_drafter.pair(remote, k=3).generate(PROMPTS[1], max_new_tokens=20)
        assert out.token_ids == vllm_target.generate(_ids(vllm_target, PROMPTS[1]), 20)[: len(out.token_ids)]
        assert sum(r.proposed for r in out.rounds) > 0
    finally:
        stop()


class _ProposeAfter:
    """Rounds that propose `draft` after exactly `ids` and nothing elsewhere."""

    def __init__(self, ids: list[int], draft: list[int]) -> None:
        self.ids, self.draft = ids, draft

    def open(self, ids, drafter_ids=None):
        pass

    def prepare(self, ids):
        pass

    def next(self, ids, limit, remaining):
        return self.draft[:limit] if list(ids) == self.ids else []


def test_sampling_in_the_engines_own_step_follows_the_targets_distribution(vllm_target, tiny_vllm_model):
    """A sampled request (temperature 0.3) verified by vLLM's rejection sampler in its own step
    (one-hot proposals): the second token, among samples whose first is the most likely one,
    follows the target's tempered softmax there, whether the proposal after that first token is
    the likely token or an unlikely one; and the third token, at the proposal's second position,
    among samples whose first two are the likely ones. Chi-square over the tokens with expected
    count >= 5 plus a pooled bin, alpha = 0.001 per check (a correct engine fails by chance about
    three times in 1,000 runs); fixed seeds."""
    from omnidraft.target import Rule

    model = tiny_vllm_model[1]
    ids = _ids(vllm_target, PROMPTS[0])
    temperature = 0.3

    def tempered(context: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([context])).logits[0, -1].float() / temperature, -1)

    top = int(tempered(ids).argmax())
    second = tempered(ids + [top])
    likely, unlikely = int(second.argmax()), int(second.argsort()[len(second) // 2])
    third = tempered(ids + [top, likely])

    def sample(proposal: list[int], seed: int) -> list[int]:
        rounds = _ProposeAfter(ids + [top], proposal)
        rule = Rule(mode="match", temperature=temperature, seed=10_000 + seed)
        return [t for step in vllm_target.begin(ids).steps(3, rounds, rule=rule, eos=False) for t in step]

    def follows(outs: list[list[int]], prefix: list[int], dist: torch.Tensor) -> None:
        counts: dict[int, int] = {}
        for out in outs:
            if out[: len(prefix)] == prefix:
                counts[out[len(prefix)]] = counts.get(out[len(prefix)], 0) + 1
        n = sum(counts.values())
        big = [t for t in range(len(dist)) if dist[t] * n >= 5]
        observed = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
        expected = [float(dist[t]) * n for t in big] + [n - sum(float(dist[t]) * n for t in big)]
        assert n >= 150 and len(big) >= 3, (prefix, n, len(big))
        assert chi_square_p(observed, expected) > 1e-3, (prefix, counts)

    for proposal in ([likely, int(third.argmax())], [unlikely]):
        with ThreadPoolExecutor(16) as pool:  # concurrent requests: vLLM batches them in its steps
            outs = list(pool.map(lambda seed: sample(proposal, seed), range(1400)))
        follows(outs, [top], second)
        if proposal[0] == likely:
            follows(outs, [top, likely], third)


def test_the_cpu_samplers_expand_kernel_writes_its_output_whatever_its_dtype(vllm_target):
    """vLLM's rejection sampler spreads each request's temperature (0 read as 1), top-k and top-p
    over its draft positions; on a CPU without Triton that kernel is vLLM's stand-in, which wrote
    into an int64 copy of its output and dropped it (temperatures and top-p of sampled drafts
    were uninitialised memory). The engine built here runs omnidraft's mended kernel."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    cu = torch.tensor([3, 3, 5], dtype=torch.int32)  # the second request drafted nothing
    temperature = expand_batch_to_tokens(torch.tensor([0.7, 0.2, 0.0]), cu, 5, replace_from=0, replace_to=1)
    assert temperature.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0, 1.0])
    top_k = expand_batch_to_tokens(torch.tensor([20, 5, 10], dtype=torch.int32), cu, 5)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [20, 20, 20, 10, 10]
    top_p = expand_batch_to_tokens(torch.tensor([0.95, 0.5, 0.9], dtype=torch.float64), cu, 5)
    assert top_p.tolist() == pytest.approx([0.95, 0.95, 0.95, 0.9, 0.9])


def test_a_sampled_request_accepts_drafts_past_the_first(vllm_target):
    """At a temperature near 0 the target's likeliest tokens are drawn with probability near 1: a
    proposal of the next four greedy tokens is mostly accepted whole by vLLM's rejection sampler,
    the step that verifies it committing five tokens, the fifth its own. Before the mended kernel
    (vllm_engine.mend_cpu_expand) the positions past the first were judged under uninitialised
    sampling parameters: never accepted, or the engine step failed on a garbage top-k."""
    ids = _ids(vllm_target, PROMPTS[1])
    greedy = vllm_target.generate(ids, 5)
    whole = 0
    for seed in range(12):
        rounds = _ProposeAfter(ids + greedy[:1], greedy[1:5])
        rule = Rule(mode="match", temperature=0.05, top_k=20, top_p=0.95, seed=seed)
        steps = list(vllm_target.begin(ids).steps(8, rounds, rule=rule, eos=False))
        whole += len(steps) > 1 and len(steps[1]) == 5 and steps[1][:4] == greedy[1:5]
    assert whole >= 4, (whole, greedy, steps)


def test_a_device_drafting_across_a_round_trip_gets_the_engines_own_greedy_output(vllm_target, tiny_drafter):
    """The device's streaming design (targets/remote_stream.py) across a delaying proxy of 40 ms: its
    proposals drafted ahead and posted from their own thread, the server's lookup fallback;
    whatever arrives when, the output is vLLM's own greedy decoding, and a proposal past the
    committed length is refused with a 422."""
    import httpx

    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.server.app import ServerConfig, create_app
    from omnidraft.targets.remote import RemoteTarget

    from .test_streaming import delaying

    url, stop = serve_in_thread(create_app(vllm_target, ServerConfig(api_key=None)))
    port, upstream = _free_port(), int(url.rsplit(":", 1)[1])
    try:
        with delaying(port, upstream, 0.04):
            remote = RemoteTarget(f"http://127.0.0.1:{port}")
            pair = tiny_drafter.pair(remote)
            for prompt in PROMPTS:
                out = pair.generate(prompt, max_new_tokens=32)
                assert out.token_ids == vllm_target.generate(_ids(vllm_target, prompt), 32)
            sampled = pair.generate(PROMPTS[0], max_new_tokens=24, temperature=0.7, top_p=0.95)
            assert (
                len(sampled.token_ids) == 24
            )  # sampled in the engine's step (tested for its distribution above)
            http = httpx.Client(base_url=url, timeout=60)
            ids = _ids(vllm_target, PROMPTS[0])
            sid = http.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
            body = {"committed": len(ids), "max_tokens": 8}
            with http.stream("POST", f"/v1/sessions/{sid}/speculate", json=body) as reply:
                far = http.post(f"/v1/sessions/{sid}/proposal", json={"at": 10**9, "proposal": [5]})
                assert far.status_code == 422 and "at most the committed" in far.text
                reply.read()
    finally:
        stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "body, status",
    [
        ({"proposal": [10**6]}, 422),  # outside the vocabulary
        ({"proposal": [True]}, 422),
        ({"committed": 1}, 409),  # stale
        ({"mode": "exact", "temperature": 1.0, "proposal": [5], "q": [{"ids": [5], "probs": [1.0]}]}, 422),
        ({"mode": "match", "temperature": 1.0, "proposal": [5]}, 422),  # top_k needed on this engine
    ],
)
def test_bad_input_to_the_vllm_server_gets_the_torch_engines_4xx(vllm_client, vllm_target, body, status):
    ids = _ids(vllm_target, PROMPTS[1])
    sid = vllm_client.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH).json()["session"]
    r = vllm_client.post(
        f"/v1/sessions/{sid}/verify", json={"committed": len(ids), "proposal": [], **body}, headers=AUTH
    )
    assert r.status_code == status, r.text
    ok = vllm_client.post(
        f"/v1/sessions/{sid}/verify", json={"committed": len(ids), "proposal": []}, headers=AUTH
    )
    assert ok.status_code == 200  # the session and the engine still serve
    plain = vllm_client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0}, headers=AUTH
    )
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2  # vLLM's own decoding
    sampled = vllm_client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2}, headers=AUTH)
    assert sampled.status_code == 200  # temperature 1 with no top_k: sampled in vLLM's own step
    assert sampled.json()["usage"]["completion_tokens"] == 2
    none = vllm_client.post("/v1/completions", json={"prompt": "0", "max_tokens": 0}, headers=AUTH)
    assert none.status_code == 200 and none.json()["usage"]["completion_tokens"] == 0  # was a 500 (fuzz)
    echo = vllm_client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0},
        headers=AUTH,
    )
    assert echo.status_code == 400  # an engine that scores no positions refuses it (a 501 was a 5xx)


@pytest.mark.real
def test_the_default_pairing_on_the_real_05b_served_by_vllm_is_vllms_own_greedy_output():
    """SmolLM2 drafting for Qwen2.5-Coder-0.5B on vLLM (fp32, the compiled engine users run): the
    default pairing's output is vLLM's own greedy decoding on a GSM8K prompt, and a fixed k that
    always drafts gives it on another."""
    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts

    target = od.VLLMTarget.load("qwen2.5-coder-0.5b", dtype="float32")
    try:
        drafter = od.Drafter.load("smollm2-135m")
        pairs = (drafter.pair(target), drafter.pair(target, k=4))
        for pair, prompt in zip(pairs, load_prompts("gsm8k", 2)):
            out = pair.generate(prompt, max_new_tokens=48)
            want = target.generate(target.tokenizer(prompt)["input_ids"], 48)
            assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) in (48, len(want))
    finally:
        target.close()


@pytest.mark.parametrize("route", ROUTES + ("verify",))
def test_fuzzed_bodies_on_every_route_of_the_vllm_server_never_get_a_5xx(vllm_client, vllm_target, route):
    """Every request route of the vLLM engine's server fuzzed (tests/route_fuzz.py; proposals
    while a speculate stream of their session runs): no 5xx, and the engine still decodes its own
    greedy output afterwards."""
    ids, vocab = _ids(vllm_target, PROMPTS[0]), vllm_client.app.state.service.vocab
    sid, streaming = None, None
    if route == "proposal":
        sid = vllm_client.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH).json()["session"]
        body = {"committed": len(ids), "max_tokens": 900}
        streaming = threading.Thread(
            target=vllm_client.post,
            args=(f"/v1/sessions/{sid}/speculate",),
            kwargs={"json": body, "headers": AUTH},
        )
        streaming.start()
    post, bodies = route_poster(vllm_client, route, vocab, ids, AUTH, sid=sid)
    fuzz_route(post, bodies, max(20, EXAMPLES // 3))
    if streaming is not None:
        streaming.join(timeout=120)
        assert not streaming.is_alive()
    r = vllm_client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0}, headers=AUTH
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


LEAVING = {  # route -> (path or a session's route, body, seconds a slowed engine step takes)
    "completions": ("/v1/completions", {"max_tokens": 900, "temperature": 0}, 0.05),
    "completions stream": ("/v1/completions", {"max_tokens": 900, "temperature": 0, "stream": True}, 0.05),
    "chat": ("/v1/chat/completions", {"max_tokens": 900, "temperature": 0}, 0.05),
    "chat stream": ("/v1/chat/completions", {"max_tokens": 900, "temperature": 0, "stream": True}, 0.05),
    "generate": ("/v1/generate", {"max_tokens": 900}, 0.05),
    "session generate": ("generate", {"max_tokens": 900}, 0.05),
    "session speculate": ("speculate", {"max_tokens": 900}, 0.05),
    "session verify (a long prefill)": ("verify", {"proposal": []}, 0.3),
}


@pytest.mark.parametrize("route", LEAVING)
def test_a_client_that_leaves_stops_its_engine_request_within_a_step(vllm_target, monkeypatch, route):
    """Issue 66: on vLLM a dropped stream went on 7-12 s (until the garbage collector closed it) and
    a dropped completion or verify to its end. Now every route aborts its engine request within a
    step or two of its client leaving (the engine slowed so that each request runs for seconds)."""
    import json
    import socket
    import time

    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.server.app import ServerConfig, create_app

    path, body, step_s = LEAVING[route]
    loop, step = vllm_target.loop, vllm_target.loop.engine.step
    monkeypatch.setattr(loop.engine, "step", lambda: (time.sleep(step_s), step())[1])
    url, stop = serve_in_thread(create_app(vllm_target, ServerConfig(api_key="k")))
    host, port = url.removeprefix("http://").split(":")
    try:
        ids = _ids(vllm_target, PROMPTS[0])
        if not path.startswith("/"):  # a session's route
            import httpx

            prompt = (ids * 100)[:900] if path == "verify" else ids
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
                if path == "verify":  # the engine's first step of a full chunk is slow once (warm-up)
                    warm = http.post("/v1/sessions", json={"prompt_ids": prompt[::-1]}).json()["session"]
                    http.post(f"/v1/sessions/{warm}/verify", json={"committed": len(prompt), "proposal": []})
                sid = http.post("/v1/sessions", json={"prompt_ids": prompt}).json()["session"]
            path, body = f"/v1/sessions/{sid}/{path}", {"committed": len(prompt), **body}
        elif path == "/v1/chat/completions":
            template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            monkeypatch.setattr(vllm_target.tokenizer, "chat_template", template, raising=False)
            body = {"messages": [{"role": "user", "content": PROMPTS[0]}], **body}
        else:
            body = {("prompt_ids" if path == "/v1/generate" else "prompt"): ids, **body}
        data = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer k\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            deadline = time.monotonic() + 10
            while not loop._handles and time.monotonic() < deadline:  # running in the engine
                time.sleep(0.01)
            assert loop._handles, "the request never reached the engine"
            time.sleep(0.5)
        left = time.monotonic()
        while loop._handles and time.monotonic() < left + 5:
            time.sleep(0.02)
        assert not loop._handles and time.monotonic() - left < 1.0 + 2 * step_s
    finally:
        stop()


def test_a_seeded_sampled_long_prompt_beside_others_does_not_fail_the_engine(vllm_target):
    """vLLM's CPU sampler cannot rewind a seeded generator after a partial prefill ("CPU Generator
    does not use offset"), and a long prompt beside other requests is prefilled in pieces: the
    whole engine step failed, every request with it. A seeded request now reaches the engine with
    its prompt cached; its samples still depend on its seed alone."""
    ids = (_ids(vllm_target, PROMPTS[0]) * 40)[:300]
    rule = Rule(mode="match", temperature=0.7, seed=5)

    def one(i: int) -> list[int]:
        return list(vllm_target.begin(ids[i:]).decode(8, rule))

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(4)))
    assert all(len(o) == 8 for o in outs)
    assert one(0) == outs[0]  # alone, the same seed gives the same tokens
