"""Copy-heavy chat prompts for `benchmarks.spec_compare`: answers that quote their prompt.

    prompts = copy_prompts(num=32, seed=7)   # the same list for the same seed
    write_sharegpt_dataset(prompts, path)    # `vllm bench serve --dataset-name sharegpt`

Every prompt asks for a passage back: even ones "Repeat the following
passage exactly", odd ones "Fix the spelling in this text and return it
whole" over the passage with a few typos put in. A passage is
`PASSAGE_SENTENCES` sentences drawn from `SENTENCES` (fixed English prose,
written for this benchmark) in a random order, so two prompts rarely share
more than their first line and a prefix cache has little to reuse; each seed
draws its own passages. A passage runs to 140-160 SmolLM2 tokens,
above the benchmark's 128 output tokens, so a faithful answer is cut at
`max_tokens` while it is still copying.

The file format is ShareGPT's (`[{"conversations": [human, gpt]}]`), which
`vllm bench serve` reads with the standard library and sends as one user
message: its `custom` format needs pandas, which vLLM's CPU venv lacks.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

SENTENCES = (
    "The harbour town woke early, and by six the fishing boats were already past the breakwater.",
    "A narrow road climbed from the station to the old mill, lined on both sides with chestnut trees.",
    "Most of the houses on the square had been painted yellow a century ago and never repainted since.",
    "The library kept its maps in long flat drawers that smelled faintly of cedar and dust.",
    "Every autumn the river rose a little higher, and the farmers moved their hay to the upper barns.",
    "She wrote her letters at the kitchen table, with the window open even in the coldest weeks.",
    "The bridge was built in stone because the first wooden one had burned during a summer storm.",
    "Children from three villages walked to the same school, which had only four classrooms.",
    "In the evenings the baker sold the bread that was left at half price to anyone who asked.",
    "The lighthouse keeper recorded the weather twice a day in a ledger bound with green cloth.",
    "A small museum near the market displayed tools that the first settlers had carried across the hills.",
    "When the snow came early, the mail arrived by sledge and the newspaper was always a day late.",
    "The orchard behind the church produced more apples than the parish could ever eat or sell.",
    "Travellers often stopped at the inn for one night and found themselves staying for a week.",
    "The clock on the town hall ran four minutes slow, and nobody had been able to fix it for years.",
    "On market days the square filled with carts of cabbages, cheeses, wool and copper pots.",
    "The doctor kept a horse long after everyone else had bought a car, because the roads were poor.",
    "A quiet canal ran along the edge of the town, where herons waited motionless among the reeds.",
    "The factory whistle sounded at noon, and the workers ate their lunch on the steps outside.",
    "Her grandfather had planted the oak in the yard on the day the railway first reached the valley.",
    "The choir practised on Thursday nights, and their singing could be heard from the harbour wall.",
    "Each spring the council argued about the budget and then approved exactly what it had the year before.",
    "The bookshop owner let students read in the back room as long as they returned the books in order.",
    "Fog rolled in from the sea most mornings and usually lifted by the time the shops opened.",
    "The old quarry had filled with rainwater and become a lake where families swam in August.",
    "A retired sailor repaired clocks and radios in a workshop no larger than a garden shed.",
    "The garden was planned so that something would be in flower in every month of the year.",
    "Along the coast path, signs warned walkers to keep away from the crumbling edge of the cliffs.",
    "The town band played on Sunday afternoons in a bandstand that leaned slightly to the left.",
    "Her notebook was full of sketches of birds, each one labelled with the date and the weather.",
    "The ferry crossed to the island three times a day, except in winter when it crossed only once.",
    "A long table in the village hall was set with plates for the harvest supper every October.",
    "The station master grew tomatoes in pots along the platform and gave them away to passengers.",
    "Nobody remembered why the street was called Silver Lane, since no silver had ever been found there.",
    "The printer set the weekly paper by hand and finished every Thursday shortly before midnight.",
    "Wind turbines now stood on the ridge where shepherds had once driven their flocks to pasture.",
    "The museum's most popular exhibit was a model of the harbour made entirely of matchsticks.",
    "Every house on the hill had a rain barrel, because the summers had been getting drier each year.",
    "The teacher read aloud to the class for twenty minutes at the end of every school day.",
    "At the edge of the forest stood a cabin that the rangers used during the fire season.",
)
PASSAGE_SENTENCES = 8
TYPOS_PER_PASSAGE = 4
REPEAT = "Repeat the following passage exactly:\n\n"
FIX = "Fix the spelling in this text and return it whole: "
_WORD = re.compile(r"[A-Za-z]{5,}")


def passage(rng: random.Random) -> str:
    """`PASSAGE_SENTENCES` distinct sentences of `SENTENCES` in a random order."""
    return " ".join(rng.sample(SENTENCES, PASSAGE_SENTENCES))


def misspell(word: str, rng: random.Random) -> str:
    """`word` with one typo inside it (first and last letters kept): two
    neighbouring letters swapped, one letter doubled, or one dropped."""
    i = rng.randrange(1, len(word) - 2)
    kind = rng.randrange(3)
    if kind == 0 and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if kind == 1:
        return word[: i + 1] + word[i] + word[i + 1 :]
    return word[:i] + word[i + 1 :]


def with_typos(text: str, count: int, rng: random.Random) -> str:
    """`text` with `count` of its words of five letters or more misspelled."""
    words = list(_WORD.finditer(text))
    chosen = sorted(rng.sample(words, min(count, len(words))), key=lambda m: m.start())
    out, end = [], 0
    for match in chosen:
        out += [text[end : match.start()], misspell(match.group(), rng)]
        end = match.end()
    return "".join([*out, text[end:]])


@dataclass(frozen=True)
class CopyPrompt:
    prompt: str  # the user message
    answer: str  # what a faithful answer says: the passage, spelled right


def copy_prompts(num: int, seed: int) -> list[CopyPrompt]:
    """`num` chat prompts, alternately "repeat" and "fix the spelling"; the
    same list for the same seed."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        text = passage(rng)
        if i % 2 == 0:
            prompts.append(CopyPrompt(REPEAT + text, text))
        else:
            prompts.append(CopyPrompt(FIX + with_typos(text, TYPOS_PER_PASSAGE, rng), text))
    return prompts


def write_sharegpt_dataset(prompts: list[CopyPrompt], path: Path) -> Path:
    """`prompts` as the JSON that `vllm bench serve --dataset-name sharegpt`
    reads: a human turn (sent) and a gpt turn (the expected answer, which sets
    the output length only where `--sharegpt-output-len` does not)."""
    turns = [
        {
            "conversations": [
                {"from": "human", "value": p.prompt},
                {"from": "gpt", "value": p.answer},
            ]
        }
        for p in prompts
    ]
    path.write_text(json.dumps(turns, indent=0))
    return path
