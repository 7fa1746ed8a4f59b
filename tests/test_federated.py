"""Adapters averaged across devices (distill/federated.py, the server's adapter exchange): FedAvg
weighted by requests and capped per key, uploads checked and clipped, versions atomic and a crash
mid-average losing nothing, the exchange behind the API key, and a poisoned adapter never
changing an output."""

from __future__ import annotations

import pytest
import torch

from omnidraft import TorchDrafter
from omnidraft.distill.adapters import AdapterConfig, adapter_state, load_adapter_state
from omnidraft.distill.federated import AdapterExchange, Rejected, check_upload, encode_state, fedavg
from omnidraft.distill.trainer import TrainConfig
from omnidraft.server.app import ServerConfig, create_app
from omnidraft.store.profiles import ProfileStore
from omnidraft.targets.remote import RemoteTarget

from .conftest import target_greedy, tiny_llama

NAMES = ("layers.0.q_proj.lora_A.weight", "layers.0.q_proj.lora_B.weight")


def adapter(value: float, rank: int = 2) -> dict[str, torch.Tensor]:
    return {NAMES[0]: torch.full((rank, 8), value), NAMES[1]: torch.full((8, rank), value)}


def test_fedavg_weights_by_requests_capped_and_clips_a_huge_upload():
    reference = adapter(0.0)
    two = fedavg([(adapter(1.0), 10), (adapter(4.0), 30)], reference, max_requests=50)
    assert torch.allclose(two[NAMES[0]], torch.full((2, 8), 0.25 * 1.0 + 0.75 * 4.0))
    capped = fedavg([(adapter(1.0), 10), (adapter(4.0), 10_000)], reference, max_requests=10)
    assert torch.allclose(capped[NAMES[0]], torch.full((2, 8), 2.5))  # one key cannot outweigh the other
    honest = [(adapter(1.0 + 0.01 * i), 20) for i in range(4)]
    poisoned = fedavg([*honest, (adapter(1e6), 20)], reference, clip=2.0)
    clean = fedavg(honest, reference)
    # clipped to twice the median difference: the huge upload moves the average by a bounded amount
    assert (poisoned[NAMES[0]] - clean[NAMES[0]]).abs().max() < 1.0
    first = fedavg([(adapter(1.0), 1), (adapter(2.0), 1), (adapter(9.0), 1)], None)
    assert first[NAMES[0]].max() < 4.0  # no version yet: differences from the median


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"layers.0.mlp.weight": torch.ones(2, 2)}, "LoRA tensors only"),
        ({NAMES[0]: torch.ones(2, 8), "layers.1.q_proj.lora_A.weight": torch.ones(3, 8)}, "one LoRA rank"),
        ({**adapter(1.0), NAMES[1]: torch.full((8, 2), float("nan"))}, "not finite"),
        (adapter(1.0, rank=4), "is \\(4, 8\\), the shared adapter's \\(2, 8\\)"),
        ({NAMES[0]: torch.ones(2, 8)}, "missing \\['layers.0.q_proj.lora_B.weight'\\]"),
    ],
)
def test_an_upload_that_is_not_the_shared_adapters_shape_is_rejected_by_name(state, message):
    with pytest.raises(Rejected, match=message):
        check_upload(state, adapter(0.0))


def test_two_keys_make_a_round_a_key_uploads_once_a_round_and_a_crash_loses_nothing(tmp_path, monkeypatch):
    exchange = AdapterExchange(tmp_path, min_keys=2)
    assert exchange.shared() == (0, None)
    assert exchange.upload(1, encode_state(adapter(1.0)), 10).uploaded == (1,)
    assert exchange.upload(1, encode_state(adapter(3.0)), 10).uploaded == (1,)  # replaced, still one key
    from omnidraft.distill import federated

    real = federated.atomic_write_bytes

    def crash(path, data):
        if path.name.startswith("shared-"):
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(federated, "atomic_write_bytes", crash)
    with pytest.raises(OSError, match="disk full"):
        exchange.upload(2, encode_state(adapter(1.0)), 10)
    monkeypatch.setattr(federated, "atomic_write_bytes", real)
    assert exchange.version() == 0 and len(exchange._uploads()) == 2  # both uploads kept
    assert exchange.upload(2, encode_state(adapter(1.0)), 10).version == 1  # averaged now
    version, data = exchange.shared()
    assert version == 1 and not list((tmp_path / "uploads").iterdir())
    shared = federated.decode_state(data)
    assert torch.allclose(shared[NAMES[0]], torch.full((2, 8), 2.0))  # median 2.0, deltas +-1 cancel
    with pytest.raises(Rejected, match="is \\(4, 8\\)"):
        exchange.upload(3, encode_state(adapter(1.0, rank=4)), 5)


def test_the_server_exchanges_adapters_per_api_key(tiny_target, tmp_path):
    from fastapi.testclient import TestClient

    config = ServerConfig(api_key=("k1", "k2"), adapters_dir=str(tmp_path / "shared"), adapter_min_keys=2)
    app = create_app(tiny_target, config)
    with TestClient(app) as http, TestClient(app) as other:  # (a client holds one key's header)
        one = RemoteTarget("http://testserver", api_key="k1", client=http, tokenizer=tiny_target.tokenizer)
        two = RemoteTarget("http://testserver", api_key="k2", client=other, tokenizer=tiny_target.tokenizer)
        assert one.shared_adapter() == (0, None)
        assert one.upload_adapter(adapter(1.0), requests=5) == {"version": 0, "uploaded": 1}
        assert two.upload_adapter(adapter(3.0), requests=5) == {"version": 1, "uploaded": 0}
        version, state = two.shared_adapter()
        assert version == 1 and torch.allclose(state[NAMES[0]], torch.full((2, 8), 2.0))
        from omnidraft.errors import RemoteRequestError

        with pytest.raises(RemoteRequestError, match="HTTP 422: .*not finite"):
            one.upload_adapter({**adapter(1.0), NAMES[0]: torch.full((2, 8), float("inf"))}, requests=5)
        assert (
            other.put(
                "/v1/adapters/upload?requests=1", content=b"x", headers={"authorization": ""}
            ).status_code
            == 401
        )
    with TestClient(create_app(tiny_target, ServerConfig(api_key="k1"))) as http:
        off = http.get("/v1/adapters/shared", headers={"authorization": "Bearer k1"})
        assert off.status_code == 404 and "--share-adapters" in off.json()["error"]


def test_a_poisoned_adapter_never_changes_an_output(draft_tokenizer, tiny_target, tmp_path):
    """The worst a shared adapter can do is draft badly: the target verifies every token."""
    drafter = TorchDrafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny"
    )
    pair = drafter.pair(
        tiny_target,
        k=4,
        learn=True,
        adapter=AdapterConfig(rank=4, alpha=8),
        store=ProfileStore(tmp_path),
        train=TrainConfig(interval=10_000, cpu_share=0),
    )
    state = adapter_state(drafter.trainable, pair.adapter)
    poisoned = {k: torch.randn_like(v) * 1e3 for k, v in state.items()}
    load_adapter_state(drafter.trainable, pair.adapter, poisoned)
    for prompt in ("Question: Tom has 3 apples", "def add(a, b):"):
        assert pair.generate(prompt, max_new_tokens=16).token_ids == target_greedy(tiny_target, prompt, 16)


def test_an_adapter_larger_than_a_request_body_is_taken(tiny_target, tmp_path):
    """The default adapter of a real drafter is ~15 MB, past the server's 8 MB request bodies."""
    from fastapi.testclient import TestClient

    config = ServerConfig(api_key="k1", adapters_dir=str(tmp_path), max_body_bytes=4096)
    big = {NAMES[0]: torch.ones(4, 1024), NAMES[1]: torch.ones(1024, 4)}  # 32 KB
    with TestClient(create_app(tiny_target, config)) as http:
        remote = RemoteTarget("http://testserver", api_key="k1", client=http, tokenizer=tiny_target.tokenizer)
        assert remote.upload_adapter(big, requests=3) == {"version": 0, "uploaded": 1}


