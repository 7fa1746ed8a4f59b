"""A drafter on the device, the target in the cloud, and a per-user adapter that learns from each
verified request and is saved in the user's profile.

The cloud side is `omnidraft serve` (started here on loopback for the example; in production it
runs on the server, `--engine vllm` for batching across devices):

    omnidraft serve --target qwen2.5-coder-0.5b --host 0.0.0.0 --port 8000   # key: $OMNIDRAFT_API_KEY

The device side pairs its drafter with `RemoteTarget`, as this script does:

    python examples/cloud_target_with_user_adapter.py --user alice@example.com
"""

import argparse
import os
import secrets
import subprocess
import sys
import time

import omnidraft as od


def start_server(target: str, port: int, key: str) -> subprocess.Popen:
    """`omnidraft serve` on loopback, waited for until it answers."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from omnidraft.cli import main; main()",
            "serve",
            "--target",
            target,
            "--port",
            str(port),
        ],
        env={**os.environ, "OMNIDRAFT_API_KEY": key},
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            od.RemoteTarget(f"http://127.0.0.1:{port}", api_key=key, retries=0, timeout=5)
            return server
        except Exception:  # not listening yet
            if server.poll() is not None:
                raise SystemExit("the server exited; see its output above") from None
            time.sleep(1)
    server.kill()
    raise SystemExit("the server did not start within 300 s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--user", default="alice@example.com")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--profiles", default=None, help="profile directory (default: $OMNIDRAFT_CACHE/profiles)")
    args = p.parse_args()

    key = secrets.token_urlsafe(16)
    server = start_server(args.target, args.port, key)
    try:
        target = od.RemoteTarget(f"http://127.0.0.1:{args.port}", api_key=key)
        # learn=True: every verified request trains this user's LoRA adapter on the drafter
        drafter = od.Drafter.load(args.drafter, backend="torch")
        pair = drafter.pair(target, user=args.user, learn=True, store=od.ProfileStore(args.profiles))
        prompts = ["def is_prime(n):", "Question: Tom has 3 apples and buys 5 more. How many now?\nAnswer:"]
        for prompt in prompts[: args.requests]:
            out = pair.generate(prompt, max_new_tokens=args.max_new_tokens)
            print(
                f"{prompt!r} -> {out.text[:80]!r}\n  {out.stats}"
            )  # with the adapter's steps and next update
        where = pair.save()  # adapter, n-gram cache, history, metrics: the user's profile
        print(f"profile of {args.user} saved in {where}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
