"""Stage 1 (data) of the SmolLM2 draft: chat prompts (templates x topics), plain text and code,
each split by stable hash into train / held-out; and the prompt encoding later stages share."""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
from pathlib import Path

import torch

from models.smollm2_recipe import SEED, atomic_save, log

TOPICS = """photosynthesis|the water cycle|black holes|the French Revolution|machine learning|
vaccines|climate change|the stock market|volcanoes|the Roman Empire|electric cars|sleep|
the internet|coffee|honeybees|the moon landing|recycling|the human heart|democracy|
earthquakes|chess|the printing press|solar panels|the immune system|inflation|dinosaurs|
rainbows|the Great Wall of China|gravity|bread baking|meditation|the Olympic Games|
hurricanes|DNA|the Renaissance|bicycles|tea|the ocean tides|plate tectonics|jazz music|
cloud computing|the Amazon rainforest|public libraries|time zones|the periodic table|
marathon training|origami|the Silk Road|antibiotics|wind turbines|the speed of light|
penguins|credit scores|the Industrial Revolution|spreadsheets|composting|lightning|
the Eiffel Tower|video games|nuclear energy|bird migration|the Moon's phases|
a healthy breakfast|public speaking|learning a new language|saving money|job interviews|
gardening|the metric system|volunteering|writing a resume|traffic lights|
password security|email etiquette|sorting algorithms|binary search|recursion|
hash tables|linked lists|unit testing|version control with git|regular expressions|
SQL joins|REST APIs|Python decorators|list comprehensions|exceptions in Python|
reading a CSV file|prime numbers|Fibonacci numbers|matrix multiplication|
the Pythagorean theorem|probability|compound interest|the scientific method|
coral reefs|glaciers|the Sahara desert|elephants|octopuses|the Milky Way|Mars|
the Titanic|Ancient Egypt|Shakespeare|Mozart|Leonardo da Vinci|the Moon|tornadoes|
wolves|mushrooms|chocolate|pizza|the violin|football|yoga|camping|first aid|
the seasons|fractions|the alphabet|maps|telescopes|submarines|airplanes|trains|
bridges|skyscrapers|batteries|magnets|sound waves|microscopes|robots|satellites"""
TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Tell me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "Can you describe {t} to a ten-year-old?",
    "Give me a brief history of {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "How would you explain {t} to a friend?",
    "List some common misconceptions about {t}.",
    "Summarize what everyone should know about {t}.",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a sentence",
    "finds the largest element of a list",
    "merges two sorted lists",
    "removes duplicates from a list",
    "computes the factorial of n",
    "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit",
    "sums the digits of an integer",
    "flattens a nested list",
    "computes the average of a list of numbers",
    "finds the common elements of two lists",
    "sorts a list of dictionaries by a key",
    "reads a text file and counts its lines",
    "capitalizes every word of a sentence",
    "returns the second largest number in a list",
]
CODE_TEMPLATES = ["Write a Python function that {t}.", "How do I write code that {t} in Python?"]


def stable_bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100


# --- 1. data --------------------------------------------------------------------------------


def chat_prompts() -> tuple[list[str], list[str]]:
    topics = [t.strip() for t in TOPICS.replace("\n", "").split("|") if t.strip()]
    train, heldout = [], []
    for topic in topics:
        side = heldout if stable_bucket(topic) < 12 else train
        side.extend(tpl.format(t=topic) for tpl in TEMPLATES)
    for task in CODE_TASKS:
        side = heldout if stable_bucket(task) < 15 else train
        side.extend(tpl.format(t=task) for tpl in CODE_TEMPLATES)
    random.Random(SEED).shuffle(train)
    random.Random(SEED + 1).shuffle(heldout)
    return train, heldout


def documents() -> dict[str, list[tuple[str, str]]]:
    """(name, text) of plain-text docs and of stdlib code, each split train / held-out."""
    site = Path(sysconfig.get_paths()["purelib"])
    roots = [site, Path(sys.base_prefix) / "lib", Path("/usr/share/doc")]
    text_files = sorted(
        {p for r in roots if r.exists() for ext in ("*.md", "*.rst") for p in r.rglob(ext)}
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code_files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if not {"site-packages", "test", "tests", "idle_test"} & set(p.parts)
    )
    out = {"text_train": [], "text_heldout": [], "code_train": [], "code_heldout": []}
    for kind, files in (("text", text_files), ("code", code_files)):
        seen = set()
        for path in files:
            try:
                body = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not 2_000 <= len(body) <= 200_000 or body in seen:
                continue
            seen.add(body)
            side = "heldout" if stable_bucket(path.name + str(len(body))) < 5 else "train"
            out[f"{kind}_{side}"].append((str(path), body))
    return out


def stage_data(work: Path) -> dict:
    path = work / "data.pt"
    if path.exists():
        return torch.load(path)
    train, heldout = chat_prompts()
    data = {"chat_train": train, "chat_heldout": heldout, **documents()}
    atomic_save(data, path)
    log("data:", {k: len(v) for k, v in data.items()})
    return data


# --- prompt encoding (2. generate, 6. eval) ------------------------------------------------


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )["input_ids"]


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask
