"""`omnidraft serve --engine vllm` under load: N device sessions replaying recorded drafts against
the server, beside the same requests decoded by vLLM alone (streamed), on one engine (docs/vllm.md).

    python -m benchmarks.vllm_load --sessions 1 --sessions 4 --sessions 16 --out bench_out/vllm-load.json

1. Record: the default drafter drafts for the target (objective "compute": every round drafts)
   on each prompt; every proposal is kept with the context length it was made at.
2. Replay: N client threads, one prompt each, over HTTP on loopback. At each round a client sends
   the recorded proposal made at its context length (or the tail of the latest one still on the
   committed text), cut to the server's draft budget; a budget of 0 hands the rest of the request
   to the server's own decoding loop (`/generate`), as a device following the budget does.
3. vLLM alone: the same N prompts as N concurrent streamed `/v1/generate` requests.
Every committed token is checked against vLLM's own greedy output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch


def record(target: Any, drafter: Any, prompts: list[str], tokens: int) -> list[dict[int, list[int]]]:
    """Per prompt: {context length: the proposal (target ids) made there}."""
    import omnidraft as od

    logs: list[dict[int, list[int]]] = []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(target, name)

        def begin(self, ids: list[int]) -> Any:
            session, log = target.begin(ids), {}
            logs.append(log)
            inner = session.verify

            def verify(proposal: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                log[len(session.ids)] = proposal.tolist()
                return inner(proposal, *args, **kwargs)

            session.verify = verify
            return session

    pair = od.pair(drafter, Recording(), objective="compute")
    for prompt in prompts:
        pair.generate(prompt, max_new_tokens=tokens)
    return logs


def proposal_at(
    log: dict[int, list[int]], start: int, committed: list[int], reference: list[int]
) -> list[int]:
    """What the drafter proposed at context length start + len(committed): the recorded proposal
    there, else the rest of the latest recorded one whose head is on the committed text."""
    here = start + len(committed)
    for at in sorted((p for p in log if p <= here), reverse=True):
        done = here - at
        if log[at][:done] == reference[at - start : here - start]:
            return log[at][done:]
        break
    return []


def replay_client(http: Any, ids: list[int], log: dict, reference: list[int], tokens: int, out: dict) -> None:
    sid = http.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
    committed: list[int] = []
    times: list[float] = []
    budget = None
    started = last = time.perf_counter()
    while len(committed) < tokens:
        proposal = proposal_at(log, len(ids), committed, reference)[: tokens - len(committed) - 1]
        if budget is not None:
            proposal = proposal[:budget]
        if budget == 0:
            body = {"committed": len(ids) + len(committed), "max_tokens": tokens - len(committed)}
            more, gaps = streamed(http, f"/v1/sessions/{sid}/generate", body, last)
            committed, times = committed + more, times + gaps
            break
        reply = http.post(
            f"/v1/sessions/{sid}/verify", json={"committed": len(ids) + len(committed), "proposal": proposal}
        ).json()
        new = proposal[: reply["accepted"]] + [reply["token"]]
        committed += new
        budget = reply.get("budget")
        now = time.perf_counter()
        times += [(now - last) / len(new)] * len(new)
        last = now
    http.delete(f"/v1/sessions/{sid}")
    out.update(tokens=committed[:tokens], seconds=time.perf_counter() - started, per_token=times[:tokens])


def streamed(http: Any, path: str, body: dict, last: float) -> tuple[list[int], list[float]]:
    """The tokens of one NDJSON stream and the time before each, counted from `last`."""
    tokens, gaps = [], []
    with http.stream("POST", path, json=body) as reply:
        for line in reply.iter_lines():
            if line.strip():
                tokens += json.loads(line)["tokens"]
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
    return tokens, gaps


def alone_client(http: Any, ids: list[int], tokens: int, out: dict) -> None:
    started = time.perf_counter()
    committed, times = streamed(http, "/v1/generate", {"prompt_ids": ids, "max_tokens": tokens}, started)
    out.update(tokens=committed, seconds=time.perf_counter() - started, per_token=times)


def run(url: str, target: Any, clients: list[tuple], fn: Any) -> dict[str, Any]:
    import httpx

    loop = target.loop
    outs: list[dict] = [{} for _ in clients]
    https = [httpx.Client(base_url=url, timeout=600) for _ in clients]
    steps, busy = loop.steps, loop.busy
    started = time.perf_counter()
    threads = [
        threading.Thread(target=fn, args=(h, *args, out)) for h, args, out in zip(https, clients, outs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    total = sum(len(o["tokens"]) for o in outs)
    per_token = sorted(x for o in outs for x in o["per_token"])
    return {
        "tokens": total,
        "wall_s": round(wall, 2),
        "tok_s": round(total / wall, 2),
        "engine_steps_per_token": round((loop.steps - steps) / total, 3),
        "engine_s_per_token": round((loop.busy - busy) / total, 4),
        "p50_s_per_token": round(statistics.median(per_token), 4),
        "p95_s_per_token": round(per_token[int(0.95 * (len(per_token) - 1))], 4),
        "outputs": [o["tokens"] for o in outs],
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_load")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--sessions", type=int, action="append", default=None, help="repeatable; default 1, 4, 16")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench_out/vllm-load.json")
    args = p.parse_args()
    sessions = args.sessions or [1, 4, 16]

    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts
    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.remote.server import ServerConfig, create_app

    target = od.VLLMTarget.load(args.target, dtype=args.dtype)
    prompts = load_prompts(args.dataset, max(sessions))
    ids = [target.tokenizer(p)["input_ids"] for p in prompts]
    references = [target.generate(i, args.tokens) for i in ids]
    logs = record(target, od.Drafter.load(args.drafter), prompts, args.tokens)
    url, stop = serve_in_thread(create_app(target, ServerConfig(max_sessions=256)))
    report: dict[str, Any] = {
        "target": args.target,
        "dtype": args.dtype,
        "verify_costs_ms": {n: round(1e3 * s, 1) for n, s in target.verify_costs().items()},
        "runs": {},
    }
    try:
        for n in sessions:
            spec = run(
                url, target, [(ids[i], logs[i], references[i], args.tokens) for i in range(n)], replay_client
            )
            alone = run(url, target, [(ids[i], args.tokens) for i in range(n)], alone_client)
            for row in (spec, alone):
                row["wrong"] = sum(
                    a != b for i, o in enumerate(row.pop("outputs")) for a, b in zip(o, references[i])
                )
            report["runs"][n] = {
                "omnidraft": spec,
                "vllm_alone": alone,
                "throughput_ratio": round(spec["tok_s"] / alone["tok_s"], 3),
                "engine_time_ratio": round(spec["engine_s_per_token"] / alone["engine_s_per_token"], 3),
            }
            print(n, json.dumps(report["runs"][n]), flush=True)
    finally:
        stop()
        target.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
