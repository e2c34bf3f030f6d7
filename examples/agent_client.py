"""An agent loop against ``mlx_lm.server --draft suffix`` with the OpenAI client.

Agent traffic repeats itself: the same system prompt and tool schema every
turn, earlier tool calls and results in the history, answers that copy JSON
from the prompt. Suffix decoding drafts those repeats. Each request streams
its answer and then prints the server's draft counters from ``usage``
(``draft_tokens``: tokens drafted, ``accepted_draft_tokens``: tokens
accepted).

Without ``--base-url`` the script starts its own server on a free local port
(the embedded random-weight demo model unless ``--model`` is given) and stops
it on exit. Needs ``pip install openai``.

Run:

    python examples/agent_client.py
    python examples/agent_client.py --model mlx-community/Qwen3-4B-4bit --turns 6
    python examples/agent_client.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from openai import OpenAI

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    }
]
SYSTEM = (
    "You are an agent. To call a tool, answer with one JSON object "
    '{"name": ..., "arguments": {...}} and nothing else. Tools:\n' + json.dumps(TOOLS, indent=2)
)
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo"]


def draft_fields(usage: Any, prefix: str = "") -> dict[str, Any]:
    """The ``usage`` entries whose name mentions drafts (nested ones too)."""
    data = usage.model_dump() if hasattr(usage, "model_dump") else usage
    out: dict[str, Any] = {}
    for key, value in (data or {}).items():
        if isinstance(value, dict):
            out.update(draft_fields(value, f"{prefix}{key}."))
        elif "draft" in key:
            out[prefix + key] = value
    return out


def run_agent(client: OpenAI, turns: int, max_tokens: int) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        city = CITIES[turn % len(CITIES)]
        messages.append({"role": "user", "content": f"What is the weather in {city}?"})
        print(f"--- turn {turn + 1}: {messages[-1]['content']}")
        stream = client.chat.completions.create(
            model="default_model",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},  # usage arrives in the last chunk
        )
        answer, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                answer += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                usage = chunk.usage
        print()
        fields = draft_fields(usage)
        print("usage:", " ".join(f"{k}={v}" for k, v in fields.items()) or "(no draft fields)")
        # Keep the tool call in the history and answer it, as an agent would.
        messages.append({"role": "assistant", "content": answer})
        result = {"city": city, "temperature": 18 + turn, "unit": "celsius"}
        messages.append({"role": "user", "content": "Tool result: " + json.dumps(result)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model id or path (default: demo model)")
    parser.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--suffix-policy",
        choices=["adaptive", "fixed"],
        default="adaptive",
        help="draft-length policy of the server this script starts",
    )
    args = parser.parse_args()

    if args.base_url:
        run_agent(OpenAI(base_url=args.base_url, api_key="none"), args.turns, args.max_tokens)
        return
    from mlx_lm_suffix.tools.launcher import ServerProcess
    from mlx_lm_suffix.tools.models import ensure_model

    model = args.model or str(ensure_model("qwen3", "small"))
    # On a free local port; stopped on leaving the `with`, Ctrl-C included.
    with ServerProcess(model, "--draft", "suffix", "--suffix-policy", args.suffix_policy) as server:
        run_agent(OpenAI(base_url=server.url + "/v1", api_key="none"), args.turns, args.max_tokens)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # (the server is stopped by then)
