"""Built-in English text the embedded tokenizer is trained on.

The text is plain prose, dialogue and a little code and arithmetic, so the
byte-level BPE learns ordinary words, punctuation, digits and indentation.
`training_lines()` extends it with deterministic compound words when a larger
vocabulary is asked for than the prose alone can supply.
"""

from __future__ import annotations

from collections.abc import Iterator

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker.
Every morning he opened the wooden shutters of his shop, swept the floor, and wound the clocks one by one.
The children of the village liked to visit him after school, because he told stories while he worked.
He spoke of mountains covered in snow, of ships that crossed wide oceans, and of cities full of light.
"Time is a river," he would say, "and every clock is a little boat that tries to follow it."
One winter evening a traveler knocked on the door. She carried a broken watch wrapped in a red scarf.
"Can you repair it?" she asked. "It belonged to my grandmother, and it stopped the day she left home."
The clockmaker held the watch under the lamp, opened the back, and looked at the tiny gears inside.
"Nothing is truly broken," he said quietly. "Some parts are only waiting for someone to be patient."

Weather and seasons
In spring the rain returns and the fields turn green. Farmers plant wheat, barley, corn and beans.
Summer brings long days, warm nights, thunderstorms in the afternoon and bright stars after midnight.
In autumn the leaves change color: yellow, orange, red and brown. Apples and pears are ready to pick.
Winter is quiet. Snow covers the roofs, rivers freeze, and people gather around the fire to talk.
Today the sky is clear, the temperature is twelve degrees, and a light wind blows from the west.
Tomorrow there may be clouds in the morning, with a chance of showers later in the evening.

Science and nature
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The Earth travels around the Sun once every year, and the Moon travels around the Earth every month.
Plants use sunlight, water and carbon dioxide to make sugar and oxygen; this is called photosynthesis.
Bees visit flowers to collect nectar, and while they do so they carry pollen from one plant to another.
Whales are mammals that live in the ocean. They breathe air and sing long songs that travel for miles.
Light from the nearest star beyond the Sun takes more than four years to reach our planet.
A healthy forest holds many species: oak, pine, birch, maple, mushrooms, moss, deer, owls and foxes.
Mountains rise when the plates of the crust push against each other over millions of years.
Volcanoes release molten rock, ash and gas. Earthquakes shake the ground when stress is released.

Computers and networks
A computer follows instructions stored in memory. The processor fetches, decodes and executes them.
Programs are written in languages such as Python, C, Rust, Java and Go, and then compiled or interpreted.
Data travels across a network in packets. Each packet carries an address, a payload and a checksum.
A server listens for requests and sends responses. A client opens a connection, writes and reads bytes.
When a cluster serves a language model, one group of workers reads the prompt and another writes the answer.
The prompt is split into tokens, the tokens become vectors, and each layer transforms the vectors again.
Attention lets every position look at earlier positions; a cache keeps the keys and values for reuse.
A state space layer carries a small summary of the past forward instead of keeping every earlier token.
Memory is divided into blocks so that many requests can share one pool without wasting space.
Latency is the time until the first byte arrives; throughput is how much work finishes each second.

def greet(name: str) -> str:
    \"\"\"Return a friendly greeting.\"\"\"
    return f"Hello, {name}!"

for index in range(10):
    if index % 2 == 0:
        print(index, "is even")
    else:
        print(index, "is odd")

class Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, amount: int = 1) -> int:
        self.total += amount
        return self.total

Numbers and arithmetic
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, thirty, forty, fifty.
1 + 1 = 2. 2 + 3 = 5. 7 * 8 = 56. 100 / 4 = 25. 3.14 is close to pi. 2^10 = 1024. 9 - 4 = 5.
The meeting starts at 09:30 and ends at 11:45. The train leaves platform 4 at 18:05 on 2024-06-21.
Half of sixty is thirty, a quarter of one hundred is twenty five, and ten percent of ninety is nine.

Conversations
User: Hello! How are you today?
Assistant: I am doing well, thank you. How can I help you?
User: Can you tell me a short story about a cat who learns to sail?
Assistant: Of course. There once was a cat named Pepper who lived beside the harbor and watched the boats.
User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Please write a list of three fruits.
Assistant: Here are three fruits: apple, banana and cherry.
User: Why is the sky blue?
Assistant: Sunlight is scattered by the air, and blue light is scattered more than red light.
User: Thank you very much.
Assistant: You are welcome! Have a wonderful day.

Cooking
To make bread, mix flour, water, salt and yeast. Knead the dough, let it rise, shape it and bake it.
A simple soup needs onions, carrots, celery, garlic, potatoes, broth, pepper and a handful of herbs.
Cut the vegetables into small pieces, cook them gently in oil, add the broth and simmer for an hour.
Pancakes are made from eggs, milk, flour, sugar and butter, and are served with honey or fresh berries.
Tea should steep for three minutes; coffee tastes best when the beans are ground just before brewing.

History and places
People have built roads, bridges, harbors and libraries for thousands of years.
The printing press made books cheaper, and more people learned to read and write.
Explorers sailed along unknown coasts, drew maps, and traded spices, silk, salt and silver.
Ancient cities had markets, temples, theaters, gardens, walls and gates that closed at night.
Today many travelers visit museums to see paintings, sculptures, coins, tools and old letters.
London, Tokyo, Cairo, Lima, Oslo, Delhi, Sydney, Nairobi and Toronto are large cities on different continents.

Advice
Read widely, ask good questions, write clearly, and check your work before you share it.
Sleep well, drink water, walk outside, and call your friends and family when you can.
When a problem seems too large, divide it into smaller parts and solve them one at a time.
Be kind to others, because everyone is carrying something that you cannot see.
Keep your promises, admit your mistakes, and learn something new every single day.

Animals
The cat sleeps on the warm windowsill while the dog waits by the door for its evening walk.
Horses run across the meadow, sheep graze on the hill, and chickens search the yard for seeds.
An eagle circles high above the valley; a rabbit hides in the tall grass until the shadow passes.
Penguins cannot fly, but they swim quickly and dive deep to catch fish in the cold southern seas.
Elephants remember paths to water, and dolphins call each other by name with whistles and clicks.
"""


def corpus_words() -> list[str]:
    """Distinct lower-case alphabetic words of the corpus, sorted (stable across runs)."""
    words = {
        "".join(ch for ch in raw if ch.isalpha()).lower() for raw in CORPUS.split() if raw.isascii()
    }
    return sorted(word for word in words if len(word) >= 3)


def training_lines(extra_compounds: int = 0) -> Iterator[str]:
    """Yield the corpus line by line, then `extra_compounds` compound-word lines.

    Compounds join two corpus words in a fixed stride pattern ("riverlight",
    "Stonegarden"); every compound is a real byte string, so tokens learned from
    them decode to readable text instead of reserved placeholders.
    """
    yield from CORPUS.splitlines()
    words = corpus_words()
    count = len(words)
    for index in range(extra_compounds):
        first = words[index % count]
        second = words[(index * 7 + 3 + index // count) % count]
        compound = first + second
        yield f"{compound} {compound.capitalize()} {second}{first}"
