"""Prompts for the demo model shared by the tests and the benchmarks: short and long, chat and code."""

from __future__ import annotations

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain, in two sentences, why the sky is blue and what Rayleigh scattering has to do with it. "
    "Then give one everyday example of the same effect that a child could observe at home.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish, French and German.",
    "The history of the Roman Empire spans many centuries. " * 12 + "Summarize it in one sentence.",
    "hi",
]
