"""Held-out prompts: fixed-length token slices of standard-library files the models never saw.

`models/heldout_files.txt` (written by models/train.py) lists the held-out files relative to
the interpreter's stdlib directory. Prompt i is the `prompt_len`-token slice starting a third
of the way into held-out file i (files too short are skipped), so a rerun on the same Python
gets the same prompts, and every contender is fed exactly the same token ids.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# Used when no held-out list exists yet (tiny development models): stable stdlib modules.
FALLBACK_FILES = (
    "argparse.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "csv.py",
    "difflib.py",
    "fractions.py",
    "heapq.py",
    "ipaddress.py",
    "json/decoder.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "tokenize.py",
    "uuid.py",
    "zipfile/__init__.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
)


def heldout_files(list_path: str | None) -> tuple[list[Path], str]:
    """The held-out stdlib files in listed order, and where the list came from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if list_path and Path(list_path).is_file():
        names = [line.strip() for line in Path(list_path).read_text().splitlines() if line.strip()]
        source = list_path
    else:
        names, source = list(FALLBACK_FILES), "built-in fallback list (no held-out list found)"
    return [root / name for name in names if (root / name).is_file()], source


def heldout_prompts(
    tokenizer, count: int, prompt_len: int = 64, list_path: str | None = None
) -> tuple[list[list[int]], dict]:
    """`count` prompts of exactly `prompt_len` token ids, plus a description for the report."""
    files, source = heldout_files(list_path)
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts, used = [], []
    for path in files:
        if len(prompts) == count:
            break
        ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) < 2 * prompt_len:
            continue
        start = len(ids) // 3
        prompts.append([int(t) for t in ids[start : start + prompt_len]])
        used.append(str(path.relative_to(root)))
    if len(prompts) < count:
        raise ValueError(
            f"only {len(prompts)} held-out files are long enough for {prompt_len}-token prompts; "
            f"{count} were asked for"
        )
    return prompts, {"source": source, "files": used, "prompt_tokens": prompt_len}
