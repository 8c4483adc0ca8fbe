"""Open-ended instruction prompts (a story, an explanation, a list of tips ...) for chat targets.

A draft head is measured on what people ask a chat model, not only on text snippets: these
prompts are made from templates and topics written here, in two disjoint halves, so the ones a
head is evaluated on ("valid") never appear in its training data ("train"). `scripts/make_prompts.py
--kind open` writes them; `--kind text` makes prompts from snippets of a text
(`train.data.regenerate.prompts_from_text`), `--kind mix` half of each.
"""

from __future__ import annotations

import numpy as np

from specdec_models.errors import check

TEMPLATES = (
    "Write a short story about {}.",
    "Explain {} to a twelve-year-old.",
    "Give me a list of practical tips for {}.",
    "Write a short poem about {}.",
    "What are the pros and cons of {}?",
    "Describe a typical day of someone who works with {}.",
    "Write a friendly email inviting a colleague to talk about {}.",
    "Explain step by step how to get started with {}.",
    "What are common mistakes people make with {}, and how can they avoid them?",
    "Summarize the history of {} in a few sentences.",
)

TOPICS = (
    "a robot who learns to paint", "growing tomatoes on a balcony", "saving money on groceries", "learning a new language",
    "the water cycle", "black holes", "baking sourdough bread", "a lighthouse keeper", "time management for students",
    "photosynthesis", "running a first marathon", "a lost cat finding its way home", "public speaking",
    "recycling plastic", "how vaccines work", "a dragon afraid of fire", "keeping a journal", "electric cars",
    "the moon landing", "training a puppy", "staying focused while working from home", "volcanoes",
    "an old clockmaker", "making friends in a new city", "composting", "the internet", "chess openings",
    "a trip to the mountains", "healthy breakfast ideas", "renewable energy", "a detective in a small town",
    "learning to play the guitar", "bees and pollination", "writing a resume", "the Roman Empire",
    "a child who can talk to birds", "sleeping better", "rainbows", "starting a small business", "camping in the rain",
    "the human heart", "a space station cook", "organizing a messy closet", "earthquakes", "reading more books",
    "a talking tree", "cycling to work", "how computers store data", "a summer by the sea", "cooking rice perfectly",
    "climate change", "an astronaut's first day", "painting with watercolors", "the pyramids of Egypt",
    "learning to swim as an adult", "a friendly ghost", "planning a birthday party", "how airplanes fly",
    "meditation for beginners", "a village without electricity", "coral reefs", "taking better photos with a phone",
    "the printing press", "a musician who lost her voice", "drinking enough water", "how rain forms",
    "a shy penguin", "budgeting for a vacation", "the solar system", "studying for exams", "a haunted library",
    "houseplants that are hard to kill", "how the stock market works", "a knight who hates horses",
    "walking every day", "the history of chocolate", "an inventor's failed machine", "packing light for travel",
    "how bridges stay up", "a robot and a cat become friends", "writing clear emails", "ocean tides",
)


def open_prompts(count: int, split: str = "train", seed: int = 0) -> list[str]:
    """`count` prompts (template x topic) from the `split` half of the topics: even-numbered topics
    for "train", odd-numbered ones for "valid"; seeded, without repeats while the pairs last."""
    check(split in ("train", "valid"), f"split must be train or valid, got {split!r}")
    check(isinstance(count, int) and count >= 1, f"count must be a positive integer, got {count!r}")
    topics = TOPICS[0 if split == "train" else 1::2]
    pairs = [(t, s) for t in TEMPLATES for s in topics]
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[order[i % len(pairs)]][0].format(pairs[order[i % len(pairs)]][1]) for i in range(count)]