def _shared_pairings(draft_tokenizer, tiny_target, tmp_path, http_clients):
    drafter = TorchDrafter(tiny_llama(len(draft_tokenizer), seed=2), draft_tokenizer, "tiny")
    pairs = []
    for i, http in enumerate(http_clients):
        remote = RemoteTarget(
            "http://testserver", api_key=f"k{i + 1}", client=http, tokenizer=tiny_target.tokenizer
        )
        pairs.append(
            drafter.pair(
                remote,
                k=4,
                user=f"device-{i}",
                learn=True,
                share=True,
                share_every=1,
                adapter=AdapterConfig(rank=2, alpha=4),
                store=ProfileStore(tmp_path / f"device-{i}"),
                train=TrainConfig(interval=10_000, cpu_share=0),
            )
        )
    return drafter, pairs


def test_pairings_that_share_average_their_adapters_through_the_server_and_keep_their_own(
    draft_tokenizer, tiny_target, tmp_path
):
    """`share=True`: two devices of one target start from the same adapter, each uploads its own
    (only tensors and a count), the server's average becomes version 1, and a device re-bases on it
    keeping its residual; every output stays the target's."""
    from fastapi.testclient import TestClient

    config = ServerConfig(api_key=("k1", "k2"), adapters_dir=str(tmp_path / "shared"), adapter_min_keys=2)
    app = create_app(tiny_target, config)
    with TestClient(app) as h1, TestClient(app) as h2:
        drafter, (one, two) = _shared_pairings(draft_tokenizer, tiny_target, tmp_path, [h1, h2])
        start = {k: v.clone() for k, v in one.sharing.base.items()}
        assert all(torch.equal(start[k], two.sharing.base[k]) for k in start)  # alike on every device
        first = next(k for k in sorted(start) if "lora_B" in k)

        def moved(pairing, by):
            state = adapter_state(drafter.trainable, pairing.adapter)
            load_adapter_state(drafter.trainable, pairing.adapter, {**state, first: state[first] + by})

        moved(one, 1.0)
        moved(two, 3.0)
        assert one.sharing.sync() == 0 and two.sharing.sync() == 0  # the second upload made v1
        assert one.sharing.sync() == 1  # re-based: v1 (start + 2) + its own residual (+1)
        mine = adapter_state(drafter.trainable, one.adapter)[first]
        assert torch.allclose(mine, start[first] + 3.0)
        assert torch.allclose(one.sharing.base[first], start[first] + 2.0)
        prompt = "Question: Tom has 3 apples"
        assert one.generate(prompt, max_new_tokens=12).token_ids == target_greedy(tiny_target, prompt, 12)
        one.sharing.wait()  # (the sync every request started in the background)
        assert one.sharing.last_error is None and one.sharing.uploads == 3


def test_share_needs_a_learning_pairing_of_a_remote_target(draft_tokenizer, tiny_target, tmp_path):
    drafter = TorchDrafter(tiny_llama(len(draft_tokenizer), seed=2), draft_tokenizer, "tiny")
    with pytest.raises(ValueError, match="not a RemoteTarget"):
        drafter.pair(tiny_target, learn=True, share=True, store=ProfileStore(tmp_path))
    from fastapi.testclient import TestClient

    config = ServerConfig(api_key="k1", adapters_dir=str(tmp_path / "shared"))
    with TestClient(create_app(tiny_target, config)) as http:
        remote = RemoteTarget("http://testserver", api_key="k1", client=http, tokenizer=tiny_target.tokenizer)
        with pytest.raises(ValueError, match="learn=True"):
            drafter.pair(remote, share=True)
