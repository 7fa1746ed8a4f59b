"""A drafter and a target on this machine: the output is the target's own greedy output, faster
where drafting pays here (the pairing measures that and decodes alone where it does not).

    python examples/local_pairing.py "def fibonacci(n):" --max-new-tokens 64
"""

import argparse

import omnidraft as od


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prompt", nargs="?", default="def fibonacci(n):")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()

    pair = od.Drafter.load(args.drafter).pair(od.load_target(args.target))
    out = pair.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    print(args.prompt + out.text)
    print(f"\n[{out.stats}]")  # tokens, speed, how it was served and why, acceptance and tau


if __name__ == "__main__":
    main()
