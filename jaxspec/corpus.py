"""Real local text for long-context prompts: the Python documentation that ships with CPython.

`pydoc_data.topics` (about 490 KB of English reference text, 79 topics) exists wherever Python does,
the GPU machine included, so tests and benchmarks build long prompts from real text without
downloading anything. Prompts are documents plus a question or a continuation request; `REQUESTS`
are short chat requests with no document, the kind of prompt a chat user sends (the planner's
profile measures them as their own cells: `jaxspec.profile --prompts requests`).
"""

from __future__ import annotations

from pydoc_data.topics import topics

from jaxspec.tokenizer import Tokenizer

TASKS = {
    "question": "Using only the documentation above, explain what the section titled {title!r} describes, with an example.",
    "summary": "Summarize the documentation above in five bullet points.",
    "continue": "Continue the last section of the documentation above for a few more paragraphs, in the same style.",
}

# Short open requests on everyday topics (none is generate's default prompt, so a profile of them
# does not measure that one request)
REQUESTS = (
    "Why do leaves change color in autumn? Explain it simply.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a virus and a bacterium?",
    "Give me five tips for sleeping better at night.",
    "How does a refrigerator keep food cold?",
    "Explain what inflation is and why it matters to ordinary people.",
    "Describe the water cycle in a few paragraphs.",
    "What should I pack for a three-day hiking trip?",
    "Write a friendly email inviting my neighbours to a garden party on Saturday.",
    "How do airplanes stay in the air?",
    "Explain the rules of chess to a beginner.",
    "What are the benefits of learning a second language?",
    "Why is the ocean salty?",
    "Summarize the causes of the First World War.",
    "Write a poem about the first snow of winter.",
    "How can I make my small apartment feel more spacious?",
    "What is photosynthesis and why is it important?",
    "Explain how vaccines train the immune system.",
    "Give me a simple recipe for vegetable soup.",
    "What makes a good team leader?",
    "Describe how the moon causes tides on Earth.",
    "How do I start learning to play the guitar?",
    "Explain why exercise is good for mental health.",
    "What happens inside a volcano before it erupts?",
)


def documents() -> list[str]:
    """The documentation topics, largest first (a fixed order)."""
    return [topics[name].strip() for name in sorted(topics, key=lambda name: (-len(topics[name]), name))]


def long_prompt(tokenizer: Tokenizer, tokens: int, task: str = "question", offset: int = 0,
                docs: list[str] | None = None) -> str:
    """A prompt text of at most `tokens` tokens: documents (`docs`, default all of `documents()`) from
    `offset` on, cut at a line to fit, then the task. (A chat template, applied by the caller, adds its
    own few tokens.)"""
    docs = documents() if docs is None else docs
    budget = tokens - len(tokenizer.encode(TASKS[task].format(title="x" * 40))) - 8
    parts: list[str] = []
    for i in range(len(docs)):
        lines = docs[(offset + i) % len(docs)].splitlines()
        fits = lambda n: len(tokenizer.encode("\n\n".join(parts + ["\n".join(lines[:n])]))) <= budget
        if fits(len(lines)):
            parts.append("\n".join(lines))
            continue
        low, high = 0, len(lines)  # the most lines of this document that still fit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        if low:
            parts.append("\n".join(lines[:low]))
        break
    title = parts[-1].splitlines()[0] if parts else "documentation"
    return "\n\n".join(parts) + "\n\n" + TASKS[task].format(title=title)
