"""Reward functions that the end-to-end tests name by import path."""


def sometimes_raises(prompt: str, completion: str, row: dict) -> float:
    """Raises for half of the prompts (always the same ones), else exact match."""
    if int(row["answer"]) % 2 == 0:
        raise ZeroDivisionError("deliberate failure in the reward")
    return 1.0 if completion.strip() == row["answer"] else 0.0


def varies_with_text(prompt: str, completion: str, row: dict) -> float:
    """A reward that differs between different completions (a checksum of the
    text), so a group of distinct samples has non-zero advantages and a step
    changes the weights even for an untrained model."""
    return (sum(map(ord, completion)) % 7) / 6.0


def completion_length(prompt: str, completion: str, row: dict) -> float:
    """The completion's length in characters: a reward a test can recompute from the replies."""
    return float(len(completion))
