"""How long another session's verify waits while one session prefills a long prompt on the torch
engine (docs/remote.md): a live server on loopback, one client opening a session of `--prompt`
tokens and verifying once (its prefill), another verifying an empty proposal in a loop meanwhile.

    python -m benchmarks.prefill_stall --target qwen2.5-coder-0.5b --prompt 16384
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> None:
    import httpx

    import omnidraft as od
    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.remote.server import ServerConfig, create_app

    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_stall")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompt", type=int, default=16384)
    args = p.parse_args()
    target = od.LocalTarget.load(args.target)
    url, stop = serve_in_thread(create_app(target, ServerConfig()))
    long_ids = (
        target.tokenizer("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n")["input_ids"]
        * args.prompt
    )[: args.prompt]
    short = target.tokenizer("Question: Tom has 3 apples.")["input_ids"]
    waits, done = [], threading.Event()
    with httpx.Client(base_url=url, timeout=3600) as a, httpx.Client(base_url=url, timeout=3600) as b:
        sid_b = b.post("/v1/sessions", json={"prompt_ids": short}).json()["session"]
        committed = b.post(
            f"/v1/sessions/{sid_b}/verify", json={"committed": len(short), "proposal": []}
        ).json()["committed"]

        def prefill() -> None:
            sid = a.post("/v1/sessions", json={"prompt_ids": long_ids}).json()["session"]
            started = time.perf_counter()
            a.post(f"/v1/sessions/{sid}/verify", json={"committed": len(long_ids), "proposal": []})
            waits.append(("prefill_s", time.perf_counter() - started))
            done.set()

        thread = threading.Thread(target=prefill)
        thread.start()
        time.sleep(0.5)
        while not done.is_set():
            started = time.perf_counter()
            committed = b.post(
                f"/v1/sessions/{sid_b}/verify", json={"committed": committed, "proposal": []}
            ).json()["committed"]
            waits.append(("verify_s", time.perf_counter() - started))
        thread.join()
    stop()
    verify = sorted(w for k, w in waits if k == "verify_s")
    report = {
        "target": args.target,
        "prompt_tokens": args.prompt,
        "prefill_s": round(dict(waits)["prefill_s"], 1),
        "verifies_meanwhile": len(verify),
        "verify_max_s": round(verify[-1], 3),
        "verify_median_s": round(verify[len(verify) // 2], 3),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
