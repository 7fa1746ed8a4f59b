"""Stream a chat answer as it is committed: the conversation goes through the target's chat template
once, both models read the same rendered text, and the answer ends where the template ends an
assistant's turn (any chat model: "<|im_end|>", "<|eot_id|>", "<end_of_turn>", ...).

    python examples/chat_streaming.py "Write a haiku about speculative decoding."
"""

import argparse
import sys

import omnidraft as od


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("question", nargs="?", default="Write a haiku about speculative decoding.")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()

    pair = od.Drafter.load(args.drafter).pair(od.load_target(args.target))
    messages = [{"role": "user", "content": args.question}]
    for piece in pair.stream(messages, max_new_tokens=args.max_new_tokens):  # ends at the turn's end
        sys.stdout.write(piece)
        sys.stdout.flush()
    print(f"\n[finished: {pair.last.finish_reason}]")


if __name__ == "__main__":
    main()
