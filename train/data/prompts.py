"""Open-ended instruction prompts (a story, an explanation, a list of tips ...) for chat targets.

A draft head is measured on what people ask a chat model, not only on text snippets: these
prompts are made from templates and topics written here, in two disjoint halves, so the ones a
head is evaluated on ("valid") never appear in its training data ("train"). `specdec prompts
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
    "a robot who learns to paint", "growing tomatoes on a balcony", "saving money on groceries",
    "learning a new language", "the water cycle", "black holes", "baking sourdough bread", "a lighthouse keeper",
    "time management for students", "photosynthesis", "running a first marathon", "a lost cat finding its way home",
    "public speaking", "recycling plastic", "how vaccines work", "a dragon afraid of fire", "keeping a journal",
    "electric cars", "the moon landing", "training a puppy", "staying focused while working from home", "volcanoes",
    "an old clockmaker", "making friends in a new city", "composting", "the internet", "chess openings",
    "a trip to the mountains", "healthy breakfast ideas", "renewable energy", "a detective in a small town",
    "learning to play the guitar", "bees and pollination", "writing a resume", "the Roman Empire",
    "a child who can talk to birds", "sleeping better", "rainbows", "starting a small business", "camping in the rain",
    "the human heart", "a space station cook", "organizing a messy closet", "earthquakes", "reading more books",
    "a talking tree", "cycling to work", "how computers store data", "a summer by the sea", "cooking rice perfectly",
    "climate change", "an astronaut's first day", "painting with watercolors", "the pyramids of Egypt",
    "learning to swim as an adult", "a friendly ghost", "planning a birthday party", "how airplanes fly",
    "meditation for beginners", "a village without electricity", "coral reefs", "taking better photos with a phone",
    "the printing press", "a musician who lost her voice", "drinking enough water", "how rain forms", "a shy penguin",
    "budgeting for a vacation", "the solar system", "studying for exams", "a haunted library",
    "houseplants that are hard to kill", "how the stock market works", "a knight who hates horses", "walking every day",
    "the history of chocolate", "an inventor's failed machine", "packing light for travel", "how bridges stay up",
    "a robot and a cat become friends", "writing clear emails", "ocean tides",
)

# Templates and topics for training prompts only: the evaluation's "valid" prompts stay the same
# TEMPLATES x odd-numbered TOPICS, so figures stay comparable as these lists grow. More kinds of
# requests and subjects make the target's answers more varied, which is what a head needs to
# generalize to topics it never saw (with 41 topics, the head learnt their answers by heart).
TRAIN_TEMPLATES = (
    "Write a dialogue between two friends about {}.",
    "Give three fun facts about {}.",
    "Write a short blog post about {}.",
    "What should a beginner know about {}?",
    "Compare two different ways of approaching {}.",
    "Write a limerick about {}.",
    "Answer briefly: why does {} matter?",
    "Write a product description for a book about {}.",
    "Create a simple plan for a week of {}.",
    "Tell me a bedtime story about {}.",
    "Write a news headline and a short article about {}.",
    "List five questions a curious student might ask about {}.",
)

TRAIN_TOPICS = (
    "a fox who opens a bakery", "repairing a bicycle tire", "the French Revolution", "a girl who collects storms",
    "learning to cook pasta", "how magnets work", "a retired pirate", "writing a cover letter",
    "the Great Wall of China", "keeping chickens", "how batteries work", "a city on the ocean floor",
    "caring for a bonsai tree", "glaciers", "a kind giant", "learning to knit", "the discovery of penicillin",
    "a robot gardener", "saving energy at home", "how the immune system works", "a train that travels through time",
    "writing a first novel", "deserts", "a clumsy wizard", "choosing a laptop", "how telescopes work",
    "a mountain rescue dog", "making homemade pizza", "the Industrial Revolution", "a family of otters",
    "learning basic first aid", "tornadoes", "a secret garden", "how money is printed", "a chef who cannot taste",
    "running a book club", "the Silk Road", "a snail in a hurry", "decluttering a kitchen", "how the eye sees color",
    "a pirate ship made of candy", "learning to draw faces", "the Olympic Games", "a grandmother's recipe box",
    "hiking safely", "how submarines dive", "a lonely lighthouse cat", "growing herbs indoors",
    "the invention of the telephone", "a cloud that wants to rain", "teaching kids to read", "how glass is made",
    "a tiny dragon in a teacup", "writing a thank-you note", "ancient Greece", "a brave mouse", "fixing a leaky faucet",
    "how satellites orbit", "a market in Marrakech", "playing the piano", "hurricanes", "a squirrel's winter plan",
    "learning to code in Python", "the history of the bicycle", "a magic paintbrush", "preparing for a job interview",
    "how fish breathe", "an island of talking animals", "birdwatching", "the Vikings", "a robot who wants to dance",
    "making a budget spreadsheet", "how the heart pumps blood", "a snowman who travels", "learning to juggle",
    "the history of the internet", "a young inventor", "reducing food waste", "how ants cooperate",
    "a castle in the clouds", "stretching after exercise", "the invention of the wheel", "a forgetful robot",
    "brewing a good cup of tea", "how earthquakes are measured", "a whale's long journey", "organizing a desk",
    "the life of Marie Curie", "a door to another world", "learning to skateboard", "how plants drink water",
    "a village festival", "caring for an old dog", "the Apollo missions", "a musician on the street", "sewing a button",
    "how wind turbines work", "a cat who runs a hotel", "speaking up in meetings", "the history of paper",
    "an owl who cannot sleep at night", "planting a tree", "how clocks keep time", "a soccer team of animals",
    "writing a speech for a wedding", "the water in the oceans", "a baker's first day", "learning chess tactics",
    "how bread rises", "a map that changes every night", "saving for retirement", "the Amazon rainforest",
    "a toy that comes alive", "making a podcast", "how thunder happens", "a friendship between a bear and a bird",
    "choosing a pet", "the history of jazz", "a mysterious letter", "keeping a vegetable garden", "how paint dries",
    "an astronaut's dog", "writing poetry for beginners", "the northern lights", "a shop that sells dreams",
    "learning to ski", "how elevators work", "a lost key", "making new habits stick", "the life of bees in winter",
    "a detective cat", "cleaning a bicycle chain", "how the brain learns", "a town where it always snows",
    "giving constructive feedback", "the history of maps", "a robot librarian", "eating more vegetables", "sand dunes",
    "a pumpkin that grows too big", "setting up a home network", "how sound travels", "a king who loves soup",
    "volunteering in a community", "the invention of the light bulb", "a balloon's adventure", "learning sign language",
)


def open_prompts(count: int, split: str = "train", seed: int = 0) -> list[str]:
    """`count` prompts (template x topic) from the `split` half of the topics: "valid" has
    TEMPLATES x odd-numbered TOPICS, "train" the even-numbered ones and TRAIN_TOPICS, under
    TEMPLATES and TRAIN_TEMPLATES; seeded, without repeats while the pairs last."""
    check(split in ("train", "valid"), f"split must be train or valid, got {split!r}")
    check(isinstance(count, int) and count >= 1, f"count must be a positive integer, got {count!r}")
    if split == "train":
        pairs = [(t, s) for t in TEMPLATES + TRAIN_TEMPLATES for s in TOPICS[0::2] + TRAIN_TOPICS]
    else:
        pairs = [(t, s) for t in TEMPLATES for s in TOPICS[1::2]]
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[order[i % len(pairs)]][0].format(pairs[order[i % len(pairs)]][1]) for i in range(count)]
