"""`omnidraft serve --engine vllm` under load: N device sessions replaying recorded drafts against
the server, beside the same requests decoded by vLLM alone (streamed) on a plain engine with the
same engine args; each engine in a process of its own, one after the other (docs/vllm.md).

    python -m benchmarks.vllm_load --sessions 1 --sessions 4 --sessions 16 --out bench_out/vllm-load.json

1. Record: the default drafter drafts for the target (objective "compute": every round drafts)
   on each prompt; every proposal is kept with the context length it was made at.
2. Replay: N client threads in a process of their own, one prompt each, over HTTP on loopback.
   Each streams its session (`/speculate`: the rest of the completion is one engine request)
   and, whenever committed tokens arrive, posts the recorded proposal made at that context length
   (or the tail of the latest one still on the committed text), cut to the server's draft budget
   (`/proposal`; nothing while the budget is 0); the engine verifies it in its own step.
3. vLLM alone: the same N prompts as N concurrent streamed `/v1/generate` requests on a server
   whose engine has no proposer.
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

    from omnidraft.target import Capabilities

    class Recording:
        # a verify per round (no drafts in the engine's step): each proposal passes through `verify` here
        capabilities = Capabilities(decodes_alone=True, batches_sessions=True)

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
    import httpx

    sid = http.post("/v1/sessions", json={"prompt_ids": ids}).json()["session"]
    poster = httpx.Client(base_url=str(http.base_url), timeout=600)
    committed: list[int] = []
    times: list[float] = []
    budget = tokens

    def offer() -> None:
        if budget == 0:  # the server takes no draft now: nothing to send (as RemoteTarget does)
            return
        limit = min(budget, tokens - len(committed) - 1)
        proposal = proposal_at(log, len(ids), committed, reference)[:limit]
        at = len(ids) + len(committed)
        poster.post(f"/v1/sessions/{sid}/proposal", json={"at": at, "proposal": proposal})

    started = last = time.perf_counter()
    body = {"committed": len(ids), "max_tokens": tokens}
    with http.stream("POST", f"/v1/sessions/{sid}/speculate", json=body) as reply:
        offer()
        for line in reply.iter_lines():
            if not line.strip():
                continue
            chunk = json.loads(line)
            now = time.perf_counter()
            if chunk["tokens"]:
                committed += chunk["tokens"]
                times += [(now - last) / len(chunk["tokens"])] * len(chunk["tokens"])
                last = now
            budget = chunk["budget"] if chunk.get("budget") is not None else budget
            if chunk["done"]:
                break
            offer()
    http.delete(f"/v1/sessions/{sid}")
    poster.close()
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


def drive(url: str, clients: list[tuple], fn: Any) -> tuple[list[dict], float]:
    """In a process of its own (devices are not the server): one thread per client; (their
    outputs, the wall time from the first start to the last end)."""
    import httpx

    outs: list[dict] = [{} for _ in clients]
    https = [httpx.Client(base_url=url, timeout=600) for _ in clients]
    threads = [
        threading.Thread(target=fn, args=(h, *args, out)) for h, args, out in zip(https, clients, outs)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs, time.perf_counter() - started


def run(url: str, target: Any, clients: list[tuple], fn: Any) -> dict[str, Any]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    loop = target.loop
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()  # the client process is up before the engine is watched
        steps, busy = loop.steps, loop.busy
        outs, wall = pool.submit(drive, url, clients, fn).result()
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


def _serve(
    name: str,
    target_spec: str,
    dtype: str,
    ids: list[list[int]],
    extra: dict,
    sessions: list[int],
    tokens: int,
) -> dict[str, Any]:
    """In a process of its own: one engine served over loopback, the row's clients at each N."""
    from concurrent.futures import ThreadPoolExecutor

    import omnidraft as od
    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.server.app import ServerConfig, create_app

    speculating = name == "omnidraft"
    draft_tokens = extra["draft_tokens"] if speculating else 0
    target = od.VLLMTarget.load(target_spec, dtype=dtype, draft_tokens=draft_tokens)
    with ThreadPoolExecutor(len(ids)) as pool:  # concurrent: the engine batches them
        references = list(pool.map(lambda i: target.generate(i, tokens), ids))
    report: dict[str, Any] = {"references": references, "runs": {}}
    if speculating:
        from omnidraft.server.budget import draft_budget

        costs = {**target.verify_costs(), **target.batch_costs()}
        report["step_costs_ms"] = {n: round(1e3 * s, 1) for n, s in costs.items()}
        report["budgets"] = {  # the draft budget at each load, for three acceptance rates
            n: {a: draft_budget(costs, a, n, 63) for a in (0.5, 0.7, 0.9)} for n in sessions
        }
        logs = record(target, od.Drafter.load(extra["drafter"]), extra["prompts"], tokens)
    app = create_app(target, ServerConfig(max_sessions=256))
    url, stop = serve_in_thread(app)
    passes: dict[int, int] = {}  # load -> passes run at it so far
    try:
        for n in sessions:  # a load repeated: the next pass, new prompts, on the same server
            again = passes[n] = passes.get(n, 0) + 1
            key, first = f"{n}#{again}", (again - 1) * max(sessions)
            if speculating:
                refs = report["references"]
                clients = [(ids[i], logs[i], refs[i], tokens) for i in range(first, first + n)]
                report["runs"][key] = run(url, target, clients, replay_client)
                rates = app.state.service.gate.rates  # committed tok/s it measured with drafts, without
                report["runs"][key]["gate"] = {
                    f"{load} {'on' if on else 'off'}": round(t / s, 1) for (load, on), (t, s) in rates.items()
                }
            else:
                clients = [(ids[i], tokens) for i in range(first, first + n)]
                report["runs"][key] = run(url, target, clients, alone_client)
            report["runs"][key]["first_prompt"] = first
            print(name, key, {k: v for k, v in report["runs"][key].items() if k != "outputs"}, flush=True)
    finally:
        stop()
        target.close()
    return report


def main() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_load")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument(
        "--sessions",
        type=int,
        action="append",
        default=None,
        help="repeatable; default 1, 4, 16; a load given twice runs a second pass on the same server",
    )
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-tokens", type=int, default=8, help="the server engine's most drafts a step")
    p.add_argument("--out", default="bench_out/vllm-load.json")
    args = p.parse_args()
    sessions = args.sessions or [1, 4, 16]

    from omnidraft.bench.datasets import load_prompts
    from omnidraft.store.models import load_tokenizer

    passes = max(sessions.count(n) for n in sessions)
    prompts = load_prompts(args.dataset, passes * max(sessions))
    tokenizer = load_tokenizer(args.target)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    rows: dict[str, dict[str, Any]] = {}
    for row in ("omnidraft", "vllm_alone"):
        extra = {"drafter": args.drafter, "prompts": prompts, "draft_tokens": args.draft_tokens}
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows[row] = pool.submit(
                _serve, row, args.target, args.dtype, ids, extra, sessions, args.tokens
            ).result()
    references = rows["vllm_alone"]["references"]
    report: dict[str, Any] = {
        "target": args.target,
        "dtype": args.dtype,
        "step_costs_ms": rows["omnidraft"]["step_costs_ms"],
        "budgets": rows["omnidraft"]["budgets"],
        "references_agree": rows["omnidraft"]["references"] == references,
        "runs": {},
    }
    for n in rows["omnidraft"]["runs"]:
        spec, alone = rows["omnidraft"]["runs"][n], rows["vllm_alone"]["runs"][n]
        for row in (spec, alone):  # a token differing from vLLM's own, or one missing or extra
            outputs = row.pop("outputs")
            row["wrong"] = sum(
                sum(a != b for a, b in zip(o, ref)) + abs(len(o) - len(ref))
                for o, ref in zip(outputs, references[row["first_prompt"] :])
            )
        report["runs"][n] = {
            "omnidraft": spec,
            "vllm_alone": alone,
            "throughput_ratio": round(spec["tok_s"] / alone["tok_s"], 3),
            "engine_time_ratio": round(spec["engine_s_per_token"] / alone["engine_s_per_token"], 3),
        }
        print(n, json.dumps(report["runs"][n]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
